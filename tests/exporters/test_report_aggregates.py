"""Summarised steps (issue 19): the report, the per-step table and compare cover every
step from the aggregates on ``trainer.step`` rows, and say which steps had full detail.

The summarised traces are made here from full-detail ones, by the contract's rules
(``ppetrace.hooks``/``ppetrace.hook_names``; the fold below is this test's own), so the
same run can be read both ways and the figures compared exactly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporters import (
    ChromeTraceExporter,
    SpanBatch,
    SpanRow,
    _aggregates,
    compare,
    read_chrome_trace,
    render_json,
    render_markdown,
    render_table,
    spans_to_frame,
    step_report,
)
from exporters._aggregates import parse_aggregates
from exporters.comparison import event_samples
from exporters.report import Detail

RunBuilder = Any
STEP_LEVEL = {"trainer.run", "trainer.epoch", "trainer.fetch_batch", "trainer.step"}
PARTS = ["data_wait_ns", "forward_ns", "backward_ns", "optimizer_ns", "other_ns"]


def _layout(rb: RunBuilder, steps: Sequence[int], *, slow: dict[int, int] | None = None) -> None:
    """The Trainer's tree per step: fetch, then step > (convert, train_step > closure x2,
    backward > user.hook, optimizer_step), and a worker span on another thread.
    ``slow`` adds ns to ``trainer.backward`` in the given steps."""
    run = rb.span("trainer.run", 0, 100_000_000)
    epoch = rb.span("trainer.epoch", 10, 99_000_000, run)
    t = 100
    for i, dur in enumerate(steps):
        extra = (slow or {}).get(i, 0)
        dur += extra
        rb.span("trainer.fetch_batch", t, t + 300 + i, epoch)
        t += 300 + i
        step = rb.span("trainer.step", t, t + dur, epoch, {"ppetrace.step": i})
        rb.span("runtime.convert_batch", t + 10, t + 30, step)
        q = dur // 4
        train = rb.span("module.train_step", t + 40, t + 40 + q, step)
        rb.span("network.closure", t + 50, t + 50 + q // 4, train)
        rb.span("network.closure", t + 60 + q // 4, t + 60 + q // 2, train)
        bw = rb.span("trainer.backward", t + 40 + q, t + 40 + 2 * q + extra, step)
        rb.span("user.hook", t + 50 + q, t + 50 + q + 7 * (i + 1), bw)
        rb.span("trainer.optimizer_step", t + 40 + 2 * q + extra, t + 40 + 3 * q + extra, step)
        if i % 3 == 2:  # an event that only some steps have (a new name, later)
            rb.span("callback.every_third", t + 45 + 3 * q + extra, t + 55 + 3 * q + extra, step)
        rb.span("worker.decode", t, t + dur // 2, step, tid=99)  # another thread: in full
        t += dur + 50


def _entry(total: int, own: int, count: int) -> str:
    if count == 1:
        return str(total) if own == total else f"{total}/{own}"
    return f"{total}/{own}/{count}"


def summarise(rows: Sequence[SpanRow], summarised: Sequence[int]) -> list[SpanRow]:
    """The rows as the writer leaves them when the steps numbered ``summarised`` (in
    start order) are summarised: their hook-level rows on the step's thread folded into
    ``ppetrace.hooks`` on the step row, with the names list as the contract says."""
    rows = sorted(rows, key=lambda r: r.start_ns)
    steps = [r for r in rows if r.name == "trainer.step"]
    chosen = {steps[i].span_id for i in summarised}
    out: list[SpanRow] = []
    folded: set[int] = set()
    names: list[str] = []
    announce = True
    for step in steps:
        if step.span_id not in chosen:
            announce = True
            continue
        inside = [
            r
            for r in rows
            if r.tid == step.tid
            and r.start_ns >= step.start_ns
            and r.end_ns <= step.end_ns
            and r.name not in STEP_LEVEL
        ]
        children: dict[int, int] = {}
        for r in inside:
            children[r.parent_id] = children.get(r.parent_id, 0) + r.end_ns - r.start_ns
        agg: dict[str, list[int]] = {}
        for r in inside:
            dur = r.end_ns - r.start_ns
            a = agg.setdefault(r.name, [0, 0, 0])
            a[0] += dur
            a[1] += dur - children.get(r.span_id, 0)
            a[2] += 1
            folded.add(r.span_id)
        new = [n for n in agg if n not in names]
        names += new
        entries = [_entry(*agg[n]) if n in agg else "" for n in names]
        while entries and not entries[-1]:
            entries.pop()  # trailing empties may be left out
        attrs = {**step.attributes, "ppetrace.hooks": ";".join(entries)}
        if announce or new:
            attrs["ppetrace.hook_names"] = ";".join(names)
            announce = False
        out.append(step._replace(attributes=attrs))
    replaced = {r.span_id: r for r in out}
    return [replaced.get(r.span_id, r) for r in rows if r.span_id not in folded]


def _rows(rb_factory: Callable[..., RunBuilder], steps: Sequence[int], **kw: Any) -> Any:
    rb = rb_factory()
    _layout(rb, steps, **kw)
    return rb


STEPS = [8_000 + 400 * (i % 5) for i in range(12)]
SUMMARISED = [2, 3, 4, 6, 7, 8, 9, 11]  # detailed: 0, 1, 5, 10


def _both(run_builder: Callable[..., RunBuilder]) -> tuple[pd.DataFrame, pd.DataFrame]:
    rb = _rows(run_builder, STEPS)
    full = spans_to_frame(rb.batch())
    summ = spans_to_frame(rb.batch(summarise(rb.rows, SUMMARISED)))
    return full, summ


def test_the_events_table_from_aggregates_matches_full_detail(
    run_builder: Callable[..., RunBuilder],
) -> None:
    full, summ = _both(run_builder)
    assert len(summ) < len(full) - 8 * 6  # the hooks of 8 steps are folded
    a, b = step_report(full, warmup_steps=1), step_report(summ, warmup_steps=1)
    assert a.detail is None and "detail_count" not in a.events.columns
    ea, eb = a.events.set_index("event"), b.events.set_index("event")
    assert sorted(ea.index) == sorted(eb.index)
    for col in ("count", "total_ns", "self_ns"):
        assert eb[col].astype(np.int64).to_dict() == ea[col].astype(np.int64).to_dict(), col
    assert np.allclose(eb["mean_ns"], ea.loc[eb.index, "mean_ns"])
    assert np.allclose(eb["share"].fillna(-1), ea.loc[eb.index, "share"].fillna(-1))
    # percentiles and max: over the detailed steps' spans only (steps 1, 5, 10 counted)
    assert eb.loc["user.hook", "detail_count"] == 3
    assert eb.loc["user.hook", "max_ns"] == 7 * 11  # step 10's, not step 11's 84 ns
    assert ea.loc["user.hook", "max_ns"] == 7 * 12
    assert eb.loc["callback.every_third", "detail_count"] == 1  # step 5 only
    assert eb.loc["trainer.step", "detail_count"] == 11  # step-level: every step
    assert b.detail == Detail(
        steps=12,
        detailed=4,
        summarised=8,
        unknown=0,
        ranges=((4242, 0, 1), (4242, 5, 5), (4242, 10, 10)),
        # 7 hook spans per step on the step's thread, 8 with the callback
        spans_summarised=sum(7 + (i % 3 == 2) for i in SUMMARISED),
    )
    assert b.spans == a.spans - b.detail.spans_summarised


def test_the_step_table_covers_summarised_steps_by_step_parts(
    run_builder: Callable[..., RunBuilder],
) -> None:
    full, summ = _both(run_builder)
    sa = step_report(full, warmup_steps=0).steps
    sb = step_report(summ, warmup_steps=0).steps
    assert len(sb) == len(sa) == 12
    assert sb["full_detail"].tolist() == [i not in SUMMARISED for i in range(12)]
    for col in ("wall_ns", "data_wait_ns", "forward_ns", "optimizer_ns", "compute_ns"):
        assert sb[col].tolist() == sa[col].tolist(), col
    # user.hook (not in STEP_PARTS) under trainer.backward: backward in a detailed step,
    # other in a summarised one (aggregates keep no ancestry), exactly its self time
    hook = np.array([7 * (i + 1) if i in SUMMARISED else 0 for i in range(12)])
    assert (sb["backward_ns"].to_numpy() == sa["backward_ns"].to_numpy() - hook).all()
    assert (sb["other_ns"].to_numpy() == sa["other_ns"].to_numpy() + hook).all()
    assert (sb["wall_ns"] == sb[PARTS].sum(axis=1)).all()


def _write(path: Path, rows: Sequence[SpanRow], **kw: Any) -> list[Path]:
    exporter = ChromeTraceExporter(path, **kw)
    resource = {"service.name": "tests", "ppetrace.rank": 0}
    for i in range(0, len(rows), 7):  # several writes, so that parts can split
        exporter.export_batch(SpanBatch(list(rows[i : i + 7]), resource, 4242, {11: "Main"}))
    exporter.shutdown()
    return list(exporter.parts)


def test_parts_read_as_one_run_and_a_later_part_alone_reports_unknown_steps(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    steps = [8_000] * 40
    rb = _rows(run_builder, steps)
    rows = summarise(rb.rows, [i for i in range(40) if i % 10])
    # every part is a trace; hook_names only on the first summarised step of a run of them
    paths = _write(tmp_path / "t.json", rows, max_part_bytes=2_000, _min_part_bytes=1)
    assert len(paths) > 3
    whole = step_report(read_chrome_trace(paths[0]), warmup_steps=0)
    assert whole.detail is not None and whole.detail.unknown == 0
    assert whole.detail.detailed == 4 and whole.detail.summarised == 36
    assert whole.events.set_index("event").loc["user.hook", "count"] == 40
    # a later part alone: steps whose names list was written in an earlier part
    alone = [read_chrome_trace(p, parts=False) for p in paths[1:]]
    counts = [parse_aggregates(f) for f in alone]
    lost = sum(len(c.unknown) for c in counts)
    assert lost > 0
    for frame, agg in zip(alone, counts, strict=True):
        if not len(agg.unknown):
            continue
        report = step_report(frame, warmup_steps=0)
        assert report.detail is not None and report.detail.unknown == len(agg.unknown)
        assert report.steps.loc[~report.steps["full_detail"], "forward_ns"].isna().sum() == (
            len(agg.unknown)
        )
        text = render_table(report)
        assert f"{len(agg.unknown):,} summarised step" in text
        assert "cannot be read (names list not found: read the run from its first part)" in text
        break


def _frame(rows: Sequence[SpanRow], *, tid: int = 11) -> pd.DataFrame:
    return spans_to_frame(SpanBatch(list(rows), {}, 4242, {tid: "Main"}))


def _step(i: int, attrs: dict[str, Any], *, tid: int = 11) -> SpanRow:
    t = 1_700_000_000_000_000_000 + 10_000 * i
    return SpanRow("trainer.step", 100 + i, 0, 7, t, t + 5_000, tid, attrs)


def test_names_lists_hold_per_thread_in_time_order_and_extend() -> None:
    rows = [
        _step(0, {"ppetrace.hooks": "10;20/5/2", "ppetrace.hook_names": "a;b"}),
        _step(1, {"ppetrace.hooks": ";7"}),  # a;b still in force
        _step(2, {"ppetrace.hooks": "1;;3", "ppetrace.hook_names": "a;b;c"}),
        _step(3, {"ppetrace.hooks": "4"}, tid=12),  # another thread: no list in force
        _step(4, {"ppetrace.hooks": "9/-2", "ppetrace.hook_names": "z"}, tid=12),
        _step(5, {"ppetrace.hooks": ""}),  # summarised, nothing in it
        _step(6, {}),  # full detail
    ]
    rows = rows[::-1]  # the frame's order is not time order
    agg = parse_aggregates(spans_to_frame(rows))
    got = agg.frame().assign(step=lambda f: [rows[r].span_id - 100 for r in f["step_row"]])
    got = got.sort_values(["step", "event"])[["step", "event", "count", "total_ns", "self_ns"]]
    assert got.values.tolist() == [
        [0, "a", 1, 10, 10],
        [0, "b", 2, 20, 5],
        [1, "b", 1, 7, 7],
        [2, "a", 1, 1, 1],
        [2, "c", 1, 3, 3],
        [4, "z", 1, 9, -2],
    ]
    assert sorted(rows[r].span_id - 100 for r in agg.summarised) == [0, 1, 2, 3, 4, 5]
    assert [rows[r].span_id - 100 for r in agg.unknown] == [3]


@pytest.mark.parametrize(
    "hooks",
    ["1;x", "1//2", "1/2/3/4", "1/1/0", "-1", "3;4;5", "1-2", 17, "é"],
)
def test_entries_that_do_not_parse_make_their_step_unknown_not_guessed(hooks: Any) -> None:
    rows = [
        _step(0, {"ppetrace.hooks": hooks, "ppetrace.hook_names": "a;b"}),
        _step(1, {"ppetrace.hooks": "5;6"}),
    ]
    agg = parse_aggregates(_frame(rows))
    assert agg.unknown.tolist() == [0]
    assert agg.step_row.tolist() == [1, 1] and agg.total_ns.tolist() == [5, 6]


def test_detail_describe_is_compact() -> None:
    ranges = ((1, 0, 329_999), *((1, k, k) for k in range(330_999, 1_000_000, 1000)))
    d = Detail(1_000_000, 330_670, 669_330, 0, ranges, 1)
    assert d.describe() == (
        "Full detail: 330,670 of 1,000,000 steps (step_index 0-329,999, "
        "330,999-999,999 every 1,000); 669,330 summarised (per-event aggregates of 1 span "
        "in the steps past the warmup)."
    )
    few = Detail(20, 10, 10, 0, ((1, 0, 0), (1, 2, 2), (1, 9, 12)), 0)
    assert "(step_index 0, 2, 9-12)" in few.describe()  # two singles are not a stride
    many = Detail(99, 30, 69, 0, tuple((1, k * k, k * k + 1) for k in range(10)), 0)
    assert "(step_index 0-1, 1-2, 4-5, 9-10, 16-17, ... 4 more ..., 81-82)" in many.describe()
    two = Detail(4, 2, 2, 0, ((1, 0, 0), (2, 3, 3)), 0)
    assert "(step_index pid 1: 0; pid 2: 3)" in two.describe()


def test_renderers_say_which_steps_had_full_detail(
    run_builder: Callable[..., RunBuilder],
) -> None:
    _, summ = _both(run_builder)
    summ.attrs["metadata"] = {
        "ppetrace.detail": {"policy": "auto", "max_trace_bytes": 10**9, "schedule": None}
    }
    report = step_report(summ, warmup_steps=1)
    text = render_table(report)
    assert "Full detail: 4 of 12 steps (step_index 0-1, 5, 10); 8 summarised" in text
    assert "past the warmup). trace_detail=auto, max_trace_bytes=1,000,000,000." in text
    assert "in detail" in text and "over the spans of the steps with full detail" in text
    assert "Full detail: 4 of 12 steps" in render_markdown(report)
    doc = json.loads(render_json(report))
    assert doc["detail"]["policy"]["policy"] == "auto"
    assert doc["detail"]["detailed"] == 4 and doc["detail"]["ranges"][1] == {
        "pid": 4242,
        "first": 5,
        "last": 5,
    }
    assert {e["event"]: e["detail_count"] for e in doc["events"]}["user.hook"] == 3


def test_compare_catches_an_event_slower_only_in_summarised_steps(
    run_builder: Callable[..., RunBuilder],
) -> None:
    steps = [20_000] * 60
    detailed = set(range(0, 60, 10))
    summarised = [i for i in range(60) if i not in detailed]
    base_rb = _rows(run_builder, steps)
    # trainer.backward 30% slower, in summarised steps only
    cand_rb = _rows(run_builder, steps, slow={i: 1_500 for i in summarised})
    base = spans_to_frame(base_rb.batch(summarise(base_rb.rows, summarised)))
    cand = spans_to_frame(cand_rb.batch(summarise(cand_rb.rows, summarised)))
    samples = event_samples(cand, warmup_steps=1)
    assert len(samples["trainer.backward"]) == 59  # every counted step has a sample
    result = compare(base, cand, gate="trainer.backward", threshold=0.05, noise_floor=0.02)
    row = result.events.set_index("event").loc["trainer.backward"]
    assert row["verdict"] == "regression" and result.has_regression
    # the detailed steps alone (aggregates dropped) would not see it
    blind = compare(
        base.drop(columns=["ppetrace.hooks"]),
        cand.drop(columns=["ppetrace.hooks"]),
        gate="trainer.backward",
        threshold=0.05,
        noise_floor=0.02,
    )
    assert not blind.has_regression


def test_html_report_says_which_steps_had_full_detail(
    run_builder: Callable[..., RunBuilder],
) -> None:
    pytest.importorskip("plotly")
    from exporters import render_html

    _, summ = _both(run_builder)
    page = render_html(step_report(summ, warmup_steps=1))
    assert "4 of 12 steps" in page and "0-1, 5, 10" in page
    assert "over the spans of the steps with full detail" in page


def test_a_run_without_summarised_steps_gets_no_detail_columns(
    run_builder: Callable[..., RunBuilder],
) -> None:
    full, _ = _both(run_builder)
    report = step_report(full)
    assert report.detail is None
    assert "full_detail" not in report.steps.columns
    assert "Full detail" not in render_table(report) and "detail" not in render_json(report)


_HOOK_TEXTS = st.one_of(
    st.text(alphabet="0123456789-;/", max_size=24),
    st.text(alphabet="0123456789-;/x\né", max_size=12),
    st.lists(
        st.one_of(
            st.just(""),
            st.integers(0, 10**19).map(str),
            st.tuples(st.integers(-5, 10**6), st.integers(-5, 10**6)).map("{0[0]}/{0[1]}".format),
            st.tuples(st.integers(0, 99), st.integers(-99, 99), st.integers(-1, 3)).map(
                "{0[0]}/{0[1]}/{0[2]}".format
            ),
        ),
        max_size=6,
    ).map(";".join),
)


@pytest.mark.skipif(_aggregates._speedups is None, reason="exporters._speedups not built")
@settings(max_examples=300, deadline=None)
@given(hooks=st.lists(_HOOK_TEXTS, min_size=1, max_size=8))
def test_the_c_hooks_parser_reads_what_the_numpy_one_reads(hooks: list[str]) -> None:
    row, pos, total, own, count, malformed = _aggregates._parse_entries(hooks)
    c = _aggregates._speedups.parse_hooks(hooks)
    assert np.frombuffer(c[5], dtype=np.bool_).tolist() == malformed.tolist(), hooks
    good = ~malformed[row]  # the numpy parser also lists a malformed row's entries
    expected = [a[good].tolist() for a in (row, pos, total, own, count)]
    assert [np.frombuffer(x, dtype=np.int64).tolist() for x in c[:5]] == expected, hooks
