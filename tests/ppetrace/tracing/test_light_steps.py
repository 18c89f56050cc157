"""Light steps (``ppetrace.tracing._light``): the spans of a summarised step taken as
aggregates in the recorder, without rows. Each test runs on the C hot path (where it
is built) and on the pure-Python one, in this process, and both give the same
aggregates (names, order, counts) for the same blocks."""

from __future__ import annotations

import os
from typing import Any

import pytest
from opentelemetry import trace as otel_trace

import ppetrace
from ppetrace.tracing import _light, _recorder
from ppetrace.tracing._fold import begin_light

IMPLEMENTATIONS = [pytest.param(_recorder.PySpan, id="python")]
if _recorder.IMPLEMENTATION == "c":
    IMPLEMENTATIONS.insert(0, pytest.param(_recorder.Span, id="c"))

RowSink = Any  # conftest.py's row_sink fixture
FULL = frozenset({"trainer.step", "trainer.fetch_batch"})


def _fold(agg: tuple[Any, ...]) -> dict[str, tuple[int, int, int]]:
    assert len(agg) % 4 == 0
    return {agg[k]: (agg[k + 1], agg[k + 2], agg[k + 3]) for k in range(0, len(agg), 4)}


def _step(
    trace: Any, body: Any, full: frozenset[str] = FULL
) -> tuple[Any, list[tuple[int, tuple[Any, ...]]]]:
    """Run ``body(trace)`` in a light step; the step span and what it published."""
    published: list[tuple[int, tuple[Any, ...]]] = []
    with trace("trainer.step") as step:
        assert begin_light(step, published.append, full)
        body(trace)
    return step, published


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_a_light_step_publishes_counts_totals_and_self_times(trace: Any, row_sink: RowSink) -> None:
    def body(t: Any) -> None:
        with t("a"):
            for _ in range(2):
                with t("b"):
                    pass
            with t("trainer.fetch_batch"):  # in full, inside a light span
                pass
        t("c").mark(None)
        hook = t("d")
        for k in range(3):
            with hook.again({"k": k}):
                pass

    step, published = _step(trace, body)
    ppetrace.flush()
    ((start, agg),) = published
    assert start == step.start_ns + _recorder.RECORDER.offset_ns  # the step row's start
    folded = _fold(agg)
    assert list(folded) == ["a", "b", "c", "d"]  # in the order they came
    assert [v[2] for v in folded.values()] == [1, 2, 1, 3]
    rows = {r.name: r for r in row_sink.rows}
    assert set(rows) == {"trainer.step", "trainer.fetch_batch"}  # the light spans: no rows
    inner = rows["trainer.fetch_batch"]
    assert inner.parent_id == step.span_id  # a light span is nobody's parent
    a_total, a_self, _ = folded["a"]
    children = folded["b"][0] + (inner.end_ns - inner.start_ns)
    assert a_self == a_total - children >= 0
    assert all(total >= own >= 0 for total, own, _ in folded.values())
    step_row = rows["trainer.step"]
    assert step_row.end_ns - step_row.start_ns >= a_total + folded["d"][0]


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_the_next_fold_keeps_the_names_in_the_order_first_met(
    trace: Any, row_sink: RowSink
) -> None:
    full = frozenset({"trainer.step", "order"})

    def first(t: Any) -> None:
        for name in ("x", "y", "z"):
            with t(name):
                pass

    def second(t: Any) -> None:
        for name in ("w", "z", "x"):
            with t(name):
                pass

    _, one = _step(trace, first, full)
    _, two = _step(trace, second, full)
    assert list(_fold(one[0][1])) == ["x", "y", "z"]
    folded = _fold(two[0][1])
    assert list(folded) == ["x", "z", "w"]  # y did not occur; w is new
    assert [v[2] for v in folded.values()] == [1, 1, 1]


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_inside_a_light_span_the_step_is_the_current_span(trace: Any, row_sink: RowSink) -> None:
    seen = []

    def body(t: Any) -> None:
        with t("hook") as hook:
            seen.append(otel_trace.get_current_span())
            seen.append(hook.get_span_context().is_valid)

    step, _ = _step(trace, body)
    assert seen == [step, False]


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_a_light_span_that_raises_is_recorded_in_full(trace: Any, row_sink: RowSink) -> None:
    def body(t: Any) -> None:
        with t("outer"), pytest.raises(ValueError), t("boom", {"k": 1}):
            raise ValueError("x")

    step, published = _step(trace, body)
    ppetrace.flush()
    ((_, agg),) = published
    folded = _fold(agg)
    assert list(folded) == ["outer"]  # the error is a row, not an aggregate
    (boom,) = [r for r in row_sink.rows if r.name == "boom"]
    assert boom.status == "ERROR" and boom.error.startswith("ValueError: x")
    assert boom.parent_id == step.span_id and boom.attributes == {"k": 1}
    total, own, _ = folded["outer"]
    assert own == total - (boom.end_ns - boom.start_ns)


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_a_light_span_that_outlives_its_step_is_recorded_in_full(
    trace: Any, row_sink: RowSink
) -> None:
    late = trace("late")

    def body(t: Any) -> None:
        late.__enter__()  # left open when the step ends

    step, published = _step(trace, body)
    late.__exit__(None, None, None)
    ppetrace.flush()
    ((_, agg),) = published
    assert agg == ()
    (row,) = [r for r in row_sink.rows if r.name == "late"]
    assert row.status == "UNSET" and row.end_ns >= row.start_ns
    assert row.start_ns <= step.end_ns + _recorder.RECORDER.offset_ns


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_a_fold_takes_no_more_names_or_depth_than_it_holds(trace: Any, row_sink: RowSink) -> None:
    def body(t: Any) -> None:
        for k in range(_light.NAMES + 3):
            with t(f"n{k}"):
                pass
        spans = [t("deep") for _ in range(_light.DEPTH + 2)]
        for s in spans:
            s.__enter__()
        for s in reversed(spans):
            s.__exit__(None, None, None)

    fresh = frozenset({"trainer.step", "fresh"})  # another set: the fold's names start anew
    _, published = _step(trace, body, fresh)
    ppetrace.flush()
    ((_, agg),) = published
    folded = _fold(agg)
    assert len(folded) == _light.NAMES  # the names past the table: rows
    assert sorted(r.name for r in row_sink.rows if r.name.startswith("n")) == sorted(
        f"n{k}" for k in range(_light.NAMES, _light.NAMES + 3)
    )
    assert "deep" not in folded  # "deep" came after the table filled: every one a row
    assert sum(r.name == "deep" for r in row_sink.rows) == _light.DEPTH + 2


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_begin_light_refuses_what_it_cannot_fold(trace: Any, row_sink: RowSink) -> None:
    step = trace("trainer.step")
    assert not begin_light(step, print, FULL)  # not entered
    with step:
        assert begin_light(step, lambda pair: None, FULL)
        assert not begin_light(step, print, FULL)  # a fold is open on this thread
    with pytest.raises(TypeError, match="frozenset of str"):
        begin_light(step, print, {"trainer.step"})
    with step, pytest.raises(TypeError, match="frozenset of str"):
        begin_light(step, print, frozenset({"trainer.step", 1}))  # a new set: its names
    ppetrace.configure(enabled=False)
    try:
        with step:
            assert not begin_light(step, print, FULL)
    finally:
        ppetrace.configure(enabled=True)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # C reports so
@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_a_failing_publish_still_leaves_the_step_row(
    trace: Any, row_sink: RowSink, caplog: pytest.LogCaptureFixture
) -> None:
    def publish(pair: Any) -> None:
        raise RuntimeError("publish failed")

    with trace("trainer.step") as step:
        assert begin_light(step, publish, FULL)
        with trace("hook"):
            pass
    ppetrace.flush()
    assert [r.name for r in row_sink.rows] == ["trainer.step"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_a_forked_child_records_in_full(trace: Any) -> None:
    read, write = os.pipe()
    with trace("trainer.step") as step:
        assert begin_light(step, lambda pair: None, FULL)
        pid = os.fork()
        if pid == 0:  # the child: no fold of its own, its spans are plain spans
            code = 1
            try:
                with trace("child") as child:
                    pass
                code = 0 if child.get_span_context().is_valid else 2
            finally:
                os.write(write, bytes([code]))
                os._exit(0)
        os.waitpid(pid, 0)
    assert os.read(read, 1) == b"\x00"
    os.close(read)
    os.close(write)
