"""Sampled Python stacks during the scheduled steps: :class:`Pyinstrument`.

For each window of its :class:`~ppetrace.profilers.Schedule`, a fresh
``pyinstrument.Profiler`` samples the training thread from the window's first
active step to its last. The window's session is written as a pyinstrument
HTML page and a speedscope JSON file, its samples become nested ``X`` events
on the "python (sampled)" track of the Chrome trace, and every sample's leaf
function adds to :meth:`Pyinstrument.top_functions`.

The clock: pyinstrument's ``Session.start_time`` is ``time.time()``, which
is not the spans' clock. Its samples, however, are ``(stack, seconds since
the previous sample)`` pairs measured with ``time.perf_counter``, starting
from the sampler's ``last_profile_time``. This module reads that anchor right
after the profiler starts, converts it to ``perf_counter_ns`` with a measured
offset between the two counters, and places sample ``i`` on the interval
``[anchor + sum(dt[:i]), anchor + sum(dt[:i+1])]``: the same clock as every
span, exactly, without assuming anything about ``time.time``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..tracing._recorder import RECORDER
from ._base import PYTHON_TID, ProfileWindow, ScheduledProfiler, resolve_output_dir
from ._schedule import ProfilerAction, Schedule

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["TOP_FUNCTION_COLUMNS", "Pyinstrument", "perf_counter_offset_ns", "stack_events"]

_log = logging.getLogger("ppetrace")
_perf_ns = time.perf_counter_ns
_HERE = os.path.dirname(os.path.abspath(__file__))

#: The columns of :meth:`Pyinstrument.top_functions`, in order.
TOP_FUNCTION_COLUMNS = (
    "function",
    "file",
    "line",
    "self_ns",
    "total_ns",
    "samples",
    "self_share",
)


def perf_counter_offset_ns(reads: int = 7) -> int:
    """``perf_counter_ns() - perf_counter() * 1e9``, measured over ``reads`` tries (tightest
    bracket wins): add it to a ``time.perf_counter`` reading (in ns) to get
    ``perf_counter_ns``."""
    best_width = None
    best = 0
    for _ in range(reads):
        a = _perf_ns()
        f = time.perf_counter()
        b = _perf_ns()
        if best_width is None or b - a < best_width:
            best_width = b - a
            best = (a + b) // 2 - round(f * 1e9)
    return best


def _parse_identifier(identifier: str) -> tuple[str, str, int] | None:
    """``(function, file, first line)`` of a pyinstrument frame identifier, or None for
    pyinstrument's thread and synthetic frames."""
    head = identifier.split("\x01", 1)[0]
    parts = head.split("\x00")
    if len(parts) < 3 or parts[1] == "<thread>":
        return None
    try:
        line = int(parts[2])
    except ValueError:
        line = 0
    return parts[0], parts[1], line


def stack_events(
    frame_records: Sequence[tuple[Sequence[str], float]],
    anchor_ns: int,
    *,
    start_ns: int,
    end_ns: int,
    tid: int = PYTHON_TID,
) -> list[dict[str, Any]]:
    """Nested Chrome ``X`` events, on track ``tid``, of pyinstrument's samples.

    ``frame_records`` are a session's ``(stack identifiers, seconds since the
    previous sample)``; the first interval starts at ``anchor_ns`` (epoch ns).
    Sample ``i`` covers ``[anchor + sum(dt[:i]), anchor + sum(dt[:i+1])]``,
    clipped to ``[start_ns, end_ns]``. Consecutive samples that share a
    stack prefix share its events, so a function on the stack for several
    samples is one event. Events are sorted by start, longest first.

    Every time is floored to a whole microsecond (``start_ns`` rounded up), so
    that the file's ``ts`` and ``dur`` are whole numbers of µs (the file's
    origin is a whole second): a viewer that adds ``ts + dur`` in floating
    point then gets exactly the next frame's ``ts`` where frames touch, never a
    hair past it (speedscope reported such frames as mis-nested). Samples are
    milliseconds apart; a sample shorter than a µs after flooring is dropped.
    """
    out: list[dict[str, Any]] = []
    open_keys: list[str] = []
    open_starts: list[int] = []
    open_info: list[tuple[str, str, int]] = []
    cum = 0.0
    lo = start_ns + (-start_ns) % 1000  # whole µs: rounded up into the window
    hi = end_ns - end_ns % 1000
    prev_end = lo

    def close_to(depth: int, at: int) -> None:
        while len(open_keys) > depth:
            open_keys.pop()
            begin = open_starts.pop()
            func, file, line = open_info.pop()
            if at > begin:
                out.append(
                    {
                        "ph": "X",
                        "cat": "python",
                        "name": func,
                        "tid": tid,
                        "ts_ns": begin,
                        "dur_ns": at - begin,
                        "args": {"file": file, "line": line},
                    }
                )

    for stack, dt in frame_records:
        before = cum
        cum += dt
        b = _whole_us(anchor_ns + round(before * 1e9))
        e = min(_whole_us(anchor_ns + round(cum * 1e9)), hi)
        b = max(b, lo, prev_end)
        if e <= b:
            continue
        if b > prev_end:  # a gap with no sample: nothing was on the stack we know of
            close_to(0, prev_end)
        frames = [(ident.split("\x01", 1)[0], _parse_identifier(ident)) for ident in stack]
        keys = [(k, info) for k, info in frames if info is not None]
        common = 0
        while (
            common < len(open_keys) and common < len(keys) and open_keys[common] == keys[common][0]
        ):
            common += 1
        close_to(common, b)
        for key, info in keys[common:]:
            open_keys.append(key)
            open_starts.append(b)
            open_info.append(info)
        prev_end = e
    close_to(0, prev_end)
    out.sort(key=lambda ev: (ev["ts_ns"], -ev["dur_ns"]))
    return out


def _whole_us(ns: int) -> int:
    """``ns`` floored to a whole microsecond."""
    return ns - ns % 1000


def _outside_frame() -> types.FrameType | None:
    """The innermost frame that is not in this package (the Trainer's loop)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == _HERE:
        frame = frame.f_back
    return frame


class Pyinstrument(ScheduledProfiler):
    """Sample Python stacks with pyinstrument during the active steps of each window.

    - ``interval``: seconds between samples (pyinstrument's ``interval``), > 0.
    - ``schedule``: which steps are sampled (default ``Schedule()``: steps 1-3,
      warm-up steps are not sampled).
    - ``output_dir``: where each window's ``pyinstrument_steps<a>-<b>.html``
      and ``.speedscope.json`` go (default: ``<trace stem>_profiles`` beside
      the Trainer's trace file, else ``./ppetrace_profiles``).
    - ``html``/``speedscope``: write those files.

    The samples go to the Trainer's Chrome trace on the "python (sampled)"
    track, on the spans' clock. :meth:`top_functions` is the table of the
    functions with the most self time over all windows (for the step
    report's ``tables``). Sampling slows the sampled steps down: read step
    times from steps outside the windows.
    """

    track_name = "python (sampled)"

    def __init__(
        self,
        *,
        interval: float = 0.001,
        schedule: Schedule | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        html: bool = True,
        speedscope: bool = True,
        top: int = 20,
    ) -> None:
        if isinstance(top, bool) or not isinstance(top, int) or top < 1:
            raise ValueError(f"Expected a positive int for top, but received {top!r}.")
        if (
            isinstance(interval, bool)
            or not isinstance(interval, (int, float))
            or not interval > 0
            or interval != interval
        ):
            raise ValueError(
                f"Expected a positive number of seconds for interval, but received {interval!r}."
            )
        super().__init__(schedule)
        self.interval = float(interval)
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.html = bool(html)
        self.speedscope = bool(speedscope)
        #: rows of the ``top_functions`` table written into the trace at the end of fit
        self.top = top
        self._dir: Path | None = self.output_dir
        self._profiler: Any = None
        self._anchor_ns = 0
        # (function, file, line) -> [self seconds, total seconds, samples]
        self._stats: dict[tuple[str, str, int], list[float]] = {}

    def _named_tracks(self) -> dict[int, str]:
        return {PYTHON_TID: self.track_name}

    def _setup(self, trainer: Any) -> None:
        self._dir = resolve_output_dir(self.output_dir, trainer)

    # -- windows -----------------------------------------------------------------

    def _begin_window(self, step: int, action: ProfilerAction) -> None:
        from pyinstrument import Profiler as PyiProfiler
        from pyinstrument.stack_sampler import get_stack_sampler

        offset = perf_counter_offset_ns()
        profiler = PyiProfiler(interval=self.interval, async_mode="disabled")
        before = _perf_ns()
        profiler.start(
            caller_frame=_outside_frame(),
            target_description=f"ppetrace training from step {step}",
        )
        after = _perf_ns()
        self._profiler = profiler
        anchor = before
        sampler = get_stack_sampler()
        last = getattr(sampler, "last_profile_time", 0.0)
        if getattr(sampler, "timer_func", None) is None and isinstance(last, float) and last > 0:
            session = getattr(profiler, "_active_session", None)
            early = getattr(session, "frame_records", ())
            candidate = round((last - sum(dt for _, dt in early)) * 1e9) + offset
            if candidate <= after:  # older when another profiler already ran this sampler
                anchor = candidate
        self._anchor_ns = anchor + RECORDER.offset_ns

    def _end_window(self, window: ProfileWindow) -> None:
        profiler, self._profiler = self._profiler, None
        session = profiler.stop()
        end_ns = _perf_ns() + RECORDER.offset_ns
        window.end_ns = end_ns
        records = session.frame_records
        window.info["samples"] = len(records)
        if not records:
            _log.warning(
                "ppetrace: pyinstrument took no samples in steps %d-%d, which ran for %.3f ms "
                "at its interval of %g ms. Sample more steps (a longer schedule) or pass a "
                "smaller interval to Pyinstrument.",
                window.first_step,
                window.last_step,
                (end_ns - window.start_ns) / 1e6,
                self.interval * 1e3,
            )
        self._accumulate(records)
        self._write_files(session, window)
        events = stack_events(records, self._anchor_ns, start_ns=window.start_ns, end_ns=end_ns)
        window.info["events"] = len(events)
        self.emit(events)

    def _abort(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None and profiler.is_running:
            profiler.stop()

    def _teardown(self) -> None:
        self._abort()
        self._emit_top_functions()

    def _emit_top_functions(self) -> None:
        """Write the ``top_functions`` table into the trace (an ``M`` event named
        ``ppetrace.table``), so every step report built from the file shows it."""
        if not self._stats or self.sink is None:
            return
        table = self.top_functions(self.top)
        self.emit(
            [
                {
                    "ph": "M",
                    "name": "ppetrace.table",
                    "tid": 0,
                    "args": {
                        "name": "top_functions",
                        "columns": list(table.columns),
                        "rows": table.to_numpy(dtype=object).tolist(),
                    },
                }
            ]
        )

    def _write_files(self, session: Any, window: ProfileWindow) -> None:
        if not (self.html or self.speedscope) or self._dir is None:
            return
        from pyinstrument.renderers import HTMLRenderer, SpeedscopeRenderer

        self._dir.mkdir(parents=True, exist_ok=True)
        stem = f"pyinstrument_steps{window.first_step}-{window.last_step}"
        if self.html:
            path = self._dir / f"{stem}.html"
            path.write_text(HTMLRenderer().render(session), encoding="utf-8")
            window.files["html"] = path
        if self.speedscope:
            path = self._dir / f"{stem}.speedscope.json"
            path.write_text(SpeedscopeRenderer().render(session), encoding="utf-8")
            window.files["speedscope"] = path

    # -- the top-functions table ----------------------------------------------------------

    def _accumulate(self, records: Sequence[tuple[Sequence[str], float]]) -> None:
        stats = self._stats
        for stack, dt in records:
            infos = [info for info in map(_parse_identifier, stack) if info is not None]
            if not infos:
                continue
            for info in set(infos):
                row = stats.get(info)
                if row is None:
                    row = stats[info] = [0.0, 0.0, 0.0]
                row[1] += dt
            leaf = stats[infos[-1]]
            leaf[0] += dt
            leaf[2] += 1

    def top_functions(self, n: int | None = 20) -> pd.DataFrame:
        """The ``n`` functions (all with None) with the most self time during the sampled
        steps, over all windows so far.

        Columns (:data:`TOP_FUNCTION_COLUMNS`): ``function``, ``file``,
        ``line`` (first line), ``self_ns`` (time as the innermost sampled
        frame), ``total_ns`` (time anywhere on the stack), ``samples`` (as the
        innermost frame), ``self_share`` (of all sampled time). Sorted by
        ``self_ns``, largest first.
        """
        import pandas as pd

        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"Expected a positive int or None for n, but received {n!r}.")
        total_self = sum(row[0] for row in self._stats.values())
        rows = [
            (
                func,
                file,
                line,
                round(s * 1e9),
                round(t * 1e9),
                int(k),
                s / total_self if total_self > 0 else float("nan"),
            )
            for (func, file, line), (s, t, k) in self._stats.items()
            if k > 0
        ]
        rows.sort(key=lambda r: (-r[3], r[0], r[1], r[2]))
        if n is not None:
            rows = rows[:n]
        frame = pd.DataFrame(rows, columns=list(TOP_FUNCTION_COLUMNS))
        return frame.astype(
            {"line": "int64", "self_ns": "int64", "total_ns": "int64", "samples": "int64"}
        )
