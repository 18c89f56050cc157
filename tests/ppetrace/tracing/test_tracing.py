"""ppetrace.trace, configure, flush and stats, checked through the OTel SDK."""

from __future__ import annotations

import contextvars
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import ppetrace
from exporters._spans import SpanBatch
from ppetrace.tracing._recorder import RECORDER, span_attributes
from ppetrace.tracing._setup import FLUSHER


def by_name(spans: tuple[ReadableSpan, ...] | list[ReadableSpan]) -> dict[str, ReadableSpan]:
    out = {s.name: s for s in spans}
    assert len(out) == len(spans), "span names in these tests are unique"
    return out


def test_nested_spans_have_parents_times_attributes_and_resource(
    span_exporter: InMemorySpanExporter,
) -> None:
    # the spans' own clock: perf_counter_ns anchored once to the epoch
    before = time.perf_counter_ns() + RECORDER.offset_ns
    with ppetrace.trace("outer", {"ppetrace.epoch": 3, "label": "a"}):
        with ppetrace.trace("inner", 7):
            pass
        with ppetrace.trace("sibling"):
            pass
    after = time.perf_counter_ns() + RECORDER.offset_ns
    assert span_exporter.get_finished_spans() == ()  # nothing leaves before a flush
    ppetrace.flush()
    spans = by_name(span_exporter.get_finished_spans())
    outer, inner, sibling = spans["outer"], spans["inner"], spans["sibling"]

    assert outer.parent is None
    assert inner.parent is not None and inner.parent.span_id == outer.context.span_id
    assert sibling.parent is not None and sibling.parent.span_id == outer.context.span_id
    assert len({s.context.trace_id for s in spans.values()}) == 1
    assert len({s.context.span_id for s in spans.values()}) == 3

    assert outer.start_time is not None and outer.end_time is not None
    assert before <= outer.start_time <= inner.start_time  # type: ignore[operator]
    assert inner.end_time <= sibling.start_time  # type: ignore[operator]
    assert sibling.end_time <= outer.end_time <= after  # type: ignore[operator]

    assert outer.attributes is not None and inner.attributes is not None
    assert outer.attributes["ppetrace.epoch"] == 3
    assert outer.attributes["label"] == "a"
    assert inner.attributes["ppetrace.arg"] == 7
    assert outer.attributes["thread.name"] == threading.current_thread().name
    assert outer.resource.attributes["service.name"] == "ppetrace-tests"
    assert outer.status.status_code == StatusCode.UNSET


def test_arg_objects_are_reduced_to_safe_attributes(span_exporter: InMemorySpanExporter) -> None:
    class Heavy:
        pass

    with ppetrace.trace("obj", Heavy()):
        pass
    with ppetrace.trace("seq", [1, 2]):
        pass
    with ppetrace.trace("mixed", {"shape": (2, 3), "obj": Heavy(), "none": None}):
        pass
    ppetrace.flush()
    spans = by_name(span_exporter.get_finished_spans())
    assert spans["obj"].attributes == {
        "ppetrace.arg": "test_arg_objects_are_reduced_to_safe_attributes.<locals>.Heavy",
        "thread.id": threading.get_native_id(),
        "thread.name": threading.current_thread().name,
    }
    assert spans["seq"].attributes["ppetrace.arg"] == (1, 2)  # type: ignore[index]
    mixed = spans["mixed"].attributes
    assert mixed is not None
    assert mixed["shape"] == (2, 3)
    # an object inside a mapping is reduced to its type name when the span starts
    assert mixed["obj"] == "test_arg_objects_are_reduced_to_safe_attributes.<locals>.Heavy"
    assert "none" not in mixed


def test_exception_sets_error_status_records_event_and_propagates(
    span_exporter: InMemorySpanExporter,
) -> None:
    error = KeyError("missing")
    with pytest.raises(KeyError) as info, ppetrace.trace("outer"), ppetrace.trace("failing"):
        raise error
    assert info.value is error  # re-raised unchanged
    ppetrace.flush()
    spans = by_name(span_exporter.get_finished_spans())
    for name in ("failing", "outer"):
        span = spans[name]
        assert span.status.status_code == StatusCode.ERROR
        (event,) = span.events
        assert event.name == "exception"
        assert event.attributes is not None
        assert event.attributes["exception.type"] == "KeyError"
        assert event.attributes["exception.message"] == "'missing'"
        assert "raise error" in str(event.attributes["exception.stacktrace"])
    assert otel_trace.get_current_span() is otel_trace.INVALID_SPAN


def test_decorator_records_one_span_per_call(span_exporter: InMemorySpanExporter) -> None:
    @ppetrace.trace("work", {"kind": "decorated"})
    def work(x: int) -> int:
        return x * 2

    assert work(2) == 4
    assert work(5) == 10
    assert work.__name__ == "work"
    ppetrace.flush()
    spans = span_exporter.get_finished_spans()
    assert [s.name for s in spans] == ["work", "work"]
    assert spans[0].context.span_id != spans[1].context.span_id


def test_current_otel_span_is_the_block_and_user_spans_are_children(
    span_exporter: InMemorySpanExporter,
) -> None:
    user_tracer = TracerProvider().get_tracer("user")
    with ppetrace.trace("hook") as block:
        current = otel_trace.get_current_span()
        inside_id = current.get_span_context().span_id
        assert current.get_span_context().is_valid
        with (
            user_tracer.start_as_current_span("user.span") as user_span,
            ppetrace.trace("under.user"),
        ):
            pass
    assert inside_id == block.span_id
    ppetrace.flush()
    spans = by_name(span_exporter.get_finished_spans())
    assert spans["hook"].context.span_id == inside_id
    assert user_span.parent is not None
    assert user_span.parent.span_id == inside_id
    assert user_span.context.trace_id == spans["hook"].context.trace_id
    under = spans["under.user"]
    assert under.parent is not None
    assert under.parent.span_id == user_span.context.span_id


def test_a_span_under_a_user_otel_span_keeps_that_parent_in_the_chrome_frame(
    span_exporter: InMemorySpanExporter, tmp_path: Any
) -> None:
    from exporters import ChromeTraceExporter, read_chrome_trace

    user_tracer = TracerProvider().get_tracer("user")  # its spans go elsewhere
    chrome = ChromeTraceExporter(tmp_path / "t.json")
    ppetrace.tracing.add_exporter(chrome)
    try:
        with (
            user_tracer.start_as_current_span("user.span") as user_span,
            ppetrace.trace("under.user"),
            ppetrace.trace("inner"),
        ):
            pass
    finally:
        ppetrace.tracing.remove_exporter(chrome)
    frame = read_chrome_trace(tmp_path / "t.json").set_index("name")
    context = user_span.get_span_context()
    assert frame.loc["under.user", "parent_id"] == context.span_id  # kept, for joining
    assert frame.loc["under.user", "trace_id"] == f"{context.trace_id:032x}"
    assert frame.loc["under.user", "depth"] == 0  # its parent is not in the file
    assert frame.loc["inner", "depth"] == 1


def test_each_thread_nests_its_own_spans_and_bound_workers_get_the_parent(
    span_exporter: InMemorySpanExporter,
) -> None:
    barrier = threading.Barrier(2)

    def worker(tag: str) -> None:
        with ppetrace.trace(f"worker.{tag}"):
            barrier.wait(timeout=10)
            with ppetrace.trace(f"worker.{tag}.child"):
                pass

    with ppetrace.trace("main"):
        bound = threading.Thread(target=ppetrace.bind_context(worker), args=("bound",))
        copied = threading.Thread(target=contextvars.copy_context().run, args=(worker, "copied"))
        bound.start()
        copied.start()
        bound.join()
        copied.join()
        plain = threading.Thread(target=worker, args=("plain",))
        plain2 = threading.Thread(target=lambda: barrier.wait(timeout=10))
        plain.start()
        plain2.start()
        plain.join()
        plain2.join()
    ppetrace.flush()
    spans = by_name(span_exporter.get_finished_spans())
    main_id = spans["main"].context.span_id
    for tag in ("bound", "copied"):
        parent = spans[f"worker.{tag}"].parent
        assert parent is not None and parent.span_id == main_id
    assert spans["worker.plain"].parent is None  # no context passed: a root
    for tag in ("bound", "copied", "plain"):
        child = spans[f"worker.{tag}.child"]
        assert child.parent is not None
        assert child.parent.span_id == spans[f"worker.{tag}"].context.span_id
        assert child.attributes is not None and spans["main"].attributes is not None
        assert child.attributes["thread.id"] != spans["main"].attributes["thread.id"]


def test_a_full_buffer_is_swapped_and_queued_and_only_past_the_cap_dropped() -> None:
    sink = _Sink()
    ppetrace.configure(exporters=[sink], buffer_spans=4, max_queued_buffers=2)
    try:
        start = ppetrace.stats()
        # While the flusher cannot drain (its lock is held), full buffers queue up to
        # the cap; the thread gets an empty buffer each time and never waits.
        with FLUSHER._lock:
            for i in range(14):
                with ppetrace.trace(f"s{i}"):
                    pass
            mid = ppetrace.stats()
        ppetrace.flush()
        end = ppetrace.stats()
        # s0..s3 and s4..s7 queued, s8..s11 past the cap (dropped), s12 s13 buffered
        assert mid.buffered - start.buffered == 10
        assert end.dropped - start.dropped == 4
        names = [r.name for b in sink.batches for r in b.rows]
        assert names == [f"s{i}" for i in (*range(8), 12, 13)]
        (s,) = end.sinks
        assert s.dropped["buffer_full"] == 4 and s.delivered == 10 and s.buffered == 0
        assert s.recorded == s.delivered + s.dropped_total + s.buffered == 14
        assert end.recorded == end.exported + end.dropped + end.buffered
    finally:
        ppetrace.configure()


def test_disabled_trace_records_nothing(span_exporter: InMemorySpanExporter) -> None:
    provider_stats = ppetrace.stats()
    ppetrace.configure(enabled=False)
    with ppetrace.trace("invisible"):
        assert otel_trace.get_current_span() is otel_trace.INVALID_SPAN
    ppetrace.flush()
    assert ppetrace.stats().recorded == provider_stats.recorded
    assert span_exporter.get_finished_spans() == ()


class _Sink:
    def __init__(self) -> None:
        self.batches: list[SpanBatch] = []
        self.shut = False

    def export_batch(self, batch: SpanBatch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        self.shut = True


class _Broken:
    def export_batch(self, batch: SpanBatch) -> None:
        raise OSError("disk full")

    def shutdown(self) -> None:
        pass


def test_fast_exporters_get_rows_and_a_failing_exporter_never_breaks_the_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = _Sink()
    ppetrace.configure(exporters=[_Broken(), sink], service_name="fast", rank=3)
    try:
        errors_before = ppetrace.stats().export_errors
        with ppetrace.trace("a", {"k": 1}), ppetrace.trace("b"):
            pass
        ppetrace.flush()
        assert ppetrace.stats().export_errors == errors_before + 1
        assert "disk full" in caplog.text
        (batch,) = sink.batches
        assert batch.resource["service.name"] == "fast"
        assert batch.resource["ppetrace.rank"] == 3
        a, b = sorted(batch.rows, key=lambda r: r.name)
        assert (a.name, b.name) == ("a", "b")
        assert b.parent_id == a.span_id and a.parent_id == 0
        assert a.attributes == {"k": 1}
        assert a.start_ns <= b.start_ns <= b.end_ns <= a.end_ns
        assert batch.thread_names[a.tid] == threading.current_thread().name
    finally:
        ppetrace.shutdown()
        ppetrace.configure()
    assert sink.shut


def test_add_and_remove_exporter_scope_what_an_exporter_sees() -> None:
    ppetrace.configure()
    sink = _Sink()
    with ppetrace.trace("before"):
        pass
    ppetrace.tracing.add_exporter(sink)
    with ppetrace.trace("during"):
        pass
    ppetrace.tracing.remove_exporter(sink)
    with ppetrace.trace("after"):
        pass
    ppetrace.flush()
    assert [r.name for b in sink.batches for r in b.rows] == ["during"]
    assert sink.shut


def test_global_sdk_provider_is_used_and_otel_service_name_is_honoured(tmp_path: Any) -> None:
    script = textwrap.dedent(
        """
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        import ppetrace
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        with ppetrace.trace("x"):
            pass
        ppetrace.flush()
        (span,) = exporter.get_finished_spans()
        print(span.name, span.resource.attributes["service.name"])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**_env(), "OTEL_SERVICE_NAME": "from-env"},
        check=True,
    )
    assert out.stdout.split() == ["x", "from-env"]


def test_spans_are_flushed_at_exit_and_import_starts_no_thread() -> None:
    script = textwrap.dedent(
        """
        import multiprocessing, threading, sys
        import ppetrace
        assert threading.active_count() == 1, threading.enumerate()
        assert "torch" not in sys.modules
        assert multiprocessing.get_start_method(allow_none=True) is None
        class Sink:
            def export_batch(self, batch):
                for row in batch.rows:
                    print("exported", row.name, flush=True)
            def shutdown(self):
                print("shutdown", flush=True)
        ppetrace.configure(exporters=[Sink()])
        with ppetrace.trace("last.words"):
            pass
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=_env(), check=True
    )
    assert out.stdout.splitlines() == ["exported last.words", "shutdown"]


def test_configure_rejects_bad_arguments() -> None:
    with pytest.raises(
        ValueError,
        match="Expected a positive int of at most 16,777,216 for buffer_spans, but received 0",
    ):
        ppetrace.configure(buffer_spans=0)
    with pytest.raises(TypeError, match=r"Expected an opentelemetry\.sdk\.trace\.TracerProvider"):
        ppetrace.configure(tracer_provider=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Expected an exporter with export_batch"):
        ppetrace.configure(exporters=[object()])
    ppetrace.configure()


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


def test_before_flush_hooks_can_complete_attributes_off_the_hot_path(
    span_exporter: InMemorySpanExporter,
) -> None:
    pending: list[dict[str, Any]] = []

    def resolve() -> None:
        for attrs in pending:
            attrs["ppetrace.device_dur_ns"] = 1234
        pending.clear()

    RECORDER.before_flush.append(resolve)
    try:
        attrs: dict[str, Any] = {"ppetrace.step": 1}
        with ppetrace.trace("trainer.step", attrs) as open_span:
            own = span_attributes(open_span)  # the span's snapshot, not the caller's dict
            assert own is not None and own is not attrs
            pending.append(own)
        ppetrace.flush()
    finally:
        RECORDER.before_flush.remove(resolve)
    (span,) = span_exporter.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["ppetrace.device_dur_ns"] == 1234
    assert "ppetrace.device_dur_ns" not in attrs


def test_values_inside_a_mapping_arg_are_not_kept_alive() -> None:
    import gc
    import weakref

    class Tensorish:
        pass

    ppetrace.configure()
    obj = Tensorish()
    ref = weakref.ref(obj)
    with ppetrace.trace("holds", {"loss": obj, "step": 1}):
        pass
    del obj
    gc.collect()
    assert ref() is None  # the buffered span keeps no reference to it
    ppetrace.flush()


def test_event_name_must_be_a_string() -> None:
    with pytest.raises(TypeError, match=r"Expected a str for event_name, but received int\."):
        ppetrace.trace(123)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="received function"):

        @ppetrace.trace  # type: ignore[arg-type]
        def oops() -> None:
            pass


def test_an_instance_cannot_be_entered_twice_and_reuse_does_not_keep_the_error(
    span_exporter: InMemorySpanExporter,
) -> None:
    span = ppetrace.trace("reused")
    with span, pytest.raises(RuntimeError, match="already entered"), span:
        pass
    assert otel_trace.get_current_span() is otel_trace.INVALID_SPAN
    with pytest.raises(KeyError), span:
        raise KeyError("x")
    with span:
        pass
    ppetrace.flush()
    statuses = [s.status.status_code for s in span_exporter.get_finished_spans()]
    assert statuses == [StatusCode.UNSET, StatusCode.ERROR, StatusCode.UNSET]


def test_an_unprintable_exception_propagates_unchanged(
    span_exporter: InMemorySpanExporter,
) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no str for you")

    error = Unprintable()
    with pytest.raises(Unprintable) as info, ppetrace.trace("odd"):
        raise error
    assert info.value is error
    ppetrace.flush()
    (span,) = span_exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert span.status.description == (
        "test_an_unprintable_exception_propagates_unchanged.<locals>.Unprintable: <unprintable>"
    )


def test_a_subclass_that_skips_init_gets_an_error_not_a_crash() -> None:
    class Careless(ppetrace.trace):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            pass

    with pytest.raises((TypeError, AttributeError)), Careless():
        pass


def test_processors_added_after_configure_receive_spans() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    ppetrace.configure(tracer_provider=provider)
    try:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        with ppetrace.trace("late"):
            pass
        ppetrace.flush()
        assert [s.name for s in exporter.get_finished_spans()] == ["late"]
    finally:
        ppetrace.configure()


def test_reconfiguring_shuts_down_replaced_exporters_and_a_bad_call_changes_nothing() -> None:
    first, kept = _Sink(), _Sink()
    ppetrace.configure(exporters=[first, kept])
    with ppetrace.trace("a"):
        pass
    ppetrace.configure(exporters=[kept])
    assert first.shut and not kept.shut
    assert [r.name for b in first.batches for r in b.rows] == ["a"]
    with pytest.raises(TypeError, match="Expected an exporter"):
        ppetrace.configure(enabled=False, exporters=[object()])
    # the failed call changed nothing
    assert RECORDER.enabled and [s.target for s in FLUSHER.sinks] == [kept]
    ppetrace.shutdown()
    assert kept.shut
    ppetrace.configure()


class _FailingFlush(_Sink):
    def force_flush(self) -> None:
        raise OSError("disk gone")


def test_flush_never_raises_an_exporter_failure(caplog: pytest.LogCaptureFixture) -> None:
    sink = _FailingFlush()
    ppetrace.configure(exporters=[sink])
    try:
        before = ppetrace.stats().export_errors
        with ppetrace.trace("x"):
            pass
        ppetrace.flush()
        assert ppetrace.stats().export_errors == before + 1
        assert "disk gone" in caplog.text
    finally:
        ppetrace.configure()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_draws_fresh_span_ids() -> None:
    script = textwrap.dedent(
        """
        import os, sys
        import ppetrace
        with ppetrace.trace("parent") as parent:
            pass
        with ppetrace.trace("parent.next") as parent_next:
            pass
        pid = os.fork()
        if pid == 0:
            with ppetrace.trace("child") as child:
                pass
            sys.stdout.write(f"{child.span_id - parent.span_id}\\n")
            sys.stdout.flush()
            os._exit(0)
        os.waitpid(pid, 0)
        sys.stdout.write(f"{parent_next.span_id - parent.span_id}\\n")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=_env(), check=True
    )
    child_gap, parent_gap = (int(x) for x in out.stdout.split())
    assert parent_gap == 1  # ids count up within a process
    assert child_gap not in (1, 2)  # the child does not continue the parent's sequence


def test_rows_carry_the_thread_id_of_their_thread_also_in_a_forked_child() -> None:
    # The C hot path reads each thread's native id once: a thread must not get another
    # thread's id, nor a forked child its parent's.
    script = textwrap.dedent(
        """
        import os, sys, threading
        import ppetrace

        class Sink:
            def __init__(self):
                self.rows = []
            def export_batch(self, batch):
                self.rows += batch.rows
            def shutdown(self):
                pass

        def spans(tag):
            for _ in range(2):
                with ppetrace.trace(tag):
                    pass
            return threading.get_native_id()

        sink = Sink()
        ppetrace.configure(exporters=[sink])
        ids = {"main": spans("main")}
        worker = threading.Thread(target=lambda: ids.update(worker=spans("worker")))
        worker.start()
        worker.join()
        pid = os.fork()
        if pid == 0:  # a forked child exports nothing until it configures its own sinks
            sink = Sink()
            ppetrace.configure(exporters=[sink])
            ids = {"child": spans("child")}
        else:
            os.waitpid(pid, 0)
            ids["after"] = spans("after")
        ppetrace.flush()
        got = sorted({(r.name, r.tid == ids[r.name]) for r in sink.rows})
        sys.stdout.write(f"{'child' if pid == 0 else 'parent'} {got}\\n")
        sys.stdout.flush()
        if pid == 0:
            os._exit(0)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=_env(), check=True
    )
    lines = sorted(out.stdout.splitlines())
    assert lines == [
        "child [('child', True)]",
        "parent [('after', True), ('main', True), ('worker', True)]",
    ]


def test_a_retired_buffer_is_drained_once_more_and_then_forgotten() -> None:
    from ppetrace.integrations._record import RowBuffer
    from ppetrace.tracing._recorder import RECORDER

    sink = _Sink()
    ppetrace.configure(exporters=[sink])
    rows = RowBuffer()
    rows.record("retired.span", 1_000, 2_000, (RECORDER.trace_id, 0), {})
    rows.close()
    assert rows._buf in RECORDER._buffers  # kept until a drain has taken its rows
    ppetrace.flush()
    assert rows._buf not in RECORDER._buffers
    names = [r.name for b in sink.batches for r in b.rows]
    assert names.count("retired.span") == 1  # taken, not lost
    ppetrace.shutdown()


def test_ids_come_from_the_os_not_the_scripts_random_module() -> None:
    """A seeded script neither repeats ppetrace's ids nor sees them drawn."""
    import random

    from ppetrace.tracing._recorder import random_bits

    random.seed(0)
    state = random.getstate()
    first = random_bits(63)
    assert random.getstate() == state
    random.seed(0)
    assert random_bits(63) != first
    assert all(0 <= random_bits(n) < 1 << n for n in (1, 59, 62, 63, 128) for _ in range(50))
