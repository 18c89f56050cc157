"""Device time per span: :class:`CudaTimer`, with an injectable :class:`EventSource`.

The spans of hooks that launch device work record an event pair on the
device stream, one right after the span opens and one right before it
closes. Nothing waits for the device there. At each flush of the recorder
(``RECORDER.before_flush``) the pairs whose end event the device has
already reached (``EventSource.query``) are resolved. A scheduled flush
runs on the recorder's flusher thread while the training thread may be
inside a hook (``RECORDER.inline_flush`` is then true), so it never waits
for the device: pairs still in flight are carried over. An explicit flush (the Trainer's, at
the end of each epoch and of the run, outside every hook) waits for them,
and :meth:`CudaTimer.teardown` resolves whatever is left. The results are:

- the span attribute ``ppetrace.device_dur_ns`` (the frame's
  ``device_dur_ns`` column and the report's device columns);
- an ``X`` event per timed span on the "cuda device time" track of the
  Chrome trace.

A span whose pair is still in flight when a scheduled flush exports the
span itself goes out without ``ppetrace.device_dur_ns``; its device-track
event is written all the same once the pair resolves.

Where the device track puts an event: the device's clock has no fixed
relation to the host's, so the track is reconstructed. The first outermost
timed span of the run starts at its host start; every later outermost span
starts at ``max(its host start, previous outermost start + device time
between their start events)`` (the device cannot run work before the host
queued it, and runs one stream in order); nested timed spans start at their
outermost span's position plus the device time between the two start
events. Durations are exact device durations, and the track nests like the
host spans, but its absolute position is a lower bound of when the device
really ran the work.

The logic runs on CPU with a fake :class:`EventSource` (tests);
:class:`CudaEventSource` uses ``torch.cuda.Event(enable_timing=True)``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

from opentelemetry import trace as otel_trace

from ..tracing._recorder import RECORDER, Span, span_attributes, trace
from ._base import DEVICE_TID, Profiler, sink_of
from ._schedule import Schedule, check_schedule

__all__ = [
    "DEFAULT_TIMED_SPANS",
    "DEVICE_DUR_ATTRIBUTE",
    "CudaEventSource",
    "CudaTimer",
    "EventSource",
    "SpanWrapper",
]

_log = logging.getLogger("ppetrace")
_perf_ns = time.perf_counter_ns
_NEVER = 1 << 62

#: The span attribute that carries a span's device time in ns.
DEVICE_DUR_ATTRIBUTE = "ppetrace.device_dur_ns"

#: Spans timed on the device by default: the hooks that launch device work.
DEFAULT_TIMED_SPANS = frozenset(
    {
        "trainer.step",
        "module.train_step",
        "trainer.backward",
        "trainer.optimizer_step",
        "evaluator.step",
    }
)


@runtime_checkable
class EventSource(Protocol):
    """Device events: ``record()`` enqueues a timestamp event on the current stream and
    returns it without waiting; ``query(event)`` says, without waiting, whether the
    device has reached a recorded event; ``elapsed_ns(start, end)`` returns the device
    time in ns between two recorded events, waiting for ``end`` if needed. The timer
    calls ``elapsed_ns`` with an ``end`` that ``query`` has not confirmed only in
    :meth:`CudaTimer.teardown`, never inside a hook."""

    def record(self) -> Any: ...

    def query(self, event: Any) -> bool: ...

    def elapsed_ns(self, start: Any, end: Any) -> int: ...


@runtime_checkable
class SpanWrapper(Protocol):
    """A profiler that opens some of the Trainer's spans itself: ``span(name, attrs)`` is a
    drop-in for ``ppetrace.trace(name, attrs)`` (:class:`CudaTimer` adds device time)."""

    def span(self, name: str, attrs: Any = None) -> Any: ...


class CudaEventSource:
    """:class:`EventSource` of ``torch.cuda.Event(enable_timing=True)`` on the current stream
    of ``device`` (default: the current device)."""

    def __init__(self, device: Any = None) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "Expected a CUDA device for CudaEventSource, but torch.cuda.is_available() is "
                "False. Use CudaTimer on a CUDA run, or inject a fake EventSource in tests."
            )
        self._torch = torch
        self.device = torch.device("cuda") if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(
                f"Expected a CUDA device for CudaEventSource, but received {str(self.device)!r}."
            )

    def record(self) -> Any:
        """A new timing event, recorded on the device's current stream (no wait)."""
        torch = self._torch
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def query(self, event: Any) -> bool:
        """Whether the device has completed ``event`` (no wait)."""
        return bool(event.query())

    def elapsed_ns(self, start: Any, end: Any) -> int:
        """Device ns from ``start`` to ``end``; waits for ``end`` unless it has completed."""
        if not end.query():
            end.synchronize()
        return max(0, round(start.elapsed_time(end) * 1_000_000))


class _Timed:
    """One timed span: its attributes, host start and device events."""

    __slots__ = ("name", "attrs", "host_ns", "start", "end", "root", "pos_ns")

    def __init__(self, name: str, attrs: dict[str, Any], host_ns: int, start: Any) -> None:
        self.name = name
        self.attrs = attrs
        self.host_ns = host_ns
        self.start = start
        self.end: Any = None
        self.root: _Timed | None = None
        self.pos_ns: int | None = None


class _Wrap:
    """Context manager recording the device event pair around a block (inside its span)."""

    __slots__ = ("_timer", "_name", "_attrs", "_rec")

    def __init__(self, timer: CudaTimer, name: str, attrs: dict[str, Any]) -> None:
        self._timer = timer
        self._name = name
        self._attrs = attrs
        self._rec: _Timed | None = None

    def __enter__(self) -> _Wrap:
        span = otel_trace.get_current_span()  # the span this block runs in, if ppetrace's
        if type(span) is Span:
            self.begin(getattr(span, "start_ns", None), span_attributes(span))
        else:
            self.begin(None, None)
        return self

    def begin(self, start_ns: int | None, span_attrs: dict[str, Any] | None) -> None:
        """Record the start event, for the span that started at ``start_ns``. The result is
        written into ``span_attrs``, the attributes that span records (ppetrace takes a
        snapshot of the dict it was given), else into the dict given to :meth:`wrap`."""
        attrs = self._attrs if span_attrs is None else span_attrs
        self._rec = self._timer._begin(self._name, attrs, start_ns)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        rec = self._rec
        if rec is not None:
            self._timer._end(rec)


class _TimedSpan:
    """A ``ppetrace.trace`` span with a device event pair recorded inside it."""

    __slots__ = ("_span", "_wrap")

    def __init__(self, timer: CudaTimer, name: str, attrs: dict[str, Any]) -> None:
        self._span = trace(name, attrs)
        self._wrap = _Wrap(timer, name, attrs)

    def __enter__(self) -> Any:
        span = self._span.__enter__()
        self._wrap.begin(getattr(span, "start_ns", None), span_attributes(span))
        return span

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._wrap.__exit__(exc_type, exc, tb)
        finally:
            self._span.__exit__(exc_type, exc, tb)


class CudaTimer(Profiler):
    """Device time for the spans of hooks that launch device work.

    - ``spans``: the event names to time (default :data:`DEFAULT_TIMED_SPANS`).
    - ``schedule``: time only the recorded steps of this schedule (and spans
      between their ``step_begin`` and ``step_end``); None (default) times every
      span in ``spans``, including ``evaluator.step``.
    - ``source``: the :class:`EventSource`; None uses :class:`CudaEventSource`
      when the Trainer's device is CUDA, and turns the timer off otherwise.

    The Trainer opens timed spans with :meth:`span` (a drop-in for
    ``ppetrace.trace``) or wraps the block inside its span with :meth:`wrap`.
    Each recorder flush resolves the pairs the device has completed, without
    waiting (module doc); a span still open, or whose device work is still
    running, at a flush is resolved at a later one, and :meth:`teardown`
    waits for the rest.
    """

    track_name = "cuda device time"

    def __init__(
        self,
        *,
        spans: Iterable[str] | None = None,
        schedule: Schedule | None = None,
        source: EventSource | None = None,
    ) -> None:
        names = DEFAULT_TIMED_SPANS if spans is None else frozenset(spans)
        if isinstance(spans, str) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(
                "Expected an iterable of event names for spans (e.g. {'trainer.step'}), but "
                f"received {spans!r}."
            )
        check_schedule(schedule)
        if source is not None and not isinstance(source, EventSource):
            raise TypeError(
                "Expected an EventSource (record(), query(event) and elapsed_ns(start, end)) "
                f"for source, but received {type(source).__name__}. Add the missing methods."
            )
        self.spans = names
        self.schedule = schedule
        self.source: EventSource | None = source
        self._injected = source is not None
        #: whether spans are timed right now
        self.active = False
        self._installed = False
        self._lock = threading.Lock()
        # one resolve at a time; a flush finding it taken skips (never waits in a hook)
        self._resolving = threading.Lock()
        self._records: list[_Timed] = []
        self._stack: list[_Timed] = []
        self._last_root: _Timed | None = None
        self._ready: list[dict[str, Any]] = []
        self._wake = _NEVER  # with a schedule: the next step that may be timed
        self.resolved = 0

    def __repr__(self) -> str:
        return f"CudaTimer(spans={sorted(self.spans)!r}, schedule={self.schedule!r})"

    @property
    def pending(self) -> int:
        """Timed spans not resolved yet: still open, or their device work still running."""
        with self._lock:
            return len(self._records)

    def _named_tracks(self) -> dict[int, str]:
        return {DEVICE_TID: self.track_name}

    # -- the Trainer's hooks -------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        """Pick the event source from the trainer's device and hook into the recorder's flush."""
        self.sink = sink_of(trainer)
        if not self._injected:
            self.source = None
            runtime = getattr(trainer, "runtime", None)
            device = getattr(runtime, "device_spec", None)
            if device is not None and str(device).startswith("cuda"):
                self.source = CudaEventSource(device)
        self._stack = []
        self._last_root = None
        self.install()
        self.active = self.source is not None and self.schedule is None
        self._wake = 0 if self.source is not None and self.schedule is not None else _NEVER

    def step_begin(self, step: int) -> None:
        """With a schedule: start timing when ``step`` is recorded (one comparison otherwise)."""
        if step < self._wake:
            return
        schedule = self.schedule
        if schedule is None or schedule.action(step).records:
            self.active = self.source is not None
            return
        nxt = schedule.next_step(step + 1, warmup=False)
        self._wake = _NEVER if nxt is None else nxt

    def step_end(self, step: int) -> None:
        """Stop timing (with a schedule) and add the device events resolved so far."""
        if self.schedule is not None:
            self.active = False
        if self._ready:
            self._emit_ready()

    def teardown(self) -> None:
        """End of the run, outside every hook: wait for the device to finish the pairs still
        pending, resolve them, flush (so that their spans carry the attribute), add the
        device events to the trace and unhook from the recorder."""
        self.active = False
        try:
            if self._installed and self._records:
                with self._resolving:
                    self._resolve(wait=True)
                RECORDER.flush()
            self._emit_ready()
        finally:
            self.uninstall()

    def install(self) -> None:
        """Resolve pending events at every recorder flush (``RECORDER.before_flush``)."""
        if not self._installed:
            RECORDER.before_flush.append(self.resolve)
            self._installed = True

    def uninstall(self) -> None:
        """Stop resolving at flushes; pending events are dropped."""
        with contextlib.suppress(ValueError):
            RECORDER.before_flush.remove(self.resolve)
        self._installed = False
        with self._lock:
            self._records = []
        self._stack = []

    # -- timing spans ----------------------------------------------------------------

    def wrap(self, name: str, attrs: dict[str, Any] | None) -> _Wrap | None:
        """A context manager that records the event pair around a block, to be entered
        right inside the span ``name`` whose attributes are ``attrs``; None when ``name``
        is not timed now (then enter nothing). ``attrs`` must be a dict that belongs to
        this span only: the result is written into it."""
        if not self.active or name not in self.spans or type(attrs) is not dict:
            return None
        return _Wrap(self, name, attrs)

    def span(self, name: str, attrs: Any = None) -> Any:
        """``ppetrace.trace(name, attrs)``, with the span's device time when ``name`` is timed
        now. Timed spans get a copy of ``attrs``, so dicts shared between spans are safe."""
        if not self.active or name not in self.spans:
            return trace(name, attrs)
        # a plain dict: ppetrace.trace snapshots it, and the device time goes into that
        # snapshot; anything else, a FrozenAttributes shared between spans included, is
        # first made a dict of this span's own
        if type(attrs) is dict:
            own = attrs
        elif isinstance(attrs, Mapping):
            own = dict(attrs)
        else:
            own = {} if attrs is None else {"ppetrace.arg": attrs}
        return _TimedSpan(self, name, own)

    def _begin(self, name: str, attrs: dict[str, Any], start_ns: int | None) -> _Timed | None:
        """Record the start event; ``start_ns`` is the span's host start (perf_counter_ns)."""
        source = self.source
        if source is None or not RECORDER.enabled:
            return None
        host = _perf_ns() if start_ns is None else start_ns
        try:
            rec = _Timed(name, attrs, host + RECORDER.offset_ns, source.record())
        except Exception:
            self.errors += 1
            _log.exception("ppetrace: recording a device event for %s failed", name)
            return None
        stack = self._stack
        rec.root = stack[0] if stack else None
        stack.append(rec)
        with self._lock:
            self._records.append(rec)
        return rec

    def _end(self, rec: _Timed) -> None:
        stack = self._stack
        while stack:
            if stack.pop() is rec:
                break
        try:
            rec.end = self.source.record()  # type: ignore[union-attr]
        except Exception:
            self.errors += 1
            _log.exception("ppetrace: recording a device event for %s failed", rec.name)

    # -- resolving (at flush) ----------------------------------------------------------

    def resolve(self) -> None:
        """The ``RECORDER.before_flush`` hook: turn the event pairs that the device has
        completed into ``ppetrace.device_dur_ns`` and device-track events.

        Runs under the flusher's lock, before the buffers are drained. A
        scheduled flush (``RECORDER.inline_flush``, on the flusher thread) never
        waits for the device, and pairs not completed yet stay pending for a
        later flush or :meth:`teardown`. An explicit flush (the
        Trainer's at the end of each epoch, outside every hook) waits for the
        device, so every span it exports carries its device time.
        """
        if not self._resolving.acquire(blocking=False):
            return  # teardown is resolving (and may be waiting): leave it to it
        try:
            self._resolve(wait=not RECORDER.inline_flush)
        finally:
            self._resolving.release()

    def _resolve(self, *, wait: bool) -> None:
        """Resolve the pending pairs: those whose end event has completed (``wait=False``),
        or all closed ones, waiting for the device (``wait=True``)."""
        source = self.source
        if source is None:
            return
        with self._lock:
            records, self._records = self._records, []
        keep: list[_Timed] = []
        ready: list[dict[str, Any]] = []
        # roots are placed in order; once one's start is not reached, later ones wait too
        can_place = True
        for rec in records:
            try:
                if rec.root is None and rec.pos_ns is None:
                    can_place = can_place and (wait or source.query(rec.start))
                    if can_place:
                        self._place_root(rec, source)
                # a child's position is measured to its start event: that must be reached too
                if rec.end is None or not (
                    wait
                    or (source.query(rec.end) and (rec.root is None or source.query(rec.start)))
                ):
                    keep.append(rec)  # still open, or the device is not there yet
                    continue
                root = rec.root if rec.root is not None else rec
                if root.pos_ns is None and wait:
                    self._place_root(root, source)
                if root.pos_ns is None:  # an earlier root is not placed yet
                    keep.append(rec)
                    continue
                dur = source.elapsed_ns(rec.start, rec.end)
                rec.attrs[DEVICE_DUR_ATTRIBUTE] = dur
                if root is rec:
                    pos = rec.pos_ns
                else:
                    pos = root.pos_ns + source.elapsed_ns(root.start, rec.start)
            except Exception:
                self.errors += 1
                _log.exception("ppetrace: resolving the device time of %s failed", rec.name)
                continue
            self.resolved += 1
            ready.append(
                {
                    "ph": "X",
                    "cat": "device",
                    "name": rec.name,
                    "tid": DEVICE_TID,
                    "ts_ns": pos,
                    "dur_ns": dur,
                    "args": {DEVICE_DUR_ATTRIBUTE: dur, "host_start_ns": rec.host_ns},
                }
            )
        with self._lock:
            if keep:
                self._records[:0] = keep
            self._ready.extend(ready)

    def _place_root(self, rec: _Timed, source: EventSource) -> None:
        if rec.pos_ns is not None:
            return
        prev = self._last_root
        if prev is None or prev.pos_ns is None:
            rec.pos_ns = rec.host_ns
        else:
            rec.pos_ns = max(rec.host_ns, prev.pos_ns + source.elapsed_ns(prev.start, rec.start))
        self._last_root = rec

    def _emit_ready(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        if ready:
            ready.sort(key=lambda ev: (ev["ts_ns"], -ev["dur_ns"]))
            self.emit(ready, flush_first=False)
