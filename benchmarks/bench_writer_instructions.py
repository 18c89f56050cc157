"""The Chrome writer's instructions per input row, in full and summarised, counted by valgrind.

Run: ``python benchmarks/bench_writer_instructions.py [--steps 300 900] [--json PATH]``
(needs ``valgrind``; a few minutes: the child imports torch under valgrind).

Issue 19 asks that the aggregates of summarised steps cost no more than writing
the same spans in full. The Trainer's summarised steps are light steps, whose spans
are never rows (``bench_long_run_instructions.py`` counts that); this counts the
writer's fold of recorded rows, which ``instrument()`` and ``LightningProfiler`` use.
``bench_long_run`` (c) times the whole tiny Trainer run both ways and (d) the writer
alone, in CPU time; on a shared 2-core machine
both move by several percent from run to run, more than the difference they
look for. Instructions do not. This takes one real step of the tiny Trainer as
``bench_long_run.template_step`` does (in this process), then, in a child under
``valgrind --tool=callgrind``, hands ``ChromeTraceExporter.export_batch`` the
template's rows for A and for B steps (``bench_long_run._shifted``, batches of
16,384 rows, then ``force_flush``), once in full and once with every step
summarised, in two rounds (the first carries what the process does once; the
second is used). Each export runs inside ``operator.call``, the region counted in
every thread (the counters are zeroed when it starts and dumped when it ends:
the writer's own thread is in it), after ``gc.collect()`` and ``gc.freeze()``, so
that a collection inside it does not walk torch's objects. The difference of the
two counts divided by the difference of the rows is the instructions per input
row, so what an exporter costs once (opening the file, the header) drops out.

Instructions are not time, but both paths are the same kind of work (C loops
over the rows, some Python per batch), so their ratio says whether summarising
costs more than writing in full.
"""

from __future__ import annotations

import argparse
import gc
import json
import operator
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

try:
    from benchmarks.bench_instructions import find_valgrind, per_step, run_callgrind, totals
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from bench_instructions import (  # type: ignore[no-redef]
        find_valgrind,
        per_step,
        run_callgrind,
        totals,
    )

__all__ = ["main", "per_row"]

VARIANTS = ("full", "summarised")
_CHUNK = 16_384  # rows per export_batch, as bench_long_run (d)
#: every thread: the counters zeroed when operator.call starts (dumped when it ends)
_COLLECT = ["--zero-before=_operator_call"]


def _export(exporter: Any, rows: list[Any]) -> None:
    from exporters import SpanBatch

    for i in range(0, len(rows), _CHUNK):
        exporter.export_batch(SpanBatch(rows[i : i + _CHUNK], {"service.name": "b"}))
    exporter.force_flush()


def _child(template_path: str, steps: tuple[int, int], order_path: str) -> None:
    """Inside valgrind: each variant once to warm up, then at both step counts inside
    ``operator.call`` (the zeroed and dumped region)."""
    from exporters import ChromeTraceExporter

    try:
        from benchmarks.bench_long_run import _shifted
    except ImportError:
        from bench_long_run import _shifted  # type: ignore[no-redef]

    template, period = pickle.loads(Path(template_path).read_bytes())
    step_row = next(r for r in template if r.name == "trainer.step")
    tmp = Path(tempfile.mkdtemp())
    order = []
    for counted in (False, True, True):  # the first counted round has one-time costs
        for name in VARIANTS:
            for n in steps if counted else steps[:1]:
                rows = [r for k in range(n) for r in _shifted(template, k, period, 1 << 40)]
                exporter = ChromeTraceExporter(tmp / f"{name}-{n}.json")
                if name == "summarised":
                    for k in range(n):
                        exporter.summarise_step(step_row.tid, step_row.start_ns + k * period)
                if counted:
                    gc.collect()
                    gc.freeze()  # a collection inside the counted region walks only new objects
                    operator.call(_export, exporter, rows)
                    order.append([name, len(rows)])
                else:
                    _export(exporter, rows)
                exporter.shutdown()
    Path(order_path).write_text(json.dumps(order))
    shutil.rmtree(tmp, ignore_errors=True)


def per_row(order: list[list[Any]], counts: list[int]) -> dict[str, float]:
    """``{variant: instructions per input row}`` from the runs at two row counts (the
    last run of each variant and count: earlier rounds include one-time costs)."""
    return {name: v["per_step"] for name, v in per_step(order, counts).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", nargs=2, type=int, default=[300, 900], metavar=("A", "B"))
    parser.add_argument("--json", dest="json_path", help="also write the results here")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = (args.steps[0], args.steps[1])
    if args.child:
        _child(args.child[0], steps, args.child[1])
        return 0
    valgrind = find_valgrind(parser, steps)
    if valgrind is None:
        return 2
    try:
        from benchmarks.bench_long_run import template_step
    except ImportError:
        from bench_long_run import template_step  # type: ignore[no-redef]

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        template_path, order_path = out / "template.pickle", out / "order.json"
        template_path.write_bytes(pickle.dumps(template_step()))
        script = ["--steps", str(steps[0]), str(steps[1])]
        script += ["--child", str(template_path), str(order_path)]
        if not run_callgrind(valgrind, _COLLECT, out, Path(__file__), script, order_path):
            return 1
        results = per_row(json.loads(order_path.read_text()), totals(out))
    ratio = results["summarised"] / results["full"]
    print(
        f"writer instructions per input row (callgrind, every thread, {steps[0]} and "
        f"{steps[1]} steps of the tiny Trainer's rows): full {results['full']:,.0f}, "
        f"summarised {results['summarised']:,.0f} ({ratio:.3f}x: the writer's fold of "
        "recorded rows, as instrument() and LightningProfiler use it; the Trainer's light "
        "steps record no rows to fold: python benchmarks/bench_long_run_instructions.py)"
    )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({**results, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
