"""spans_to_frame and read_chrome_trace: the frame schema, self time, depth and inheritance."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from exporters import (
    COLUMNS,
    ChromeTraceExporter,
    SpanBatch,
    SpanRow,
    TraceError,
    TraceTruncatedWarning,
    read_chrome_trace,
    spans_to_frame,
)

RunBuilder = Any  # the builder from conftest.py's run_builder fixture


def _tree(rb: RunBuilder) -> dict[str, int]:
    """run > epoch(epoch=2) > step(step=7) > {backward > hook, optimizer}; a worker thread
    child of the step; times in ns after T0."""
    ids: dict[str, int] = {}
    ids["run"] = rb.span("trainer.run", 0, 10_000)
    ids["epoch"] = rb.span("trainer.epoch", 100, 9_000, ids["run"], {"ppetrace.epoch": 2})
    ids["step"] = rb.span(
        "trainer.step",
        200,
        5_200,
        ids["epoch"],
        {
            "ppetrace.step": 7,
            "ppetrace.batch_idx": 3,
            "ppetrace.stage": "train",
            "ppetrace.batch_size": 32,
            "ppetrace.device": "cpu",
        },
    )
    ids["backward"] = rb.span(
        "trainer.backward", 300, 1_300, ids["step"], {"ppetrace.device_dur_ns": 640}
    )
    ids["hook"] = rb.span("callback.on_end_backward", 1_000, 1_250, ids["backward"])
    ids["optimizer"] = rb.span(
        "trainer.optimizer_step", 1_400, 2_400, ids["step"], {"ppetrace.step": 8}
    )
    ids["worker"] = rb.span("user.prefetch", 250, 4_000, ids["step"], tid=99)
    return ids


def test_frame_columns_self_time_depth_and_inheritance(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rb = run_builder(pid=77, rank=5)
    ids = _tree(rb)
    frame = spans_to_frame(rb.batch())
    assert list(frame.columns[: len(COLUMNS)]) == list(COLUMNS)
    assert "ppetrace.batch_size" in frame.columns and "ppetrace.device" in frame.columns
    assert "ppetrace.step" not in frame.columns  # renamed to step
    f = frame.set_index("name")

    assert f.loc["trainer.step", "start_ns"] == rb.T0 + 200
    assert f.loc["trainer.step", "end_ns"] == rb.T0 + 5_200
    assert f.loc["trainer.step", "dur_ns"] == 5_000
    # self time: minus the direct children on the same thread only
    assert f.loc["trainer.step", "self_ns"] == 5_000 - 1_000 - 1_000
    assert f.loc["trainer.backward", "self_ns"] == 1_000 - 250
    assert f.loc["trainer.run", "self_ns"] == 10_000 - 8_900
    assert f.loc["user.prefetch", "self_ns"] == 3_750

    assert f.loc["trainer.run", "depth"] == 0
    assert f.loc["callback.on_end_backward", "depth"] == 4
    assert f.loc["user.prefetch", "depth"] == 3

    assert f.loc["trainer.step", "parent_id"] == ids["epoch"]
    assert f.loc["trainer.run", "parent_id"] == 0
    assert f.loc["trainer.step", "span_id"] == ids["step"]

    # epoch and step come from the nearest ancestor that has them
    assert pd.isna(f.loc["trainer.run", "epoch"])
    assert f.loc["callback.on_end_backward", "epoch"] == 2
    assert f.loc["callback.on_end_backward", "step"] == 7
    assert f.loc["trainer.optimizer_step", "step"] == 8  # its own value wins
    assert pd.isna(f.loc["trainer.epoch", "step"])
    # batch_idx is not inherited
    assert f.loc["trainer.step", "batch_idx"] == 3
    assert pd.isna(f.loc["trainer.backward", "batch_idx"])
    assert f.loc["trainer.step", "stage"] == "train"
    assert pd.isna(f.loc["trainer.run", "stage"])

    assert f.loc["trainer.backward", "device_dur_ns"] == 640.0
    assert np.isnan(f.loc["trainer.step", "device_dur_ns"])
    assert f.loc["trainer.step", "ppetrace.batch_size"] == 32
    assert (frame["pid"] == 77).all() and (frame["rank"] == 5).all()
    assert f.loc["user.prefetch", "tid"] == 99
    assert (frame["status"] == "UNSET").all() and (frame["error"] == "").all()
    assert (frame["trace_id"] == f"{rb.TRACE_ID:032x}").all()

    assert frame["span_id"].dtype == np.uint64
    assert frame["start_ns"].dtype == np.int64
    for col in ("epoch", "step", "batch_idx", "rank"):
        assert str(frame[col].dtype) == "Int64"
    assert frame["device_dur_ns"].dtype == np.float64


def test_a_rank_attribute_overrides_the_process_rank(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rb = run_builder(rank=None)
    rb.span("a", 0, 10, 0, {"ppetrace.rank": 3})
    rb.span("b", 20, 30)
    frame = spans_to_frame(rb.batch()).set_index("name")
    assert frame.loc["a", "rank"] == 3
    assert pd.isna(frame.loc["b", "rank"])


def test_the_chrome_file_reads_back_into_the_same_frame(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder(pid=77, rank=5)
    _tree(rb)
    rb.span("module.train_step", 6_000, 6_100, 0, status="ERROR", error="RuntimeError: x\ntb")
    path = tmp_path / "t.json"
    exporter = ChromeTraceExporter(path)
    exporter.export_batch(rb.batch())
    exporter.shutdown()
    from_file = read_chrome_trace(path)
    from_spans = spans_to_frame(rb.batch())
    pd.testing.assert_frame_equal(from_file, from_spans)
    assert from_file.attrs["metadata"]["rank"] == 5


def test_readable_spans_give_the_same_frame_as_rows() -> None:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "x", "ppetrace.rank": 1}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("t")
    t0 = 1_650_000_000_000_000_000
    outer = tracer.start_span(
        "trainer.step", start_time=t0, attributes={"ppetrace.step": 3, "thread.id": 5}
    )
    from opentelemetry import trace as otel_trace

    ctx = otel_trace.set_span_in_context(outer)
    inner = tracer.start_span(
        "user.op", context=ctx, start_time=t0 + 10, attributes={"thread.id": 5, "size": 4}
    )
    inner.end(end_time=t0 + 60)
    outer.end(end_time=t0 + 100)
    spans = memory.get_finished_spans()
    frame = spans_to_frame(spans).set_index("name")
    assert frame.loc["user.op", "parent_id"] == outer.get_span_context().span_id
    assert frame.loc["user.op", "step"] == 3
    assert frame.loc["trainer.step", "self_ns"] == 50
    assert frame.loc["user.op", "size"] == 4
    assert frame.loc["user.op", "rank"] == 1
    assert "thread.id" not in frame.columns  # it is the tid column


def test_empty_input_gives_the_standard_columns() -> None:
    frame = spans_to_frame([])
    assert list(frame.columns) == list(COLUMNS)
    assert len(frame) == 0
    assert len(spans_to_frame(SpanBatch([]))) == 0


def test_rejects_objects_that_are_not_spans() -> None:
    with pytest.raises(TypeError, match="Expected OpenTelemetry ReadableSpans, SpanRows or Sp"):
        spans_to_frame([{"name": "x"}])  # type: ignore[list-item]


def test_parents_resolve_within_each_process_when_ids_repeat(
    run_builder: Callable[..., RunBuilder],
) -> None:
    a, b = run_builder(pid=1), run_builder(pid=2)
    for rb, dur in ((a, 100), (b, 300)):
        rb.span("parent", 0, 1_000, 0, span_id=10)
        rb.span("child", 10, 10 + dur, 10, span_id=11)
    frame = spans_to_frame([a.batch(), b.batch()])
    parents = frame[frame["name"] == "parent"].set_index("pid")
    assert parents.loc[1, "self_ns"] == 900 and parents.loc[2, "self_ns"] == 700
    assert (frame.loc[frame["name"] == "child", "depth"] == 1).all()


# -- foreign Chrome traces --------------------------------------------------------


def test_reads_a_foreign_trace_inferring_parents_from_nesting(tmp_path: Path) -> None:
    events = [
        {"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "job rank 4"}},
        {"ph": "X", "name": "outer", "pid": 9, "tid": 1, "ts": 10, "dur": 100},
        {"ph": "X", "name": "inner", "pid": 9, "tid": 1, "ts": 10, "dur": 30.5, "args": {"k": "v"}},
        {"ph": "X", "name": "inner2", "pid": 9, "tid": 1, "ts": 50, "dur": 10},
        {"ph": "B", "name": "begin_end", "pid": 9, "tid": 2, "ts": 20},
        {"ph": "E", "pid": 9, "tid": 2, "ts": 25.25},
        {"ph": "i", "name": "instant", "pid": 9, "tid": 1, "ts": 12},
    ]
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(events))  # the bare array form
    frame = read_chrome_trace(path).set_index("name")
    assert set(frame.index) == {"outer", "inner", "inner2", "begin_end"}
    assert frame.loc["inner", "parent_id"] == frame.loc["outer", "span_id"]
    assert frame.loc["inner2", "parent_id"] == frame.loc["outer", "span_id"]
    assert frame.loc["outer", "parent_id"] == 0
    assert frame.loc["outer", "self_ns"] == 100_000 - 30_500 - 10_000
    assert frame.loc["inner", "start_ns"] == 10_000 and frame.loc["inner", "dur_ns"] == 30_500
    assert frame.loc["begin_end", "dur_ns"] == 5_250 and frame.loc["begin_end", "tid"] == 2
    assert frame.loc["inner", "k"] == "v"
    assert (frame["rank"] == 4).all()


def test_a_cut_off_foreign_array_is_read_up_to_its_last_event(tmp_path: Path) -> None:
    text = json.dumps(
        [
            {"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 5},
            {
                "ph": "X",
                "name": "b",
                "pid": 1,
                "tid": 1,
                "ts": 6,
                "dur": 5,
                "args": {"x": {"y": 1}},
            },
        ]
    )
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('"dur": 5, "args"') + 20])
    with pytest.warns(TraceTruncatedWarning, match="read its first 1 complete events"):
        frame = read_chrome_trace(path)
    assert list(frame["name"]) == ["a"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "but the file is empty"),
        (b"not json at all", "but the file is not JSON"),
        (b'{"traceEvents": [1, 2]}', "Expected Chrome trace events"),
        (b'{"foo": 1, "bar": 2}', r"a JSON object with a 'traceEvents' list\), but its keys"),
        (b'"just a string"', "but the file is not JSON"),
        (b'{"a": [1, 2, 3', "not valid JSON and no complete event"),
        (b"\xff\xfe{}", "not UTF-8 text"),
    ],
)
def test_rejects_files_that_are_not_traces(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=message):
        read_chrome_trace(path)


def test_a_missing_file_or_directory_is_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"Expected a trace file at .*no such file"):
        read_chrome_trace(tmp_path / "missing.json")
    with pytest.raises(TraceError, match="but it is a directory"):
        read_chrome_trace(tmp_path)


def test_integer_attributes_with_missing_values_stay_exact(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rb = run_builder()
    big = 2**60 + 1  # not representable in float64
    rb.span("a", 0, 10, 0, {"user.bytes": big, "user.flag": True})
    rb.span("b", 20, 30, 0, {"user.flag": False})
    rb.span("c", 40, 50, 0, {"user.bytes": -big})
    frame = spans_to_frame(rb.batch()).set_index("name")
    assert str(frame["user.bytes"].dtype) == "Int64"
    assert frame.loc["a", "user.bytes"] == big
    assert frame.loc["c", "user.bytes"] == -big
    assert pd.isna(frame.loc["b", "user.bytes"])
    assert str(frame["user.flag"].dtype) == "boolean"  # bools are not ints


def _trace_file(
    tmp_path: Path, span_id: Any = "0000000000000001", origin_ns: Any = 0, ts: Any = 1.0
) -> Path:
    events = [
        {
            "ph": "X",
            "name": "trainer.step",
            "pid": 1,
            "tid": 1,
            "ts": ts,
            "dur": 2.0,
            "args": {"span_id": span_id, "parent_id": "0000000000000000"},
        }
    ]
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"otherData": {"origin_ns": origin_ns}, "traceEvents": events}))
    return path


@pytest.mark.parametrize("span_id", ["-1", "123456789012345678", -1, 2**64])
def test_span_ids_out_of_range_are_a_trace_error(tmp_path: Path, span_id: Any) -> None:
    with pytest.raises(
        TraceError,
        match=(
            r"^In .*odd\.json: Expected span ids of at most 16 hex digits "
            r"\(0 to ffffffffffffffff\) in "
            rf"args\.span_id, but received {re.escape(repr(span_id))}\. Fix the ids, or remove "
            r"span_id and parent_id from every event so that parents are inferred from nesting\.$"
        ),
    ):
        read_chrome_trace(_trace_file(tmp_path, span_id=span_id))


def test_the_largest_span_id_and_non_hex_ids_are_still_read(tmp_path: Path) -> None:
    frame = read_chrome_trace(_trace_file(tmp_path, span_id="ffffffffffffffff"))
    assert frame["span_id"].tolist() == [2**64 - 1]
    frame = read_chrome_trace(_trace_file(tmp_path, span_id="not hex"))  # parents inferred
    assert frame["span_id"].tolist() == [1]


def test_an_origin_out_of_the_int64_range_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(
        TraceError,
        match=(
            r"^In .*odd\.json: Expected otherData\.origin_ns to be epoch nanoseconds "
            r"within the int64 range "
            r"\(\|origin_ns\| < 2\*\*63\), but received 100000000000000000000000\. Fix "
            r"origin_ns, or remove it to read the event times as they are\.$"
        ),
    ):
        read_chrome_trace(_trace_file(tmp_path, origin_ns=10**23))
    with pytest.raises(
        TraceError,
        match=(
            r"^In .*odd\.json: Expected span times "
            r"\(otherData\.origin_ns plus each event's ts and dur\) within "
            r"the int64 nanosecond range, but with origin_ns=9223372036854775000 they reach "
            r"beyond it\. Fix origin_ns or the events' ts and dur\.$"
        ),
    ):
        read_chrome_trace(_trace_file(tmp_path, origin_ns=2**63 - 808))
    with pytest.raises(
        TraceError,
        match=(
            r"^In .*odd\.json: Expected event 'ts' values in microseconds "
            r"within the int64 nanosecond range "
            r"\(\|ts\| < 9\.2e15\), but received 1e\+20\. Fix the 'ts' of the events that were "
            r"written wrong\.$"
        ),
    ):
        read_chrome_trace(_trace_file(tmp_path, ts=1e20))


def test_tuple_and_mixed_attribute_values_stay_as_they_are() -> None:
    """Equal-length tuples are values, not rows; a float among strings is no string."""
    for n in (3, 2_000):  # short columns, and long ones that take the encoded paths
        rows = [
            SpanRow("a", i + 1, 0, 7, i, i + 5, 1, {"t": (1, 2), "m": "a" if i else 1.5})
            for i in range(n)
        ]
        frame = spans_to_frame(rows)
        assert frame.loc[0, "t"] == (1, 2) and type(frame.loc[n - 1, "t"]) is tuple
        assert frame["m"].dtype == object
        assert frame.loc[0, "m"] == 1.5 and frame.loc[1, "m"] == "a"


def test_spans_recorded_after_the_fact_nest_by_time_in_self_and_depth(tmp_path: Path) -> None:
    """instrument() records a step after the fact, with the parent current when it began:
    its forward and backward are its siblings by id. In the frame of its trace (whose
    otherData says so) they are its children by time (a trial summed self_ns by name and
    counted the forward twice: the step's self time was its whole duration). Without
    that entry, a trace keeps the ids' nesting, whatever its ids (random OpenTelemetry
    ids are often above ppetrace's after-the-fact range)."""
    from exporters import ChromeTraceExporter
    from exporters._spans import BY_TIME, NESTING

    base = (3 << 61) + 100
    t0 = 1_700_000_000_000_000_000
    rows = [
        SpanRow("trainer.fetch_batch", base, 0, 1, t0, t0 + 100, 1, {}),
        SpanRow("trainer.step", base + 1, 0, 1, t0 + 100, t0 + 1_100, 1, {"ppetrace.step": 0}),
        SpanRow("module.forward", base + 2, 0, 1, t0 + 110, t0 + 500, 1, {}),
        SpanRow("module.forward", 7, 0, 1, t0 + 120, t0 + 300, 1, {}),  # a submodule's span
        SpanRow("trainer.backward", base + 3, 0, 1, t0 + 510, t0 + 900, 1, {}),
    ]

    def read(metadata: dict[str, Any] | None) -> pd.DataFrame:
        path = tmp_path / f"t{len(list(tmp_path.iterdir()))}.json"
        with ChromeTraceExporter(path, metadata=metadata) as exporter:
            exporter.export_batch(SpanBatch(rows))
        return read_chrome_trace(path).set_index("span_id")

    frame = read({NESTING: BY_TIME})
    assert frame.loc[base + 1, "self_ns"] == 1_000 - 390 - 390
    assert frame.loc[base + 2, "self_ns"] == 390 - 180 and frame.loc[7, "depth"] == 2
    assert list(frame.loc[[base, base + 1, base + 2, base + 3], "depth"]) == [0, 0, 1, 1]
    assert frame.loc[7, "step"] == 0  # inherited from the step it ran in
    by_id = read(None)
    assert (by_id["depth"] == 0).all() and (by_id["self_ns"] == by_id["dur_ns"]).all()
    assert (spans_to_frame(SpanBatch(rows))["depth"] == 0).all()  # no such entry in memory
