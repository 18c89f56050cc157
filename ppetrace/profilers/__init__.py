"""Deep profilers on a schedule, on the same timeline as the hook spans.

Pass them to the Trainer (``Trainer(profilers=[...])``); each follows the
:class:`Schedule` it is given, so the run as a whole stays fast:

- :class:`Pyinstrument`: sampled Python stacks ("python (sampled)" track),
  an HTML page and a speedscope file per window, and :meth:`~Pyinstrument.top_functions`.
- :class:`TorchProfiler`: ``torch.profiler`` operators (and kernels on GPU),
  merged into the trace on the spans' clock.
- :class:`CudaTimer`: device time per span (``ppetrace.device_dur_ns``) and a
  "cuda device time" track, resolved at flush, never synchronizing in a hook.
- :class:`SystemCounters`: CPU %, RSS and CUDA memory as counter tracks and a frame.

:class:`Profiler` is the base class (documented no-op hooks) and
:class:`ScheduledProfiler` the base of the windowed ones. A profiler that is a
:class:`SpanWrapper` (``CudaTimer``) opens the Trainer's device-work spans.
"""

from __future__ import annotations

from ._base import EventSink, Profiler, ProfileWindow, ScheduledProfiler
from ._counters import SystemCounters
from ._cuda import DEFAULT_TIMED_SPANS, CudaEventSource, CudaTimer, EventSource, SpanWrapper
from ._pyinstrument import Pyinstrument
from ._schedule import ProfilerAction, Schedule
from ._torch import ClockAlignment, TorchProfiler, TraceAlignmentError

__all__ = [
    "DEFAULT_TIMED_SPANS",
    "ClockAlignment",
    "CudaEventSource",
    "CudaTimer",
    "EventSink",
    "EventSource",
    "ProfileWindow",
    "Profiler",
    "ProfilerAction",
    "Pyinstrument",
    "Schedule",
    "ScheduledProfiler",
    "SpanWrapper",
    "SystemCounters",
    "TorchProfiler",
    "TraceAlignmentError",
]
