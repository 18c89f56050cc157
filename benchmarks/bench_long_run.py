"""Long runs (issue 19): the trace volume after the switch to windows, a simulated
1,000,000-step run at the default settings, and the cost of the aggregates.

Run: ``python benchmarks/bench_long_run.py [--steps N] [--rounds R] [--sim-steps N]
[--out DIR] [--json PATH]``.

- **bytes per step** (a): the tiny Trainer (Linear 16->4, batch 8, CPU) with
  ``trace_detail="all"`` and with the default windows from the start
  (``Schedule(wait=999, warmup=0, active=1, repeat=0)``: what ``"auto"`` does
  after the switch), at two step counts; the bytes per step are the slope
  (``(B(2N) - B(N)) / N``: the header and the run's own spans cancel out).
  Budget: ``windows / all <= 30%``.
- **simulated 1,000,000 steps** (b): one real step of the tiny Trainer (its
  ``trainer.fetch_batch``, ``trainer.step`` and every span in it, as the
  recorder hands them over) is the template; the writer
  (``ChromeTraceExporter`` with the Trainer's default parts) gets the template
  shifted by one step period per step, in batches of 1,024 steps, and the
  Trainer's default policy (``"auto"``, ``max_trace_bytes`` 1 GB) decides per
  step. Budget: total bytes ``<= max_trace_bytes + 30%`` of the full-detail
  bytes per step for every step after the switch. The files are left in
  ``--out`` for timing ``ppetrace report`` on them (printed).
- **cost of the aggregates** (c): paired, interleaved rounds of the tiny
  Trainer (building it and ``fit``, which closes the file) with
  ``trace_detail="all"``, with a schedule that summarises 999 steps in 1,000,
  and with tracing disabled (``configure(enabled=False)``: the loop alone), in
  the process's CPU time (every thread: the writer's too) and in wall time.
  Each round runs the three in one of their six orders, in turn, so that each
  follows each other alike. The *overhead ratio* is ``median(summarised - off)
  / median(all - off)`` over the rounds' paired differences: what the
  aggregates cost over the loop against what recording the same spans costs
  over it (the budget's own terms), with a bootstrap 95% interval over rounds
  (a ratio per round would flip its sign on a round where the noise makes
  ``all - off`` negative). The *run ratio* is the median of summarised / all
  per round (the whole run, the loop included: a weaker test, as the loop's
  noise is in both). Budget: the overhead ratio ``<= 1.0`` (the aggregates cost
  no more than recording the same spans), PASS when the interval's upper bound
  is.
- **writer cost per row** (d): the template's rows of 2,000 steps through
  ``export_batch`` alone, written in full and summarised, in CPU ns per input
  row (median of interleaved repetitions).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import ppetrace
from exporters import ChromeTraceExporter, SpanBatch, SpanRow
from ppetrace.integrations._detail import (
    DEFAULT_MAX_TRACE_BYTES,
    DEFAULT_WINDOWS,
    TRACE_PART_BYTES,
    StepDetail,
    detail_metadata,
)

try:
    from benchmarks.trainer_variants import WORKLOADS
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from trainer_variants import WORKLOADS  # type: ignore[no-redef]

__all__ = ["bytes_per_step", "main", "paired_cost", "simulate", "template_step", "writer_cost"]

TINY = WORKLOADS["tiny"]
#: every step summarised but one in 1,000 (the default windows)
WINDOWS = DEFAULT_WINDOWS
_tuple_new = tuple.__new__


def _fit(steps: int, path: Path | None, trace_detail: Any) -> ppetrace.Trainer:
    model = TINY.model()
    trainer = ppetrace.Trainer(
        max_epochs=1,
        progress=False,
        val_every_n_epochs=None,
        trace_path=path,
        trace_detail=trace_detail,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer.fit(model, TINY.loader(steps), optimizer=opt, loss_fn=F.cross_entropy)
    return trainer


def bytes_per_step(steps: int, tmp: Path) -> dict[str, float]:
    """(a): the trace bytes per step of the tiny Trainer, in full and in windows."""
    out: dict[str, float] = {}
    for name, detail in (("all", "all"), ("windows", WINDOWS)):
        sizes = []
        for n in (steps, 2 * steps):
            trainer = _fit(n, tmp / f"bytes-{name}-{n}.json", detail)
            sizes.append(trainer.trace_exporter.bytes_written)
        out[name] = (sizes[1] - sizes[0]) / steps
    out["ratio"] = out["windows"] / out["all"]
    return out


class _Capture:
    """A ppetrace sink that keeps the rows it is given."""

    def __init__(self) -> None:
        self.rows: list[SpanRow] = []

    def export_batch(self, batch: SpanBatch) -> None:
        self.rows.extend(batch.rows)

    def shutdown(self) -> None:
        pass


def template_step(index: int = 20) -> tuple[list[SpanRow], int]:
    """The rows of one real step of the tiny Trainer (its fetch, its step and every span
    in it), in the order the recorder hands them over, and the step period (ns)."""
    capture = _Capture()
    ppetrace.tracing.add_exporter(capture)
    try:
        _fit(index + 10, None, "all")
    finally:
        ppetrace.tracing.remove_exporter(capture)
    rows = capture.rows
    steps = sorted((r for r in rows if r.name == "trainer.step"), key=lambda r: r.start_ns)
    fetches = sorted((r for r in rows if r.name == "trainer.fetch_batch"), key=lambda r: r.start_ns)
    step, fetch, nxt = steps[index], fetches[index], fetches[index + 1]
    keep = [
        r
        for r in rows
        if r.tid == step.tid
        and (r is fetch or (step.start_ns <= r.start_ns and r.end_ns <= step.end_ns))
    ]
    return keep, nxt.start_ns - fetch.start_ns


def _shifted(
    template: Sequence[SpanRow],
    k: int,
    period: int,
    base: int,
    mapping: Callable[[dict[str, Any]], Any] = dict,
) -> list[SpanRow]:
    """The template's rows as step ``k``: times shifted by ``k`` periods, new span ids
    (parents inside the step follow), the step's number in its attributes (one
    ``mapping`` of them shared by the step's rows)."""
    ids = {r.span_id: base + k * len(template) + i for i, r in enumerate(template)}
    dt = k * period
    attrs = mapping({**template[0].attributes, "ppetrace.step": k, "ppetrace.batch_idx": k})
    return [
        _tuple_new(
            SpanRow,
            (
                r.name,
                ids[r.span_id],
                ids.get(r.parent_id, r.parent_id),
                r.trace_id,
                r.start_ns + dt,
                r.end_ns + dt,
                r.tid,
                attrs,
                r.status,
                r.error,
            ),
        )
        for r in template
    ]


def simulate(
    steps: int,
    out_dir: Path,
    template: Sequence[SpanRow],
    period: int,
    *,
    max_trace_bytes: int = DEFAULT_MAX_TRACE_BYTES,
    batch_steps: int = 1_024,
    notify: Callable[[str], None] = print,
) -> dict[str, Any]:
    """(b): ``steps`` template steps through the writer under the default policy."""
    path = out_dir / "trace.json"
    exporter = ChromeTraceExporter(
        path,
        metadata={"ppetrace.detail": detail_metadata("auto", max_trace_bytes)},
        max_part_bytes=TRACE_PART_BYTES,
    )
    detail = StepDetail.create(exporter, "auto", max_trace_bytes, notify)
    assert detail is not None
    step_row = next(r for r in template if r.name == "trainer.step")
    offset = step_row.start_ns - template[0].start_ns  # the step starts after its fetch
    base = 1 << 40
    t0 = time.perf_counter()
    rows: list[SpanRow] = []
    for k in range(steps):
        if detail.due(k):
            detail.summarise_at(template[0].start_ns + offset + k * period, step_row.tid)
        rows.extend(_shifted(template, k, period, base))
        if (k + 1) % batch_steps == 0 or k + 1 == steps:
            exporter.export_batch(SpanBatch(rows, {"service.name": "bench"}))
            rows = []
    exporter.shutdown()
    seconds = time.perf_counter() - t0
    switched = detail.switched_at
    total = sum(p.stat().st_size for p in exporter.parts)
    full_rate = len_full = float("nan")
    if switched:
        # the full-detail bytes per step, from the steps before the switch
        full_rate = max_trace_bytes / switched
        len_full = switched
    after = steps - (switched or steps)
    budget = max_trace_bytes + 0.30 * full_rate * after if switched else float(max_trace_bytes)
    return {
        "steps": steps,
        "spans": steps * len(template),
        "switched_at_step": switched,
        "full_bytes_per_step": full_rate,
        "steps_in_full_before_switch": len_full,
        "total_bytes": total,
        "budget_bytes": budget,
        "parts": [str(p) for p in exporter.parts],
        "steps_summarised": exporter.steps_summarised,
        "spans_summarised": exporter.spans_summarised,
        "seconds": seconds,
        "errors": exporter.errors,
        "spans_lost": exporter.spans_lost,
    }


def _bootstrap_median(values: Sequence[float], resamples: int = 2_000) -> tuple[float, float]:
    data = np.asarray(values, dtype=float)
    rng = np.random.default_rng(0)
    medians = np.median(data[rng.integers(0, len(data), size=(resamples, len(data)))], axis=1)
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return float(lo), float(hi)


def _fit_variant(name: str, steps: int, path: Path) -> None:
    if name == "off":
        ppetrace.configure(enabled=False)
        try:
            _fit(steps, None, "all")
        finally:
            ppetrace.configure()
    else:
        _fit(steps, path, "all" if name == "all" else WINDOWS)


def _overhead(all_: np.ndarray, summ: np.ndarray, off: np.ndarray) -> float:
    """median(summarised - off) / median(all - off); NaN when the second is not > 0."""
    over = float(np.median(all_ - off))
    return float(np.median(summ - off)) / over if over > 0 else float("nan")


def _overhead_ci(
    all_: np.ndarray, summ: np.ndarray, off: np.ndarray, resamples: int = 2_000
) -> tuple[float, float]:
    """A bootstrap 95% interval of :func:`_overhead` over the rounds (resampled in pairs);
    a resample whose ``all - off`` is not > 0 counts as an infinite ratio."""
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(all_), size=(resamples, len(all_)))
    found = [_overhead(all_[p], summ[p], off[p]) for p in picks]
    ratios = np.nan_to_num(np.asarray(found), nan=np.inf)
    # nearest ranks, not interpolation: inf - inf would be NaN where infinities begin
    lo, hi = np.percentile(ratios, [2.5, 97.5], method="nearest")
    return float(lo), float(hi)


def paired_cost(steps: int, rounds: int, tmp: Path) -> dict[str, Any]:
    """(c): the overhead ratio median(summarised - off) / median(all - off) over the
    rounds, and the run ratio summarised / all per round, in CPU and wall time."""
    variants = ("all", "summarised", "off")
    for name in variants:  # warm-up
        _fit_variant(name, steps, tmp / f"warm-{name}.json")
    cpu: dict[str, list[int]] = {name: [] for name in variants}
    wall: dict[str, list[int]] = {name: [] for name in variants}
    orders = list(itertools.permutations(variants))  # each one after each other alike
    for r in range(rounds):
        for name in orders[r % len(orders)]:
            gc.collect()
            c0, w0 = time.process_time_ns(), time.perf_counter_ns()
            _fit_variant(name, steps, tmp / f"cost-{name}.json")
            cpu[name].append(time.process_time_ns() - c0)
            wall[name].append(time.perf_counter_ns() - w0)
    out: dict[str, Any] = {"steps": steps, "rounds": rounds}
    for label, data in (("cpu", cpu), ("wall", wall)):
        all_, summ, off = (np.asarray(data[name], dtype=float) for name in variants)
        runs = list(summ / all_)
        out[label] = {
            "overhead_ratio": _overhead(all_, summ, off),
            "overhead_ci95": _overhead_ci(all_, summ, off),
            "run_ratio": statistics.median(runs),
            "run_ci95": _bootstrap_median(runs),
            **{
                f"us_per_step_{name}": statistics.median(data[name]) / steps / 1e3
                for name in variants
            },
        }
    return out


def writer_cost(
    template: Sequence[SpanRow], period: int, tmp: Path, steps: int = 2_000, reps: int = 7
) -> dict[str, float]:
    """(d): ns per input row of ``export_batch``, rows written in full and summarised."""
    rows = [r for k in range(steps) for r in _shifted(template, k, period, 1 << 40)]
    step_row = next(r for r in template if r.name == "trainer.step")
    starts = [step_row.start_ns + k * period for k in range(steps)]
    chunk = 16_384
    times: dict[str, list[float]] = {"full": [], "summarised": []}
    for rep in range(reps):
        for name in ("full", "summarised") if rep % 2 == 0 else ("summarised", "full"):
            exporter = ChromeTraceExporter(tmp / f"writer-{name}.json")
            if name == "summarised":
                for s in starts:
                    exporter.summarise_step(step_row.tid, s)
            gc.collect()
            t0 = time.process_time_ns()  # CPU time: the writer's own thread included
            for i in range(0, len(rows), chunk):
                exporter.export_batch(SpanBatch(rows[i : i + chunk], {"service.name": "b"}))
            exporter.force_flush()
            times[name].append((time.process_time_ns() - t0) / len(rows))
            exporter.shutdown()
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2_000, help="tiny steps for (a)")
    parser.add_argument("--cost-steps", type=int, default=500, help="tiny steps for (c)")
    parser.add_argument("--rounds", type=int, default=15, help="paired rounds for (c)")
    parser.add_argument("--sim-steps", type=int, default=1_000_000, help="steps for (b)")
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for (b)'s trace (default: a temp dir)"
    )
    parser.add_argument("--skip", default="", help="parts to skip, e.g. 'b,c'")
    parser.add_argument("--json", dest="json_path", help="write the results here")
    args = parser.parse_args(argv)
    skip = set(args.skip.split(",")) - {""}
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix="ppetrace-long-"))
    try:
        if "a" not in skip:
            a = results["bytes_per_step"] = bytes_per_step(args.steps, tmp)
            print(
                f"(a) bytes/step, tiny: all {a['all']:.0f}, windows (1 in 1,000) "
                f"{a['windows']:.0f}: {a['ratio']:.1%} (budget <= 30%: "
                f"{'PASS' if a['ratio'] <= 0.30 else 'FAIL'})"
            )
        template, period = template_step()
        if "d" not in skip:
            d = results["writer_ns_per_row"] = writer_cost(template, period, tmp)
            print(
                f"(d) writer, ns per input row: full {d['full']:.0f}, summarised "
                f"{d['summarised']:.0f} ({d['summarised'] / d['full']:.2f}x)"
            )
        if "c" not in skip:
            c = results["aggregates_cost"] = paired_cost(args.cost_steps, args.rounds, tmp)
            for label in ("cpu", "wall"):
                x = c[label]
                lo, hi = x["overhead_ci95"]
                rlo, rhi = x["run_ci95"]
                print(
                    f"(c) {label} time, us/step: all {x['us_per_step_all']:.1f}, summarised "
                    f"{x['us_per_step_summarised']:.1f}, tracing off {x['us_per_step_off']:.1f}; "
                    f"overhead ratio (summarised - off) / (all - off): "
                    f"{x['overhead_ratio']:.3f} [95% {lo:.3f}, {hi:.3f}] (budget <= 1.0: "
                    f"{'PASS' if hi <= 1.0 else ('FAIL' if lo > 1.0 else 'UNDECIDED')}); "
                    f"run ratio summarised / all: {x['run_ratio']:.3f} [95% {rlo:.3f}, {rhi:.3f}]"
                )
        if "b" not in skip:
            out = args.out or Path(tempfile.mkdtemp(prefix="ppetrace-1m-"))
            out.mkdir(parents=True, exist_ok=True)
            b = results["simulated"] = simulate(args.sim_steps, out, template, period)
            ok = b["total_bytes"] <= b["budget_bytes"]
            print(
                f"(b) {b['steps']:,} steps ({b['spans']:,} spans): {b['total_bytes']:,} bytes "
                f"in {len(b['parts'])} parts, budget {b['budget_bytes']:,.0f} "
                f"({'PASS' if ok else 'FAIL'}); switched at step {b['switched_at_step']}, "
                f"{b['steps_summarised']:,} steps summarised, written in {b['seconds']:.0f} s"
            )
            print(f"(b) the trace: {b['parts'][0]} (time: ppetrace report {b['parts'][0]})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
