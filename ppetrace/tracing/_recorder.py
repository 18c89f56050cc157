"""The span recorder: the hot path of :func:`ppetrace.trace` and its buffers.

Entering and leaving a traced block creates no OpenTelemetry span. It reads
``perf_counter_ns`` twice, makes the block's span id current in the
OpenTelemetry context (a non-recording span whose context is built only if
someone asks for it) and appends one :class:`exporters.SpanRow` to a bounded
per-thread buffer. The flusher (:mod:`._flusher`) takes the rows with
:meth:`Recorder.take` and hands them to the sinks (:mod:`._sinks`).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation import _SPAN_KEY

from exporters._spans import FrozenAttributes, SpanRow

from . import _light
from ._attributes import _EMPTY, _error_text, _snapshot


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


def random_bits(n: int) -> int:
    """``n`` random bits from the OS, for ids: not from the ``random`` module, whose state
    is the script's (a seed would repeat the ids of every run, and drawing them would
    change the script's own random numbers); fresh in a forked child too."""
    return int.from_bytes(os.urandom((n + 7) // 8), "big") >> (-n % 8)


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
    """Finished-span records of one thread, taken by :meth:`Recorder.take`."""

    __slots__ = ("records", "thread", "tid", "name", "retired")

    def __init__(self) -> None:
        t = threading.current_thread()
        self.retired = False  # Recorder.retire: forgotten once drained
        self.records: list[SpanRow] = []
        self.thread = weakref.ref(t)
        self.tid = threading.get_native_id()
        self.name = t.name


class Recorder:
    """Process-wide span recorder with per-thread bounded buffers.

    A thread whose buffer fills hands the full list to a queue for the
    flusher (:meth:`on_full`) and goes on with an empty one; past
    ``max_queued_buffers`` full buffers waiting, the spans of a full buffer
    are dropped and counted (``buffer_full``). :meth:`take` empties every
    buffer and the queue; the flusher (:mod:`._flusher`) calls it.
    """

    def __init__(self) -> None:
        self.enabled = True
        self.capacity = 65_536
        self.max_queued_buffers = 16
        self.trace_id = random_bits(128) or 1
        # span ids: a random 64-bit start, then a counter (next() is atomic)
        first_id = random_bits(62) + 1
        self._ids = iter(range(first_id, 1 << 64))
        # span clock (perf_counter_ns) -> epoch ns
        self.offset_ns = time.time_ns() - _perf_ns()
        if _speedups is not None:
            _speedups.set_state(True, self.capacity, self.trace_id, first_id, self.offset_ns)
        self._buffers: list[_ThreadBuffer] = []
        self._full: list[list[SpanRow]] = []  # full buffers waiting for the flusher
        self._buffers_lock = threading.Lock()
        self.pid = os.getpid()
        self.on_first_use: Callable[[], None] | None = None
        # wakes the flusher thread (set by ppetrace.tracing._flusher)
        self.wake: Callable[[], None] | None = None
        self.flush_impl: Callable[[bool], None] | None = None  # set by ._setup
        # called (on the draining thread, one drain at a time) before each drain takes
        # the buffers, e.g. to resolve CUDA events into span attributes off the hot path
        self.before_flush: list[Callable[[], None]] = []
        # True while a scheduled (background) drain runs the before-flush hooks: a
        # hook must not wait for a device then
        self.inline_flush = False
        self.dropped = 0  # spans of full buffers beyond max_queued_buffers (buffer_full)
        self.taken = 0  # spans handed on by take() (and injected from other processes)
        self.hook_errors = 0
        # attribute dicts handed to hooks by span_attributes(): copied when taken, so a
        # hook that writes one later never races a sink reading it
        self.hooked: dict[int, dict[Any, Any]] = {}

    def flush(self, *, wait: bool = True) -> None:
        """Take every finished span to the sinks now; with ``wait``, return when each sink
        has delivered them (see :func:`ppetrace.flush`); without, on the flusher thread."""
        impl = self.flush_impl
        if impl is not None:
            impl(wait)

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

    def retire(self, buf: _ThreadBuffer) -> None:
        """``buf`` (made by :meth:`_new_buffer_object` for a recorder of its own, such as
        ``instrument()``'s) gets no more rows: the next drain takes what it holds and then
        forgets it, as it does the buffer of a thread that ended."""
        buf.retired = True

    def _new_buffer(self) -> list[SpanRow]:
        """Register a buffer for the calling thread and return its record list (C path)."""
        return self._new_buffer_object().records

    def on_full(self, records: list[SpanRow]) -> None:
        """A thread's buffer is full: queue its spans for the flusher and empty it (the
        thread keeps appending to the same list); past the cap, drop and count them.
        Never waits for a flush."""
        with self._buffers_lock:
            n = len(records)
            if n:
                if len(self._full) < self.max_queued_buffers:
                    self._full.append(records[:])
                else:
                    self.dropped += n
                del records[:]
        wake = self.wake
        if wake is not None:
            wake()

    def discard_buffered(self) -> int:
        """Drop every buffered span without exporting it; returns how many (benchmarks)."""
        n = 0
        with self._buffers_lock:
            for buf in self._buffers:
                n += len(buf.records)
                del buf.records[:]
            for full in self._full:
                n += len(full)
            self._full = []
            self.taken += n
        self.hooked.clear()
        return n

    def buffered(self) -> int:
        """Spans in thread buffers and in full buffers waiting for the flusher."""
        with self._buffers_lock:
            return sum(len(b.records) for b in self._buffers) + sum(map(len, self._full))

    def counts(self) -> tuple[int, int, int]:
        """(taken, dropped, buffered), read together."""
        with self._buffers_lock:
            buffered = sum(len(b.records) for b in self._buffers) + sum(map(len, self._full))
            return self.taken, self.dropped, buffered

    def baseline(self) -> tuple[int, int]:
        """(taken, dropped) now: where a sink attached now starts counting."""
        with self._buffers_lock:
            return self.taken, self.dropped

    def count_taken(self, n: int) -> None:
        """Count ``n`` spans recorded in another process as taken here."""
        with self._buffers_lock:
            self.taken += n

    def take(self) -> tuple[list[SpanRow], dict[int, str]]:
        """Every finished span (queued full buffers first, then each thread's buffer),
        and the names of their threads. One caller at a time (the flusher's lock)."""
        with self._buffers_lock:
            buffers = list(self._buffers)
            rows: list[SpanRow] = []
            for full in self._full:
                rows.extend(full)
            self._full = []
            self.taken += len(rows)
        names: dict[int, str] = {}
        dead = []
        for buf in buffers:
            names[buf.tid] = buf.name
            live = buf.records
            if live:
                # Take the records out in place: the owning thread keeps appending to
                # the same list object. The lock keeps on_full from emptying it between
                # the copy and the delete.
                with self._buffers_lock:
                    n = len(live)
                    rows.extend(live[:n])
                    del live[:n]
                    self.taken += n
            t = buf.thread()
            if buf.retired or t is None or not t.is_alive():
                dead.append(buf)
        if dead:
            with self._buffers_lock:
                for buf in dead:
                    if not buf.records and buf in self._buffers:
                        self._buffers.remove(buf)
        hooked = self.hooked
        if hooked:
            for i, row in enumerate(rows):
                attrs = row.attributes
                if hooked.get(id(attrs)) is attrs:
                    del hooked[id(attrs)]
                    rows[i] = row._replace(attributes=dict(attrs))
        return rows, names

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's buffered spans (its counts go on)."""
        global _tls
        _tls = threading.local()
        if _speedups is not None:
            _speedups.forget_thread_buffer()
        self._buffers = []
        self._full = []
        self._buffers_lock = threading.Lock()
        self.before_flush = []
        self.pid = os.getpid()
        self.hooked = {}  # the counts go on from the parent's
        # fresh span ids, so that spans of parent and child never share one
        first_id = random_bits(62) + 1
        self._ids = iter(range(first_id, 1 << 64))
        if _speedups is not None:
            _speedups.set_state(
                self.enabled, self.capacity, self.trace_id, first_id, self.offset_ns
            )


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
    ``span.again(arg)`` returns the span itself with ``arg`` as its new arg,
    ready to be entered again, or a new span of the same name and ``arg``
    while this one is open: a loop can keep one object per event instead of
    making one per block (ppetrace's Trainer does, for the spans of each
    step). The object then stands for its latest block only: its ids are
    those of the block entered last. ``span.mark(arg)`` records an empty
    block's span at once, as ``with span.again(arg): pass`` would, for a hook
    that has nothing to run (the span is not made current: nothing runs in it).
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

        def again(self, arg: Any = None) -> _SpanAPI: ...

        def mark(self, arg: Any = None) -> None: ...

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
        "_lmode",
        "_lslot",
    )
    _token: Any
    _attrs: Mapping[Any, Any]
    _lmode: int  # light steps (._light): 1 an open light span, 2 a full span in a fold
    _lslot: int

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
        self._lmode = 0

    def again(self, arg: Any = None) -> PySpan:
        """This span with ``arg`` as its arg, to enter again; a new span of the same name
        and ``arg`` while this one is open (the C twin: ``SpanBase.again``). The C twin
        also keeps the context its last block made, and sets it again when the next block
        is entered in the same context, instead of copying it again: the contexts seen
        inside are the same, and such a span is freed by the cycle collector."""
        if self._token is not None:
            return type(self)(self.name, arg)
        self.arg = arg
        return self

    def mark(self, arg: Any = None) -> None:
        """Record an empty block's span now, as ``with self.again(arg): pass`` does (the
        C twin, ``SpanBase.mark``, does not make it the current span: nothing runs in it)."""
        with self.again(arg):
            pass

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
        light = getattr(_tls, "light", None)
        if light is not None and light.enter(self):
            return self
        self._begin(rec, True)
        if light is not None:
            light.enter_full(self)
        return self

    def _begin(self, rec: Recorder, current: bool) -> None:
        """The attribute snapshot, the parent, the ids, the context (when ``current``: the
        block becomes the current span), then the clock."""
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
        if current:
            # The new context is the parent's plus this span. It is a plain dict
            # (what Context.copy() returns): the OpenTelemetry API only reads it.
            new = ctx.copy()
            new[_SPAN_KEY] = self
            self._token = _set_ctx(new)
        self.start_ns = _perf_ns()

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
        light = getattr(_tls, "light", None)
        if token is _light.LIGHT:
            if not _light.exit_light(light, self, end, exc):  # raised, or its fold is gone
                start = self.start_ns
                self._begin(RECORDER, False)
                self.start_ns = start
                self._record(end, exc)
            return
        if self._lmode == 2:  # entered in full inside a fold (gone, perhaps)
            self._lmode = 0
            if light is not None:
                _light.exit_full(light, self, end)
        if light is not None and light.owner is self:
            _tls.light = None
            light.finish(self.start_ns + RECORDER.offset_ns)
            _tls.light_spare = light  # the thread's next fold starts from its names
        self._token = None
        try:  # noqa: SIM105 - contextlib.suppress costs more on this hot path
            _reset_ctx(token)
        except (ValueError, RuntimeError):
            # Left in another context than it was entered in (a generator
            # resumed elsewhere), or the token was used already; the span is
            # still recorded, and the block's own exception goes on unchanged.
            pass
        self._record(end, exc)

    def _record(self, end: int, exc: BaseException | None) -> None:
        """The finished span's row, appended to this thread's buffer."""
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
    they write there before the span is flushed reaches the exporters (the row takes a
    copy when the flusher takes it, so later writes reach nothing). None
    for anything else: not a ppetrace span, not entered while tracing was
    enabled, or attributes that are not a private dict (a
    :class:`FrozenAttributes` shared between spans, the shared empty mapping).
    """
    attrs = getattr(span, "_attrs", None) if isinstance(span, _SpanAPI) else None
    if type(attrs) is not dict:
        return None
    RECORDER.hooked[id(attrs)] = attrs  # copied when the span is taken (Recorder.take)
    return attrs


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
