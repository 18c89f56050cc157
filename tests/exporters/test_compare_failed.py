"""A run that failed (its fit raised, a step ended with an error, its trace is cut off)
is named by ``compare`` and never reads as a clean verdict: its steps up to the
failure are no measure of the code's speed."""

from __future__ import annotations

import json
from pathlib import Path

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
        "ppetrace compare: 2 base runs and 1 candidate run failed, "
    )


@pytest.mark.parametrize("status", ["UNSET", "OK"])
def test_statuses_other_than_error_are_no_failure(status: str) -> None:
    assert run_failure(_frame(run_status=status)) is None


def test_a_run_error_recorded_at_the_end_is_a_failure() -> None:
    """``instrument()`` and ``ppetrace run`` write how the run ended (an exception, an exit
    code, a thread that died) into the closing ``ppetrace.final`` event."""
    frame = _frame()
    frame.attrs["metadata"] = {"ppetrace.final": {"run_error": "ValueError: bad batch\n..."}}
    assert run_failure(frame) == "it ended with an error (ValueError: bad batch)"
    frame.attrs["metadata"] = {"ppetrace.final": {"steps_summarised": 0}}
    assert run_failure(frame) is None


@pytest.mark.parametrize("text", ["SystemExit: 0", "SystemExit: None", "SystemExit: "])
def test_sys_exit_0_through_a_fit_is_no_failure(text: str) -> None:
    assert run_failure(_frame(failed_step=5, run_status="ERROR", error=text)) is None
    failed = run_failure(_frame(failed_step=5, error="SystemExit: 3"))
    assert failed == "1 trainer.step span ended with an error (SystemExit: 3)"


@pytest.mark.parametrize("error", [pd.NA, float("nan"), None, "   ", ""])
def test_errors_without_text_give_the_counts_alone(error: object) -> None:
    frame = _frame(failed_step=4)
    frame["error"] = frame["error"].astype(object)
    frame.loc[frame["status"] == "ERROR", "error"] = error
    assert run_failure(frame) == "1 trainer.step span ended with an error"


def test_an_error_without_a_message_loses_its_dangling_colon() -> None:
    text = run_failure(_frame(failed_step=4, error="KeyboardInterrupt: "))
    assert text == "1 trainer.step span ended with an error (KeyboardInterrupt)"


def test_a_failure_on_another_rank_is_the_runs_even_with_rank() -> None:
    ok, bad = _frame(), _frame(failed_step=10)
    ok["rank"], bad["rank"] = 0, 1
    run = pd.concat([ok, bad.assign(pid=bad["pid"] + 1)], ignore_index=True)
    run.attrs = {"path": "merged.json"}
    base = _frame()
    with pytest.raises(ValueError, match="Expected spans of rank 0 in the run, but it has no rank"):
        compare(base, run, rank=0)  # (a pandas error before: its ranks were all missing)
    base["rank"] = 0
    result = compare(base, run, rank=0)
    assert result.failed_runs == {
        "candidate": [
            "merged.json: 1 trainer.step span ended with an error (RuntimeError: "
            "CUDA out of memory)"
        ]
    }


def test_a_cut_off_file_left_out_as_a_copy_keeps_its_run_failed() -> None:
    from exporters import drop_copies

    whole, cut = _frame(), _frame()
    meta = {"trace_id": "ab" * 16, "start_time_ns": 5, "pid": 1}
    whole.attrs = {"path": "aa.json", "metadata": meta}
    cut.attrs = {"path": "zz.json", "metadata": meta, "truncated": True}
    kept, copies = drop_copies([whole, cut])
    assert [f.attrs["path"] for f in kept] == ["aa.json"] and copies == [("zz.json", "aa.json")]
    assert run_failure(kept[0]) == "its trace is cut off (the process was killed, or still runs)"


def test_repaired_and_merged_cut_off_traces_say_which_file_was_cut() -> None:
    frame = _frame()
    frame.attrs = {"path": "t.repaired.json", "metadata": {"ppetrace.cut": ["t.json"]}}
    assert run_failure(frame) == (
        "its trace (t.json) was cut off (the process was killed, or still runs)"
    )
    merged = {
        "merged_from": [
            {"path": "r0.json", "truncated": False},
            {"path": "r1.json", "truncated": True},
        ]
    }
    frame.attrs = {"path": "m.json", "metadata": merged}
    assert run_failure(frame) == (
        "its trace (r1.json) was cut off (the process was killed, or still runs)"
    )


def test_every_process_run_error_of_a_merged_trace_is_named(tmp_path: Path) -> None:
    """A rank that crashed and the rank whose collective then broke: both are said, the
    cause not hidden behind the knock-on error."""
    from exporters import read_chrome_trace

    events = []
    for pid, error in ((10, "rank 0: RuntimeError: Connection closed by peer"), (11, None)):
        events.append(
            {
                "ph": "X",
                "name": STEP,
                "pid": pid,
                "tid": 1,
                "ts": 1.0,
                "dur": 5.0,
                "args": {"ppetrace.step": 0},
            }
        )
        args = {"steps_summarised": 0} if error is None else {"run_error": error}
        events.append({"ph": "M", "name": "ppetrace.final", "pid": pid, "tid": 0, "args": args})
    events.append(
        {
            "ph": "M",
            "name": "ppetrace.final",
            "pid": 12,
            "tid": 0,
            "args": {"run_error": "rank 1: RuntimeError: injected crash"},
        }
    )
    path = tmp_path / "merged.json"
    path.write_text(json.dumps({"otherData": {}, "traceEvents": events}))
    frame = read_chrome_trace(path)
    assert frame.attrs["metadata"]["ppetrace.final"]["run_errors"] == [
        "rank 0: RuntimeError: Connection closed by peer",
        "rank 1: RuntimeError: injected crash",
    ]
    assert run_failure(frame) == (
        "it ended with an error (rank 0: RuntimeError: Connection closed by peer; rank 1: "
        "RuntimeError: injected crash)"
    )


def test_the_step_report_says_first_that_the_run_failed() -> None:
    from exporters import render_json, render_table, step_report

    report = step_report(_frame(failed_step=12, run_status="ERROR", error="RuntimeError: x"))
    assert report.failure == (
        "1 trainer.run span, 1 trainer.step span ended with an error (RuntimeError: x)"
    )
    lines = render_table(report).splitlines()
    assert lines[1] == (
        f"Not a clean run: {report.failure}. The figures cover its steps up to then."
    )
    assert json.loads(render_json(report))["failure"] == report.failure
    clean = step_report(_frame())
    assert clean.failure is None and "Not a clean run" not in render_table(clean)


def test_sys_exit_0_as_the_recorder_writes_it_with_its_traceback_is_no_failure() -> None:
    text = 'SystemExit: 0\nTraceback (most recent call last):\n  File "t.py", line 3'
    assert run_failure(_frame(failed_step=5, run_status="ERROR", error=text)) is None


@pytest.mark.parametrize(
    "meta",
    [
        {"ppetrace.cut": 5},
        {"ppetrace.cut": "yes"},
        {"ppetrace.final": {"run_errors": 5}},
        {"ppetrace.final": {"run_errors": "boom"}},
        {"ppetrace.final": {"run_error": ["x"]}},
        {"merged_from": [{"path": "a.json", "truncated": "false"}, 3, None]},
        {"merged_from": "a.json"},
        {"ppetrace.final": 7},
    ],
)
def test_odd_metadata_from_a_file_neither_crashes_nor_counts(meta: dict[str, object]) -> None:
    frame = _frame()
    frame.attrs = {"path": "odd.json", "metadata": meta}
    assert run_failure(frame) is None


def test_unhashable_fields_of_a_merged_input_do_not_break_copies() -> None:
    from exporters import drop_copies

    merged = _frame()
    other = {"trace_id": "ab" * 16, "start_time_ns": 5, "rank": [0], "host": {"a": 1}}
    merged.attrs = {"path": "m.json", "metadata": {"merged_from": [{"otherData": other}]}}
    rank = _frame()
    rank.attrs = {"path": "r.json", "metadata": {**other, "pid": 3}}
    kept, _ = drop_copies([merged, rank])
    assert len(kept) == 2  # another pid: not the merged input


def test_more_than_four_process_errors_are_counted() -> None:
    frame = _frame()
    errors = [f"rank {r}: RuntimeError: e" for r in range(6)]
    frame.attrs = {"metadata": {"ppetrace.final": {"run_errors": errors}}}
    text = run_failure(frame)
    assert text is not None and text.endswith("rank 3: RuntimeError: e; and 2 more)")
