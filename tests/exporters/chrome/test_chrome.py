"""ChromeTraceExporter: the file format, streaming, crash safety, gzip and both input paths."""

from __future__ import annotations

import gzip
import json
import logging
import warnings
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.trace import Status, StatusCode

import exporters
import ppetrace
from exporters import (
    ChromeTraceExporter,
    SpanBatch,
    SpanRow,
    TraceTruncatedWarning,
    load_chrome_trace,
    owner_of,
    read_chrome_trace,
    rows_from_readable_spans,
)

RunBuilder = Any  # the builder from conftest.py's run_builder fixture


def _doc(path: Path) -> dict[str, Any]:
    """The file parsed with every float kept as its exact decimal text."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:  # type: ignore[operator]
        return json.load(f, parse_float=Decimal)


def _x_events(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def _write(path: Path, *batches: SpanBatch) -> ChromeTraceExporter:
    exporter = ChromeTraceExporter(path)
    for batch in batches:
        exporter.export_batch(batch)
    exporter.shutdown()
    return exporter


def test_owner_is_the_name_prefix_when_it_is_a_known_owner() -> None:
    assert owner_of("trainer.step") == "trainer"
    assert owner_of("runtime.convert_batch") == "runtime"
    assert owner_of("module.train_step") == "module"
    assert owner_of("network.closure") == "network"
    assert owner_of("callback.on_end_backward") == "callback"
    assert owner_of("evaluator.step") == "evaluator"
    assert owner_of("trainerx.step") == "user"
    assert owner_of("trainer") == "user"
    assert owner_of("my_block") == "user"


def test_events_carry_exact_times_owner_args_and_metadata(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder(tid=7, pid=31337, rank=3)
    root = rb.span("trainer.run", 0, 10_000_001)
    step = rb.span("trainer.step", 1_001, 2_999_999, root, {"ppetrace.step": 5, "lr": 0.25})
    rb.span("my.block", 2_000, 2_001, step, {"flag": True, "shape": (2, 3), "none": "x"})
    rb.span(
        "module.train_step",
        3_000,
        3_500,
        step,
        status="ERROR",
        error="ValueError: bad\nTraceback ...",
    )
    path = tmp_path / "trace.json"
    _write(path, rb.batch())
    doc = _doc(path)

    assert doc["displayTimeUnit"] == "ns"
    other = doc["otherData"]
    assert other["service_name"] == "tests"
    assert other["trace_id"] == f"{rb.TRACE_ID:032x}"
    assert other["ppetrace_version"] == "0.0-test"
    assert other["rank"] == 3 and other["pid"] == 31337
    assert other["start_time_ns"] == rb.T0
    origin = other["origin_ns"]
    assert origin == (rb.T0 // 10**9) * 10**9  # a whole second at or before the first span
    assert other["clock_offset_ns"] == 0

    events = {e["name"]: e for e in _x_events(doc)}
    run, st, blk, mod = (
        events[n] for n in ("trainer.run", "trainer.step", "my.block", "module.train_step")
    )
    rel = rb.T0 - origin  # 123456789 ns
    assert run["ts"] == Decimal(rel) / 1000 and str(run["ts"]) == "123456.789"
    assert str(run["dur"]) == "10000.001"
    assert str(st["ts"]) == "123457.790" and str(st["dur"]) == "2998.998"
    assert str(blk["dur"]) == "0.001"
    assert {e["cat"] for e in (run, st)} == {"trainer"}
    assert blk["cat"] == "user" and mod["cat"] == "module"
    assert all(e["pid"] == 31337 and e["tid"] == 7 for e in events.values())

    # ids, status and attributes sit beside ts, outside args: speedscope keys frames by
    # name plus args, so that equal names aggregate; args holds only an error
    assert st["span_id"] == f"{step:016x}"
    assert st["parent_id"] == f"{root:016x}"
    assert run["parent_id"] == "0" * 16
    assert st["attrs"]["ppetrace.step"] == 5 and st["attrs"]["lr"] == Decimal("0.25")
    assert blk["attrs"]["flag"] is True and blk["attrs"]["shape"] == [2, 3]
    assert st["status"] == "UNSET" and "args" not in st
    assert mod["status"] == "ERROR"
    assert mod["args"] == {"error": "ValueError: bad\nTraceback ..."}
    assert list(st)[:12] == [
        *("ph", "cat", "name", "pid", "tid", "ts", "dur"),
        *("span_id", "parent_id", "status", "attrs"),
    ]

    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    names = {(e["name"], e["tid"]): e["args"] for e in meta}
    assert names[("process_name", 0)]["name"] == "tests rank 3"  # viewers add the pid
    assert names[("process_sort_index", 0)]["sort_index"] == 3
    assert names[("thread_name", 7)]["name"] == "MainThread"


def test_strings_are_escaped_so_any_name_or_value_round_trips(
    tmp_path: Path, run_builder: Callable[..., RunBuilder], string_storage: str
) -> None:
    nasty = 'q"uote \\ back\nnew\ttab \x00\x1f ctl é 漢字 🙂 \ud800'
    rb = run_builder()
    rb.span(nasty, 0, 10, 0, {nasty: nasty, "span_id": "user's own", "k": "plain"})
    rb.span("none", 20, 30, 0, {})
    path = tmp_path / "t.json"
    _write(path, rb.batch())
    raw = path.read_bytes()
    assert raw.isascii()  # non-ASCII is escaped, so any viewer decodes it
    event, bare = _x_events(_doc(path))
    assert event["name"] == nasty
    assert event["attrs"][nasty] == nasty
    assert event["attrs"]["span_id"] == "user's own"  # its own object: no clash
    assert "attrs" not in bare and "args" not in bare  # nothing to write
    frame = read_chrome_trace(path)
    assert frame.loc[0, "name"] == nasty and frame.loc[0, nasty] == nasty
    assert frame.loc[0, "span_id"] == rb.rows[0].span_id  # not the user's attribute
    assert frame.loc[0, "attr.span_id"] == "user's own"
    assert frame.loc[0, "k"] == "plain" and pd.isna(frame.loc[1, "k"])


def test_non_finite_floats_are_written_as_tagged_objects(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder()
    rb.span("a", 0, 10, 0, {"x": float("nan"), "y": float("inf"), "z": -float("inf")})
    path = tmp_path / "t.json"
    _write(path, rb.batch())
    (event,) = _x_events(json.loads(path.read_text()))  # strict JSON: no NaN tokens
    assert event["attrs"]["x"] == {"ppetrace.float": "NaN"}
    assert event["attrs"]["y"] == {"ppetrace.float": "Infinity"}
    assert event["attrs"]["z"] == {"ppetrace.float": "-Infinity"}


def test_mixed_attribute_types_under_one_key_keep_their_types(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder()
    values = [1, True, 1.0, "1", 0, False, (1, True)]
    for i, v in enumerate(values):
        rb.span("s", i * 10, i * 10 + 5, 0, {"v": v})
    path = tmp_path / "t.json"
    _write(path, rb.batch())
    got = [e["attrs"]["v"] for e in _x_events(json.loads(path.read_text()))]
    assert got == [1, True, 1.0, "1", 0, False, [1, True]]
    assert [type(g) for g in got] == [int, bool, float, str, int, bool, list]


def test_parents_come_before_children_that_start_at_the_same_time(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder()
    parent = rb.span("parent", 100, 900, 0, span_id=1)
    rb.span("child", 100, 400, parent, span_id=2)
    rb.span("grandchild", 100, 200, 2, span_id=3)
    # the recorder hands over children first (they end first)
    batch = rb.batch(list(reversed(rb.rows)))
    path = tmp_path / "t.json"
    _write(path, batch)
    assert [e["name"] for e in _x_events(_doc(path))] == ["parent", "child", "grandchild"]


def test_x_events_nest_per_thread(tmp_path: Path, run_builder: Callable[..., RunBuilder]) -> None:
    rb = run_builder()
    rb.training([3_000, 4_000, 5_000, 6_000])
    rb.span("worker.load", 200, 90_000, 0, tid=99)  # another thread overlaps freely
    path = tmp_path / "t.json"
    _write(path, rb.batch())
    events = _x_events(json.loads(path.read_text()))
    by_thread: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        by_thread.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    assert set(by_thread) == {rb.tid, 99}
    for intervals in by_thread.values():
        stack: list[float] = []
        for start, end in sorted(intervals, key=lambda iv: (iv[0], -iv[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], "overlapping siblings on one thread"
            stack.append(end)


def test_streams_each_batch_to_disk_before_shutdown(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder()
    rb.training([1_000] * 6)
    rows = sorted(rb.rows, key=lambda r: r.start_ns)
    path = tmp_path / "t.json"
    exporter = ChromeTraceExporter(path)
    exporter.export_batch(rb.batch(rows[:5]))
    with pytest.warns(TraceTruncatedWarning, match="cut off"):
        first = read_chrome_trace(path)  # still open: no closing bracket yet
    assert list(first["span_id"]) == [r.span_id for r in rows[:5]]
    exporter.export_batch(rb.batch(rows[5:]))
    with pytest.warns(TraceTruncatedWarning):
        second = read_chrome_trace(path)
    assert len(second) == len(rows)
    exporter.shutdown()
    exporter.shutdown()  # idempotent
    final = read_chrome_trace(path)  # no warning once closed
    assert final.attrs["truncated"] is False
    assert len(final) == len(rows)


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_a_file_cut_anywhere_reads_back_its_complete_events(
    tmp_path: Path, run_builder: Callable[..., RunBuilder], suffix: str
) -> None:
    rb = run_builder()
    rb.training([1_000 + i for i in range(8)])
    rows = sorted(rb.rows, key=lambda r: r.start_ns)
    path = tmp_path / f"t{suffix}"
    exporter = ChromeTraceExporter(path)
    for i in range(0, len(rows), 4):  # several flushed batches
        exporter.export_batch(rb.batch(rows[i : i + 4]))
    exporter.shutdown()
    data = path.read_bytes()
    full = read_chrome_trace(path)
    header_end = 400 if suffix == ".json" else 60
    counts = []
    for cut in range(header_end, len(data), max(1, len(data) // 60)):
        broken = tmp_path / f"cut{suffix}"
        broken.write_bytes(data[:cut])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                part = read_chrome_trace(broken)
            except exporters.TraceError as exc:
                assert cut < 700, "only a file cut inside its header is unreadable"
                assert "cut off" in str(exc) or "not valid JSON" in str(exc) or "empty" in str(exc)
                continue
        assert [w.category for w in caught] == [TraceTruncatedWarning]
        n = len(part)
        # what was read is exactly the first n spans, unchanged
        core = ["name", "span_id", "parent_id", "start_ns", "end_ns", "tid", "status"]
        assert part[core].to_dict("records") == full[core].iloc[:n].to_dict("records")
        counts.append(n)
    assert counts == sorted(counts)  # a longer prefix never reads fewer spans
    assert counts[-1] >= len(rows) - 4  # at most the last batch is lost
    assert counts[0] < counts[-1]


def test_gzip_output_is_gzip_and_reads_back_like_plain_json(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder()
    rb.training([2_000, 3_000, 4_000])
    plain, packed = tmp_path / "t.json", tmp_path / "t.json.gz"
    _write(plain, rb.batch())
    _write(packed, rb.batch())
    assert packed.read_bytes()[:2] == b"\x1f\x8b"
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    assert read_chrome_trace(packed).equals(read_chrome_trace(plain))


def test_times_keep_nanoseconds_over_long_runs_and_before_the_origin(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder()
    ten_days = 10 * 86_400 * 10**9
    late = rb.span("late", ten_days + 7, ten_days + 7 + 123_456_789_123, 0)
    path = tmp_path / "t.json"
    exporter = ChromeTraceExporter(path)
    exporter.export_batch(rb.batch())
    origin = exporter.origin_ns
    # a span that started before the origin arrives later (it was still open)
    early = SpanRow("early", 77, 0, rb.TRACE_ID, origin - 1, origin + 5, rb.tid, {})
    exporter.export_batch(SpanBatch([early], {}, rb.pid, {}))
    exporter.shutdown()
    ts = {e["name"]: str(e["ts"]) for e in _x_events(_doc(path))}
    assert ts["early"] == "-0.001"
    frame = read_chrome_trace(path).set_index("name")
    assert frame.loc["late", "start_ns"] == rb.T0 + ten_days + 7
    assert frame.loc["late", "dur_ns"] == 123_456_789_123
    assert frame.loc["early", "start_ns"] == origin - 1
    assert frame.loc["early", "span_id"] == 77 and late != 77


def test_otel_path_and_fast_path_write_identical_files(tmp_path: Path) -> None:
    resource = Resource.create({"service.name": "otel-app", "process.pid": 555})
    provider = TracerProvider(resource=resource)
    via_otel = ChromeTraceExporter(tmp_path / "otel.json")
    provider.add_span_processor(SimpleSpanProcessor(via_otel))
    tracer = provider.get_tracer("t")
    t0 = 1_600_000_000_000_000_000
    with tracer.start_as_current_span("trainer.step", start_time=t0, end_on_exit=False) as outer:
        outer.set_attribute("ppetrace.step", 4)
        outer.set_attribute("thread.id", 21)
        outer.set_attribute("thread.name", "worker")
        inner = tracer.start_span("user.work", start_time=t0 + 1_500)
        inner.set_attribute("thread.id", 21)
        inner.set_status(Status(StatusCode.ERROR, "boom"))
        inner.end(end_time=t0 + 2_750)
        outer.end(end_time=t0 + 9_999)
    provider.shutdown()  # shuts the exporter down too
    assert via_otel.export([]) is SpanExportResult.FAILURE  # after shutdown

    # the same spans through rows_from_readable_spans and export_batch
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider2 = TracerProvider(resource=resource)
    provider2.add_span_processor(SimpleSpanProcessor(memory))
    tracer2 = provider2.get_tracer("t")
    with tracer2.start_as_current_span("trainer.step", start_time=t0, end_on_exit=False) as o2:
        o2.set_attribute("ppetrace.step", 4)
        o2.set_attribute("thread.id", 21)
        o2.set_attribute("thread.name", "worker")
        i2 = tracer2.start_span("user.work", start_time=t0 + 1_500)
        i2.set_attribute("thread.id", 21)
        i2.set_status(Status(StatusCode.ERROR, "boom"))
        i2.end(end_time=t0 + 2_750)
        o2.end(end_time=t0 + 9_999)
    spans = memory.get_finished_spans()
    ids = {s.name: (s.context.span_id, s.parent.span_id if s.parent else 0) for s in spans}
    fast = ChromeTraceExporter(tmp_path / "fast.json")
    for span in spans:  # one span per call, as SimpleSpanProcessor does
        for batch in rows_from_readable_spans([span]):
            fast.export_batch(batch)
    fast.shutdown()

    a, b = _doc(tmp_path / "otel.json"), _doc(tmp_path / "fast.json")
    strip = ("trace_id", "resource")
    for doc in (a, b):
        for key in strip:
            doc["otherData"].pop(key)
        for e in _x_events(doc):
            e.pop("span_id")
            e.pop("parent_id")
    assert a == b
    frame = read_chrome_trace(tmp_path / "fast.json").set_index("name")
    assert frame.loc["user.work", "parent_id"] == ids["trainer.step"][0]
    assert frame.loc["user.work", "status"] == "ERROR"
    assert frame.loc["user.work", "error"] == "boom"
    assert frame.loc["user.work", "dur_ns"] == 1_250
    assert frame.loc["trainer.step", "tid"] == 21 and frame.loc["trainer.step", "pid"] == 555
    assert frame.loc["trainer.step", "step"] == 4
    names = [e["args"]["name"] for e in a["traceEvents"] if e["name"] == "thread_name"]
    assert names == ["thread 21", "worker"]  # the placeholder is renamed once known


@pytest.fixture
def reconfigure() -> Iterator[None]:
    yield
    ppetrace.shutdown()
    ppetrace.configure()


def test_ppetrace_trace_reaches_the_file_through_the_fast_path(
    tmp_path: Path, reconfigure: None
) -> None:
    path = tmp_path / "run.json"
    exporter = ChromeTraceExporter(path)
    ppetrace.configure(exporters=[exporter], service_name="fastpath", rank=2)
    with ppetrace.trace("trainer.epoch", {"ppetrace.epoch": 1}):
        for i in range(3):
            with (
                ppetrace.trace("trainer.step", {"ppetrace.step": i}),
                ppetrace.trace("trainer.backward"),
            ):
                pass
    with pytest.raises(KeyError), ppetrace.trace("user.fails"):
        raise KeyError("gone")
    ppetrace.shutdown()
    frame = read_chrome_trace(path)
    assert frame.attrs["truncated"] is False
    assert sorted(frame["name"]) == sorted(
        ["trainer.epoch", *["trainer.step"] * 3, *["trainer.backward"] * 3, "user.fails"]
    )
    epoch = frame.loc[frame["name"] == "trainer.epoch"].iloc[0]
    steps = frame.loc[frame["name"] == "trainer.step"]
    assert (steps["parent_id"] == epoch["span_id"]).all()
    assert list(steps["step"]) == [0, 1, 2]
    assert (frame.loc[frame["name"] != "user.fails", "epoch"] == 1).all()  # inherited
    backward = frame.loc[frame["name"] == "trainer.backward"]
    assert set(backward["parent_id"]) == set(steps["span_id"])
    assert list(backward["step"]) == [0, 1, 2]  # inherited from the parent step
    fails = frame.loc[frame["name"] == "user.fails"].iloc[0]
    assert fails["status"] == "ERROR" and fails["error"].startswith("KeyError: 'gone'")
    assert (frame["rank"] == 2).all()
    doc = json.loads(path.read_text())
    assert doc["otherData"]["service_name"] == "fastpath"
    assert doc["otherData"]["ppetrace_version"] == ppetrace.__version__
    assert exporter.events_written == len(doc["traceEvents"])


def test_write_errors_are_logged_and_counted_never_raised(
    tmp_path: Path, run_builder: Callable[..., RunBuilder], caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

        def flush(self) -> None:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            return None

    rb = run_builder()
    rb.span("a", 0, 10)
    exporter = ChromeTraceExporter(tmp_path / "t.json")
    exporter._file.file.close()  # type: ignore[union-attr]
    exporter._file.file = Broken()  # type: ignore[assignment,union-attr]
    with caplog.at_level(logging.ERROR, logger="exporters"):
        exporter.export_batch(rb.batch())  # no exception
        assert (exporter.errors, exporter.spans_lost) == (1, 1)
        assert "No space left" in (exporter.last_error or "")
        exporter.export_batch(rb.batch())  # not tried again: counted as lost, not logged
        assert (exporter.errors, exporter.spans_lost) == (1, 2)
        provider = TracerProvider()
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        mem = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(mem))
        provider.get_tracer("t").start_span("b").end()
        assert exporter.export(list(mem.get_finished_spans())) is SpanExportResult.FAILURE
        assert exporter.spans_lost == 3
        assert exporter.force_flush() is False
        exporter.shutdown()
    assert sum("writing" in r.getMessage() for r in caplog.records) == 1


def test_a_failed_write_on_the_writer_thread_counts_its_spans_and_cuts_the_file(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    class FailsLarge:
        """Takes small writes; a large one (the writer thread's) writes half and fails."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def write(self, data: bytes) -> int:
            if len(data) >= 1 << 20:
                self.inner.write(data[: len(data) // 2])
                raise OSError(28, "No space left on device")
            return self.inner.write(data)

        def flush(self) -> None:
            self.inner.flush()

        def close(self) -> None:
            self.inner.close()

    rb = run_builder()
    rb.span("a", 0, 10)
    big = run_builder()
    for i in range(5_000):  # over 1 MB of JSON: written on the writer thread
        big.span(f"b{i % 7}", i * 10, i * 10 + 5, 0, {"ppetrace.step": i, "k": "v" * 100})
    path = tmp_path / "t.json"
    exporter = ChromeTraceExporter(path)
    exporter._file.file = FailsLarge(exporter._file.file)  # type: ignore[union-attr]
    exporter.export_batch(rb.batch())
    exporter.export_batch(big.batch())  # fails on the thread: known at the next call
    assert exporter.force_flush() is False
    assert (exporter.errors, exporter.spans_lost) == (1, 5_000)
    exporter.shutdown()
    with pytest.warns(UserWarning, match="cut off"):
        frame = read_chrome_trace(path)  # half an event was cut away: the rest reads
    assert list(frame["name"]) == ["a"]


def test_add_events_streams_raw_events_with_exact_times(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder()
    rb.span("trainer.step", 0, 10_000)
    path = tmp_path / "t.json"
    exporter = ChromeTraceExporter(path)
    exporter.export_batch(rb.batch())
    origin = exporter.origin_ns
    exporter.add_events(
        [
            {
                "ph": "X",
                "name": "aten::mm",
                "tid": 5,
                "ts_ns": rb.T0 + 1_234,
                "dur_ns": 999,
                "args": {"shape": [2, 2]},
            },
            {"ph": "C", "name": "rss", "ts": 1.5, "args": {"bytes": 1024}},
            {"ph": "M", "name": "thread_name", "tid": 5, "args": {"name": "python (sampled)"}},
        ]
    )
    exporter.shutdown()
    doc = _doc(path)
    added = {e["name"]: e for e in doc["traceEvents"]}
    mm = added["aten::mm"]
    assert str(mm["ts"]) == str(Decimal(rb.T0 + 1_234 - origin) / 1000)
    assert str(mm["dur"]) == "0.999"
    assert "ts_ns" not in mm and "dur_ns" not in mm
    assert mm["pid"] == rb.pid  # defaults to the process of the spans
    assert added["rss"]["ts"] == Decimal("1.5") and added["rss"]["args"] == {"bytes": 1024}
    # events without span ids are not spans: the frame keeps only the span
    assert list(read_chrome_trace(path)["name"]) == ["trainer.step"]
    trace = load_chrome_trace(path)
    assert any(e.get("name") == "aten::mm" for e in trace.events)


def test_add_events_rejects_events_without_a_phase(tmp_path: Path) -> None:
    exporter = ChromeTraceExporter(tmp_path / "t.json")
    with pytest.raises(ValueError, match="Expected Chrome trace events as mappings with a 'ph'"):
        exporter.add_events([{"name": "x", "ts": 1}])
    exporter.shutdown()


def test_metadata_can_be_extended_until_the_header_is_written(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder()
    rb.span("a", 0, 10)
    path = tmp_path / "t.json"
    exporter = ChromeTraceExporter(path, clock_offset_ns=-250, metadata={"job": "nightly"})
    exporter.update_metadata(commit="abc123")
    exporter.export_batch(rb.batch())
    with pytest.raises(RuntimeError, match="Expected update_metadata before the first event"):
        exporter.update_metadata(late=True)
    meta = exporter.metadata
    exporter.shutdown()
    other = json.loads(path.read_text())["otherData"]
    assert other == meta
    assert other["job"] == "nightly" and other["commit"] == "abc123"
    assert other["clock_offset_ns"] == -250


def test_rejects_a_clock_offset_that_is_not_an_int(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="Expected an int number of nanoseconds for clock_"):
        ChromeTraceExporter(tmp_path / "t.json", clock_offset_ns=1.5)  # type: ignore[arg-type]


def test_an_exporter_without_spans_writes_a_valid_empty_trace(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / "t.json"
    with ChromeTraceExporter(path) as exporter:
        assert exporter.force_flush() is True
    doc = json.loads(path.read_text())
    assert doc["traceEvents"] == []
    assert doc["otherData"]["pid"] > 0
    assert len(read_chrome_trace(path)) == 0


def test_large_batches_written_on_the_writer_thread_arrive_in_order(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    path = tmp_path / "big.json"
    exporter = ChromeTraceExporter(path)
    for b in range(3):  # each batch is over 1 MB of JSON
        rb = run_builder()
        for i in range(5_000):
            t = (b * 5_000 + i) * 100
            rb.span(f"e{b}", t, t + 50, 0, {"ppetrace.step": b * 5_000 + i, "k": "v" * 100})
        exporter.export_batch(rb.batch())
        assert exporter._file is not None and exporter._file._thread is not None  # in flight
    exporter.add_events([{"ph": "i", "name": "mark", "ts_ns": rb.T0, "tid": 1}])
    assert exporter.force_flush() is True
    with pytest.warns(TraceTruncatedWarning):  # no closing ]} yet, but every event is there
        assert len(read_chrome_trace(path)) == 15_000
    exporter.shutdown()
    frame = read_chrome_trace(path)
    assert frame["step"].tolist() == list(range(15_000))
    assert [e["ph"] for e in _doc(path)["traceEvents"]][-1] == "i"
    assert exporter.errors == 0


def test_an_earlier_trace_at_the_path_is_replaced_and_links_are_written_through(
    tmp_path: Path,
) -> None:
    """A regular file at the path is removed, not truncated (on ext4 truncating a file just
    written waits for its pages to be written out); a symlink and a hard-linked file are
    written through, as open() does."""
    path = tmp_path / "t.json"
    path.write_text("an earlier trace" * 1_000)
    path.chmod(0o600)
    before = path.stat().st_ino
    keeper = path.open("rb")  # a reader of the earlier trace keeps reading it whole
    with ChromeTraceExporter(path):
        pass
    assert json.loads(path.read_text())["traceEvents"] == []
    assert path.stat().st_ino != before and keeper.read(16) == b"an earlier trace"
    assert path.stat().st_mode & 0o777 == 0o600  # its permissions kept
    keeper.close()
    gz = tmp_path / "t.json.gz"
    gz.write_bytes(b"an earlier trace")
    with ChromeTraceExporter(gz):
        pass
    assert json.loads(gzip.decompress(gz.read_bytes()))["traceEvents"] == []
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    with ChromeTraceExporter(link):
        pass
    assert link.is_symlink() and json.loads(target.read_text())["traceEvents"] == []
    other = tmp_path / "other-name.json"
    other.hardlink_to(target)
    with ChromeTraceExporter(target):
        pass
    assert other.stat().st_ino == target.stat().st_ino  # one file, written in place
    assert json.loads(other.read_text())["traceEvents"] == []
