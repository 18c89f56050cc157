"""``ppetrace report --html`` and ``ppetrace compare --html``: the page is written beside the
text output, and the exit codes stay the text commands'."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from test_cli import write_run

from ppetrace.cli import main

pytest.importorskip("plotly", reason="the HTML pages need plotly: pip install 'ppetrace[html]'")


def _steps(seed: int, median: float, n: int = 25) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.lognormal(np.log(median), 0.05, n)]


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_report_and_compare_write_their_pages(tmp_path: Path) -> None:
    env = {"device": "cpu", "torch_threads": 3, "cpu_count": 2}
    base = write_run(tmp_path / "base.json", _steps(1, 1_000_000), environment=env)
    cand = write_run(tmp_path / "cand.json", _steps(2, 1_500_000), environment=env)
    page = tmp_path / "report.html"
    code, out, err = run("report", str(base), "--html", str(page))
    assert code == 0 and "ppetrace step report" in out  # the text report still prints
    text = page.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and 'id="step-time"' in text
    assert "<dt>torch threads</dt><dd>3</dd>" in text
    assert f"ppetrace: wrote {page} (" in err
    page = tmp_path / "compare.html"
    code, out, err = run("compare", str(base), str(cand), "--html", str(page))
    assert code == 1  # a gated regression: the exit code is compare's
    text = page.read_text(encoding="utf-8")
    assert "ppetrace compare: 2 gated regressions" in text and 'id="changes"' in text
    assert "ppetrace compare: 2 gated regressions" in out


def test_an_unwritable_html_path_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base.json", _steps(1, 1_000_000))
    code, _, err = run("report", str(base), "--html", str(tmp_path))  # a folder, not a file
    assert code == 2
    assert err.startswith("ppetrace report: error: Expected a writable file path for --html")
    assert err.count("\n") == 1
