"""torch.profiler on the schedule, merged into the span trace: :class:`TorchProfiler`.

Each window of the :class:`~ppetrace.profilers.Schedule` runs one
``torch.profiler.profile`` whose own schedule is the same plan (shifted so
its step 0 is the window's first step): warm-up steps warm Kineto up, active
steps are recorded, and the last active step ends the window. Kineto's trace
is exported per window, read back, moved onto the spans' clock and streamed
into the Chrome trace.

The clock: Kineto writes ``ts`` in µs on its own clock, relative to
``baseTimeNanoseconds`` when the trace has it (newer Kineto, at the top level
or in ``otherData``) and absolute otherwise. Neither is assumed to be the
spans' clock. While a window records, the profiler enters a
``record_function`` marker (torch's fast C++ one when it exists) named
``ppetrace.clock_sync#N`` between two ``perf_counter_ns`` reads, three times
at each step boundary; the marker's Kineto start lies between the reads. The
marker with the tightest bracket gives the offset, and
half its bracket is the alignment error (:attr:`ClockAlignment.error_ns`).
A trace without markers (a window with no recorded step) falls back to
``baseTimeNanoseconds`` read as epoch ns.
"""

from __future__ import annotations

import decimal
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..tracing._recorder import RECORDER
from ._base import TORCH_TID_BASE, ProfileWindow, ScheduledProfiler, resolve_output_dir
from ._schedule import ProfilerAction, Schedule

__all__ = [
    "MARKER_PREFIX",
    "ClockAlignment",
    "ClockMarker",
    "KinetoTracks",
    "TorchProfiler",
    "TraceAlignmentError",
    "align_kineto",
    "kineto_base_ns",
    "kineto_events",
    "load_kineto",
]

_log = logging.getLogger("ppetrace")
_perf_ns = time.perf_counter_ns

#: Name prefix of the clock-sync markers (they are dropped from the merged events).
MARKER_PREFIX = "ppetrace.clock_sync#"
_KEPT_PHASES = frozenset({"X", "i", "I", "s", "t", "f", "C", "b", "e", "n"})
_STEP_PREFIX = "ProfilerStep#"


class TraceAlignmentError(ValueError):
    """A Kineto trace carries nothing to put it on the spans' clock."""


class ClockMarker(NamedTuple):
    """A ``record_function`` marker entered between two reads of the spans' clock (epoch ns)."""

    name: str
    before_ns: int
    after_ns: int


@dataclass(frozen=True)
class ClockAlignment:
    """``spans' epoch ns = Kineto ns + offset_ns``, where Kineto ns is
    ``baseTimeNanoseconds + ts * 1000`` (``ts`` alone without a base).

    ``error_ns`` bounds the error (None when unknown); ``method`` is
    ``"marker"`` or ``"baseTimeNanoseconds"``.
    """

    offset_ns: int
    error_ns: int | None
    method: str


def _ns(value: Any) -> int:
    """A JSON µs value (int, float, Decimal or numeric string) as integer ns, exactly."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value * 1000
    if isinstance(value, decimal.Decimal):
        return int((value * 1000).to_integral_value(decimal.ROUND_HALF_EVEN))
    if isinstance(value, float):
        return round(value * 1000.0)
    if isinstance(value, str):
        return _ns(decimal.Decimal(value))
    raise TypeError(f"Expected a number of µs, but received {value!r}.")


def _plain(value: Any) -> Any:
    """``value`` with Decimals (from :func:`load_kineto`) turned back into floats."""
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def load_kineto(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a Kineto Chrome trace, keeping its decimal ``ts`` values exact (as Decimals)."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f, parse_float=decimal.Decimal)
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(
            f"Expected a Kineto trace (a JSON object with 'traceEvents') in {path}, but "
            f"received a {type(doc).__name__}."
        )
    return doc


def kineto_base_ns(doc: Mapping[str, Any]) -> int | None:
    """``baseTimeNanoseconds`` of a Kineto trace (top level, else ``otherData``), or None."""
    for holder in (doc, doc.get("otherData")):
        if isinstance(holder, Mapping):
            value = holder.get("baseTimeNanoseconds")
            if value is not None and not isinstance(value, bool):
                try:
                    return int(decimal.Decimal(str(value)))
                except decimal.InvalidOperation:
                    continue
    return None


def align_kineto(doc: Mapping[str, Any], markers: Sequence[ClockMarker]) -> ClockAlignment:
    """The offset from Kineto's clock to the spans' clock (see the module doc).

    Raises :class:`TraceAlignmentError` when the trace has neither a marker
    of ``markers`` nor ``baseTimeNanoseconds``.
    """
    base = kineto_base_ns(doc)
    by_name = {m.name: m for m in markers}
    best: tuple[int, int] | None = None
    if by_name:
        for ev in doc.get("traceEvents", ()):
            if not isinstance(ev, Mapping) or ev.get("ph") != "X":
                continue
            marker = by_name.get(ev.get("name"))  # type: ignore[arg-type]
            if marker is None or "ts" not in ev:
                continue
            kineto = (base or 0) + _ns(ev["ts"])
            width = marker.after_ns - marker.before_ns
            mid = marker.before_ns + width // 2
            if best is None or width < best[0]:
                best = (width, mid - kineto)
    if best is not None:
        return ClockAlignment(offset_ns=best[1], error_ns=(best[0] + 1) // 2, method="marker")
    if base is not None:
        return ClockAlignment(offset_ns=0, error_ns=None, method="baseTimeNanoseconds")
    raise TraceAlignmentError(
        "Expected clock-sync markers (ppetrace.clock_sync#N events) or baseTimeNanoseconds in "
        "the Kineto trace to put it on the spans' clock, but it has neither. Record at least "
        "one active step in the window."
    )


class KinetoTracks:
    """Maps Kineto's ``(pid, tid)`` pairs to thread tracks of this process, stable across
    windows: ``tid`` from ``TORCH_TID_BASE`` up, named ``torch ...``."""

    def __init__(self, tid_base: int = TORCH_TID_BASE) -> None:
        self.tid_base = tid_base
        self.names: dict[int, str] = {}
        self._by_label: dict[str, int] = {}

    def tid(self, label: str) -> int:
        """The track of ``label`` (a new one the first time)."""
        tid = self._by_label.get(label)
        if tid is None:
            tid = self._by_label[label] = self.tid_base + len(self._by_label)
            self.names[tid] = label
        return tid


def kineto_events(
    doc: Mapping[str, Any],
    alignment: ClockAlignment,
    tracks: KinetoTracks,
    *,
    step_offset: int = 0,
    pid: int | None = None,
) -> list[dict[str, Any]]:
    """Kineto's events on the spans' clock, as raw events for ``add_events``.

    Times become ``ts_ns``/``dur_ns`` (epoch ns). Each Kineto thread gets a
    track of ``tracks`` (``torch ops: <thread>`` for this process's threads,
    ``torch <process> / <thread>`` for devices). ``ProfilerStep#n`` is
    renamed ``ProfilerStep#<n + step_offset>`` (the training step). Kineto's
    metadata, its global instants and the clock-sync markers are dropped.
    """
    me = os.getpid() if pid is None else pid
    base = kineto_base_ns(doc) or 0
    offset = base + alignment.offset_ns
    raw = [e for e in doc.get("traceEvents", ()) if isinstance(e, Mapping)]
    pnames: dict[Any, str] = {}
    tnames: dict[tuple[Any, Any], str] = {}
    for e in raw:
        if e.get("ph") == "M":
            args = e.get("args")
            label = args.get("name") if isinstance(args, Mapping) else None
            if e.get("name") == "process_name" and label is not None:
                pnames.setdefault(e.get("pid"), str(label))
            elif e.get("name") == "thread_name" and label is not None:
                tnames.setdefault((e.get("pid"), e.get("tid")), str(label))
    out: list[dict[str, Any]] = []
    for e in raw:
        ph = e.get("ph")
        if ph not in _KEPT_PHASES or "ts" not in e:
            continue
        name = str(e.get("name", ""))
        if name.startswith(MARKER_PREFIX) or e.get("cat") == "Trace":
            continue
        if ph in ("i", "I") and e.get("s") == "g":
            continue
        kpid, ktid = e.get("pid"), e.get("tid")
        tname = tnames.get((kpid, ktid), f"thread {ktid}")
        pname = pnames.get(kpid, kpid)
        label = f"torch ops: {tname}" if kpid == me else f"torch {pname} / {tname}"
        if name.startswith(_STEP_PREFIX) and name[len(_STEP_PREFIX) :].isdigit():
            name = f"{_STEP_PREFIX}{int(name[len(_STEP_PREFIX) :]) + step_offset}"
        ev: dict[str, Any] = {
            k: _plain(v) for k, v in e.items() if k not in ("ts", "dur", "pid", "tid", "name")
        }
        ev["name"] = name
        ev["tid"] = tracks.tid(label)
        ev["ts_ns"] = _ns(e["ts"]) + offset
        if ph == "X":
            ev["dur_ns"] = max(0, _ns(e.get("dur", 0)))
        out.append(ev)
    return out


def _marker(name: str) -> Any:
    """A ``record_function`` range named ``name``: torch's fast C++ one when it exists
    (a ~0.5 µs bracket instead of ~5 µs), else ``torch.autograd.profiler.record_function``."""
    import torch

    fast = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)
    if fast is not None:
        return fast(name)
    from torch.autograd.profiler import record_function

    return record_function(name)


def _activities(activities: Iterable[Any] | None) -> list[Any]:
    import torch
    from torch.profiler import ProfilerActivity

    if activities is None:
        found = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            found.append(ProfilerActivity.CUDA)
        return found
    names = {"cpu": ProfilerActivity.CPU, "cuda": ProfilerActivity.CUDA}
    out = []
    for a in activities:
        if isinstance(a, ProfilerActivity):
            out.append(a)
        elif isinstance(a, str) and a.lower() in names:
            out.append(names[a.lower()])
        else:
            raise ValueError(
                "Expected torch.profiler.ProfilerActivity values (or 'cpu', 'cuda') for "
                f"activities, but received {a!r}."
            )
    if not out:
        raise ValueError(
            "Expected at least one activity for activities, but received none. Pass None for "
            "CPU plus CUDA when available."
        )
    return out


class TorchProfiler(ScheduledProfiler):
    """Run ``torch.profiler`` during each window and merge its trace into the span trace.

    - ``activities``: ``torch.profiler.ProfilerActivity`` values or ``"cpu"``/
      ``"cuda"``; None means CPU, plus CUDA when available.
    - ``record_shapes``, ``profile_memory``, ``with_stack``: passed to
      ``torch.profiler.profile``.
    - ``schedule``: the windows (default ``Schedule()``); warm-up steps run
      the profiler without recording.
    - ``output_dir``: where each window's Kineto trace
      ``torch_steps<a>-<b>.json`` (the steps it records, warm-up left out) is kept
      (default as :class:`Pyinstrument`);
      ``keep_traces=False`` deletes them after the merge.

    Operators (and, on GPU, kernels) go to the Trainer's Chrome trace on
    ``torch ...`` tracks, aligned with the spans (module doc). Each window's
    ``info`` holds ``offset_ns``, ``alignment_error_ns``, ``alignment`` and
    ``events``.
    """

    uses_warmup = True

    def __init__(
        self,
        *,
        activities: Iterable[Any] | None = None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        schedule: Schedule | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        keep_traces: bool = True,
    ) -> None:
        super().__init__(schedule)
        self.activities = None if activities is None else _activities(activities)
        self.record_shapes = bool(record_shapes)
        self.profile_memory = bool(profile_memory)
        self.with_stack = bool(with_stack)
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.keep_traces = bool(keep_traces)
        self.tracks = KinetoTracks()
        self._dir: Path | None = self.output_dir
        self._resolved: list[Any] = []
        self._prof: Any = None
        self._markers: list[ClockMarker] = []
        self._marker_count = 0
        self._base_step = 0
        self._window: ProfileWindow | None = None

    def _named_tracks(self) -> dict[int, str]:
        return dict(self.tracks.names)

    def _setup(self, trainer: Any) -> None:
        self._dir = resolve_output_dir(self.output_dir, trainer)
        self._resolved = _activities(self.activities)

    # -- windows -----------------------------------------------------------------

    def _mark(self, tries: int = 3) -> None:
        off = RECORDER.offset_ns
        for _ in range(tries):
            name = f"{MARKER_PREFIX}{self._marker_count}"
            self._marker_count += 1
            rf = _marker(name)
            before = _perf_ns()
            rf.__enter__()
            after = _perf_ns()
            rf.__exit__(None, None, None)
            self._markers.append(ClockMarker(name, before + off, after + off))

    def _begin_window(self, step: int, action: ProfilerAction) -> None:
        import torch.profiler

        self._markers = []
        self._base_step = step
        self._prof = torch.profiler.profile(
            activities=self._resolved or _activities(self.activities),
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            schedule=self.schedule.to_torch(offset=step),
            on_trace_ready=self._trace_ready,
        )
        self._prof.start()
        if action.records:
            self._mark()

    def _window_step_begin(self, step: int) -> None:
        if self.schedule.action(step).records:
            self._mark()

    def _window_step_end(self, step: int) -> None:
        if self.schedule.action(step).records:
            self._mark()
        self._prof.step()

    def _end_window(self, window: ProfileWindow) -> None:
        if self.schedule.action(window.last_step).records:
            self._mark()
        prof, self._prof = self._prof, None
        self._window = window
        try:
            prof.stop()  # calls _trace_ready when the window recorded anything
        finally:
            self._window = None

    def _abort(self) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.on_trace_ready = None
            prof.stop()

    def _teardown(self) -> None:
        self._abort()

    def _trace_ready(self, prof: Any) -> None:
        window = self._window
        if window is None:  # only the window's end saves a trace
            return
        first = window.first_step  # the file is named by the steps it records, as
        while first < window.last_step and not self.schedule.action(first).records:
            first += 1  # Pyinstrument's are (the warm-up steps record nothing)
        stem = f"torch_steps{first}-{window.last_step}.json"
        if self.keep_traces and self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            path = self._dir / stem
            prof.export_chrome_trace(str(path))
            window.files["kineto"] = path
            doc = load_kineto(path)
        else:
            with tempfile.TemporaryDirectory(prefix="ppetrace-kineto-") as tmp:
                path = Path(tmp) / stem
                prof.export_chrome_trace(str(path))
                doc = load_kineto(path)
        try:
            alignment = align_kineto(doc, self._markers)
        except TraceAlignmentError:
            _log.warning(
                "ppetrace: the torch.profiler trace of steps %d-%d cannot be aligned with the "
                "spans; it is kept in its file but not merged",
                window.first_step,
                window.last_step,
                exc_info=True,
            )
            return
        events = kineto_events(doc, alignment, self.tracks, step_offset=self._base_step)
        window.info.update(
            offset_ns=alignment.offset_ns,
            alignment_error_ns=alignment.error_ns,
            alignment=alignment.method,
            events=len(events),
        )
        self.emit(events)
