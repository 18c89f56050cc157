"""The Chrome writer's cost per span row, and the part of it a training thread feels.

Run: ``python benchmarks/bench_writer.py [--steps N] [--batch-rows N ...] [--reps R]
[--rounds R] [--pure] [--json PATH]``.

The rows are one real step of the tiny Trainer (``bench_long_run.template_step``:
its ``trainer.fetch_batch``, ``trainer.step`` and every span in it, in the order
the recorder hands them over), repeated ``--steps`` times with shifted times, new
ids and one attribute mapping per step (a ``FrozenAttributes``, as the Trainer
shares one per step), handed to ``ChromeTraceExporter.export_batch`` in batches of
``--batch-rows`` (the tiny Trainer's flusher hands over about 1,000 to 10,000
rows at a time; ``bench_long_run`` (d) uses 16,384).

- **cpu**: the process's CPU time per row, user and system (the file write is
  mostly system time), median of ``--reps`` repetitions.
- **gil**: the time per row that a Python thread running beside the writer
  could not run. The writer runs ``export_batch`` on a thread of its own (as
  ppetrace's sink thread does) while the main thread counts loop iterations;
  the iterations missing against those counted beside a thread that sleeps as
  long are time the writer held the GIL (or switched it). On two cores that is
  what a training thread feels of the writer; its other CPU time competes only
  for a core. Median of ``--rounds`` interleaved rounds, with the rounds'
  spread (a busy machine takes time from the counting thread too).

``--pure`` runs the pure-Python encoder (``exporters.chrome._encode`` without
its C helpers) for comparison.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exporters import ChromeTraceExporter, SpanBatch, SpanRow
from exporters._spans import FrozenAttributes

try:
    from benchmarks.bench_long_run import _shifted, template_step
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from bench_long_run import _shifted, template_step  # type: ignore[no-redef]

__all__ = ["cpu_cost", "gil_cost", "main", "step_rows"]


def step_rows(template: Sequence[SpanRow], period: int, steps: int) -> list[SpanRow]:
    """``steps`` copies of the template step: times shifted by one period each, new span
    ids (parents inside the step follow), one shared attribute mapping per step."""
    out: list[SpanRow] = []
    for k in range(steps):
        out.extend(_shifted(template, k, period, 1 << 40, FrozenAttributes))
    return out


def _export(exporter: ChromeTraceExporter, rows: list[SpanRow], batch_rows: int) -> None:
    for i in range(0, len(rows), batch_rows):
        exporter.export_batch(SpanBatch(rows[i : i + batch_rows], {"service.name": "bench"}))
    exporter.force_flush()


def cpu_cost(rows: list[SpanRow], batch_rows: int, tmp: Path, reps: int = 7) -> dict[str, float]:
    """CPU ns per row of ``export_batch`` (process time: every thread), median of ``reps``."""
    times: dict[str, list[float]] = {"cpu": [], "user": [], "system": []}
    for _ in range(reps + 1):  # the first is a warm-up
        exporter = ChromeTraceExporter(tmp / "cpu.json")
        gc.collect()
        r0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time_ns()
        _export(exporter, rows, batch_rows)
        c1, r1 = time.process_time_ns(), resource.getrusage(resource.RUSAGE_SELF)
        exporter.shutdown()
        times["cpu"].append((c1 - c0) / len(rows))
        times["user"].append((r1.ru_utime - r0.ru_utime) * 1e9 / len(rows))
        times["system"].append((r1.ru_stime - r0.ru_stime) * 1e9 / len(rows))
    return {name: statistics.median(v[1:]) for name, v in times.items()}


def _count_while(thread: threading.Thread) -> tuple[int, int]:
    """Loop iterations of this thread while ``thread`` runs, and the ns they took."""
    n = 0
    alive = thread.is_alive
    t0 = time.perf_counter_ns()
    thread.start()
    while alive():
        n += 1
    return n, time.perf_counter_ns() - t0


def gil_cost(rows: list[SpanRow], batch_rows: int, tmp: Path, rounds: int = 9) -> dict[str, Any]:
    """ns per row that the writer's thread keeps a counting thread from running (module doc)."""
    lost: list[float] = []
    busy_ns = 0  # the last busy run's length: the sleeper sleeps as long
    for r in range(rounds + 1):  # the first is a warm-up
        exporter = ChromeTraceExporter(tmp / "gil.json")
        gc.collect()
        order = ("busy", "idle") if r % 2 == 0 else ("idle", "busy")
        counted: dict[str, tuple[int, int]] = {}
        for what in order:
            if what == "busy":
                writer = threading.Thread(target=_export, args=(exporter, rows, batch_rows))
                counted[what] = _count_while(writer)
                busy_ns = counted[what][1]
            else:
                sleeper = threading.Thread(target=time.sleep, args=(busy_ns / 1e9,))
                counted[what] = _count_while(sleeper)
        exporter.shutdown()
        (n_busy, t_busy), (n_idle, t_idle) = counted["busy"], counted["idle"]
        if r:
            rate = n_idle / t_idle  # iterations per ns beside a thread that only sleeps
            lost.append(max(0.0, t_busy - n_busy / rate) / len(rows))
    lost.sort()
    return {"median": statistics.median(lost), "min": lost[0], "max": lost[-1], "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4_000, help="template steps (8 rows each)")
    parser.add_argument(
        "--batch-rows", type=int, nargs="+", default=[1_000, 16_384], help="rows per batch"
    )
    parser.add_argument("--reps", type=int, default=7, help="repetitions for the CPU time")
    parser.add_argument("--rounds", type=int, default=9, help="rounds for the GIL time")
    parser.add_argument("--pure", action="store_true", help="the pure-Python encoder")
    parser.add_argument("--json", dest="json_path", help="write the results here")
    args = parser.parse_args(argv)
    if args.pure:
        from exporters.chrome import _encode

        _encode._speedups = None
    template, period = template_step()
    rows = step_rows(template, period, args.steps)
    results: dict[str, Any] = {"rows": len(rows), "pure": args.pure, "batches": {}}
    with tempfile.TemporaryDirectory(prefix="ppetrace-writer-") as tmp:
        for batch_rows in args.batch_rows:
            cpu = cpu_cost(rows, batch_rows, Path(tmp), args.reps)
            gil = gil_cost(rows, batch_rows, Path(tmp), args.rounds)
            results["batches"][batch_rows] = {"cpu_ns_per_row": cpu, "gil_ns_per_row": gil}
            print(
                f"writer, batches of {batch_rows:,} rows ({len(rows):,} rows"
                f"{', pure Python' if args.pure else ''}): CPU {cpu['cpu']:.0f} ns/row "
                f"(user {cpu['user']:.0f}, system {cpu['system']:.0f}); a thread beside it "
                f"loses {gil['median']:.0f} ns/row (rounds {gil['min']:.0f}-{gil['max']:.0f})"
            )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
