"""``instrument()`` and the loops that split its cost, in instructions per step, counted by
valgrind: what the wall-time rows of ``bench_instrument`` measure, without the noise.

Run: ``python benchmarks/bench_instrument_instructions.py [--workload tiny] [--steps 20
120] [--all-threads] [--json PATH] [VARIANT ...]`` (needs ``valgrind``; about two
minutes for tiny: the child imports torch under valgrind).

The variants are ``bench_instrument``'s (:data:`VARIANTS`): ``hand`` (the bare loop),
``hooks`` (under the call-through hooks), ``rows`` (the spans recorded after the fact by
hand, trace written), ``hooks_rows`` (both), ``nofile`` (``instrument()`` without a
trace file) and ``instrument`` (trace written). In a child under ``valgrind
--tool=callgrind`` each is warmed up, then run at two step counts inside
``operator.call`` (the counted region, dumped after each call), after ``gc.collect()``
and ``gc.freeze()``; the difference of the two counts divided by the difference of the
steps is the variant's instructions per step, so what a run costs once drops out. By
default only the training thread counts; ``--all-threads`` adds the flusher's and the
writer's (the warm-up runs are dumped too and set aside, as in ``bench_instructions``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import operator
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file: `benchmarks` is a folder of the repository
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_instructions import (  # noqa: E402
    count_variants,
    find_valgrind,
    variant_parser,
)

__all__ = ["VARIANTS", "main", "runner"]

VARIANTS = ("hand", "hooks", "rows", "hooks_rows", "nofile", "instrument")


def runner(kind: str, workload: str, steps: int, tmp: Path) -> Callable[[], None]:
    """One run of variant ``kind`` over ``steps`` batches of ``workload``, with its own
    model and optimizer (as ``bench_instrument.measure_instrument`` builds them)."""
    import torch

    import ppetrace
    from benchmarks import bench_instrument as bi
    from benchmarks.trainer_variants import LR, WORKLOADS

    if kind not in VARIANTS:
        raise ValueError(f"Expected a variant out of {', '.join(VARIANTS)}, but received {kind!r}.")
    wl = WORKLOADS[workload]
    model = wl.model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loader = wl.loader(steps)
    path = tmp / f"{kind}-{steps}.json"

    def run() -> None:
        if kind in ("hand", "hooks"):
            with bi._pass_through_hooks() if kind == "hooks" else contextlib.nullcontext():
                bi._hand_loop(model, opt, loader)
        elif kind in ("nofile", "instrument"):
            with ppetrace.instrument(trace_path=path if kind == "instrument" else None):
                bi._hand_loop(model, opt, loader)
        else:
            from exporters.chrome import ChromeTraceExporter

            exporter = ChromeTraceExporter(path)
            ppetrace.tracing.add_exporter(exporter)
            try:
                with bi._pass_through_hooks() if kind == "hooks_rows" else contextlib.nullcontext():
                    bi._rows_loop(model, opt, loader)
            finally:
                ppetrace.tracing.remove_exporter(exporter)

    return run


def _child(workload: str, steps: tuple[int, int], variants: list[str], order_path: str) -> None:
    import torch

    import ppetrace

    torch.set_num_threads(1)
    ppetrace.configure()
    tmp = Path(tempfile.mkdtemp())
    runs = {(v, n): runner(v, workload, n, tmp) for v in variants for n in steps}
    order: list[Any] = []
    for counted in (False, True):
        for (name, n), run in runs.items():
            gc.collect()
            gc.freeze()
            operator.call(run)
            order.append([name if counted else f"warm-{name}", n])
    Path(order_path).write_text(json.dumps(order))
    shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = variant_parser(__doc__.splitlines()[0], list(VARIANTS))
    args = parser.parse_args(argv)
    steps = (args.steps[0], args.steps[1])
    if args.child:
        _child(args.workload, steps, args.variants, args.child)
        return 0
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}; expected some of {', '.join(VARIANTS)}")
    valgrind = find_valgrind(parser, steps)
    if valgrind is None:
        return 2
    variants = list(dict.fromkeys(["hand", *args.variants]))
    found = count_variants(valgrind, Path(__file__), args, variants)
    if found is None:
        return 1
    where = "every thread" if args.all_threads else "the training thread"
    print(
        f"{args.workload}: instructions per step on {where} (callgrind, runs of {steps[0]} "
        f"and {steps[1]} steps), and above the bare loop"
    )
    hand = found["hand"]["per_step"]
    for name in variants:
        n = found[name]["per_step"]
        print(f"  {name:<12} {n:12,.0f}   {n - hand:+10,.0f} ({n / hand:.3f}x)")
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps({"workload": args.workload, "steps": steps, "results": found}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
