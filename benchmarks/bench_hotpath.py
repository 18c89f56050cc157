"""Nanoseconds per span of ``ppetrace.trace`` against its references, in one process.

Run: ``python benchmarks/bench_hotpath.py [--spans N] [--rounds R] [--json PATH]``

Each case runs ``N`` empty blocks per round; rounds of all cases are interleaved
so that machine noise hits them alike, and each case keeps its best round.
Every budget is a ratio of two figures from the same run (DESIGN.md, Budgets):

- enabled ``trace`` <= 0.10x OpenTelemetry's ``start_as_current_span``;
- enabled ``trace`` <= 3x the floor (two ``perf_counter_ns`` reads and a list
  append in a small class context manager);
- disabled ``trace`` <= 1.5x ``contextlib.nullcontext``.

"hot path" cases clear the span buffer between rounds, so they time entering and
leaving a block; the "all in" case also turns every record into an exported row
(``ppetrace.flush`` to an exporter that keeps nothing).

Attribute snapshots: ``trace`` copies a dict ``arg`` when the block is entered
(issue 18). The cases "dict arg" (the Trainer's six ``ppetrace.*`` keys, copied)
and "FrozenAttributes arg" (the same keys, shared without a copy) show what the
copy costs; their difference is printed as "snapshot copy".

Runtime hooks (:func:`measure_runtime_trace`, printed after the budgets, no
budget): a ``runtime.<hook>`` call through ``call_hook`` on
``PyTorchRuntime``, whose ``trace`` also opens a ``record_function`` range
while a torch profiler records, against the same call on a runtime with the
default ``BaseRuntime.trace``, no profiler active. The ratio is the median of
per-round paired ratios (rounds interleaved, order alternating) with a 95%
bootstrap interval; "ppe-style" always opens ``record_function``, as ppe's
``PyTorchRuntime.trace`` does, for scale.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import ppetrace
from exporters._spans import FrozenAttributes
from ppetrace.tracing import _recorder

# the attributes of a Trainer step span (training/_trainer.py)
_STEP_ATTRS = {
    "ppetrace.epoch": 0,
    "ppetrace.step": 12,
    "ppetrace.batch_idx": 12,
    "ppetrace.stage": "train",
    "ppetrace.device": "cpu",
    "ppetrace.runtime": "PyTorchRuntime",
}


class _Floor:
    __slots__ = ("start",)

    def __enter__(self) -> _Floor:
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        _FLOOR_SINK.append((self.start, time.perf_counter_ns()))


_FLOOR_SINK: list[tuple[int, int]] = []


class _NullSink:
    def export_batch(self, batch: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _cases(n: int) -> dict[str, tuple[Callable[[], None], int]]:
    """name -> (function running n blocks, spans per call)."""
    trace = ppetrace.trace

    def nullcontext() -> None:
        for _ in range(n):
            with contextlib.nullcontext():
                pass

    def floor() -> None:
        for _ in range(n):
            with _Floor():
                pass
        _FLOOR_SINK.clear()

    def flat() -> None:
        for _ in range(n):
            with trace("bench.flat"):
                pass

    def nested() -> None:
        for _ in range(n // 3):
            with (
                trace("bench.a", {"ppetrace.step": 1}),
                trace("bench.b", {"ppetrace.step": 1}),
                trace("bench.c", {"ppetrace.step": 1}),
            ):
                pass

    attrs = dict(_STEP_ATTRS)
    frozen = FrozenAttributes(_STEP_ATTRS)

    def with_dict() -> None:
        for _ in range(n):
            with trace("bench.dict", attrs):
                pass

    def with_frozen() -> None:
        for _ in range(n):
            with trace("bench.frozen", frozen):
                pass

    cases: dict[str, tuple[Callable[[], None], int]] = {
        "nullcontext": (nullcontext, n),
        "floor": (floor, n),
        "trace enabled, flat": (flat, n),
        "trace enabled, nested x3 + attribute": (nested, n // 3 * 3),
        "trace enabled, dict arg (6 keys, copied)": (with_dict, n),
        "trace enabled, FrozenAttributes arg (6 keys, shared)": (with_frozen, n),
    }
    try:
        from opentelemetry.sdk.trace import TracerProvider

        tracer = TracerProvider().get_tracer("bench")

        def otel() -> None:
            for _ in range(n):
                with tracer.start_as_current_span("bench.otel"):
                    pass

        cases["otel start_as_current_span"] = (otel, n)
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch.profiler

        record_function = torch.profiler.record_function

        def torch_rf() -> None:
            for _ in range(n):
                with record_function("bench.rf"):
                    pass

        cases["torch record_function"] = (torch_rf, n)
    except ImportError:  # pragma: no cover
        print("torch record_function: not installed")
    return cases


def _time(fn: Callable[[], None]) -> int:
    gc.collect()
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0


def _clear_buffer() -> None:
    _recorder.RECORDER.discard_buffered()


def measure(n: int, rounds: int) -> dict[str, float]:
    cases = _cases(n)
    best: dict[str, float] = {}
    sink = _NullSink()

    def run(name: str, fn: Callable[[], None], spans: int) -> None:
        ns = _time(fn) / spans
        _clear_buffer()
        best[name] = min(best.get(name, float("inf")), ns)

    for _ in range(rounds):
        ppetrace.configure(buffer_spans=n + 1)
        for name, (fn, spans) in cases.items():
            run(name, fn, spans)
        # all in: the records also become rows and reach an exporter
        ppetrace.configure(buffer_spans=n + 1, exporters=[sink])
        flat = cases["trace enabled, flat"][0]

        def flat_and_flush(flat: Callable[[], None] = flat) -> None:
            flat()
            ppetrace.flush()

        ns = _time(flat_and_flush) / n
        best["trace enabled, all in (+flush to rows)"] = min(
            best.get("trace enabled, all in (+flush to rows)", float("inf")), ns
        )
        ppetrace.configure(enabled=False)
        run("trace disabled", flat, n)
    ppetrace.configure()
    return best


def budgets(best: dict[str, float]) -> list[tuple[str, float, float]]:
    """(what, measured ratio, budget)."""
    out = [
        (
            "trace / floor",
            best["trace enabled, flat"] / best["floor"],
            3.0,
        ),
        (
            "disabled trace / nullcontext",
            best["trace disabled"] / best["nullcontext"],
            1.5,
        ),
    ]
    if "otel start_as_current_span" in best:
        out.insert(
            0,
            (
                "trace / OTel start_as_current_span",
                best["trace enabled, flat"] / best["otel start_as_current_span"],
                0.10,
            ),
        )
    return out


def measure_runtime_trace(n: int, rounds: int, *, seed: int = 0) -> dict[str, Any]:
    """ns per runtime hook call: default trace, PyTorchRuntime's, ppe-style; and the ratios."""
    import random

    import torch

    from ppetrace.runtime import BaseRuntime, PyTorchRuntime, call_hook

    class DefaultTrace(BaseRuntime):
        pass

    class PpeStyle(BaseRuntime):
        @classmethod
        @contextlib.contextmanager
        def trace(cls, event_name: str | None, arg: Any) -> Any:
            name = str(event_name)
            with torch.profiler.record_function(name), _recorder.trace(name, arg):
                yield

    module = torch.nn.Linear(2, 2)
    attrs = {"ppetrace.step": 0}
    runtimes = {
        "default trace": DefaultTrace("cpu", None),
        "PyTorchRuntime": PyTorchRuntime("cpu", None),
        "ppe-style record_function": PpeStyle("cpu", None),
    }

    def case(runtime: BaseRuntime) -> Callable[[], None]:
        def run() -> None:
            for _ in range(n):
                call_hook(runtime, "train_epoch_begin", attrs, module)

        return run

    per_round: dict[str, list[float]] = {name: [] for name in runtimes}
    names = list(runtimes)
    ppetrace.configure(buffer_spans=n + 1)
    try:
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                per_round[name].append(_time(case(runtimes[name])) / n)
                _clear_buffer()
    finally:
        ppetrace.configure()
    out: dict[str, Any] = {name: min(values) for name, values in per_round.items()}
    rng = random.Random(seed)
    for name in ("PyTorchRuntime", "ppe-style record_function"):
        ratios = sorted(
            a / b for a, b in zip(per_round[name], per_round["default trace"], strict=True)
        )
        boots = sorted(_median([rng.choice(ratios) for _ in ratios]) for _ in range(2000))
        out[f"{name} / default trace"] = (
            _median(ratios),
            boots[int(0.025 * len(boots))],
            boots[int(0.975 * len(boots)) - 1],
        )
    return out


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=20_000, help="blocks per round")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--json", dest="json_path", help="also write the results here")
    args = parser.parse_args(argv)
    best = measure(args.spans, args.rounds)
    width = max(map(len, best))
    print(f"{'case':<{width}}  ns/span")
    for name, ns in best.items():
        print(f"{name:<{width}}  {ns:8.0f}")
    copy_ns = (
        best["trace enabled, dict arg (6 keys, copied)"]
        - best["trace enabled, FrozenAttributes arg (6 keys, shared)"]
    )
    print(f"{'snapshot copy (dict - FrozenAttributes)':<{width}}  {copy_ns:8.0f}")
    print()
    with_dict = best["trace enabled, dict arg (6 keys, copied)"] / best["floor"]
    print(f"{'trace with a 6-key dict / floor':<40} {with_dict:6.3f}x  (information: same 3x)")
    failed = False
    checks = budgets(best)
    for what, ratio, budget in checks:
        ok = ratio <= budget
        failed |= not ok
        print(f"{what:<40} {ratio:6.3f}x  budget <= {budget:.2f}x  {'PASS' if ok else 'FAIL'}")
    hooks = measure_runtime_trace(max(args.spans // 4, 1), max(2 * args.rounds, 3))
    print()
    print("runtime hook through call_hook, no torch profiler active (ns/call):")
    for name in ("default trace", "PyTorchRuntime", "ppe-style record_function"):
        print(f"  {name:<38} {hooks[name]:8.0f}")
    for name in ("PyTorchRuntime / default trace", "ppe-style record_function / default trace"):
        ratio, low, high = hooks[name]
        print(f"  {name:<38} {ratio:6.3f}x  (95% CI {low:.3f}-{high:.3f})")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(
                {
                    "ns_per_span": best,
                    "budgets": [
                        {"what": w, "ratio": r, "budget": b, "pass": r <= b} for w, r, b in checks
                    ],
                    "runtime_hook": hooks,
                    "python": sys.version.split()[0],
                    "machine": platform.machine(),
                    "spans": args.spans,
                    "rounds": args.rounds,
                },
                fh,
                indent=2,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
