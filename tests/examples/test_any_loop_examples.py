"""examples/any_loop/ under `ppetrace run`: a plain loop and a Lightning module, no code change."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from example_loader import ROOT

from exporters import read_chrome_trace, step_report
from ppetrace.cli import main

EXAMPLES = ROOT / "examples" / "any_loop"


def _run(trace: Path, script: str, *args: str) -> str:
    err = io.StringIO()
    code = main(["run", "--trace", str(trace), str(EXAMPLES / script), *args], stderr=err)
    assert code == 0, err.getvalue()
    return err.getvalue()


def test_the_plain_loop_runs_under_ppetrace_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "train.json"
    err = _run(trace, "train.py", "--epochs", "2", "--samples", "128", "--batch-size", "64")
    assert capsys.readouterr().out.count("val accuracy") == 2
    frame = read_chrome_trace(trace)
    counts = frame["name"].value_counts()
    assert counts["trainer.step"] == 2 * 2 and counts["trainer.validation"] == 2
    report = step_report(frame)
    assert len(report.steps) == 3 and "trainer.optimizer_step" in err


def test_the_lightning_module_runs_under_ppetrace_run_and_with_its_profiler(
    tmp_path: Path,
) -> None:
    pytest.importorskip("lightning")
    trace = tmp_path / "lit.json"
    _run(trace, "lightning_module.py", "--epochs", "1", "--samples", "256")
    counts = read_chrome_trace(trace)["name"].value_counts()
    assert counts["trainer.step"] == 256 // 64 and counts["trainer.backward"] == 4
    # with its own profiler the global hooks stand aside: Lightning's actions only
    own = tmp_path / "profiler.json"
    _run(trace, "lightning_module.py", "--epochs", "1", "--samples", "256", "--profiler",
         "--trace", str(own))  # fmt: skip
    frame = read_chrome_trace(own)
    steps = frame[frame["name"] == "trainer.step"]
    assert len(steps) == 4 and set(steps["lightning.action"]) == {"run_training_batch"}
    assert "module.forward" not in set(read_chrome_trace(trace)["name"])
