"""How fast rank files merge into one timeline, and what that costs per span.

Budget (issue 15): the merge of 2 x 500,000 spans <= 3 s.

Two rank files of ``--spans`` spans each, written the way the Trainer writes
them under torchrun (``ChromeTraceExporter`` with ``distributedInfo``, the
common origin and the clock fields; the spans of ``bench_export``: a traced
training run, 10 spans per step), are merged with ``exporters.merge_traces``:

- ``copied``: what one host gives (distinct pids, times already on rank 0's
  clock): each file's events are copied as text. The budgeted figure;
- ``edited``: both ranks with the same pid (containers on several hosts) and a
  clock offset, so every span line is edited (new ``ts`` and ``pid``).

Each is run ``--repeat`` times (default 3); the best and median wall seconds,
CPU seconds, ns per span, bytes per span on disk and the peak RSS growth of
the process during the merge are printed (and written with ``--json``). The
machine is shared: the lead re-measures the budget on a quiet one.

Run::

    python benchmarks/bench_merge.py [--spans 500000] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_export import make_batches
from exporters import ChromeTraceExporter, merge_traces

BUDGET_S = 3.0
ORIGIN = 1_700_000_000_000_000_000


def write_rank(path: Path, rank: int, spans: int, *, pid: int, offset: int = 0) -> int:
    """A rank file of ``spans`` spans as the Trainer writes it; returns its size."""
    exporter = ChromeTraceExporter(
        path,
        origin_ns=ORIGIN - offset,
        clock_offset_ns=offset,
        distributed_info={"rank": rank, "world_size": 2, "backend": "gloo"},
        header_reserve=1024,
        metadata={"clock_error_ns": 100_000},
    )
    for batch in make_batches(spans):
        batch.resource["ppetrace.rank"] = rank
        exporter.export_batch(type(batch)(batch.rows, batch.resource, pid, batch.thread_names))
    exporter.shutdown()
    return path.stat().st_size


class _PeakRSS:
    """The peak RSS growth of this process while the block runs (sampled every 5 ms)."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()

    def __enter__(self) -> _PeakRSS:
        self._base = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._proc.memory_info().rss - self._base)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss - self._base)


def measure(folder: Path, out: Path, repeat: int) -> dict[str, Any]:
    walls, cpus, peaks = [], [], []
    for _ in range(repeat):
        gc.collect()
        with _PeakRSS() as rss:
            cpu = time.process_time()
            start = time.perf_counter()
            merge_traces(out, [folder])
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
        peaks.append(rss.peak)
    return {
        "best_s": min(walls),
        "median_s": statistics.median(walls),
        "cpu_median_s": statistics.median(cpus),
        "peak_rss_mb": max(peaks) / 1e6,
        "out_bytes": out.stat().st_size,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=500_000, help="spans per rank")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--dir", default=None, help="where to write the files (default: tmp)")
    args = parser.parse_args(argv)
    n = args.spans
    results: dict[str, Any] = {
        "spans_per_rank": n,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "load_average": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for case, pids, offset in (("copied", (1000, 1001), 0), ("edited", (1000, 1000), -12_345)):
            folder = Path(tmp) / case
            folder.mkdir()
            size = 0
            for rank in (0, 1):
                size += write_rank(
                    folder / f"rank{rank}.json", rank, n, pid=pids[rank], offset=offset * rank
                )
            row = measure(folder, Path(tmp) / f"{case}.json", args.repeat)
            row["in_bytes"] = size
            row["bytes_per_span"] = size / (2 * n)
            row["ns_per_span"] = row["median_s"] / (2 * n) * 1e9
            row["cpu_ns_per_span"] = row["cpu_median_s"] / (2 * n) * 1e9
            results[case] = row
    scale = 1_000_000 / (2 * n)
    copied = results["copied"]
    results["budget_s"] = BUDGET_S
    results["pass"] = copied["median_s"] * scale <= BUDGET_S
    print(f"merge of 2 x {n:,} spans (budget: 2 x 500,000 in <= {BUDGET_S} s)")
    for case in ("copied", "edited"):
        r = results[case]
        print(
            f"  {case:7s}: median {r['median_s']:.2f} s (best {r['best_s']:.2f} s, cpu "
            f"{r['cpu_median_s']:.2f} s), {r['ns_per_span']:.0f} ns/span wall, "
            f"{r['cpu_ns_per_span']:.0f} ns/span cpu, {r['bytes_per_span']:.0f} B/span on disk, "
            f"peak RSS +{r['peak_rss_mb']:.0f} MB"
        )
    verdict = "PASS" if results["pass"] else "FAIL"
    print(f"  budget (copied, median, scaled to 2 x 500,000): {verdict}")
    print(f"  load average during the run: {results['load_average']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if results["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
