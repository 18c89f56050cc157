"""Issue 19 (c) in instructions: the tiny Trainer with every step summarised against the
same run in full detail and with tracing disabled, counted by valgrind over every thread.

Run: ``python benchmarks/bench_long_run_instructions.py [--steps 100 400] [--json PATH]``
(needs ``valgrind``; about five minutes: the child imports torch under valgrind).

``bench_long_run`` (c) compares the two runs in CPU time, which moves by several
percent from run to run on a shared 2-core machine, more than the difference it looks
for. Instructions do not. In a child under ``valgrind --tool=callgrind``, this runs
``bench_long_run._fit_variant`` (building the Trainer, ``fit``, closing the trace) with
``trace_detail="all"``, with the default windows from the first step
(``DEFAULT_WINDOWS``: 999 steps in 1,000 summarised) and with tracing disabled (the loop
alone), at two step counts, in two rounds
(the first carries what the process does once; the second is used). Each fit runs inside
``operator.call``, the region counted in every thread (the counters are zeroed when it
starts and dumped when it ends: the flusher's and the writer's threads are in it), after
``gc.collect()`` and ``gc.freeze()``. The difference of the two counts divided by the
difference of the steps is the instructions per step, so what a run costs once drops out.
The overhead ratio ``(summarised - off) / (all - off)`` is issue 19 (c) in the budget's
own terms: what the aggregates add to the loop against what recording the spans adds.
"""

from __future__ import annotations

import argparse
import gc
import json
import operator
import shutil
import tempfile
from pathlib import Path

try:
    from benchmarks.bench_instructions import find_valgrind, per_step, run_callgrind, totals
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from bench_instructions import (  # type: ignore[no-redef]
        find_valgrind,
        per_step,
        run_callgrind,
        totals,
    )

__all__ = ["main"]

VARIANTS = ("all", "summarised", "off")
#: every thread: the counters zeroed when operator.call starts (dumped when it ends)
_COLLECT = ["--zero-before=_operator_call"]


def _child(steps: tuple[int, int], order_path: str) -> None:
    import torch

    try:
        from benchmarks.bench_long_run import _fit_variant
    except ImportError:
        from bench_long_run import _fit_variant  # type: ignore[no-redef]

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    order = []
    for counted in (False, True):  # the first round carries one-time costs
        for name in VARIANTS:
            for n in steps:
                gc.collect()
                gc.freeze()
                operator.call(_fit_variant, name, n, tmp / f"{name}-{n}.json")
                if counted:
                    order.append([name, n])
                else:
                    order.append([f"warm-{name}", n])
    Path(order_path).write_text(json.dumps(order))
    shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", nargs=2, type=int, default=[100, 400], metavar=("A", "B"))
    parser.add_argument("--json", dest="json_path", help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = (args.steps[0], args.steps[1])
    if args.child:
        _child(steps, args.child)
        return 0
    valgrind = find_valgrind(parser, steps)
    if valgrind is None:
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        order_path = out / "order.json"
        script = ["--steps", str(steps[0]), str(steps[1]), "--child", str(order_path)]
        if not run_callgrind(valgrind, _COLLECT, out, Path(__file__), script, order_path):
            return 1
        found = per_step(json.loads(order_path.read_text()), totals(out))
    results = {name: found[name]["per_step"] for name in VARIANTS}
    all_, summ, off = (results[name] for name in VARIANTS)
    ratio = summ / all_
    overhead = (summ - off) / (all_ - off) if all_ != off else float("nan")
    print(
        f"instructions per tiny Trainer step, every thread ({steps[0]} and {steps[1]} steps): "
        f"all {all_:,.0f}, summarised {summ:,.0f} ({summ - all_:+,.0f}, {ratio:.4f}x), "
        f"tracing off {off:,.0f}; overhead ratio (summarised - off) / (all - off) "
        f"{overhead:.3f} (issue 19 (c): <= 1.0 {'PASS' if overhead <= 1.0 else 'FAIL'})"
    )
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps({**results, "ratio": ratio, "overhead_ratio": overhead}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
