"""RSS of a long traced run: the recorder and the streaming Chrome exporter stay flat.

Run: ``python benchmarks/bench_memory.py [--spans 1000000] [--checkpoint 100000]
[--flush-every 50000] [--json PATH]``

The run records spans shaped like a traced training run: per step a
``trainer.fetch_batch`` and a ``trainer.step`` with eight hooks under it (ten
spans), each carrying a fresh attribute dict as the Trainer's do, through
``ppetrace.trace``. Every span goes to a :class:`exporters.ChromeTraceExporter`
that streams to a file. ``ppetrace.flush()`` runs every ``--flush-every``
spans, as the Trainer flushes at each epoch end (between flushes the
recorder's bounded buffer flushes itself when it fills).

The resident set size (``psutil``, after ``gc.collect()``) is read at the
start, at ``--checkpoint`` spans and at the end, and after every flush for
the peak. Phases:

- *warm-up* (start -> checkpoint): the buffer filling up to its bound, the
  exporter's string caches, the allocator's first arenas;
- *steady* (checkpoint -> end): must stay flat. Budget: less than
  :data:`BUDGET_MB` MB of growth between 10^5 and 10^6 spans, that is about
  20 bytes per span, where keeping the spans would take hundreds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import psutil

import ppetrace
from exporters import ChromeTraceExporter

__all__ = ["BUDGET_MB", "SPANS_PER_STEP", "main", "measure"]

#: allowed RSS growth (MB) between the checkpoint and the end of the run
BUDGET_MB = 20.0
SPANS_PER_STEP = 10
_HOOKS = (
    "runtime.train_pre_step",
    "runtime.convert_batch",
    "module.train_step",
    "callback.on_end_backward",
    "callback.on_end_train_step",
    "runtime.train_post_step",
)


class _NullSink:
    """A ppetrace exporter that keeps nothing."""

    def export_batch(self, batch: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


def _steps(n_steps: int, first: int) -> None:
    """Record ``n_steps`` traced steps (10 spans each), numbered from ``first``."""
    trace = ppetrace.trace
    for step in range(first, first + n_steps):
        attrs = {
            "ppetrace.epoch": 0,
            "ppetrace.step": step,
            "ppetrace.batch_idx": step,
            "ppetrace.stage": "train",
            "ppetrace.device": "cpu",
            "ppetrace.runtime": "PyTorchRuntime",
        }
        with trace("trainer.fetch_batch", attrs):
            pass
        step_attrs = attrs.copy()
        step_attrs["ppetrace.batch_size"] = 64
        with trace("trainer.step", step_attrs):
            with trace(_HOOKS[0], attrs):
                pass
            with trace(_HOOKS[1], attrs):
                pass
            with trace(_HOOKS[2], attrs):
                pass
            with trace("trainer.backward", attrs), trace(_HOOKS[3], attrs):
                pass
            with trace("trainer.optimizer_step", attrs), trace(_HOOKS[4], attrs):
                pass
            with trace(_HOOKS[5], attrs):
                pass


def measure(
    spans: int = 1_000_000,
    *,
    checkpoint: int = 100_000,
    flush_every: int = 50_000,
    trace_dir: str | os.PathLike[str] | None = None,
    sink: Literal["chrome", "null"] = "chrome",
    rss: Callable[[], int] = _rss,
) -> dict[str, Any]:
    """Record ``spans`` spans into a streamed Chrome trace; RSS at each phase (bytes).

    ``sink="null"`` sends the spans to a sink that keeps nothing instead, to
    tell the recorder's share from the exporter's. ``rss`` returns the
    current resident set size (injectable for tests).
    Returns ``rss_start``, ``rss_checkpoint``, ``rss_end``, ``rss_peak``, the
    growth of each phase in bytes, ``rss_series`` (``(spans, rss)`` after
    each flush), the spans exported and dropped, the trace
    file size and the seconds taken. Tracing is restored to the default setup
    afterwards.
    """
    for name, value in (("spans", spans), ("checkpoint", checkpoint), ("flush_every", flush_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < SPANS_PER_STEP:
            raise ValueError(
                f"Expected an int of at least {SPANS_PER_STEP} for {name}, but received {value!r}."
            )
    if sink not in ("chrome", "null"):
        raise ValueError(f"Expected sink 'chrome' or 'null', but received {sink!r}.")
    if checkpoint >= spans:
        raise ValueError(
            f"Expected checkpoint < spans, but received checkpoint={checkpoint} and "
            f"spans={spans}. Pass e.g. --checkpoint 100000 --spans 1000000."
        )
    steps_total = spans // SPANS_PER_STEP
    steps_checkpoint = checkpoint // SPANS_PER_STEP
    steps_per_flush = max(1, flush_every // SPANS_PER_STEP)
    with tempfile.TemporaryDirectory(dir=trace_dir) as tmp:
        path = Path(tmp) / "memory.json"
        exporter: Any = ChromeTraceExporter(path) if sink == "chrome" else _NullSink()
        ppetrace.configure(exporters=[exporter])
        before = ppetrace.stats()
        try:
            rss_start = rss()
            peak = rss_start
            rss_checkpoint = rss_start
            series: list[tuple[int, int]] = [(0, rss_start)]
            t0 = time.perf_counter()
            done = 0
            while done < steps_total:
                # run up to the next flush point or the checkpoint, whichever comes first
                target = min(steps_total, (done // steps_per_flush + 1) * steps_per_flush)
                if done < steps_checkpoint < target:
                    target = steps_checkpoint
                _steps(target - done, done)
                done = target
                if done % steps_per_flush == 0 or done in (steps_checkpoint, steps_total):
                    ppetrace.flush()  # the Trainer flushes at each epoch end
                    now = rss()
                    peak = max(peak, now)
                    series.append((done * SPANS_PER_STEP, now))
                    if done == steps_checkpoint:
                        rss_checkpoint = now
            elapsed = time.perf_counter() - t0
            rss_end = rss()
            after = ppetrace.stats()
        finally:
            ppetrace.configure()
            exporter.shutdown()
        size = path.stat().st_size if path.exists() else 0
    return {
        "spans": steps_total * SPANS_PER_STEP,
        "checkpoint_spans": steps_checkpoint * SPANS_PER_STEP,
        "flush_every_spans": steps_per_flush * SPANS_PER_STEP,
        "sink": sink,
        "rss_start": rss_start,
        "rss_checkpoint": rss_checkpoint,
        "rss_end": rss_end,
        "rss_peak": peak,
        "growth_warmup": rss_checkpoint - rss_start,
        "growth_steady": rss_end - rss_checkpoint,
        "exported": after.exported - before.exported,
        "dropped": after.dropped - before.dropped,
        "rss_series": series,
        "trace_bytes": size,
        "seconds": elapsed,
    }


def verdict(result: dict[str, Any], budget_mb: float = BUDGET_MB) -> bool:
    """Whether the steady phase grew by less than ``budget_mb`` MB."""
    return bool(result["growth_steady"] < budget_mb * 1e6)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--checkpoint", type=int, default=100_000)
    parser.add_argument("--flush-every", type=int, default=50_000)
    parser.add_argument("--dir", default=None, help="where to write the trace (default: tmp)")
    parser.add_argument(
        "--sink",
        choices=("chrome", "null"),
        default="chrome",
        help="null: a sink that keeps nothing, to measure the recorder alone",
    )
    parser.add_argument("--json", dest="json_path", help="also write the results here")
    args = parser.parse_args(argv)
    res = measure(
        args.spans,
        checkpoint=args.checkpoint,
        flush_every=args.flush_every,
        trace_dir=args.dir,
        sink=args.sink,
    )
    mb = 1e6
    ok = verdict(res)
    where = (
        f"streamed to a Chrome trace ({res['trace_bytes'] / mb:.0f} MB)"
        if res["sink"] == "chrome"
        else "sent to a sink that keeps nothing"
    )
    print(
        f"{res['spans']:,} spans {where} "
        f"in {res['seconds']:.1f} s, flushed every {res['flush_every_spans']:,} spans; "
        f"{res['dropped']:,} dropped"
    )
    print(f"  RSS at start              : {res['rss_start'] / mb:8.1f} MB")
    print(
        f"  RSS at {res['checkpoint_spans']:>9,} spans   : {res['rss_checkpoint'] / mb:8.1f} MB"
        f"  (warm-up growth {res['growth_warmup'] / mb:+.1f} MB)"
    )
    print(
        f"  RSS at {res['spans']:>9,} spans   : {res['rss_end'] / mb:8.1f} MB"
        f"  (steady growth {res['growth_steady'] / mb:+.1f} MB, budget < {BUDGET_MB:.0f} MB: "
        f"{'PASS' if ok else 'FAIL'})"
    )
    print(f"  peak RSS                  : {res['rss_peak'] / mb:8.1f} MB")
    if args.json_path:
        out = dict(res, budget_mb=BUDGET_MB, passed=ok, python=sys.version.split()[0])
        out["machine"] = platform.machine()
        Path(args.json_path).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
