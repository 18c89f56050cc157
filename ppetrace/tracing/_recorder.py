"""The span recorder: the hot path of :func:`ppetrace.trace` and its buffers.

Entering and leaving a traced block creates no OpenTelemetry span. It reads
``perf_counter_ns`` twice, makes the block's span id current in the
OpenTelemetry context (a non-recording span whose context is built only if
someone asks for it) and appends one tuple to a bounded per-thread buffer.
:meth:`Recorder.flush` turns those tuples into :class:`exporters.SpanBatch`
rows for ppetrace's own exporters and, only where a user's OpenTelemetry
processor is installed, into SDK ``ReadableSpan`` objects.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import random
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation import _SPAN_KEY

from exporters._spans import FrozenAttributes, SpanBatch, SpanRow

from ._attributes import _EMPTY, _snapshot


def _load_speedups() -> Any:
    """The C hot path, or None (not built, not Linux, or ``PPETRACE_PURE_PYTHON`` set)."""
    if os.environ.get("PPETRACE_PURE_PYTHON") or not sys.platform.startswith("linux"):
        # the C clock is CLOCK_MONOTONIC, which is perf_counter_ns on Linux only
        return None
    try:
        return importlib.import_module("ppetrace.tracing._speedups")
    except ImportError:
        return None


_speedups: Any = _load_speedups()

_log = logging.getLogger("ppetrace")

F = TypeVar("F", bound=Callable[..., Any])

# The OpenTelemetry runtime context is a ContextVar holding an immutable dict.
# Setting it directly skips three Python-level calls per span; any other runtime
# context implementation goes through the public attach/detach API.
_CTXVAR = getattr(getattr(otel_context, "_RUNTIME_CONTEXT", None), "_current_context", None)
_get_ctx: Callable[[], Context]
_set_ctx: Callable[[Any], Any]
_reset_ctx: Callable[[Any], Any]
if isinstance(_CTXVAR, ContextVar):
    _get_ctx, _set_ctx, _reset_ctx = _CTXVAR.get, _CTXVAR.set, _CTXVAR.reset
else:  # pragma: no cover - an exotic runtime context
    _get_ctx, _set_ctx, _reset_ctx = (
        otel_context.get_current,
        otel_context.attach,
        otel_context.detach,
    )

_perf_ns = time.perf_counter_ns
_native_id = threading.get_native_id
_tuple_new = tuple.__new__
_KEEP_SCALAR = frozenset({type(None), str, bool, int, float})
_SAMPLED = otel_trace.TraceFlags(otel_trace.TraceFlags.SAMPLED)
# The calling thread's record list; its _ThreadBuffer owns the same list.
_tls = threading.local()


class _ThreadBuffer:
    """Finished-span records of one thread, drained by :meth:`Recorder.flush`."""

    __slots__ = ("records", "thread", "tid", "name")

    def __init__(self) -> None:
        t = threading.current_thread()
        self.records: list[SpanRow] = []
        self.thread = weakref.ref(t)
        self.tid = threading.get_native_id()
        self.name = t.name


@dataclass(frozen=True)
class RecorderStats:
    """Counters of the recorder since the process started (or since the fork).

    ``dropped`` counts spans lost because a full buffer could not be flushed
    at once; ``export_errors`` counts exporter calls that raised.
    """

    recorded: int
    exported: int
    dropped: int
    buffered: int
    flushes: int
    export_errors: int


class Recorder:
    """Process-wide span recorder with per-thread bounded buffers."""

    def __init__(self) -> None:
        self.enabled = True
        self.capacity = 65_536
        self.trace_id = random.getrandbits(128) or 1
        # span ids: a random 64-bit start, then a counter (next() is atomic)
        first_id = random.getrandbits(62) + 1
        self._ids = iter(range(first_id, 1 << 64))
        # span clock (perf_counter_ns) -> epoch ns
        self.offset_ns = time.time_ns() - _perf_ns()
        if _speedups is not None:
            _speedups.set_state(True, self.capacity, self.trace_id, first_id, self.offset_ns)
        self._buffers: list[_ThreadBuffer] = []
        self._buffers_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self.pid = os.getpid()
        self.sinks: list[Any] = []  # objects with export_batch(SpanBatch)
        self.otel_sinks: list[Any] = []  # SpanExporter objects fed ReadableSpans
        self.processor: Any = None  # an SDK span processor, or None
        self.resource_attrs: dict[str, Any] = {}
        self._span_builder: Any = None
        self.on_first_use: Callable[[], None] | None = None
        # called (under the flush lock) before each flush drains the buffers,
        # e.g. to resolve CUDA events into span attributes off the hot path
        self.before_flush: list[Callable[[], None]] = []
        # True while a full buffer is flushed from inside a traced block: a
        # before-flush hook must not wait for a device then
        self.inline_flush = False
        self.dropped = 0
        self.recorded_flushed = 0
        self.exported = 0
        self.flushes = 0
        self.export_errors = 0

    def apply(self) -> None:
        """Push ``enabled``, ``capacity`` and ``trace_id`` to the C hot path, if built."""
        if _speedups is not None:
            _speedups.set_state(self.enabled, self.capacity, self.trace_id, 0, self.offset_ns)

    # -- buffers -------------------------------------------------------------

    def _new_buffer_object(self) -> _ThreadBuffer:
        """Register a buffer for the calling thread and return it."""
        hook = self.on_first_use
        if hook is not None:
            self.on_first_use = None
            hook()
        buf = _ThreadBuffer()
        with self._buffers_lock:
            self._buffers.append(buf)
        return buf

    def _new_buffer(self) -> list[SpanRow]:
        """Register a buffer for the calling thread and return its record list (C path)."""
        return self._new_buffer_object().records

    def on_full(self, records: list[SpanRow]) -> None:
        """A thread's buffer is full: flush now, or drop if a flush is running."""
        if self._flush_lock.acquire(blocking=False):
            self.inline_flush = True
            try:
                self._flush_locked()
            finally:
                self.inline_flush = False
                self._flush_lock.release()
        else:
            # the same lock as the drain, so a flusher never loses or double-counts
            with self._buffers_lock:
                self.dropped += len(records)
                del records[:]

    def discard_buffered(self) -> int:
        """Drop every buffered span without exporting it; returns how many (benchmarks)."""
        n = 0
        with self._buffers_lock:
            for buf in self._buffers:
                n += len(buf.records)
                del buf.records[:]
        return n

    def buffered(self) -> int:
        with self._buffers_lock:
            return sum(len(b.records) for b in self._buffers)

    # -- flushing ------------------------------------------------------------

    def flush(self) -> None:
        """Push every finished span to the sinks and the span processor."""
        with self._flush_lock:
            self._flush_locked()

    def _drain(self) -> Iterator[tuple[_ThreadBuffer, list[SpanRow]]]:
        with self._buffers_lock:
            buffers = list(self._buffers)
        dead = []
        for buf in buffers:
            live = buf.records
            if live:
                # Take the records out in place: the owning thread keeps appending
                # to the same list object. The lock keeps a thread that drops its
                # full buffer from clearing it between the copy and the delete.
                with self._buffers_lock:
                    n = len(live)
                    records = live[:n]
                    del live[:n]
                yield buf, records
            t = buf.thread()
            if t is None or not t.is_alive():
                dead.append(buf)
        if dead:
            with self._buffers_lock:
                for buf in dead:
                    if not buf.records and buf in self._buffers:
                        self._buffers.remove(buf)

    def _flush_locked(self) -> None:
        for hook in list(self.before_flush):
            try:
                hook()
            except Exception:
                self.export_errors += 1
                _log.exception("ppetrace: before-flush hook %r failed", hook)
        rows: list[SpanRow] = []
        thread_names: dict[int, str] = {}
        for buf, records in self._drain():
            thread_names[buf.tid] = buf.name
            rows.extend(records)
        if not rows:
            return
        self.flushes += 1
        self.recorded_flushed += len(rows)
        batch = SpanBatch(rows, self.resource_attrs, self.pid, thread_names)
        for sink in list(self.sinks):
            try:
                sink.export_batch(batch)
            except Exception:  # telemetry never breaks training
                self.export_errors += 1
                _log.exception("ppetrace: exporter %r failed; its spans are lost", sink)
        if self.processor is not None or self.otel_sinks:
            self._to_otel(batch)  # builds ReadableSpans only if someone receives them
        self.exported += len(rows)

    def _to_otel(self, batch: SpanBatch) -> None:
        builder = self._span_builder
        if builder is None:
            return
        processor = self.processor if _has_processors(self.processor) else None
        if processor is None and not self.otel_sinks:
            return
        spans = [builder(row, batch.thread_names) for row in batch.rows]
        if processor is not None:
            on_end = processor.on_end
            for span in spans:
                try:
                    on_end(span)
                except Exception:
                    self.export_errors += 1
                    _log.exception("ppetrace: span processor failed")
        for exporter in list(self.otel_sinks):
            try:
                exporter.export(spans)
            except Exception:
                self.export_errors += 1
                _log.exception("ppetrace: exporter %r failed; its spans are lost", exporter)

    def stats(self) -> RecorderStats:
        buffered = self.buffered()
        return RecorderStats(
            recorded=self.recorded_flushed + buffered,
            exported=self.exported,
            dropped=self.dropped,
            buffered=buffered,
            flushes=self.flushes,
            export_errors=self.export_errors,
        )

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's buffers and exporters."""
        global _tls
        _tls = threading.local()
        if _speedups is not None:
            _speedups.forget_thread_buffer()
        self._buffers = []
        self._buffers_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self.sinks = []
        self.otel_sinks = []
        self.processor = None
        self.before_flush = []
        self.pid = os.getpid()
        # fresh span ids, so that spans of parent and child never share one
        first_id = random.getrandbits(62) + 1
        self._ids = iter(range(first_id, 1 << 64))
        if _speedups is not None:
            _speedups.set_state(
                self.enabled, self.capacity, self.trace_id, first_id, self.offset_ns
            )


def _has_processors(processor: Any) -> bool:
    """Whether an SDK span processor has anything to feed (checked at each flush, so
    processors added to the provider after ``configure`` are served)."""
    if processor is None:
        return False
    inner = getattr(processor, "_span_processors", None)
    return inner is None or len(inner) > 0


def _error_text(exc: BaseException) -> str:
    """``"Type: message"`` and the traceback; never raises."""
    name = type(exc).__qualname__
    try:
        head = f"{name}: {exc}"
    except Exception:
        head = f"{name}: <unprintable>"
    try:
        stack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception:
        stack = ""
    return head + "\n" + stack


RECORDER = Recorder()


class _SpanAPI:
    """Record the enclosed block as an OpenTelemetry span named ``event_name``.

    This class is ``ppetrace.trace``. Use it as ``with ppetrace.trace("name",
    arg):`` or as a decorator ``@ppetrace.trace("name")``. ``arg`` becomes
    attributes: a mapping gives one attribute per key, any other value the
    attribute ``ppetrace.arg``. The attributes are a snapshot taken when the
    block is entered, as OpenTelemetry copies attributes when they are set: a
    dict changed afterwards does not change the span. ppetrace's own code may
    pass a :class:`FrozenAttributes`, which is shared instead of copied.
    Values that are not numbers, strings or tuples of them (tensors, modules),
    also inside a mapping, are reduced to their type name in the snapshot, so
    no reference to them is kept until the flush. ``event_name`` must be a
    ``str``. When the block raises, the span gets ERROR status and an
    ``exception`` event, and the exception propagates unchanged; a failure of
    the recording itself is logged, never raised.

    While the block runs, this object is the OpenTelemetry current span
    (``opentelemetry.trace.get_current_span()``): a non-recording span whose
    ``SpanContext`` is built only when someone asks for it, so spans that user
    code starts there with the OpenTelemetry API are its children. An instance
    can be entered again after its block ends, not while it is open (that
    raises ``RuntimeError``); the decorator makes a new one per call.
    While tracing is disabled (``configure(enabled=False)``), entering and
    leaving it does nothing.
    """

    __slots__ = ()
    name: str
    arg: Any
    span_id: int
    trace_id: int
    parent_id: int
    start_ns: int
    end_ns: int
    error: str | None

    if TYPE_CHECKING:  # implemented by PySpan in Python and by CSpan in C

        def __init__(self, event_name: str, arg: Any = None) -> None: ...

        def __enter__(self) -> _SpanAPI: ...

        def __exit__(
            self,
            exc_type: type[BaseException] | None,
            exc: BaseException | None,
            tb: TracebackType | None,
        ) -> None: ...

    # -- the OpenTelemetry side ------------------------------------------------

    def get_span_context(self) -> otel_trace.SpanContext:
        # built on request only: the hot path never pays for a SpanContext
        trace_id = getattr(self, "trace_id", None)
        if trace_id is None:  # never recorded (not entered, or entered while disabled)
            return otel_trace.INVALID_SPAN_CONTEXT
        return otel_trace.SpanContext(trace_id, self.span_id, is_remote=False, trace_flags=_SAMPLED)

    def __repr__(self) -> str:
        return f"ppetrace.Span({self.name!r})"

    def __call__(self, func: F) -> F:
        name, arg = self.name, self.arg

        @functools.wraps(func)
        def traced(*args: Any, **kwargs: Any) -> Any:
            with trace(name, arg):
                return func(*args, **kwargs)

        return traced  # type: ignore[return-value]


class PySpan(_SpanAPI, otel_trace.NonRecordingSpan):
    """The pure-Python hot path of :class:`Span` (the reference implementation).

    ``ppetrace.tracing._speedups`` does the same in C; :data:`Span` is whichever is in use.
    """

    __slots__ = (
        "name",
        "arg",
        "_attrs",
        "span_id",
        "trace_id",
        "parent_id",
        "start_ns",
        "end_ns",
        "error",
        "_token",
    )
    _token: Any
    _attrs: Mapping[Any, Any]

    def __init__(self, event_name: str, arg: Any = None) -> None:  # no super(): lazy context
        if type(event_name) is not str and not isinstance(event_name, str):
            raise TypeError(
                f"Expected a str for event_name, but received {type(event_name).__name__}. "
                'Pass the event name first, as in ppetrace.trace("data.load", arg) or '
                '@ppetrace.trace("data.load").'
            )
        self.name = event_name
        self.arg = arg
        self._token = None

    # -- the hot path ------------------------------------------------------------

    def __enter__(self) -> PySpan:
        if self._token is not None:
            raise RuntimeError(
                "Expected a ppetrace.trace instance that is not already entered, but this one "
                "is open. Create one per block: with ppetrace.trace(name): ..."
            )
        self.error = None
        rec = RECORDER
        if not rec.enabled:
            return self
        # the attributes as they are now (the C path does the same, see _speedups.c)
        arg = self.arg
        if type(arg) is dict:
            copy = arg.copy()
            for v in copy.values():
                if type(v) not in _KEEP_SCALAR:
                    self._attrs = _snapshot(copy)
                    break
            else:
                self._attrs = copy
        else:
            self._attrs = _snapshot(arg)
        ctx = _get_ctx()
        parent = ctx.get(_SPAN_KEY)
        if parent is None:
            self.trace_id = rec.trace_id
            self.parent_id = 0
        elif type(parent) is PySpan:
            try:
                self.trace_id = parent.trace_id
                self.parent_id = parent.span_id
            except AttributeError:  # never recorded, so it has no ids: a root, as in C
                self.trace_id = rec.trace_id
                self.parent_id = 0
        else:  # an OpenTelemetry span of someone else's, as the C path does
            ids = _foreign_parent(parent)
            self.trace_id, self.parent_id = (rec.trace_id, 0) if ids is None else ids
        self.span_id = next(rec._ids)
        # The new context is the parent's plus this span. It is a plain dict
        # (what Context.copy() returns): the OpenTelemetry API only reads it.
        new = ctx.copy()
        new[_SPAN_KEY] = self
        self._token = _set_ctx(new)
        self.start_ns = _perf_ns()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        token = self._token
        if token is None:  # tracing was disabled when the block started
            return
        end = _perf_ns()
        self._token = None
        try:  # noqa: SIM105 - contextlib.suppress costs more on this hot path
            _reset_ctx(token)
        except (ValueError, RuntimeError):
            # Left in another context than it was entered in (a generator
            # resumed elsewhere), or the token was used already; the span is
            # still recorded, and the block's own exception goes on unchanged.
            pass
        self.end_ns = end
        try:
            if exc is None:
                status, text = "UNSET", ""
            else:
                status = "ERROR"
                self.error = text = _error_text(exc)
            offset = RECORDER.offset_ns
            # the finished span becomes an exporters.SpanRow right here, before the
            # buffer is looked up: making it can run a finalizer, even a fork whose
            # child replaces this thread's buffer
            row = _tuple_new(
                SpanRow,
                (
                    self.name,
                    self.span_id,
                    self.parent_id,
                    self.trace_id,
                    self.start_ns + offset,
                    end + offset,
                    _native_id(),
                    self._attrs,
                    status,
                    text,
                ),
            )
            try:
                buf = _tls.buf
            except AttributeError:
                buf = _tls.buf = RECORDER._new_buffer_object()
            records = buf.records
            records.append(row)
            if len(records) >= RECORDER.capacity:
                RECORDER.on_full(records)
        except Exception:  # telemetry never breaks training, nor replaces its exception
            _log.exception("ppetrace: recording the span %r failed; it is lost", self.name)


def span_attributes(span: Any) -> dict[Any, Any] | None:
    """The attribute dict that the entered ppetrace span ``span`` records: its snapshot.

    For ppetrace's own hooks that complete attributes off the hot path (a
    ``RECORDER.before_flush`` hook writing ``ppetrace.device_dur_ns``): what
    they write there before the span is flushed reaches the exporters. None
    for anything else: not a ppetrace span, not entered while tracing was
    enabled, or attributes that are not a private dict (a
    :class:`FrozenAttributes` shared between spans, the shared empty mapping).
    """
    attrs = getattr(span, "_attrs", None) if isinstance(span, _SpanAPI) else None
    return attrs if type(attrs) is dict else None


def _foreign_parent(parent: Any) -> tuple[int, int] | None:
    """(trace id, span id) of a parent span that ppetrace did not create."""
    sc = parent.get_span_context()
    return (sc.trace_id, sc.span_id) if sc.is_valid else None


if _speedups is not None and _CTXVAR is not None:

    class CSpan(_SpanAPI, _speedups.SpanBase, otel_trace.NonRecordingSpan):  # type: ignore[misc]
        """:class:`Span` with its hot path (``__init__``, ``__enter__``, ``__exit__``) in C."""

        __slots__ = ()

    _speedups.install(
        _CTXVAR,
        _SPAN_KEY,
        "ppetrace.records",
        RECORDER._new_buffer,
        RECORDER.on_full,
        _foreign_parent,
        _snapshot,
        _error_text,
        SpanRow,
        FrozenAttributes,
        _EMPTY,
    )
    Span: type[_SpanAPI] = CSpan
else:
    _speedups = None
    Span = PySpan

trace = Span
"""``ppetrace.trace(event_name, arg=None)``: see :class:`_SpanAPI` (the C or the
pure-Python implementation, whichever is in use; ``IMPLEMENTATION`` says which)."""
IMPLEMENTATION = "c" if _speedups is not None else "python"


def _after_fork_in_child() -> None:
    RECORDER.reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
