"""Compare two git revisions like with like: both checked out, run interleaved on one
machine, A B A B ..., then ``ppetrace compare`` of the runs as runs.

    python examples/ci/ab_runs.py --base origin/main --cand HEAD --runs 5 \\
        --setup "python setup.py build_ext --inplace -q" --warmup 20 \\
        -- python examples/ci/bench_step.py --out {out} --steps 300

Each revision is checked out in a worktree of its own (``git worktree add``,
the two paths of equal length), set up with ``--setup`` (run in the worktree,
e.g. to build C extensions in place), and its benchmark command runs with that
worktree as the current folder and first on ``PYTHONPATH``, so it imports that
revision's code. ``{out}`` in the command is replaced by the trace file of the
run. The runs alternate, base then candidate, ``--runs`` times each, so the
machine's drift (its neighbours, its clock) falls on both alike. The traces land
in ``OUT/base/run-NN.json`` and ``OUT/cand/run-NN.json``, then ``python -m
ppetrace compare OUT/base OUT/cand`` (the ppetrace installed where this script
runs) writes ``OUT/comment.md`` (the Markdown for a pull request comment) and this
script prints it.

Fallback: ``--base-runs DIR`` skips the base revision and compares the
candidate's runs with stored baseline traces in DIR (runs recorded earlier,
maybe on another machine: the comparison then measures the machines too).

Exit codes: those of ``ppetrace compare`` (0 no gated regression, 1 gated
regression, 2 bad input or, with ``--strict-env``, different environments),
and 3 when a revision cannot be checked out, set up or run; the message says
which. The worktrees are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

EXIT_CANNOT_RUN = 3


class CannotRun(Exception):
    """A revision could not be checked out, set up or run."""


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise CannotRun(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def _checkout(repo: Path, rev: str, where: Path) -> str:
    """A detached worktree of ``rev`` at ``where``; returns the commit it checked out."""
    commit = _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}")
    _git(repo, "worktree", "add", "--detach", str(where), commit)
    return commit


def _env_for(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    return env


def _run(cmd: Sequence[str], tree: Path, what: str) -> None:
    done = subprocess.run(list(cmd), cwd=tree, env=_env_for(tree), check=False)
    if done.returncode != 0:
        raise CannotRun(
            f"{what} failed with exit code {done.returncode} in {tree}: {shlex.join(cmd)}"
        )


def run_interleaved(
    trees: dict[str, Path], command: Sequence[str], runs: int, out: Path
) -> dict[str, list[Path]]:
    """Run ``command`` ``runs`` times in each tree, alternating; return the traces."""
    traces: dict[str, list[Path]] = {side: [] for side in trees}
    for i in range(1, runs + 1):
        for side, tree in trees.items():
            trace = (out / side / f"run-{i:02d}.json").resolve()
            trace.parent.mkdir(parents=True, exist_ok=True)
            cmd = [part.replace("{out}", str(trace)) for part in command]
            print(f"ab_runs: {side} run {i}/{runs}", flush=True)
            _run(cmd, tree, f"the {side} revision's benchmark (run {i})")
            if not trace.is_file():
                raise CannotRun(
                    f"the {side} revision's benchmark wrote no trace at {trace}; pass its "
                    "output path as {out} in the command"  # a plain string: {out} stays
                )
            traces[side].append(trace)
    return traces


#: the file that marks a folder ab_runs made (and may delete again)
MARKER = ".ab-runs"


def _unsafe_out(out: Path, repo: Path, base_runs: str | None) -> str | None:
    """Why ``--out`` must not be deleted and rewritten, or None: it must be new, or a
    folder that an earlier ab_runs made, and hold neither the repository, the working
    folder nor the stored base runs."""
    if not out.exists():
        return None
    where = out.resolve()
    guarded = [Path.cwd().resolve(), repo]
    if base_runs is not None:
        guarded.append(Path(base_runs).resolve())
    for keep in guarded:
        if where == keep or where in keep.parents:
            return (
                f"expected --out to be a folder of its own, but {out} holds {keep}, which "
                "ab_runs would delete; pass another --out"
            )
    if not (out / MARKER).is_file():
        return (
            f"expected --out to be a new folder or one that ab_runs made (it holds {MARKER}), "
            f"but {out} exists without it; pass another --out, or delete it yourself"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Check out, set up, run interleaved and compare; return ``ppetrace compare``'s code
    (or 3 when a revision cannot run)."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args_in:
        print("ab_runs: error: put the benchmark command after '--'", file=sys.stderr)
        return 2
    split = args_in.index("--")
    options, command = args_in[:split], args_in[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the base revision (e.g. origin/main, a commit)")
    parser.add_argument("--base-runs", metavar="DIR", help="stored base traces (fallback)")
    parser.add_argument("--cand", default="HEAD", help="the candidate revision (HEAD)")
    parser.add_argument("--runs", type=int, default=5, help="runs per revision (default 5)")
    parser.add_argument("--out", default="ab-runs", help="folder for the traces")
    parser.add_argument("--setup", help="a command run once in each worktree before the runs")
    parser.add_argument("--repo", default=".", help="the git repository (default: .)")
    parser.add_argument("--warmup", type=int, default=20, help="steps compare leaves out")
    parser.add_argument(
        "--compare-args", default="", help="more options for ppetrace compare, quoted"
    )
    args = parser.parse_args(options)
    if not command:
        parser.error("expected a benchmark command after '--'")
    if (args.base is None) == (args.base_runs is None):
        parser.error("expected exactly one of --base REV and --base-runs DIR")
    if args.runs < 1:
        parser.error("expected --runs >= 1")
    out = Path(args.out)
    repo = Path(args.repo).resolve()
    problem = _unsafe_out(out, repo, args.base_runs)
    if problem:
        parser.error(problem)
    if out.exists():
        shutil.rmtree(out)  # one that an earlier ab_runs made: it holds the marker
    out.mkdir(parents=True)
    (out / MARKER).write_text("made by examples/ci/ab_runs.py: it deletes this folder\n")
    work = Path(tempfile.mkdtemp(prefix="ab-runs-"))
    made: list[Path] = []
    try:
        sides = {"base": args.base, "cand": args.cand} if args.base else {"cand": args.cand}
        trees: dict[str, Path] = {}
        for side, rev in sides.items():
            tree = work / side  # "base" and "cand": paths of equal length
            commit = _checkout(repo, rev, tree)
            made.append(tree)
            print(f"ab_runs: {side} = {rev} ({commit[:12]}) in {tree}", flush=True)
            if args.setup:
                _run(shlex.split(args.setup), tree, f"the {side} revision's setup")
            trees[side] = tree
        run_interleaved(trees, command, args.runs, out)
    except CannotRun as exc:
        print(f"ab_runs: error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    finally:
        for tree in made:
            subprocess.run(
                ["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                capture_output=True,
                check=False,
            )
        shutil.rmtree(work, ignore_errors=True)
    base_dir = out / "base" if args.base else Path(args.base_runs)
    compare = [sys.executable, "-m", "ppetrace", "compare", str(base_dir), str(out / "cand")]
    compare += ["--warmup", str(args.warmup), *shlex.split(args.compare_args)]
    comment = out / "comment.md"
    code = subprocess.run([*compare, "--format", "md", "--output", str(comment)]).returncode
    if comment.is_file():
        print(comment.read_text(encoding="utf-8"), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
