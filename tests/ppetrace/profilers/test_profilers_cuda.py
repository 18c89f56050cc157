"""CudaTimer on CPU, through a fake event source with controllable device times."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from profiler_harness import FakeTrainer

import ppetrace
from exporters.chrome import ChromeTraceExporter, load_chrome_trace
from ppetrace.profilers import CudaTimer, EventSource, Schedule
from ppetrace.profilers._base import DEVICE_TID
from ppetrace.tracing._recorder import RECORDER
from ppetrace.tracing._setup import FLUSHER


class FakeEvent:
    __slots__ = ("t", "done")

    def __init__(self, t: int, done: bool) -> None:
        self.t = t
        self.done = done


class FakeSource:
    """Events stamped with a device clock the test moves. ``reached`` says whether the
    device has reached new events at once (else ``catch_up()`` does it); ``calls`` lists
    every call, with a ``"synchronize"`` where ``elapsed_ns`` had to wait for its end."""

    def __init__(self) -> None:
        self.device_ns = 0
        self.recorded = 0
        self.waits = 0  # elapsed_ns calls
        self.reached = True
        self.events: list[FakeEvent] = []
        self.calls: list[str] = []

    def record(self) -> FakeEvent:
        self.recorded += 1
        self.calls.append("record")
        event = FakeEvent(self.device_ns, self.reached)
        self.events.append(event)
        return event

    def query(self, event: FakeEvent) -> bool:
        self.calls.append("query")
        return event.done

    def elapsed_ns(self, start: FakeEvent, end: FakeEvent) -> int:
        self.waits += 1
        if not end.done:
            self.calls.append("synchronize")
            for event in self.events[: self.events.index(end) + 1]:  # the stream runs in order
                event.done = True
        self.calls.append("elapsed_ns")
        return end.t - start.t

    def catch_up(self) -> None:
        """The device reaches every event recorded so far."""
        for event in self.events:
            event.done = True


_Trainer = functools.partial(FakeTrainer, device="cuda")


@pytest.fixture
def timer() -> Iterator[CudaTimer]:
    t = CudaTimer(source=FakeSource())
    yield t
    t.uninstall()


def _device_durs(exporter: InMemorySpanExporter) -> dict[str, list[int | None]]:
    out: dict[str, list[int | None]] = {}
    for s in exporter.get_finished_spans():
        attrs = s.attributes or {}
        out.setdefault(s.name, []).append(attrs.get("ppetrace.device_dur_ns"))  # type: ignore[arg-type]
    return out


def test_the_fake_is_an_event_source() -> None:
    assert isinstance(FakeSource(), EventSource)


def test_spans_get_their_device_time_at_flush_and_never_wait_in_a_hook(
    span_exporter: InMemorySpanExporter, timer: CudaTimer
) -> None:
    source = timer.source
    assert isinstance(source, FakeSource)
    timer.setup(_Trainer())
    shared = {"ppetrace.step": 0}  # the Trainer shares one dict between several spans
    timer.step_begin(0)
    with timer.span("trainer.step", {"ppetrace.step": 0}):
        source.device_ns += 10
        with timer.span("module.train_step", shared):
            source.device_ns += 300
        with timer.span("trainer.backward", shared):
            source.device_ns += 500
        with timer.span("runtime.train_post_step", shared):  # not a timed span
            source.device_ns += 7
    timer.step_end(0)
    assert source.waits == 0  # nothing was resolved inside a hook
    assert source.recorded == 6
    ppetrace.flush()
    durs = _device_durs(span_exporter)
    assert durs["trainer.step"] == [817]
    assert durs["module.train_step"] == [300]
    assert durs["trainer.backward"] == [500]
    assert durs["runtime.train_post_step"] == [None]
    assert "ppetrace.device_dur_ns" not in shared  # the shared dict was copied, not written
    assert timer.resolved == 3


def test_wrap_times_a_block_inside_a_span_the_trainer_opened(
    span_exporter: InMemorySpanExporter, timer: CudaTimer
) -> None:
    source = timer.source
    assert isinstance(source, FakeSource)
    timer.setup(_Trainer())
    attrs: dict[str, Any] = {"ppetrace.step": 4}
    with ppetrace.trace("evaluator.step", attrs):
        wrap = timer.wrap("evaluator.step", attrs)
        assert wrap is not None
        with wrap:
            source.device_ns += 42
    assert timer.wrap("runtime.convert_batch", {}) is None  # not timed
    assert timer.wrap("trainer.step", None) is None  # no dict to write the result into
    ppetrace.flush()
    assert _device_durs(span_exporter)["evaluator.step"] == [42]


def test_a_span_open_at_a_flush_is_resolved_at_a_later_flush(
    span_exporter: InMemorySpanExporter, timer: CudaTimer
) -> None:
    source = timer.source
    assert isinstance(source, FakeSource)
    timer.setup(_Trainer())
    with timer.span("trainer.step", {}):
        with timer.span("trainer.backward", {}):
            source.device_ns += 5
        ppetrace.flush()  # e.g. a full buffer: the child is done, its parent still open
        assert _device_durs(span_exporter) == {"trainer.backward": [5]}
        source.device_ns += 20
    ppetrace.flush()
    assert _device_durs(span_exporter)["trainer.step"] == [25]


class ListSink:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def add_events(self, events: Any) -> None:
        self.events.extend(events)


def test_a_pair_the_device_has_not_reached_is_resolved_at_a_later_flush_without_a_wait(
    span_exporter: InMemorySpanExporter, timer: CudaTimer
) -> None:
    source = timer.source
    assert isinstance(source, FakeSource)
    sink = ListSink()
    timer.setup(_Trainer(sink))
    source.reached = False  # the device runs behind the host

    def step(i: int, device_ns: int) -> None:
        timer.step_begin(i)
        with timer.span("trainer.step", {"ppetrace.batch_idx": i}):
            source.device_ns += device_ns
        timer.step_end(i)

    step(0, 40)
    with ppetrace.trace("runtime.train_post_step"):
        FLUSHER.drain(background=True)  # the flusher's scheduled drain, during a hook
    assert "synchronize" not in source.calls and source.waits == 0
    assert timer.resolved == 0 and timer.pending == 1  # carried over
    source.catch_up()
    step(1, 60)
    FLUSHER.drain(background=True)  # again: step 0 has completed, step 1 has not
    assert "synchronize" not in source.calls
    assert timer.resolved == 1 and timer.pending == 1
    step(2, 80)  # still buffered at the end of the run
    before = len(source.calls)
    timer.teardown()  # the end of the run, outside every hook: waits for steps 1 and 2
    assert "synchronize" not in source.calls[:before] and "synchronize" in source.calls
    assert timer.resolved == 3 and timer.pending == 0
    device = [(e["name"], e["dur_ns"]) for e in sink.events if e.get("ph") == "X"]
    assert device == [("trainer.step", 40), ("trainer.step", 60), ("trainer.step", 80)]
    durs = {
        (s.attributes or {})["ppetrace.batch_idx"]: (s.attributes or {}).get(
            "ppetrace.device_dur_ns"
        )
        for s in span_exporter.get_finished_spans()
        if s.name == "trainer.step"
    }
    # steps 0 and 1 left with a flush before the device got there: they have their
    # device-track event only; step 2 was still buffered and gets the attribute too
    assert durs == {0: None, 1: None, 2: 80}


def test_an_explicit_flush_outside_hooks_waits_so_every_span_gets_its_device_time(
    span_exporter: InMemorySpanExporter, timer: CudaTimer
) -> None:
    source = timer.source
    assert isinstance(source, FakeSource)
    timer.setup(_Trainer(ListSink()))
    source.reached = False  # the device runs behind the host
    timer.step_begin(0)
    with timer.span("trainer.step", {"ppetrace.batch_idx": 0}):
        source.device_ns += 70
    timer.step_end(0)
    ppetrace.flush()  # the Trainer's end-of-epoch flush
    assert "synchronize" in source.calls
    assert _device_durs(span_exporter) == {"trainer.step": [70]}
    timer.teardown()


def test_teardown_waits_outside_the_flush_and_flushes_the_attributes(
    span_exporter: InMemorySpanExporter,
) -> None:
    source = FakeSource()
    source.reached = False
    timer = CudaTimer(source=source)
    timer.setup(_Trainer())
    flush_calls: list[list[str]] = []

    def spy() -> None:  # the calls made while the recorder flushes
        flush_calls.append(list(source.calls))

    with timer.span("trainer.backward", {}):
        source.device_ns += 9
    RECORDER.before_flush.insert(0, spy)
    RECORDER.before_flush.append(spy)
    try:
        timer.teardown()
    finally:
        RECORDER.before_flush.remove(spy)
        RECORDER.before_flush.remove(spy)
    before, after = flush_calls
    assert "synchronize" in before  # the wait happened before the flush began
    assert before == after  # and the flush's own resolve called nothing
    assert _device_durs(span_exporter) == {"trainer.backward": [9]}


def test_the_device_track_nests_and_follows_the_device_clock(
    tmp_path: Path, timer: CudaTimer
) -> None:
    exporter = ChromeTraceExporter(tmp_path / "trace.json")
    ppetrace.configure(exporters=[exporter])
    try:
        source = timer.source
        assert isinstance(source, FakeSource)
        timer.setup(_Trainer(exporter))
        source.device_ns = 1_000_000_000  # the device clock has its own origin
        for step in range(2):
            timer.step_begin(step)
            with timer.span("trainer.step", {"ppetrace.batch_idx": step}):
                source.device_ns += 1_000
                with timer.span("trainer.backward", {}):
                    # the device runs far behind: 10 ms of queued work
                    source.device_ns += 10_000_000
                source.device_ns += 1_000
            timer.step_end(step)
        timer.teardown()
        ppetrace.shutdown()
        trace = load_chrome_trace(exporter.path)
    finally:
        ppetrace.configure()

    def ns(ts: float) -> int:
        return round(ts * 1000) + trace.origin_ns

    host = {
        (e["name"], e["attrs"].get("ppetrace.batch_idx")): (ns(e["ts"]), e["attrs"])
        for e in trace.events
        if e.get("ph") == "X" and "span_id" in e
    }
    device = [e for e in trace.events if e.get("tid") == DEVICE_TID and e.get("ph") == "X"]
    names = [
        e["args"]["name"]
        for e in trace.events
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e["tid"] == DEVICE_TID
    ]
    assert names == ["cuda device time"]
    assert [(e["name"], e["dur"]) for e in device] == [
        ("trainer.step", 10_002.0),
        ("trainer.backward", 10_000.0),
        ("trainer.step", 10_002.0),
        ("trainer.backward", 10_000.0),
    ]
    step0, back0, step1, back1 = (ns(e["ts"]) for e in device)
    # the first step starts at its host start; its child 1 µs of device time later
    assert step0 == host[("trainer.step", 0)][0]
    assert back0 == step0 + 1_000
    # the second step cannot start on the device before the first one ended there
    assert step1 == step0 + 10_002_000 > host[("trainer.step", 1)][0]
    assert back1 == step1 + 1_000
    # the host spans carry the attribute (the frame's device_dur_ns)
    assert host[("trainer.step", 1)][1]["ppetrace.device_dur_ns"] == 10_002_000


def test_with_a_schedule_only_recorded_steps_are_timed(
    span_exporter: InMemorySpanExporter,
) -> None:
    source = FakeSource()
    timer = CudaTimer(source=source, schedule=Schedule(warmup=1, active=1))
    timer.setup(_Trainer())
    try:
        for step in range(3):
            timer.step_begin(step)
            with timer.span("trainer.step", {"ppetrace.batch_idx": step}):
                source.device_ns += 100 + step
            timer.step_end(step)
        with timer.span("evaluator.step", {}):  # outside a recorded step
            source.device_ns += 1
        timer.teardown()
    finally:
        timer.uninstall()
    ppetrace.flush()
    by_step = {
        attrs["ppetrace.batch_idx"]: attrs.get("ppetrace.device_dur_ns")
        for s in span_exporter.get_finished_spans()
        if s.name == "trainer.step"
        for attrs in [s.attributes or {}]
    }
    assert by_step == {0: None, 1: 101, 2: None}
    assert source.recorded == 2


def test_on_a_cpu_run_without_a_source_nothing_is_timed(
    span_exporter: InMemorySpanExporter,
) -> None:
    timer = CudaTimer()
    timer.setup(_Trainer(device="cpu"))
    try:
        assert timer.source is None and not timer.active
        span = timer.span("trainer.step", {"a": 1})
        assert type(span) is ppetrace.trace  # the plain span, no wrapper
        with span:
            pass
        assert timer.wrap("trainer.step", {}) is None
    finally:
        timer.teardown()
    assert timer.resolve not in RECORDER.before_flush
    ppetrace.flush()
    assert _device_durs(span_exporter) == {"trainer.step": [None]}


def test_teardown_resolves_the_rest_and_unhooks(span_exporter: InMemorySpanExporter) -> None:
    source = FakeSource()
    timer = CudaTimer(source=source)
    timer.setup(_Trainer())
    assert timer.resolve in RECORDER.before_flush
    with timer.span("trainer.optimizer_step", {}):
        source.device_ns += 3
    timer.teardown()
    assert timer.resolve not in RECORDER.before_flush
    assert _device_durs(span_exporter)["trainer.optimizer_step"] == [3]


def test_a_failing_source_never_breaks_the_block(
    span_exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(FakeSource):
        def record(self) -> FakeEvent:
            raise RuntimeError("device lost")

    timer = CudaTimer(source=Broken())
    timer.setup(_Trainer())
    try:
        with pytest.raises(KeyError, match="user error"), timer.span("trainer.step", {}):
            raise KeyError("user error")  # the block's own exception propagates unchanged
    finally:
        timer.teardown()
    assert timer.errors == 1
    assert "recording a device event for trainer.step failed" in caplog.text
    ppetrace.flush()
    spans = span_exporter.get_finished_spans()
    assert [s.name for s in spans] == ["trainer.step"]


def test_invalid_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"Expected an iterable of event names for spans"):
        CudaTimer(spans="trainer.step")
    with pytest.raises(
        TypeError,
        match=(
            r"^Expected an EventSource \(record\(\), query\(event\) and elapsed_ns\(start, end\)\) "
            r"for source, but received object\. Add the missing methods\.$"
        ),
    ):
        CudaTimer(source=object())  # type: ignore[arg-type]

    class NoQuery:  # the protocol before query() existed
        def record(self) -> FakeEvent:
            return FakeEvent(0, True)

        def elapsed_ns(self, start: FakeEvent, end: FakeEvent) -> int:
            return 0

    with pytest.raises(TypeError, match=r"but received NoQuery\. Add the missing methods\.$"):
        CudaTimer(source=NoQuery())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Expected a ppetrace.profilers.Schedule or None"):
        CudaTimer(schedule=3)  # type: ignore[arg-type]
