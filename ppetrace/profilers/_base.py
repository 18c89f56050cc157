"""The contract between the Trainer and its profilers, and what they share.

A profiler is any object with ``setup(trainer)``, ``step_begin(step)``,
``step_end(step)`` and ``teardown()`` (the Trainer's ``StepProfiler``
protocol). :class:`Profiler` is a base class whose hooks are documented
no-ops; :class:`ScheduledProfiler` turns the step hooks into *windows* of a
:class:`~ppetrace.profilers.Schedule` and costs one integer comparison per
hook outside them.

Everything a profiler adds to the Chrome trace goes through an
:class:`EventSink` (the Trainer's ``trace_exporter``, an
``exporters.ChromeTraceExporter``), as raw Chrome events timed with ``ts_ns``
(epoch ns) and ``dur_ns``: the clock of the spans,
``time.perf_counter_ns() + RECORDER.offset_ns``. Each profiler draws on its
own thread track, named by a ``thread_name`` metadata event.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from exporters._names import PROFILE_WINDOW_EVENT, SAVE_WINDOW_EVENT

from ..tracing._recorder import RECORDER, trace
from ._schedule import ProfilerAction, Schedule

__all__ = [
    "DEVICE_TID",
    "PYTHON_TID",
    "TORCH_TID_BASE",
    "EventSink",
    "Profiler",
    "ProfileWindow",
    "ScheduledProfiler",
    "now_ns",
    "sink_of",
    "PROFILE_WINDOW_EVENT",
    "SAVE_WINDOW_EVENT",
]

_log = logging.getLogger("ppetrace")
_perf_ns = time.perf_counter_ns

#: Thread ids of the profilers' tracks. Linux thread ids stay below 2**22, so
#: these never collide with a real thread of the process.
PYTHON_TID = 2_130_000_001
DEVICE_TID = 2_130_000_002
TORCH_TID_BASE = 2_130_000_100
_NEVER = 1 << 62


def now_ns() -> int:
    """The current time in epoch ns on the spans' clock (``perf_counter_ns`` + offset)."""
    return _perf_ns() + RECORDER.offset_ns


@runtime_checkable
class EventSink(Protocol):
    """Where profilers stream raw Chrome trace events (``ChromeTraceExporter.add_events``).

    Events are mappings with ``ph``, ``name``, ``tid``, ``args`` and times as
    ``ts_ns`` (epoch ns) and ``dur_ns`` (ns); ``pid`` defaults to the
    process's own.
    """

    def add_events(self, events: Iterable[Mapping[str, Any]]) -> None: ...


class Profiler:
    """Base class of ppetrace's profilers; every hook is a documented no-op.

    The Trainer calls ``setup(trainer)`` at the start of ``fit``,
    ``step_begin(step)`` right before each training batch's ``trainer.step``
    span opens, ``step_end(step)`` right after it closes, and ``teardown()``
    at the end of ``fit``, also when it raises. ``step`` counts the training
    batches completed before this one, across resumes.
    """

    #: where this profiler's Chrome events go (set by :meth:`setup`)
    sink: EventSink | None = None
    #: failures that were logged instead of raised (telemetry never breaks training)
    errors: int = 0
    _named_for: tuple[Any, set[int]] | None = None

    def setup(self, trainer: Any) -> None:
        """Start of ``fit``: read ``trainer.trace_exporter``, ``trainer.runtime``..."""

    def step_begin(self, step: int) -> None:
        """Right before the ``trainer.step`` span of batch ``step`` opens."""

    def step_end(self, step: int) -> None:
        """Right after the ``trainer.step`` span of batch ``step`` closes."""

    def teardown(self) -> None:
        """End of ``fit`` (also on an exception): stop, write what is pending."""

    # -- shared helpers ----------------------------------------------------------

    def _named_tracks(self) -> dict[int, str]:
        """``tid -> track name`` of the tracks this profiler draws on (named once per sink)."""
        return {}

    def emit(self, events: list[dict[str, Any]], *, flush_first: bool = True) -> None:
        """Send ``events`` to :attr:`sink`, naming this profiler's tracks first.

        With ``flush_first`` (never from inside a recorder flush), pending spans
        are flushed before the first event reaches an empty file, so the
        file's header carries the run's metadata. Errors are logged, not raised.
        """
        sink = self.sink
        if sink is None or not events:
            return
        try:
            if flush_first and getattr(sink, "events_written", 1) == 0:
                RECORDER.flush()
            if self._named_for is None or self._named_for[0] is not sink:
                self._named_for = (sink, set())
            named = self._named_for[1]
            meta: list[dict[str, Any]] = []
            for tid, name in self._named_tracks().items():
                if tid not in named and any(e.get("tid") == tid for e in events):
                    named.add(tid)
                    meta.append(
                        {"ph": "M", "name": "thread_name", "tid": tid, "args": {"name": name}}
                    )
                    meta.append(
                        {
                            "ph": "M",
                            "name": "thread_sort_index",
                            "tid": tid,
                            "args": {"sort_index": tid - PYTHON_TID + 1},
                        }
                    )
            sink.add_events(meta + events if meta else events)
        except Exception:  # telemetry never breaks training
            self.errors += 1
            _log.exception("ppetrace: %r could not add its events to the trace", self)


@dataclass
class ProfileWindow:
    """One profiled window: its steps, its epoch-ns span and the files written for it.

    ``complete`` is False for a window cut short by the end of ``fit``;
    ``files`` maps a kind (``html``, ``speedscope``, ``kineto``) to its path;
    ``info`` holds the profiler's figures (samples, events, clock alignment).
    """

    index: int | None
    first_step: int
    last_step: int
    start_ns: int
    end_ns: int
    complete: bool
    files: dict[str, Path] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def sink_of(trainer: Any) -> EventSink | None:
    """The trainer's ``trace_exporter`` when it takes raw events (``add_events``), else None."""
    exporter = getattr(trainer, "trace_exporter", None)
    return exporter if isinstance(exporter, EventSink) else None


def resolve_output_dir(output_dir: str | os.PathLike[str] | None, trainer: Any) -> Path:
    """``output_dir``, or ``<trace file stem>_profiles`` beside the trainer's trace file,
    or ``./ppetrace_profiles``."""
    if output_dir is not None:
        return Path(output_dir)
    path = getattr(getattr(trainer, "trace_exporter", None), "path", None)
    if path is not None:
        p = Path(path)
        stem = p.name.split(".")[0] or "trace"
        return p.parent / f"{stem}_profiles"
    return Path("ppetrace_profiles")


class ScheduledProfiler(Profiler):
    """A profiler that is on only during the windows of a :class:`Schedule`.

    Subclasses implement ``_begin_window(step, action)``,
    ``_window_step_begin(step)``/``_window_step_end(step)`` (steps inside an
    open window) and ``_end_window(window)``. Outside windows each step hook
    is one comparison. ``uses_warmup`` says whether warm-up steps open a
    window (torch.profiler) or are skipped (samplers). An exception in a
    subclass is logged and switches the profiler off for the rest of the run.
    """

    uses_warmup: ClassVar[bool] = False

    def __init__(self, schedule: Schedule | None) -> None:
        if schedule is None:
            schedule = Schedule()
        if not isinstance(schedule, Schedule):
            raise TypeError(
                "Expected a ppetrace.profilers.Schedule for schedule, but received "
                f"{type(schedule).__name__}. Build one with Schedule(wait=..., warmup=..., "
                "active=...)."
            )
        self.schedule = schedule
        self.windows: list[ProfileWindow] = []
        self.errors = 0
        self.trainer: Any = None
        self._wake = 0
        self._open = False
        self._first = 0
        self._last = 0
        self._start_ns = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(schedule={self.schedule!r})"

    # -- the Trainer's hooks -----------------------------------------------------

    def setup(self, trainer: Any) -> None:
        """Reset the window state and take the trainer's trace exporter as the sink."""
        self.trainer = trainer
        self.sink = sink_of(trainer)
        self._wake = 0
        self._open = False
        self._setup(trainer)

    def step_begin(self, step: int) -> None:
        """Open a window when ``step`` starts one; one comparison outside windows."""
        if step < self._wake:
            return
        try:
            if self._open:
                self._last = step
                self._window_step_begin(step)
                return
            action = self.schedule.action(step)
            if action is ProfilerAction.NONE or (
                action is ProfilerAction.WARMUP and not self.uses_warmup
            ):
                nxt = self.schedule.next_step(step + 1, warmup=self.uses_warmup)
                self._wake = _NEVER if nxt is None else nxt
                return
            self._open = True
            self._first = self._last = step
            self._start_ns = now_ns()
            self._begin_window(step, action)
        except Exception:
            self._fail("step_begin")

    def step_end(self, step: int) -> None:
        """Close the window after its last active step."""
        if not self._open:
            return
        try:
            if self.schedule.action(step) is ProfilerAction.RECORD_AND_SAVE:
                self._close(step, complete=True)
            else:
                self._window_step_end(step)
        except Exception:
            self._fail("step_end")

    def teardown(self) -> None:
        """Close a window that the end of ``fit`` cut short, then release resources."""
        try:
            if self._open:
                self._close(self._last, complete=False)
        except Exception:
            self._fail("teardown")
        finally:
            try:
                self._teardown()
            except Exception:
                self.errors += 1
                _log.exception("ppetrace: %r failed to tear down", self)

    def _close(self, step: int, *, complete: bool) -> None:
        self._open = False
        nxt = self.schedule.next_step(step + 1, warmup=self.uses_warmup)
        self._wake = _NEVER if nxt is None else nxt
        window = ProfileWindow(
            index=self.schedule.window(self._first),
            first_step=self._first,
            last_step=step,
            start_ns=self._start_ns,
            end_ns=now_ns(),
            complete=complete,
        )
        # its files and events are made between steps, in a span of their own: reports
        # leave that time out of the next step, as they do validation
        with trace(SAVE_WINDOW_EVENT, {"ppetrace.profiler": type(self).__name__}):
            self._end_window(window)
        self.windows.append(window)
        # the window in the trace, so that reports leave its (slowed) steps out
        self.emit(
            [
                {
                    "ph": "M",
                    "name": PROFILE_WINDOW_EVENT,
                    "tid": 0,
                    "ts_ns": window.start_ns,
                    "dur_ns": max(0, window.end_ns - window.start_ns),
                    "args": {
                        "profiler": type(self).__name__,
                        "first_step": window.first_step,
                        "last_step": window.last_step,
                        "complete": window.complete,
                    },
                }
            ]
        )

    def _fail(self, where: str) -> None:
        self.errors += 1
        self._wake = _NEVER
        was_open, self._open = self._open, False
        _log.exception("ppetrace: %r failed in %s; it is off for the rest of the run", self, where)
        if was_open:
            try:
                self._abort()
            except Exception:
                _log.exception("ppetrace: %r failed to stop", self)

    # -- for subclasses --------------------------------------------------------------

    def _setup(self, trainer: Any) -> None:
        """Called by :meth:`setup`."""

    def _teardown(self) -> None:
        """Called at the end of :meth:`teardown`."""

    def _begin_window(self, step: int, action: ProfilerAction) -> None:
        """A window opens at ``step`` (``action`` is WARMUP or a recording action)."""

    def _window_step_begin(self, step: int) -> None:
        """``step_begin`` of a later step of the open window."""

    def _window_step_end(self, step: int) -> None:
        """``step_end`` of a step of the open window that is not its last."""

    def _end_window(self, window: ProfileWindow) -> None:
        """The window ends (after its last step, or cut short); fill ``window.files``."""

    def _abort(self) -> None:
        """Stop whatever runs after a failure, discarding its results."""
