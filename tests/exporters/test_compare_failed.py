"""A run that failed (its fit raised, a step ended with an error, its trace is cut off)
is named by ``compare`` and never reads as a clean verdict: its steps up to the
failure are no measure of the code's speed."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from exporters import (
    SpanBatch,
    SpanRow,
    compare,
    render_comparison,
    run_failure,
    spans_to_frame,
    summarize_run,
)

STEP = "trainer.step"


def _frame(
    steps: int = 30,
    *,
    failed_step: int | None = None,
    error: str = "RuntimeError: CUDA out of memory",
    run_status: str = "UNSET",
    module_error: bool = False,
) -> pd.DataFrame:
    """A run of ``steps`` steps of about 1 ms inside ``trainer.run``; ``failed_step``
    ends that step with ERROR and ``error`` (and ends the run there)."""
    rng = np.random.default_rng(3)
    rows, t = [], 1_000
    last = steps if failed_step is None else failed_step + 1
    for i in range(last):
        d = int(rng.normal(1_000_000, 20_000))
        bad = i == failed_step
        rows.append(
            SpanRow(
                STEP,
                10 + i,
                1,
                7,
                t,
                t + d,
                1,
                {"ppetrace.step": i},
                "ERROR" if bad else "UNSET",
                error if bad else "",
            )
        )
        if module_error and i == 3:  # an error a loop caught: no failure of the run
            rows.append(
                SpanRow("module.forward", 5000 + i, 10 + i, 7, t + 10, t + 20, 1, {}, "ERROR", "x")
            )
        t += d + 1_000
    rows.append(
        SpanRow("trainer.run", 1, 0, 7, 0, t, 1, {}, run_status, error if run_status else "")
    )
    return spans_to_frame(SpanBatch(rows))


def test_a_clean_run_has_no_failure_and_an_error_in_a_hook_is_none() -> None:
    assert run_failure(_frame()) is None
    assert run_failure(_frame(module_error=True)) is None
    assert summarize_run(_frame()).failure is None


def test_an_error_step_and_a_failed_fit_are_named_with_the_first_error_line() -> None:
    frame = _frame(failed_step=12, run_status="ERROR", error="RuntimeError: boom\nTraceback ...")
    assert run_failure(frame) == (
        "1 trainer.run span, 1 trainer.step span ended with an error (RuntimeError: boom)"
    )
    long = "E" * 300
    text = run_failure(_frame(failed_step=2, error=long))
    assert text is not None and text.endswith("E" * 117 + "...)")


def test_a_cut_off_trace_is_a_failure() -> None:
    frame = _frame()
    frame.attrs["truncated"] = True
    assert run_failure(frame) == "its trace is cut off (the process was killed, or still runs)"


def test_compare_lists_failed_runs_by_side_and_every_format_says_so() -> None:
    base = _frame()
    base.attrs["path"] = "base.json"
    cand = _frame(failed_step=20, run_status="ERROR")
    cand.attrs["path"] = "cand.json"
    result = compare(base, cand)
    assert result.runs_failed
    assert list(result.failed_runs) == ["candidate"]
    (line,) = result.failed_runs["candidate"]
    assert line.startswith("cand.json: ") and "ended with an error" in line
    assert any(n.startswith("a candidate run failed: cand.json: ") for n in result.notes)
    table = render_comparison(result, "table")
    assert table.startswith("ppetrace compare: a candidate run failed, ")
    assert render_comparison(result, "md").startswith("### ppetrace compare: ❌ a candidate")
    doc = json.loads(render_comparison(result, "json"))
    assert doc["failed_runs"] == {"candidate": [line]}
    clean = compare(base, base)
    assert not clean.runs_failed and clean.failed_runs == {}
    assert json.loads(render_comparison(clean, "json"))["failed_runs"] == {}


def test_failed_runs_on_both_sides_are_counted_and_numbered_without_a_file() -> None:
    bad = [_frame(failed_step=25), _frame(failed_step=26)]
    result = compare(bad, bad[:1])
    assert [len(result.failed_runs[s]) for s in ("base", "candidate")] == [2, 1]
    assert result.failed_runs["base"][1].startswith("run 2: 1 trainer.step span")
    assert render_comparison(result, "table").startswith(
        "ppetrace compare: 3 base and candidate runs failed, "
    )


@pytest.mark.parametrize("status", ["UNSET", "OK"])
def test_statuses_other_than_error_are_no_failure(status: str) -> None:
    assert run_failure(_frame(run_status=status)) is None
