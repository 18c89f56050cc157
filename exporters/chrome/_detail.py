"""The detail filter of :class:`~exporters.chrome.ChromeTraceExporter`: summarised steps.

Takes in: the start of each training step that is to be *summarised*
(:meth:`DetailFilter.publish`, called on the training thread), and the rows
of each batch (:meth:`DetailFilter.take`, on the exporter's thread). Gives
back: the rows to write in full, in which the ``trainer.step`` row of each
summarised step carries the per-event aggregates of the hook-level rows it
replaces (count, total and self time, per event name).

Method. Each ``(pid, tid)`` has a *lane*: a FIFO of the published starts (the training
thread may publish step N+1 before this side has seen step N's row) and the interval
open now. A batch's rows are taken in the order they ended on each thread (a stable sort
by thread and end, the later start first at equal ends: a thread may record through
several buffers, as ``instrument()`` does). A row that starts at or after the head start
is held in the open interval, unless it is step-level (:data:`STEP_LEVEL_EVENTS`) or an
ERROR row: those are written in full. The ``trainer.step`` row that contains the head
start closes the interval (one that only ends there is an earlier step): its held rows
that ended within the step are folded into aggregates, the others are written in full.
An interval whose step row cannot come any more (a later ``trainer.step`` row,
or a ``trainer.epoch``/``trainer.run`` row around its start, ended first) and
an interval that holds more than :data:`MAX_HELD` rows give their rows back
in full: nothing is swallowed, and memory stays bounded. A row that arrives
after its step's row (in a later batch) is written in full too: the totals a
reader adds up stay right. ``flush_held`` gives back every held row (at
shutdown).

The attributes' format is the contract of ``ppetrace.hooks`` and
``ppetrace.hook_names`` documented on :class:`ChromeTraceExporter`.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from .._accel import SPEEDUPS as _speedups
from .._spans import SpanRow
from ._encode import _PART_ROWS, _dumps
from ._fold import light_lane_fast, take_lane_fast

__all__ = ["HOOKS", "HOOK_NAMES", "MAX_HELD", "STEP_LEVEL_EVENTS", "DetailFilter"]

#: Event names always written in full: the step level of a run (ppetrace's Trainer,
#: ``instrument()`` and ``LightningProfiler`` use these names at the step level).
STEP_LEVEL_EVENTS: frozenset[str] = frozenset(
    {
        "trainer.run",
        "trainer.epoch",
        "trainer.loader_start",
        "trainer.loader_end",
        "trainer.fetch_batch",
        "trainer.step",
        "trainer.validation",
        "trainer.checkpoint",
    }
)
#: The attribute with a summarised step's aggregates, and the one with the names list.
HOOKS, HOOK_NAMES = "ppetrace.hooks", "ppetrace.hook_names"
#: Rows one open interval may hold; past that its rows are written in full.
MAX_HELD = 1 << 16
#: Take a thread's rows in C where it can (``_fold``); False: the loop alone.
FAST = True
_STEP = "trainer.step"
_name, _start, _end, _tid = itemgetter(0), itemgetter(4), itemgetter(5), itemgetter(6)


def _escape(name: str) -> str:
    """An event name as ``ppetrace.hook_names`` lists it: ``%`` and ``;`` percent-encoded."""
    return name.replace("%", "%25").replace(";", "%3B")


_tuple_new = tuple.__new__
_K_HOOK, _K_FULL, _K_STEP, _K_ENCLOSING = 0, 1, 2, 3  # what a name is to the filter
_ENCLOSING = frozenset({"trainer.epoch", "trainer.run"})


class _Interval:
    """The rows of one summarised step seen so far."""

    __slots__ = ("start", "rows", "inner", "full")

    def __init__(self, start: int) -> None:
        self.start = start
        self.rows: list[SpanRow] = []  # held: to fold when the step row comes
        # rows in it written in full (step level, ERROR): (start, end, parent, duration)
        self.inner: list[tuple[int, int, int, int]] = []
        self.full = False  # gave its rows back (MAX_HELD): the rest is written in full


class _Lane:
    """One thread's published starts, open interval and names list."""

    __slots__ = (
        "starts",
        "light",
        "cur",
        "names",
        "index",
        "exact",
        "announce",
        "part",
        "listed",
    )

    def __init__(self) -> None:
        self.starts: deque[int] = deque()
        #: light steps (published when they end): (start, aggregates), see light_publisher
        self.light: deque[tuple[int, tuple[Any, ...]]] = deque()
        self.cur: _Interval | None = None
        self.names: list[str] = []  # as written (escaped), in the order they came
        self.index: dict[str, int] = {}  # name -> its place in names
        self.exact = True  # every key of index is an exact str (the C path's condition)
        self.announce = True  # write the names list on the next summarised step
        self.part = -1  # the part where the names list was last written
        self.listed = 0  # how many names it held then


#: A summarised step, made into a row by :meth:`DetailFilter.finish`: its ``trainer.step``
#: row (its ``ppetrace.hooks`` text among the attributes), its lane, how many names of the
#: lane's list that text refers to, and whether the names list must be written (the first
#: summarised step of its thread, or the first after a detailed step). A plain tuple: the
#: C fold makes them.
Summary = tuple[SpanRow, _Lane, int, bool]


def _entries(lane: _Lane, aggregates: dict[str, list[int]]) -> str:
    """The ``ppetrace.hooks`` text of a step's aggregates; a new name is added to the
    lane's names list (``_speedups.fold_lane`` is the C twin)."""
    names, index = lane.names, lane.index
    entries = [""] * len(names)
    for name, (total, own, count) in aggregates.items():
        at = index.get(name)
        if at is None:
            if type(name) is not str:
                lane.exact = False
            at = index[name] = len(names)
            names.append(_escape(name) if "%" in name or ";" in name else name)
            entries.append("")
        if count != 1:
            entries[at] = f"{total}/{own}/{count}"
        elif own != total:
            entries[at] = f"{total}/{own}"
        else:
            entries[at] = str(total)
    while entries and not entries[-1]:
        entries.pop()
    return ";".join(entries)


class DetailFilter:
    """Folds the hook-level rows of summarised steps (see the module doc)."""

    def __init__(self) -> None:
        self._lanes: dict[tuple[int, int], _Lane] = {}
        self._create = threading.Lock()
        self._kinds: dict[str, int] = {}  # event name -> _K_*
        #: True once a step was published: before that, rows pass untouched at no cost
        self.active = False
        self.spans_summarised = 0
        self.steps_summarised = 0
        #: spans of light steps whose step row never came (their aggregates are not written)
        self.light_lost = 0
        #: the exporter's alarm (``ChromeTraceExporter.on_bytes``): its byte count, its callback
        self.alarm_bytes: float = float("inf")
        self.alarm: Callable[[], None] | None = None

    def ring(self) -> None:
        """The alarm's byte count was reached: call its callback once."""
        alarm, self.alarm, self.alarm_bytes = self.alarm, None, float("inf")
        if alarm is not None:
            alarm()

    def publish(self, pid: int, tid: int, start_ns: int) -> None:
        """Summarise the step that starts at ``start_ns`` on thread ``tid`` (thread-safe)."""
        lane = self._lanes.get((pid, tid))
        if lane is None:
            with self._create:
                lane = self._lanes.setdefault((pid, tid), _Lane())
        lane.starts.append(start_ns)  # deque.append is atomic
        self.active = True

    def light_publisher(self, pid: int, tid: int) -> Callable[[tuple[int, tuple[Any, ...]]], None]:
        """For one thread: a callable of one pair ``(start_ns, aggregates)`` that
        publishes a *light* step, one whose spans the recorder took as aggregates only
        (``begin_light`` in ``ppetrace.tracing._fold``): ``aggregates`` is ``(name,
        total, self, count, ...)``. Call it when the step ends, before its row is made:
        the step row that starts at ``start_ns`` is then written with these aggregates.
        It is the lane's ``deque.append`` (atomic, and no Python frame per step)."""
        self.active = True
        lane = self._lanes.get((pid, tid))
        if lane is None:
            with self._create:
                lane = self._lanes.setdefault((pid, tid), _Lane())
        return lane.light.append

    def pending(self) -> bool:
        """Whether a published step is still waiting for its rows (else :meth:`take` has
        nothing to do: :meth:`idle` instead)."""
        return any(
            lane.starts or lane.light or lane.cur is not None for lane in list(self._lanes.values())
        )

    def idle(self) -> None:
        """A batch went by without :meth:`take`: its steps were detailed, so the next
        summarised step of each thread writes the names list."""
        for lane in list(self._lanes.values()):
            lane.announce = True

    def publisher(self, pid: int, tid: int) -> Callable[[int], None]:
        """:meth:`publish` for one thread: a callable of the start alone."""
        self.active = True
        lane = self._lanes.get((pid, tid))
        if lane is None:
            with self._create:
                lane = self._lanes.setdefault((pid, tid), _Lane())
        return lane.starts.append

    def take(self, pid: int, rows: Sequence[SpanRow]) -> tuple[list[Any], list[int]]:
        """The rows of a batch to write, and the indices among them of the
        :data:`Summary` tuples that stand for summarised step rows."""
        lanes = self._lanes
        n = len(rows)
        out: list[Any] = []
        summaries: list[int] = []
        if not n:
            return out, summaries
        if FAST and _speedups is not None and type(rows) is list:
            # the common case: one thread's rows, in end order already (else it declines)
            tid = _speedups.one_thread(rows)
            lane = lanes.get((pid, tid)) if tid is not None else None
            if lane is not None and (
                light_lane_fast(self, lane, rows, out, summaries)
                if lane.light
                else (lane.cur is not None or lane.starts)
                and take_lane_fast(self, lane, rows, out, summaries)
            ):
                return out, summaries
        for tid, group in self._groups(rows):
            lane = lanes.get((pid, tid))
            if lane is None:
                out.extend(group)
            elif lane.light:
                if not (FAST and light_lane_fast(self, lane, group, out, summaries)):
                    self._take_lane(lane, group, out, summaries)
            elif lane.cur is None and not lane.starts:
                if _STEP in map(_name, group):
                    lane.announce = True  # a detailed step
                out.extend(group)
            elif not (FAST and take_lane_fast(self, lane, group, out, summaries)):
                self._take_lane(lane, group, out, summaries)
        return out, summaries

    @staticmethod
    def _groups(rows: Sequence[SpanRow]) -> list[tuple[Any, list[SpanRow]]]:
        """The rows grouped by thread, each group in end order (the later start first
        at equal ends)."""
        n = len(rows)
        try:
            if _speedups is not None:  # the columns in C
                cols = _speedups.span_columns(rows if type(rows) is list else list(rows))
                starts = np.frombuffer(cols[7], dtype=np.int64)
                ends = np.frombuffer(cols[8], dtype=np.int64)
                tids = np.frombuffer(cols[9], dtype=np.int64)
            else:
                starts = np.fromiter(map(_start, rows), dtype=np.int64, count=n)
                ends = np.fromiter(map(_end, rows), dtype=np.int64, count=n)
                tids = np.fromiter(map(_tid, rows), dtype=np.int64, count=n)
            # at equal ends the later start (the inner span) first: instrument() records a
            # step and its last optimizer step after the fact, both ending at one instant
            order = np.lexsort((-starts, ends, tids))
            if (order == np.arange(n)).all():  # one buffer's rows: in order already
                ordered = list(rows)
            else:
                ordered = list(map(rows.__getitem__, order.tolist()))
            sorted_tids = tids[order]
            cuts = (np.flatnonzero(sorted_tids[1:] != sorted_tids[:-1]) + 1).tolist()
            groups = [
                (int(sorted_tids[lo]), ordered[lo:hi])
                for lo, hi in zip([0, *cuts], [*cuts, n], strict=True)
            ]
            return groups
        except (OverflowError, TypeError, ValueError):  # ids beyond int64
            by_tid: dict[Any, list[SpanRow]] = {}
            for r in sorted(rows, key=lambda r: (r[6], r[5], -r[4])):
                by_tid.setdefault(r[6], []).append(r)
            return list(by_tid.items())

    def _kind(self, name: str) -> int:
        kinds = self._kinds
        if len(kinds) > 65_536:
            kinds.clear()
        if name == _STEP:
            kind = _K_STEP
        elif name in _ENCLOSING:
            kind = _K_ENCLOSING
        elif name in STEP_LEVEL_EVENTS:
            kind = _K_FULL
        else:
            kind = _K_HOOK
        kinds[name] = kind
        return kind

    def _take_lane(
        self, lane: _Lane, group: list[SpanRow], out: list[Any], summaries: list[int]
    ) -> None:
        """The rows of one thread with published steps, in end order (the module doc)."""
        kinds = self._kinds
        starts = lane.starts
        light = lane.light
        cur = lane.cur
        emit = out.append
        start = 0
        for row in group:
            kind = kinds.get(row[0])
            if kind is None:
                kind = self._kind(row[0])
            if light and kind == _K_STEP and self._light_step(lane, row, out, summaries):
                continue
            while True:
                if cur is not None:
                    start = cur.start
                elif starts:
                    start = starts[0]
                else:
                    if kind == _K_STEP:
                        lane.announce = True  # a detailed step
                    emit(row)
                    break
                if kind == _K_HOOK and row[8] != "ERROR":
                    if row[4] >= start:
                        if cur is None:
                            cur = _Interval(start)
                        if cur.full:
                            emit(row)
                        else:
                            held = cur.rows
                            held.append(row)
                            if len(held) > MAX_HELD:
                                out.extend(held)
                                cur.rows = []
                                cur.full = True
                    else:
                        emit(row)
                    break
                if kind == _K_STEP:
                    if row[5] < start or (row[5] == start and row[4] < start):
                        # an earlier step, in full (one that ends where this interval
                        # starts, too: without a DataLoader the next step starts there)
                        lane.announce = True
                        emit(row)
                        break
                    if row[4] <= start:  # the step row of this interval
                        starts.popleft()
                        done = cur if cur is not None else _Interval(start)
                        cur = None
                        if done.full:
                            lane.announce = True
                            emit(row)
                        else:
                            summary = self._close(row, lane, done, out)
                            summaries.append(len(out))
                            emit(summary)
                        break
                elif row[4] >= start:  # in the step, written in full
                    if cur is None:
                        cur = _Interval(start)
                    if not cur.full:
                        cur.inner.append((row[4], row[5], row[2], max(0, row[5] - row[4])))
                    emit(row)
                    break
                elif not (kind == _K_ENCLOSING and start < row[5]):
                    emit(row)
                    break
                # the interval's step row can no longer come: its rows in full, but for
                # those of the next published step
                starts.popleft()
                if cur is not None:
                    lane.cur = None
                    self._give_back(lane, cur, out)
                    cur = lane.cur
        lane.cur = cur

    def _light_step(self, lane: _Lane, row: SpanRow, out: list[Any], summaries: list[int]) -> bool:
        """``row`` (a step row) as the summary of the light step that starts where it does:
        True; False when no light step starts there. Published light steps that start
        before it can no longer get their row: their spans are counted lost."""
        light, start = lane.light, row[4]
        while light and light[0][0] < start:
            self.light_lost += sum(light.popleft()[1][3::4])
        if not light or light[0][0] != start:
            return False
        flat = light.popleft()[1]
        aggregates = {
            flat[k]: [flat[k + 1], flat[k + 2], flat[k + 3]] for k in range(0, len(flat), 4)
        }
        summaries.append(len(out))
        out.append(self._summary(row, lane, aggregates, sum(flat[3::4])))
        return True

    @staticmethod
    def _give_back(lane: _Lane, cur: _Interval, out: list[Any]) -> None:
        """Write an orphaned interval's rows, but move those that start at or after the
        next published start to that step's interval."""
        nxt = lane.starts[0] if lane.starts else None
        if nxt is None or cur.full:
            out.extend(cur.rows)
            return
        moved = _Interval(nxt)
        for r in cur.rows:
            if r[4] >= nxt:
                moved.rows.append(r)
            else:
                out.append(r)
        moved.inner = [x for x in cur.inner if x[0] >= nxt]
        if moved.rows or moved.inner:
            lane.cur = moved

    def _close(self, row: SpanRow, lane: _Lane, cur: _Interval, out: list[Any]) -> Summary:
        end = row[5]
        children: dict[int, int] = {}  # parent span id -> the sum of its children's durations
        folded = []
        for r in cur.rows:
            if r[5] <= end:
                folded.append(r)
                dur = r[5] - r[4]
                children[r[2]] = children.get(r[2], 0) + (dur if dur > 0 else 0)
            else:  # recorded inside the interval but ended after the step: in full
                out.append(r)
        for _start, stop, parent, dur in cur.inner:
            if stop <= end:
                children[parent] = children.get(parent, 0) + dur
        aggregates: dict[str, list[int]] = {}
        for r in folded:
            dur = r[5] - r[4]
            if dur < 0:
                dur = 0
            own = dur - children.get(r[1], 0)
            agg = aggregates.get(r[0])
            if agg is None:
                aggregates[r[0]] = [dur, own, 1]
            else:
                agg[0] += dur
                agg[1] += own
                agg[2] += 1
        return self._summary(row, lane, aggregates, len(folded))

    def _summary(
        self, row: SpanRow, lane: _Lane, aggregates: dict[str, list[int]], spans: int
    ) -> Summary:
        """The :data:`Summary` of the step row ``row`` with ``aggregates`` (of ``spans``
        spans)."""
        self.spans_summarised += spans
        self.steps_summarised += 1
        announce, lane.announce = lane.announce, False
        hooks = _entries(lane, aggregates)
        done = _tuple_new(SpanRow, (*row[:7], {**row[7], HOOKS: hooks}, row[8], row[9]))
        return (done, lane, len(lane.names), announce)

    def finish(self, out: list[Any], summaries: Iterable[int], part: int) -> None:
        """Replace the :data:`Summary` tuples at ``summaries`` (in order) by their step
        rows, for rows written to part ``part``. The names list is added when the
        summary asks for it, on the first step of a part, and when the step refers to
        names not written yet (a new name)."""
        for i in summaries:
            row, lane, count, announce = out[i]
            if announce or lane.part != part or count > lane.listed:
                lane.part, lane.listed = part, count
                names = lane.names
                listed = ";".join(names if count == len(names) else names[:count])
                attrs = {**row[7], HOOK_NAMES: listed}
                row = _tuple_new(SpanRow, (*row[:7], attrs, row[8], row[9]))
            out[i] = row

    def flush_held(self) -> dict[int, list[SpanRow]]:
        """Every held row, by pid, and forget the open intervals (the run ends)."""
        held: dict[int, list[SpanRow]] = {}
        for (pid, _tid), lane in list(self._lanes.items()):
            cur = lane.cur
            if cur is not None and cur.rows:
                held.setdefault(pid, []).extend(cur.rows)
            lane.cur = None
            lane.starts.clear()
            while lane.light:  # light steps whose row never came
                self.light_lost += sum(lane.light.popleft()[1][3::4])
        return held

    def held(self) -> int:
        """How many rows are held in open intervals now."""
        return sum(len(lane.cur.rows) for lane in list(self._lanes.values()) if lane.cur)


# -- writing, for ChromeTraceExporter (its lock held) --------------------------------------


def write_summarised(
    exporter: Any,
    out: list[Any],
    summaries: list[int],
    pid: int,
    meta: list[str],
    earliest: int | None,
) -> int:
    """Write ``out`` in slices of one encoded part each, the summarised step rows of each
    slice given their attributes for the part file it goes to; returns the rows written."""
    written = 0
    at = 0
    for lo in range(0, len(out), _PART_ROWS):
        hi = lo + _PART_ROWS
        upto = bisect_left(summaries, hi, at)  # summaries are positions in out, ascending
        mine, at = summaries[at:upto], upto
        exporter._detail.finish(out, mine, exporter._part + exporter._switching())
        first = exporter._first_event and not meta
        for part in exporter._encode_spans(out[lo:hi], pid, first):
            exporter._write(meta, earliest, part, spans=part[1])
            written += part[1]
            meta, earliest = [], None
    return written


def write_held(exporter: Any, log: logging.Logger) -> None:
    """Write the rows the filter still holds, in full (the run ends)."""
    for pid, rows in exporter._detail.flush_held().items():
        written = 0
        try:
            for part in exporter._encode_spans(rows, pid, exporter._first_event):
                exporter._write([], None, part, spans=part[1])
                written += part[1]
        except Exception as exc:
            exporter.errors += 1
            exporter.spans_lost += len(rows) - written
            exporter.last_error = f"encoding spans for {exporter.path} failed: {exc}"
            log.exception("exporters: encoding spans for %s failed", exporter.path)


def final_event(exporter: Any, name: str) -> str | None:
    """The closing ``M`` event with the final counts, or None when there is nothing to say
    (no step was summarised and no final metadata was given)."""
    detail = exporter._detail
    if not detail.active and not exporter._final:
        return None
    args = {
        "steps_summarised": detail.steps_summarised,
        "spans_summarised": detail.spans_summarised,
        "parts": len(exporter._paths) + exporter._switching(),
        **({"light_spans_lost": detail.light_lost} if detail.light_lost else {}),
        **exporter._final,
    }
    pid = int(exporter._other["pid"] or exporter._pid)
    return f'{{"ph":"M","name":"{name}","pid":{pid},"tid":0,"args":{_dumps(args)}}}'
