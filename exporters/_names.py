"""Event names that ppetrace's profilers write and the reader and reports look for, in a
module that imports nothing (the profilers import it without loading pandas)."""

from __future__ import annotations

__all__ = ["PROFILE_WINDOW_EVENT", "SAVE_WINDOW_EVENT"]

#: The ``M`` event of a profiled window (``ts``/``dur``: its time; ``args``: the profiler
#: and its steps), written by ``ppetrace.profilers``' scheduled profilers.
PROFILE_WINDOW_EVENT = "ppetrace.profile_window"
#: The span of a scheduled profiler writing a window's files and events, between steps.
SAVE_WINDOW_EVENT = "profiler.save_window"
