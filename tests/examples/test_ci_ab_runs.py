"""The CI workflow's script, end to end: two git revisions of a small project, checked
out side by side, run interleaved, compared as runs; and the stored-baseline fallback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from example_loader import ROOT, load

from exporters import read_chrome_trace

BENCH = textwrap.dedent(
    """
    import sys, time

    import ppetrace
    from exporters import ChromeTraceExporter
    from ppetrace.tracing import capture_environment
    from work import SPIN_NS

    out = sys.argv[sys.argv.index("--out") + 1]
    ppetrace.configure(
        exporters=[ChromeTraceExporter(out, metadata={"environment": capture_environment()})]
    )
    with ppetrace.trace("trainer.run"):
        for i in range(40):
            with ppetrace.trace("trainer.step", {"ppetrace.step": i}):
                # short waits on the wall clock: a step that the OS preempts is an
                # outlier, and the median of the run does not see it
                end = time.perf_counter_ns() + SPIN_NS
                while time.perf_counter_ns() < end:
                    pass
    ppetrace.shutdown()
    """
)

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A git repository with two commits: ``v1`` (300 µs steps) and ``v2`` (600 µs)."""
    repo = tmp_path / "project"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "ci@example.invalid")
    _git(repo, "config", "user.name", "ci")
    (repo / "bench.py").write_text(BENCH)
    for tag, spin in (("v1", 300_000), ("v2", 600_000)):
        (repo / "work.py").write_text(f"SPIN_NS = {spin}\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", tag)
        _git(repo, "tag", tag)
    return repo


def _ab_runs(repo: Path, out: Path, *options: str) -> subprocess.CompletedProcess[str]:
    script = ROOT / "examples" / "ci" / "ab_runs.py"
    command = [sys.executable, str(script), "--repo", str(repo), "--out", str(out), *options]
    command += ["--warmup", "2", "--", sys.executable, "bench.py", "--out", "{out}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


def test_two_revisions_interleaved_then_the_fallback_then_one_that_cannot_run(
    project: Path, tmp_path: Path
) -> None:
    out = tmp_path / "runs"
    done = _ab_runs(project, out, "--base", "v1", "--cand", "v2", "--runs", "3")
    assert done.returncode == 1, done.stdout + done.stderr
    # interleaved: base 1, cand 1, base 2, cand 2, ...
    order = [line for line in done.stdout.splitlines() if line.startswith("ab_runs: ")]
    assert [line.split()[1] for line in order[2:]] == ["base", "cand"] * 3
    assert sorted(p.name for p in (out / "base").iterdir()) == [f"run-0{i}.json" for i in (1, 2, 3)]
    # each side ran its own revision: 300 µs against 600 µs steps
    for side, spin in (("base", 3e5), ("cand", 6e5)):
        frame = read_chrome_trace(out / side / "run-01.json")
        steps = frame.loc[frame["name"] == "trainer.step", "dur_ns"]
        assert spin <= steps.median() < spin * 1.5
        assert frame.attrs["metadata"]["environment"]["python"]
    comment = (out / "comment.md").read_text()
    assert comment.startswith("### ppetrace compare: ❌ 2 gated regressions")
    assert "3 runs vs 3 runs" in comment and comment in done.stdout
    assert _git(project, "worktree", "list").count("\n") == 0  # no worktree left behind

    # the fallback: the candidate's runs against stored runs; v1 against v1 passes
    stored = tmp_path / "stored"
    shutil.copytree(out / "base", stored)
    fallback = _ab_runs(
        project, tmp_path / "fb", "--base-runs", str(stored), "--cand", "v1", "--runs", "2"
    )
    assert fallback.returncode == 0, fallback.stdout + fallback.stderr
    assert "3 runs vs 2 runs" in (tmp_path / "fb" / "comment.md").read_text()

    # a base revision without the benchmark: exit 3, said in one line
    _git(project, "checkout", "-q", "--orphan", "empty")
    _git(project, "rm", "-rq", "--cached", ".")
    (project / "README").write_text("nothing to run\n")
    _git(project, "add", "README")
    _git(project, "commit", "-q", "-m", "empty")
    broken = _ab_runs(
        project, tmp_path / "broken", "--base", "empty", "--cand", "v2", "--runs", "1"
    )
    assert broken.returncode == 3
    assert "ab_runs: error: the base revision's benchmark (run 1) failed" in broken.stderr


def test_the_options_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ab = load("ci/ab_runs.py")
    assert ab.main(["--base", "v1"]) == 2
    assert "put the benchmark command after '--'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--cand", "v1", "--", "true"])
    assert "exactly one of --base REV and --base-runs DIR" in capsys.readouterr().err


def test_out_is_deleted_only_when_ab_runs_made_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ab = load("ci/ab_runs.py")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("a user's file")
    stored = tmp_path / "stored"
    (stored / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    cases = [
        (["--out", str(mine), "--base", "v1"], "exists without it"),
        (["--out", ".", "--base", "v1"], "which ab_runs would delete"),
        (["--out", str(stored), "--base-runs", str(stored / "base")], "would delete"),
    ]
    for options, said in cases:
        with pytest.raises(SystemExit):
            ab.main([*options, "--cand", "v2", "--repo", str(tmp_path), "--", "true"])
        assert said in capsys.readouterr().err
    assert (mine / "keep.txt").read_text() == "a user's file" and (stored / "base").is_dir()


def test_the_workflow_runs_both_revisions_on_one_runner_with_a_stored_fallback() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed: the workflow is not parsed")
    workflow = ROOT / ".github" / "workflows" / "ppetrace-bench.yml"
    doc = yaml.safe_load(workflow.read_text())
    steps = doc["jobs"]["bench"]["steps"]
    checkout = steps[0]
    assert checkout["uses"].startswith("actions/checkout") and checkout["with"]["fetch-depth"] == 0
    runs = {s.get("id", s.get("name")): s.get("run", "") for s in steps}
    ab = runs["ab"]
    assert "python examples/ci/ab_runs.py" in ab
    assert "--base ${{ github.event.pull_request.base.sha }}" in ab
    assert "--cand ${{ github.event.pull_request.head.sha }}" in ab
    assert doc["env"]["RUNS"] == "5" and '--runs "$RUNS"' in ab
    assert "-- python examples/ci/bench_step.py --out {out}" in ab
    fallback = runs["fallback"]
    assert "--base-runs baseline" in fallback
    fb_step = next(s for s in steps if s.get("id") == "fallback")
    assert "steps.ab.outputs.code == '3'" in fb_step["if"]
    stores = [s for s in steps if str(s.get("uses", "")).startswith("actions/upload-artifact")]
    assert stores and stores[0]["with"]["name"] == "ppetrace-baseline"
    assert "gh pr comment" in "\n".join(runs.values())
    text = workflow.read_text()
    assert "index-url" not in text  # no package index is named in the repository
    json.dumps(doc)  # plain data
