"""Instructions per training step, counted by valgrind: the Trainer's own cost, without noise.

Run: ``python benchmarks/bench_instructions.py [--workload tiny] [--steps 20 120]
[--json PATH] [VARIANT ...]`` (needs ``valgrind``; about ten minutes: valgrind runs
the whole process, torch's import included, some 50 times slower).

Wall time on a shared 2-core machine moves by tens of percent between runs;
instruction counts do not. This runs the variants of ``bench_trainer`` (default:
every hand loop and every Trainer variant, :data:`DEFAULT`) in one process under
``valgrind --tool=callgrind``, each once to warm up and then at two step counts,
collecting only inside each run (``--toggle-collect`` on ``operator.call``, which
nothing else calls, and a dump after each). The difference of the two counts
divided by the difference of the steps is the variant's instructions per step, so
what a run costs once (building the Trainer, opening and closing the trace file)
drops out. By default only the training thread counts (callgrind toggles
collection per thread): what ppetrace does on its own threads (the flusher, the
sink workers that encode the trace file) is not in those figures.
``--all-threads`` counts every thread instead (the counters are zeroed when each
run starts and dumped when it ends), which adds that work: the whole CPU cost. The
warm-up runs are counted too, and set aside: the first dump of the process carries
some 40M instructions of other threads (seen even when nothing ran before it; I do not
know what they are), and when that dump was a counted run the first variant's figure
per step came out at half the training thread's own.

It prints, per variant, the instructions per step and, for each Trainer variant,
those above the hand loop of its module kind and the ratio. Instructions are not
time (an instruction of torch's kernels is not one of the interpreter), so the
ratios say where the cost is and whether a change shrinks it; the budgets are
wall-time ratios (``python -m benchmarks.run``).
"""

from __future__ import annotations

import argparse
import gc
import json
import operator
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

try:
    from benchmarks.bench_trainer import REFERENCE, VARIANTS
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from bench_trainer import REFERENCE, VARIANTS  # type: ignore[no-redef]

__all__ = [
    "DEFAULT",
    "count_variants",
    "find_valgrind",
    "main",
    "per_step",
    "run_callgrind",
    "totals",
    "variant_parser",
]

#: every hand loop and every Trainer variant of bench_trainer
DEFAULT: tuple[str, ...] = tuple(v for v in VARIANTS if v.startswith(("hand", "ppetrace")))


def _child(workload: str, steps: tuple[int, int], variants: list[str], order_path: str) -> None:
    """Inside valgrind: warm every variant up, then run each at both step counts inside
    ``operator.call`` (the toggled, dumped region), the warm-ups too (named
    ``warm-<variant>`` in the order file, and not reported)."""
    import torch

    import ppetrace

    try:
        from benchmarks.trainer_variants import CLASSES, WORKLOADS
    except ImportError:
        from trainer_variants import CLASSES, WORKLOADS  # type: ignore[no-redef]

    torch.set_num_threads(1)
    ppetrace.configure()
    wl = WORKLOADS[workload]
    tmp = Path(tempfile.mkdtemp())
    runners = {(name, n): CLASSES[name](wl, wl.loader(n), tmp) for name in variants for n in steps}
    order = []
    for counted in (False, True):
        if counted:
            gc.collect()
            gc.freeze()
        for (name, n), runner in runners.items():
            gc.collect()
            # the warm-up runs are dumped too: with --all-threads the first dump carries
            # other threads' work that is no run's (see the module docstring)
            operator.call(runner.run)  # run(): the variant's setup too (tracing off)
            order.append([name if counted else f"warm-{name}", n])
    Path(order_path).write_text(json.dumps(order))
    shutil.rmtree(tmp, ignore_errors=True)


def totals(out_dir: Path) -> list[int]:
    """The instruction total of each dump in ``out_dir``, in dump order."""
    found = []
    for path in sorted(out_dir.glob("cg.out.*"), key=lambda p: int(p.suffix[1:])):
        for line in path.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                found.append(int(line.split()[1]))
                break
    return found


def per_step(order: list[list[Any]], counts: list[int]) -> dict[str, dict[str, float]]:
    """``{variant: {"per_step": ..., "once": ...}}`` from the runs at two step counts (the
    last run of each at each count). Warm-up runs (``warm-<variant>``) take their dump
    and are left out."""
    if len(order) != len(counts):
        raise ValueError(
            f"Expected one callgrind dump per run ({len(order)}), but found {len(counts)}."
        )
    by: dict[str, dict[int, int]] = {}
    for (name, n), count in zip(order, counts, strict=True):
        if not str(name).startswith("warm-"):
            by.setdefault(name, {})[int(n)] = count
    out = {}
    for name, runs in by.items():
        (n1, c1), (n2, c2) = sorted(runs.items())
        step = (c2 - c1) / (n2 - n1)
        out[name] = {"per_step": step, "once": c1 - step * n1}
    return out


def find_valgrind(parser: argparse.ArgumentParser, steps: tuple[int, int]) -> str | None:
    """valgrind's path, after checking ``--steps A B`` (0 < A < B, else a usage error);
    None, having said so on stderr, when valgrind is not installed."""
    if not 0 < steps[0] < steps[1]:
        parser.error(f"expected 0 < A < B for --steps, but received {steps[0]} {steps[1]}")
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("valgrind is not installed: nothing to count.", file=sys.stderr)
    return valgrind


def run_callgrind(
    valgrind: str, collect: list[str], out: Path, script: Path, args: list[str], done: Path
) -> bool:
    """Run ``python script args`` under callgrind (``collect``: its collection options),
    with a dump into ``out`` after each ``operator.call``; False, having printed the
    tail of its stderr, when it failed or did not write ``done``."""
    command = [
        valgrind,
        "--tool=callgrind",
        *collect,
        "--dump-after=_operator_call",
        f"--callgrind-out-file={out / 'cg.out'}",
        sys.executable,
        str(script.resolve()),
        *args,
    ]
    env = dict(os.environ, PYTHONHASHSEED="0")
    finished = subprocess.run(command, env=env, capture_output=True, text=True)
    if finished.returncode != 0 or not done.exists():
        print(finished.stderr[-4000:], file=sys.stderr)
        return False
    return True


def variant_parser(description: str, default: list[str]) -> argparse.ArgumentParser:
    """The command line of the scripts that count variants per step: ``VARIANT ...``,
    ``--workload``, ``--steps A B``, ``--json``, ``--all-threads`` (and the child's)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("variants", nargs="*", default=default)
    parser.add_argument("--workload", default="tiny", choices=("tiny", "mlp"))
    parser.add_argument("--steps", nargs=2, type=int, default=[20, 120], metavar=("A", "B"))
    parser.add_argument("--json", dest="json_path", help="also write the results here")
    parser.add_argument(
        "--all-threads", action="store_true", help="count every thread, not only the training one"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def count_variants(
    valgrind: str, script: Path, args: argparse.Namespace, variants: list[str]
) -> dict[str, dict[str, float]] | None:
    """Run ``script``'s child (``--child``) under callgrind over ``variants`` at the two
    step counts of ``args`` and return :func:`per_step` of its dumps; None, having said
    why on stderr, when the run failed or counted nothing."""
    collect = (
        ["--zero-before=_operator_call"]
        if args.all_threads
        else ["--collect-atstart=no", "--toggle-collect=_operator_call"]
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        order_path = out / "order.json"
        steps = [str(n) for n in args.steps]
        child = ["--workload", args.workload, "--steps", *steps, "--child", str(order_path)]
        if not run_callgrind(valgrind, collect, out, script, [*child, *variants], order_path):
            return None
        counts = totals(out)
        if not any(counts):
            print(
                "callgrind counted nothing: this Python's library lacks the symbol "
                "_operator_call that the counting toggles on.",
                file=sys.stderr,
            )
            return None
        return per_step(json.loads(order_path.read_text()), counts)


def main(argv: list[str] | None = None) -> int:
    parser = variant_parser(__doc__.splitlines()[0], list(DEFAULT))
    args = parser.parse_args(argv)
    steps = (args.steps[0], args.steps[1])
    if args.child:
        _child(args.workload, steps, args.variants, args.child)
        return 0
    unknown = [v for v in args.variants if v not in REFERENCE]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}; expected some of {', '.join(REFERENCE)}")
    valgrind = find_valgrind(parser, steps)
    if valgrind is None:
        return 2
    variants = list(dict.fromkeys([REFERENCE[v] for v in args.variants] + args.variants))
    results = count_variants(valgrind, Path(__file__), args, variants)
    if results is None:
        return 1
    where = "in all threads" if args.all_threads else "on the training thread"
    print(
        f"{args.workload}: instructions per step {where} (callgrind, runs of {steps[0]} and "
        f"{steps[1]} steps), and above the hand loop of the same module kind"
    )
    for name in variants:
        line = f"  {name:<24} {results[name]['per_step']:12,.0f} instr/step"
        ref = REFERENCE[name]
        if ref != name:
            above = results[name]["per_step"] - results[ref]["per_step"]
            ratio = results[name]["per_step"] / results[ref]["per_step"]
            line += f"   {above:+12,.0f} above {ref} ({ratio:.3f}x)"
        print(line)
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(
                {
                    "workload": args.workload,
                    "steps": steps,
                    "all_threads": args.all_threads,
                    "results": results,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
