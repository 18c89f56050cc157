"""step_report: per-event and per-step numbers against injected durations, and its renderers."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import exporters
from exporters import (
    StepReport,
    render,
    render_csv,
    render_json,
    render_markdown,
    render_table,
    spans_to_frame,
    step_report,
)
from exporters import report as report_module

RunBuilder = Any  # the builder from conftest.py's run_builder fixture

STEPS = [5_000, 6_000, 7_000, 8_000, 9_000]
FETCH = [100, 200, 300, 400, 500]
GAP = 500
BATCH = 16


def _report(rb: RunBuilder, warmup: int = 1) -> StepReport:
    return step_report(spans_to_frame(rb.batch()), warmup_steps=warmup)


def _run(run_builder: Callable[..., RunBuilder]) -> RunBuilder:
    rb = run_builder()
    rb.training(STEPS, fetch_ns=FETCH, gap_ns=GAP, batch_size=BATCH)
    return rb


def test_per_step_wall_data_wait_compute_and_other(
    run_builder: Callable[..., RunBuilder],
) -> None:
    report = _report(_run(run_builder))
    steps = report.steps
    assert report.warmup_steps == 1 and report.excluded_steps == 1 and report.total_steps == 5
    assert list(steps["step_index"]) == [1, 2, 3, 4]
    assert list(steps["step"]) == [1, 2, 3, 4]
    assert list(steps["compute_ns"]) == STEPS[1:]
    assert list(steps["data_wait_ns"]) == FETCH[1:]
    assert list(steps["between_ns"]) == [GAP] * 4  # loop time between a step and the next fetch
    assert list(steps["backward_ns"]) == [s // 3 for s in STEPS[1:]]
    assert list(steps["forward_ns"]) == list(steps["optimizer_ns"]) == [0] * 4
    # other: the step's own self time (the step less its backward) and the loop time
    assert list(steps["other_ns"]) == [GAP + s - s // 3 for s in STEPS[1:]]
    assert list(steps["wall_ns"]) == [
        GAP + f + s for f, s in zip(FETCH[1:], STEPS[1:], strict=True)
    ]
    assert list(steps["batch_size"]) == [BATCH] * 4
    assert (
        steps["wall_ns"] == steps["data_wait_ns"] + steps["compute_ns"] + steps["between_ns"]
    ).all()
    parts = ["data_wait_ns", "forward_ns", "backward_ns", "optimizer_ns", "other_ns"]
    assert (steps["wall_ns"] == steps[parts].sum(axis=1)).all()


def test_the_first_step_wall_time_starts_at_its_fetch(
    run_builder: Callable[..., RunBuilder],
) -> None:
    report = _report(_run(run_builder), warmup=0)
    first = report.steps.iloc[0]
    assert first["wall_ns"] == FETCH[0] + STEPS[0]
    assert first["between_ns"] == 0
    assert report.excluded_steps == 0 and len(report.steps) == 5


def test_per_event_statistics_match_numpy_on_known_durations(
    run_builder: Callable[..., RunBuilder],
) -> None:
    report = _report(_run(run_builder))
    events = report.events.set_index("event")
    backward = np.array([s // 3 for s in STEPS[1:]], dtype=float)
    row = events.loc["trainer.backward"]
    assert row["count"] == 4
    assert row["total_ns"] == backward.sum()
    assert row["mean_ns"] == pytest.approx(backward.mean())
    assert row["p50_ns"] == pytest.approx(np.percentile(backward, 50))
    assert row["p90_ns"] == pytest.approx(np.percentile(backward, 90))
    assert row["p99_ns"] == pytest.approx(np.percentile(backward, 99))
    assert row["max_ns"] == backward.max()
    assert row["self_ns"] == backward.sum()
    wall = sum(GAP + f + s for f, s in zip(FETCH[1:], STEPS[1:], strict=True))
    assert row["share"] == pytest.approx(backward.sum() / wall)
    step = events.loc["trainer.step"]
    assert step["count"] == 4 and step["total_ns"] == sum(STEPS[1:])
    assert step["self_ns"] == sum(STEPS[1:]) - backward.sum()
    # share is self time: the step's own time only, never its children again
    assert step["share"] == pytest.approx((sum(STEPS[1:]) - backward.sum()) / wall)
    fetch = events.loc["trainer.fetch_batch"]
    assert fetch["count"] == 4 and fetch["total_ns"] == sum(FETCH[1:])
    between = events.loc["(between steps)"]
    assert between["count"] == 4 and between["self_ns"] == 4 * GAP
    # over the events inside steps and the loop time between them: all the step time
    assert events["share"].sum() == pytest.approx(1.0)
    # spans outside steps are counted, with no share of step time
    assert events.loc["trainer.run", "count"] == 1
    assert np.isnan(events.loc["trainer.run", "share"])
    assert report.events["total_ns"].is_monotonic_decreasing
    assert report.spans == len(spans_to_frame(_run(run_builder).batch())) - 3  # warmup step


def test_throughput_counts_steps_and_samples_over_step_wall_time(
    run_builder: Callable[..., RunBuilder],
) -> None:
    report = _report(_run(run_builder))
    wall_s = sum(GAP + f + s for f, s in zip(FETCH[1:], STEPS[1:], strict=True)) / 1e9
    t = report.throughput
    assert t.steps == 4 and t.processes == 1
    assert t.wall_ns == round(wall_s * 1e9)
    assert t.steps_per_s == pytest.approx(4 / wall_s)
    assert t.samples == 4 * BATCH
    assert t.samples_per_s == pytest.approx(4 * BATCH / wall_s)


def test_samples_per_second_needs_the_batch_size_of_every_step(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rb = run_builder()
    rb.training(STEPS)
    t = _report(rb).throughput
    assert t.samples is None and t.samples_per_s is None and t.steps_per_s > 0


def test_validation_and_checkpoint_between_steps_are_not_step_time(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rb = run_builder()
    epoch = rb.span("trainer.epoch", 0, 100_000, 0, {"ppetrace.epoch": 0})
    t = 0
    for i in range(4):
        t += 100
        rb.span("trainer.fetch_batch", t, t + 50, epoch)
        t += 50
        rb.span("trainer.step", t, t + 1_000, epoch, {"ppetrace.step": i})
        t += 1_000
        if i == 1:  # validation, then a checkpoint, between steps 1 and 2
            rb.span("trainer.validation", t + 10, t + 5_010, epoch)
            rb.span("trainer.checkpoint", t + 5_020, t + 6_020, epoch)
            t += 6_020
    report = _report(rb, warmup=0)
    # step 2 waits 10 + 5,000 + 10 + 1,000 + 100 ns before its fetch: the validation and
    # checkpoint (6,000 ns) are left out, the 120 ns around them are loop time
    assert list(report.steps["wall_ns"]) == [1_050, 1_150, 1_170, 1_150]
    assert list(report.steps["between_ns"]) == [0, 100, 120, 100]
    assert list(report.steps["other_ns"]) == [1_000, 1_100, 1_120, 1_100]  # + step self


def test_warmup_steps_and_the_spans_inside_them_are_excluded_per_process(
    run_builder: Callable[..., RunBuilder],
) -> None:
    a, b = run_builder(pid=1, rank=0), run_builder(pid=2, rank=1)
    a.training([1_000, 2_000, 3_000])
    b.training([4_000, 5_000, 6_000])
    frame = spans_to_frame([a.batch(), b.batch()])
    report = step_report(frame, warmup_steps=2)
    assert report.excluded_steps == 4 and len(report.steps) == 2
    assert sorted(report.steps["compute_ns"]) == [3_000, 6_000]
    events = report.events.set_index("event")
    assert events.loc["trainer.backward", "count"] == 2
    assert events.loc["trainer.backward", "total_ns"] == 1_000 + 2_000
    t = report.throughput
    assert t.processes == 2
    wall_a, wall_b = 500 + 1_000 + 3_000, 500 + 1_000 + 6_000
    # two ranks at once: the run's step rate is a rank's (their mean), samples would add
    assert t.steps_per_s == pytest.approx((1 / (wall_a / 1e9) + 1 / (wall_b / 1e9)) / 2)


def test_processes_one_after_another_join_their_times_and_at_once_add_their_rates(
    run_builder: Callable[..., RunBuilder],
) -> None:
    # two ranks at once (their rates add), then a third process after both (a later run
    # merged into the same trace: its time adds to theirs, its rate does not)
    a, b, c = (run_builder(pid=p, rank=0) for p in (1, 2, 3))
    a.training([1_000] * 4, batch_size=8)
    b.training([3_000] * 4, batch_size=8)
    end = c.training([2_000] * 4, batch_size=8, start=10**6)["end"]
    assert end > 10**6
    t = step_report(spans_to_frame([a.batch(), b.batch(), c.batch()]), warmup_steps=0).throughput
    # each step: its fetch (1,000) and the gap before it (500; none before the first)
    wall = {1: 4 * 2_500 - 500, 2: 4 * 4_500 - 500, 3: 4 * 3_500 - 500}
    # the pair takes 4 steps together at a rank's mean rate, their 64 samples at the sum
    step_rate = (4 / (wall[1] / 1e9) + 4 / (wall[2] / 1e9)) / 2
    sample_rate = 32 / (wall[1] / 1e9) + 32 / (wall[2] / 1e9)
    third = wall[3] / 1e9  # time = count / rate, per group
    assert t.steps_per_s == pytest.approx(8 / (4 / step_rate + third))
    assert t.samples_per_s == pytest.approx(96 / (64 / sample_rate + third))
    assert (t.processes, t.concurrent) == (3, 2)
    text = render_table(step_report(spans_to_frame([a.batch(), b.batch(), c.batch()])))
    assert "(3 processes, at most 2 at a time: steps/s of one, samples/s of all)" in text
    alone = step_report(spans_to_frame([a.batch(), c.batch()]), warmup_steps=0)
    assert alone.throughput.steps_per_s == pytest.approx(8 / ((wall[1] + wall[3]) / 1e9))
    assert alone.throughput.concurrent == 1
    assert "(2 processes, one after another)" in render_table(alone)
    assert json.loads(render_json(alone))["throughput"]["concurrent"] == 1


def test_device_time_adds_device_columns(run_builder: Callable[..., RunBuilder]) -> None:
    rb = run_builder()
    for i in range(3):
        rb.span(
            "trainer.step",
            i * 1_000,
            i * 1_000 + 800,
            0,
            {"ppetrace.step": i, "ppetrace.device_dur_ns": 100 * (i + 1)},
        )
    report = _report(rb, warmup=0)
    events = report.events.set_index("event")
    assert events.loc["trainer.step", "device_total_ns"] == 600
    assert events.loc["trainer.step", "device_mean_ns"] == 200
    assert list(report.steps["device_ns"]) == [100.0, 200.0, 300.0]
    header = next(x for x in render_table(report).splitlines() if x.startswith("event"))
    assert header.split()[-3:] == ["device", "device", "mean"]


def test_a_trace_without_steps_still_reports_events(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rb = run_builder()
    rb.span("user.a", 0, 1_000)
    rb.span("user.a", 2_000, 2_500)
    report = _report(rb)
    assert report.total_steps == 0 and len(report.steps) == 0
    assert report.throughput.steps == 0 and report.throughput.steps_per_s == 0.0
    assert report.events.loc[0, "event"] == "user.a" and report.events.loc[0, "count"] == 2
    assert "No trainer.step spans" in render_table(report)
    assert json.loads(render_json(report))["throughput"]["steps"] == 0


# -- renderers ------------------------------------------------------------------------


def test_terminal_table_is_aligned_and_uses_human_units(
    run_builder: Callable[..., RunBuilder],
) -> None:
    report = _report(_run(run_builder))
    text = render_table(report)
    assert "4 steps (1 warmup step excluded; warmup_steps=1)" in text
    assert "samples/s" in text
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("event"))
    table = lines[start : start + 2 + len(report.events)]
    assert len({len(line) for line in table}) == 1  # right-aligned columns line up
    backward = next(line for line in table if line.startswith("trainer.backward"))
    assert backward.split()[2:4] == ["10.0", "µs"]  # total 9,999 ns, to 3 digits
    assert "%" in backward


def test_top_keeps_the_largest_events(run_builder: Callable[..., RunBuilder]) -> None:
    report = _report(_run(run_builder))
    text = render_table(report, top=2)
    assert "trainer.run " in text and "trainer.backward " not in text
    assert f"({len(report.events) - 2} more events not shown)" in text
    assert render_markdown(report, top=2).count("| trainer.") == 2


def test_markdown_is_a_valid_table(run_builder: Callable[..., RunBuilder]) -> None:
    report = _report(_run(run_builder))
    md = render_markdown(report)
    rows = [line for line in md.splitlines() if line.startswith("|")]
    header = rows[0]
    assert all(line.count("|") == header.count("|") for line in rows[: 2 + 4])
    assert "| trainer.backward | 4 |" in md
    assert md.startswith("### ppetrace step report")


def test_csv_reads_back_to_the_event_numbers(run_builder: Callable[..., RunBuilder]) -> None:
    report = _report(_run(run_builder))
    back = pd.read_csv(io.StringIO(render_csv(report)))
    assert list(back["event"]) == list(report.events["event"])
    assert list(back["total_ns"]) == list(report.events["total_ns"])
    assert np.allclose(back["p90_ns"], report.events["p90_ns"])
    steps = pd.read_csv(io.StringIO(render_csv(report, table="steps")))
    assert list(steps["wall_ns"]) == list(report.steps["wall_ns"])
    assert render(report, "csv") == render_csv(report)


def test_json_holds_the_whole_report(run_builder: Callable[..., RunBuilder]) -> None:
    report = _report(_run(run_builder))
    doc = json.loads(render_json(report))
    assert doc["warmup_steps"] == 1 and doc["excluded_steps"] == 1
    assert doc["throughput"]["samples"] == 4 * BATCH
    by_event = {e["event"]: e for e in doc["events"]}
    assert by_event["trainer.step"]["total_ns"] == sum(STEPS[1:])
    assert by_event["trainer.run"]["share"] is None
    assert [s["wall_ns"] for s in doc["steps"]] == list(report.steps["wall_ns"])
    assert [p["part"] for p in doc["step_summary"]] == [
        "wall",
        "data wait",
        "forward",
        "backward",
        "optimizer",
        "other",
    ]


def test_extra_tables_are_rendered_in_every_format(
    run_builder: Callable[..., RunBuilder],
) -> None:
    report = _report(_run(run_builder))
    report.tables["top_functions"] = pd.DataFrame(
        {"function": ["forward (model.py:10)"], "self_ns": [1_500_000], "share": [0.25]}
    )
    assert "top_functions" in render_table(report)
    assert "1.50 ms" in render_table(report) and "25.0%" in render_markdown(report)
    assert json.loads(render_json(report))["tables"]["top_functions"][0]["self_ns"] == 1_500_000
    assert render_csv(report, table="top_functions").startswith("function,self_ns,share")


def test_bad_arguments_are_refused_with_clear_messages(
    run_builder: Callable[..., RunBuilder],
) -> None:
    frame = spans_to_frame(_run(run_builder).batch())
    with pytest.raises(ValueError, match="Expected a non-negative int for warmup_steps, but rec"):
        step_report(frame, warmup_steps=-1)
    with pytest.raises(TypeError, match=r"Expected a span frame from exporters\.spans_to_frame"):
        step_report(pd.DataFrame({"x": [1]}))
    report = step_report(frame)
    with pytest.raises(ValueError, match="Unknown report format 'xml'; expected one of table"):
        render(report, "xml")
    with pytest.raises(ValueError, match="Expected a positive int for top, but received 0"):
        render_table(report, top=0)
    with pytest.raises(
        ValueError, match="Expected one of the tables events, validation, steps, summary"
    ):
        render_csv(report, table="nope")


def test_names_that_are_not_utf8_survive_the_report_and_compare(
    run_builder: Callable[..., RunBuilder], string_storage: str
) -> None:
    """A lone surrogate (legal in a Python str, not in UTF-8) in a name or key."""
    odd = "user.\ud800block"

    def frame(scale: int) -> pd.DataFrame:
        rb = run_builder()
        for i, step in enumerate(rb.training([scale * d for d in STEPS] * 4)["steps"]):
            rb.span(
                odd,
                step["start"] + 20,
                step["start"] + 20 + scale * 1_000,
                step["id"],
                {odd: i, "note": odd},
            )
        return spans_to_frame(rb.batch())

    base, slow = frame(1), frame(2)
    rows = base[base["name"] == odd]
    assert len(rows) == 20 and list(rows[odd]) == list(range(20))
    assert set(rows["note"]) == {odd}
    report = step_report(base)
    assert report.events.set_index("event").loc[odd, "count"] == 19  # warmup excluded
    for fmt in ("table", "md", "csv", "json"):
        assert "user." in render(report, fmt)
    json.loads(render_json(report))
    comparison = exporters.compare(base, slow, gate=[odd], min_effect_ns=100)
    assert odd in comparison.regressions
    for fmt in ("table", "md", "json"):
        assert "user." in exporters.render_comparison(comparison, fmt)


_ROWS = st.lists(
    st.tuples(st.integers(0, 5), st.integers(-10, 10**6), st.integers(-10, 10**6), st.booleans()),
    min_size=1,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(rows=_ROWS)
def test_event_sums_by_counting_match_pandas_groupby(
    rows: list[tuple[int, int, int, bool]],
) -> None:
    """The event table's sums by ``np.bincount`` against pandas' groupby (its twin):
    counts, totals, means, maxima and self times, exactly."""
    codes = np.array([r[0] for r in rows], dtype=np.int64)
    dur = np.array([r[1] for r in rows], dtype=np.int64)
    self_ns = np.array([r[2] for r in rows], dtype=np.int64)
    in_step = np.array([r[3] for r in rows])
    step_self = np.where(in_step, self_ns, 0)
    fast = report_module._sums_by_code(codes, 6, dur, self_ns, step_self, in_step)
    assert fast is not None
    slow = report_module._sums_by_pandas(codes, dur, self_ns, step_self, in_step)
    for a, b in zip(fast, slow, strict=True):
        if isinstance(a, pd.DataFrame):
            pd.testing.assert_frame_equal(
                a.sort_index(), b.sort_index(), check_index_type=False, check_names=False
            )
        else:
            pd.testing.assert_series_equal(
                a.sort_index(), b.sort_index(), check_index_type=False, check_names=False
            )


def test_event_sums_too_large_for_float64_or_without_a_name_go_to_pandas() -> None:
    codes, one = np.array([0, 0, 1]), np.ones(3, dtype=bool)
    big = np.array([2**52, 1, 5], dtype=np.int64)
    small = np.array([1, 2, 3], dtype=np.int64)
    assert report_module._sums_by_code(codes, 2, big, small, small, one) is None
    assert report_module._sums_by_code(np.array([0, -1, 1]), 2, small, small, small, one) is None
    assert report_module._sums_by_code(codes, 2, small, small, small, one) is not None


def test_an_inference_run_heads_its_events_as_outside_training() -> None:
    """A script without an optimizer: its fetches are no training steps' data wait, and
    the table no longer says "Training events" of them."""
    from exporters import SpanBatch, SpanRow, render_markdown, render_table

    rows = []
    for i in range(3):
        t = 1_000_000 * i
        rows.append(SpanRow("trainer.fetch_batch", 10 + i, 0, 1, t, t + 100, 1, {}))
        val = {"ppetrace.stage": "val", "ppetrace.module": "Net"}
        rows.append(SpanRow("module.forward", 20 + i, 0, 1, t + 200, t + 900, 1, val))
    report = exporters.step_report(exporters.spans_to_frame(SpanBatch(rows)))
    text = render_table(report)
    assert "Events outside any training step (the run did not train)" in text
    assert "Training events" not in text and "Validation and test events" in text
    assert "#### Events outside any training step" in render_markdown(report)
