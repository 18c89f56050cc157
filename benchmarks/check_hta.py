"""Does HolisticTraceAnalysis load a ppetrace trace with sane durations?

HTA (``pip install holistictraceanalysis``; it brings JupyterLab and about a
hundred packages, so it is no test dependency) rounds each event's start up
and its end down to a whole microsecond whenever ``ts`` is fractional: a span
shorter than a µs gets ``dur`` 0 or -1. ``HTA_DISABLE_NS_ROUNDING=1`` turns
that off. This script writes a one-rank trace with ppetrace's writer (spans
of 250 ns to 40 µs), loads it with HTA both ways, and prints how many
durations HTA got wrong against the file's own.

Run (HTA in a venv of its own)::

    python benchmarks/check_hta.py --hta-python /path/to/hta-venv/bin/python

It exits with 1 when HTA, with ``HTA_DISABLE_NS_ROUNDING=1``, gets any
duration wrong or cannot load the trace.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from exporters import ChromeTraceExporter, SpanBatch, SpanRow, read_chrome_trace

_LOAD = """
import json, sys, logging
logging.disable(logging.CRITICAL)
from hta.trace_analysis import TraceAnalysis
t = TraceAnalysis(trace_dir=sys.argv[1]).t
rank = next(iter(t.traces))
df = t.get_trace(rank)
names = t.symbol_table.get_sym_table()
x = df[df["dur"].notna() & (df["dur"] > -10**9)]
print(json.dumps([[names[n], float(d)] for n, d in zip(x["name"], x["dur"]) if n >= 0]))
"""


def write_trace(folder: Path) -> Path:
    """A one-rank trace: 50 steps, each a step span over five hooks of 250 ns to 40 µs."""
    rows = []
    t = 1_700_000_000_123_456_789
    sid = 1
    for step in range(50):
        start, step_id = t, sid
        sid += 1
        t += 137
        hooks = []
        for k, dur in enumerate((300, 999, 1_500, 250, 40_123)):
            hooks.append(
                SpanRow(f"hook{k}", sid, step_id, 1, t, t + dur, 7, {"ppetrace.step": step})
            )
            sid += 1
            t += dur + 41
        t += 77
        rows.append(SpanRow("trainer.step", step_id, 0, 1, start, t, 7, {"ppetrace.step": step}))
        rows.extend(hooks)
        t += 500
    rows.sort(key=lambda r: r.start_ns)
    path = folder / "rank0.json"
    exporter = ChromeTraceExporter(path, metadata={"distributedInfo": {"rank": 0}})
    exporter.export_batch(SpanBatch(rows, {"service.name": "hta", "ppetrace.rank": 0}, 4242, {}))
    exporter.shutdown()
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hta-python", default=sys.executable, help="a python with HTA")
    parser.add_argument("--json", dest="json_path", default=None, help="write results here")
    args = parser.parse_args(argv)
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_trace(Path(tmp))
        ours = read_chrome_trace(path)
        exact = sorted(zip(ours["name"], (ours["dur_ns"] / 1000).round(3), strict=True))
        for label, rounding in (("default", "0"), ("HTA_DISABLE_NS_ROUNDING=1", "1")):
            env = {**os.environ, "HTA_DISABLE_NS_ROUNDING": rounding}
            done = subprocess.run(
                [args.hta_python, "-c", _LOAD, tmp], capture_output=True, text=True, env=env
            )
            if done.returncode != 0:
                tail = done.stderr.strip().splitlines()[-1:] or ["?"]
                print(f"HTA ({label}) could not load the trace: {tail[0]}")
                results[label] = {"loaded": False, "error": tail[0]}
                continue
            got = sorted((n, round(d, 3)) for n, d in json.loads(done.stdout))
            wrong = sum(a != b for a, b in zip(got, exact, strict=False)) + abs(
                len(got) - len(exact)
            )
            negative = sum(d < 0 for _, d in got)
            zero = sum(d == 0 for _, d in got)
            results[label] = {
                "loaded": True,
                "spans": len(got),
                "wrong": wrong,
                "negative": negative,
                "zero": zero,
            }
            print(
                f"HTA ({label}): {len(got)} spans, {wrong} durations differ from the file's, "
                f"{negative} negative, {zero} zero (the file has {len(exact)}, none zero)"
            )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2) + "\n")
    fixed = results.get("HTA_DISABLE_NS_ROUNDING=1")
    ok = isinstance(fixed, dict) and fixed.get("loaded") and fixed.get("wrong") == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
