"""How much of each training step the trace file keeps: ``trace_detail`` and ``max_trace_bytes``.

Takes in: the option values of ``Trainer``, ``instrument()`` and ``ppetrace
run``, the run's ``ChromeTraceExporter``, and each training step as it
starts. Gives back: for each step, whether it keeps full detail or is
*summarised* (the exporter folds its hook-level spans into per-event
aggregates on its ``trainer.step`` row; see ``ChromeTraceExporter``).

- ``"auto"`` (the default): every step in full until the trace holds
  ``max_trace_bytes`` (``exporter.bytes_written``, every part), then one
  step in full in each window of :data:`DEFAULT_WINDOWS` (1 in 1,000) and the
  others summarised; one line says so when it switches.
- ``"all"``: every step in full, whatever the size.
- a :class:`~ppetrace.Schedule`: from the first step, the steps whose action
  records (``RECORD``/``RECORD_AND_SAVE``) are in full, the others summarised.

Step numbers are those of the profilers' schedules: training batches
completed before the step, over the whole run. The policy is written in
``otherData["ppetrace.detail"]`` (:func:`detail_metadata`), and the step at
which ``"auto"`` switched in the exporter's closing ``ppetrace.final`` event
(``switched_at_step``: int or null).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from exporters import STEP_LEVEL_EVENTS

from ..profilers._schedule import Schedule
from ..tracing import _recorder as rec_module
from ..tracing._fold import begin_light
from ..tracing._recorder import RECORDER
from ..tracing._setup import FLUSHER
from ._ranks import rank_info

__all__ = [
    "DEFAULT_MAX_TRACE_BYTES",
    "DEFAULT_WINDOWS",
    "TRACE_PART_BYTES",
    "StepDetail",
    "check_detail",
    "detail_metadata",
]

#: ``max_trace_bytes`` by default: about 1 GB of trace before the windows start.
DEFAULT_MAX_TRACE_BYTES = 1_000_000_000
#: The windows of ``"auto"`` past the budget: 1 step in full in 1,000.
DEFAULT_WINDOWS = Schedule(wait=999, warmup=0, active=1, repeat=0)
#: The part size of the trace files the Trainer and ``ppetrace run`` write (256 MiB).
TRACE_PART_BYTES = 1 << 28


def check_detail(trace_detail: Any, max_trace_bytes: Any) -> tuple[str | Schedule, int]:
    """The validated ``(trace_detail, max_trace_bytes)``; raises with a full sentence."""
    if not (isinstance(trace_detail, Schedule) or trace_detail in ("auto", "all")):
        raise ValueError(
            "Expected 'auto', 'all' or a ppetrace.Schedule for trace_detail, but received "
            f"{trace_detail!r}. Pass trace_detail='all' to trace every step in full, or "
            "trace_detail=ppetrace.Schedule(wait=99, warmup=0, active=1, repeat=0) for 1 "
            "step in 100."
        )
    if (
        isinstance(max_trace_bytes, bool)
        or not isinstance(max_trace_bytes, int)
        or max_trace_bytes < 1
    ):
        raise ValueError(
            "Expected a positive int number of bytes for max_trace_bytes, but received "
            f"{max_trace_bytes!r}. Pass e.g. max_trace_bytes=10_000_000_000 for 10 GB."
        )
    return trace_detail, max_trace_bytes


def detail_metadata(trace_detail: str | Schedule, max_trace_bytes: int) -> dict[str, Any]:
    """``otherData["ppetrace.detail"]``: the policy, its budget and its schedule."""
    schedule: Schedule | None
    if isinstance(trace_detail, Schedule):
        policy, schedule = "schedule", trace_detail
    else:
        policy, schedule = trace_detail, DEFAULT_WINDOWS if trace_detail == "auto" else None
    return {
        "policy": policy,
        "max_trace_bytes": max_trace_bytes if policy == "auto" else None,
        "schedule": None
        if schedule is None
        else {
            "wait": schedule.wait,
            "warmup": schedule.warmup,
            "active": schedule.active,
            "repeat": schedule.repeat,
            "skip_first": schedule.skip_first,
        },
    }


class StepDetail:
    """Decides, step by step, which steps a run's trace keeps in full (module doc).

    ``due(step)`` is True for a step to summarise; :meth:`summarise` then
    publishes the step's start to the exporter. ``notify`` prints the one-line
    notice of the switch. Build it with :meth:`create`, which returns None
    when every step is kept in full (``"all"``, or no exporter): the caller
    then tests ``detail is not None`` and nothing else per step.
    """

    def __init__(
        self,
        exporter: Any,
        trace_detail: str | Schedule,
        max_trace_bytes: int,
        notify: Callable[[str], None],
    ) -> None:
        self.exporter = exporter
        self.max_trace_bytes = max_trace_bytes
        self.notify = notify
        self.schedule = trace_detail if isinstance(trace_detail, Schedule) else DEFAULT_WINDOWS
        #: the step at which "auto" switched to windows (None: not yet, or a Schedule)
        self.switched_at: int | None = None
        self._switched = isinstance(trace_detail, Schedule)
        sch = self.schedule  # Schedule.action(step).records, as arithmetic (per step)
        self._skip, self._cycle = sch.skip_first, sch.wait + sch.warmup + sch.active
        self._idle, self._until = sch.wait + sch.warmup, sch.repeat * self._cycle
        self._summarise = exporter.summarise_step
        self._tid = threading.get_native_id()
        self._publish = exporter.step_summariser(self._tid)
        #: light steps (summarise(light=True)): their spans become aggregates in the
        #: recorder, without rows, while this exporter is the only sink
        maker = getattr(exporter, "light_summariser", None)
        self._publish_light = None if maker is None else maker(self._tid)
        self._sinks: Any = None  # the sink list last seen, and whether it was this alone
        self._alone = False
        #: False while no step can be due: "auto" before the trace reaches the budget, as
        #: the exporter's byte alarm tells (``on_bytes``). The loops test it before
        #: :meth:`due`, an attribute read instead of a call per step.
        self.armed = True
        #: every step in ``range(due_from, due_below)`` is due: the stretch of summarised
        #: steps that :meth:`due` last found (a loop tests it before calling :meth:`due`)
        self.due_from = self.due_below = 0
        speedups = rec_module._speedups  # the C fold, called without begin_light's checks
        self._c_begin = None if speedups is None else speedups.light_begin
        self._c_span: type = type(None) if speedups is None else speedups.SpanBase
        if not self._switched and hasattr(exporter, "on_bytes"):
            self.armed = False
            exporter.on_bytes(max_trace_bytes, self._arm)

    @classmethod
    def create(
        cls,
        exporter: Any,
        trace_detail: str | Schedule,
        max_trace_bytes: int,
        notify: Callable[[str], None],
    ) -> StepDetail | None:
        """The policy for ``exporter`` (None: every step in full, nothing to do per step)."""
        if exporter is None or not hasattr(exporter, "summarise_step"):
            return None
        if trace_detail == "all":
            return None
        exporter.add_final_metadata(switched_at_step=None)  # "auto": set when it switches
        return cls(exporter, trace_detail, max_trace_bytes, notify)

    def _arm(self) -> None:
        self.armed = True

    def due(self, step: int) -> bool:
        """True when ``step`` is to be summarised (it switches "auto" when due). Always
        False while :attr:`armed` is False."""
        if not self._switched:
            if self.exporter.bytes_written < self.max_trace_bytes:
                return False
            self._switch(step)
        rel = step - self._skip
        if rel < 0:  # summarised until the schedule's first window
            self.due_from, self.due_below = step, self._skip
            return True
        if self._until and rel >= self._until:  # the windows are over: every step
            self.due_from, self.due_below = step, sys.maxsize
            return True
        into = rel % self._cycle
        if into < self._idle:  # summarised until the next window starts
            self.due_from, self.due_below = step, step + self._idle - into
            return True
        return False

    def _switch(self, step: int) -> None:
        self._switched = True
        self.switched_at = step
        self.exporter.add_final_metadata(switched_at_step=step)
        sch = self.schedule
        cycle = sch.wait + sch.warmup + sch.active
        held = self.exporter.bytes_written
        self.notify(
            f"ppetrace: {_who()}the trace held {held:,} bytes "
            f"(max_trace_bytes={self.max_trace_bytes:,}, checked as spans are written) at "
            f"training batch {step} (optimizer steps are fewer under gradient accumulation); "
            "from here it keeps "
            f"{sch.active} step in {cycle:,} in full and, for "
            "the others, each hook's count, total and self time. Pass trace_detail='all' "
            "(ppetrace run: --detail all) to keep every span, or a larger max_trace_bytes."
        )

    def summarise(self, span: Any, light: bool = False) -> None:
        """Publish the start of the entered ``trainer.step`` span ``span`` (a ppetrace span;
        anything else, or a span that recorded nothing, leaves the step in full).

        With ``light`` (the caller's spans of the step are plain ppetrace spans: no
        profiler, no CudaTimer), and while the exporter is the only sink, the step is a
        *light* step instead: the recorder takes the spans of this thread until ``span``
        ends as aggregates, without rows (``ppetrace.tracing._light``), and publishes
        them when it ends."""
        rec = RECORDER
        if rec.enabled:  # else no step row comes
            publish = self._publish_light
            if light and publish is not None:
                if FLUSHER.sinks is not self._sinks:  # (tested inline: this runs every step)
                    self._only_sink()
                if self._alone:
                    begin = self._c_begin
                    if begin is not None and isinstance(span, self._c_span):
                        if begin(span, publish, STEP_LEVEL_EVENTS):
                            return
                    elif begin_light(span, publish, STEP_LEVEL_EVENTS):
                        return
            try:  # (a plain try: contextlib.suppress costs ~1 µs per step)
                start = span.start_ns + rec.offset_ns
            except (AttributeError, TypeError):
                return  # not a ppetrace span (no start_ns): the step stays in full
            self._publish(start)

    def _only_sink(self) -> None:
        """Note in ``_alone`` whether the exporter is the recorder's only sink (others would
        lose the rows of light steps); the sink list is a new one when a sink comes or goes."""
        sinks = self._sinks = FLUSHER.sinks
        self._alone = len(sinks) == 1 and sinks[0].target is self.exporter

    def summarise_at(self, start_ns: int, tid: int) -> None:
        """Publish a step that starts at ``start_ns`` (epoch ns) on thread ``tid``."""
        self._summarise(tid, start_ns)


def _who() -> str:
    """``"rank R: "`` in a process of a multi-process run (``RANK``/``WORLD_SIZE``, as
    torchrun sets them): each rank switches on its own, and their lines interleave."""
    try:
        info = rank_info()
    except ValueError:
        return ""
    return "" if info is None or info.world_size < 2 else f"rank {info.rank}: "
