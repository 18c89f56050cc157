"""Delivery to OpenTelemetry: what it costs to hand every span to the SDK's processors.

Two budgets (DESIGN.md, issue 11), each a paired ratio from interleaved rounds of one
run (the collector frozen for the objects that exist before, as in ``bench_trainer``),
reported as the median over rounds with a bootstrap 95% interval:

- ``simple``: ``n`` spans through ``ppetrace.trace`` delivered to an SDK
  ``SimpleSpanProcessor(InMemorySpanExporter)``, all in (recording, the flush, the
  conversion to ``ReadableSpan`` on the sink thread, the export), per span, against the
  SDK's own ``tracer.start_as_current_span`` to the same kind of processor and exporter.
  Budget: <= 0.10x.
- ``batch trainer``: the tiny Trainer (Linear 16->4, batch 8, ``steps`` steps) with every
  span delivered through a default ``BatchSpanProcessor`` to an ``InMemorySpanExporter``
  (checked: the exporter holds every recorded span), against the hand-written loop of
  ``bench_trainer``. Budget: <= 1.20x. The same Trainer with no sink at all runs in the
  same rounds (``no_sink_ratio``): the part of the ratio that delivery adds.

Run alone: ``python -m benchmarks.bench_delivery [--spans N] [--steps N] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import ppetrace
from benchmarks.bench_trainer import WORKLOADS, gc_frozen

__all__ = ["BUDGETS", "measure_batch_trainer", "measure_simple", "paired"]

BUDGETS = {"simple": 0.10, "batch trainer": 1.20}
LR = 0.01


def paired(ours: list[int], ref: list[int], seed: int = 0) -> dict[str, float]:
    """Median of the per-round ratios ``ours[i] / ref[i]``, and a bootstrap 95% interval
    of that median."""
    ratios = [a / b for a, b in zip(ours, ref, strict=True)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2_000))
    return {
        "ratio": statistics.median(ratios),
        "low": medians[int(0.025 * len(medians))],
        "high": medians[int(0.975 * len(medians)) - 1],
        "rounds": len(ratios),
    }


def _interleave(rounds: int, runs: dict[str, Callable[[], int]]) -> dict[str, list[int]]:
    times: dict[str, list[int]] = {name: [] for name in runs}
    for run in runs.values():  # warm-up
        run()
    order = list(runs)
    for r in range(rounds):
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            gc.collect()
            times[name].append(runs[name]())
    return times


def measure_simple(n: int, rounds: int) -> dict[str, Any]:
    """ppetrace -> SimpleSpanProcessor, all in, against the SDK's own span (see module doc)."""
    ours_exp, sdk_exp = InMemorySpanExporter(), InMemorySpanExporter()
    ours_provider, sdk_provider = TracerProvider(), TracerProvider()
    ours_provider.add_span_processor(SimpleSpanProcessor(ours_exp))
    sdk_provider.add_span_processor(SimpleSpanProcessor(sdk_exp))
    tracer = sdk_provider.get_tracer("bench")
    trace = ppetrace.trace
    ppetrace.configure(tracer_provider=ours_provider)

    def ours() -> int:
        ours_exp.clear()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            with trace("bench.span"):
                pass
        ppetrace.flush()
        ns = time.perf_counter_ns() - t0
        if len(ours_exp.get_finished_spans()) != n:
            raise RuntimeError(
                f"Expected {n} spans delivered, got {len(ours_exp.get_finished_spans())}."
            )
        return ns

    def sdk() -> int:
        sdk_exp.clear()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            with tracer.start_as_current_span("bench.span"):
                pass
        return time.perf_counter_ns() - t0

    try:
        times = _interleave(rounds, {"ppetrace": ours, "sdk": sdk})
    finally:
        ppetrace.configure()
    out = paired(times["ppetrace"], times["sdk"])
    out["ppetrace_ns_per_span"] = statistics.median(times["ppetrace"]) / n
    out["sdk_ns_per_span"] = statistics.median(times["sdk"]) / n
    return out


def measure_batch_trainer(steps: int, rounds: int) -> dict[str, Any]:
    """The tiny Trainer with a default BatchSpanProcessor -> InMemorySpanExporter against
    the hand-written loop (see module doc)."""
    workload = WORKLOADS["tiny"]
    loader = workload.loader(steps)
    hand_model, ours_model, bare_model = workload.model(), workload.model(), workload.model()
    hand_opt = torch.optim.SGD(hand_model.parameters(), lr=LR)
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=LR)
    bare_opt = torch.optim.SGD(bare_model.parameters(), lr=LR)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    ppetrace.configure(tracer_provider=provider)

    def hand() -> int:
        t0 = time.perf_counter_ns()
        hand_model.train()
        for x, y in loader:
            loss = F.cross_entropy(hand_model(x), y)
            loss.backward()
            hand_opt.step()
            hand_opt.zero_grad(set_to_none=True)
        return time.perf_counter_ns() - t0

    def bare() -> int:  # the same Trainer, spans recorded but delivered nowhere
        ppetrace.configure()
        try:
            t0 = time.perf_counter_ns()
            trainer = ppetrace.Trainer(
                device="cpu", max_epochs=1, val_every_n_epochs=None, progress=False
            )
            trainer.fit(bare_model, loader, optimizer=bare_opt, loss_fn=F.cross_entropy)
            return time.perf_counter_ns() - t0
        finally:
            ppetrace.configure(tracer_provider=provider)

    def ours() -> int:
        exporter.clear()
        before = ppetrace.stats().recorded
        t0 = time.perf_counter_ns()
        trainer = ppetrace.Trainer(
            device="cpu", max_epochs=1, val_every_n_epochs=None, progress=False
        )
        trainer.fit(ours_model, loader, optimizer=ours_opt, loss_fn=F.cross_entropy)
        ns = time.perf_counter_ns() - t0  # fit ends with a flush: delivery is inside
        recorded = ppetrace.stats().recorded - before
        got = len(exporter.get_finished_spans())
        if got != recorded:
            raise RuntimeError(f"Expected every one of {recorded} spans delivered, got {got}.")
        return ns

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with gc_frozen():
            times = _interleave(rounds, {"hand": hand, "ppetrace": ours, "no sink": bare})
    finally:
        torch.set_num_threads(threads)
        ppetrace.configure()
        provider.shutdown()
    out = paired(times["ppetrace"], times["hand"])
    out["ppetrace_us_per_step"] = statistics.median(times["ppetrace"]) / steps / 1e3
    out["hand_us_per_step"] = statistics.median(times["hand"]) / steps / 1e3
    # the same Trainer with no sink: what recording costs before any delivery
    out["no_sink_ratio"] = paired(times["no sink"], times["hand"])["ratio"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=20_000)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    failed = False
    simple = measure_simple(args.spans, args.rounds)
    batch = measure_batch_trainer(args.steps, args.rounds)
    for name, res in (("simple", simple), ("batch trainer", batch)):
        ok = res["ratio"] <= BUDGETS[name]
        failed |= not ok
        extra = {k: round(v, 2) for k, v in res.items() if k not in ("ratio", "low", "high")}
        print(
            f"{name}: {res['ratio']:.3f}x [{res['low']:.3f}, {res['high']:.3f}] "
            f"budget <= {BUDGETS[name]:.2f}x {'PASS' if ok else 'FAIL'} {extra}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
