"""The C twin of ``DetailFilter._take_lane``: one thread's rows of a batch at once.

The pure-Python loop of :mod:`._detail` is the reference; ``_speedups.fold_lane``
gives the same rows, summaries and lane state for the common case and declines
(returns None, having changed nothing) for everything else, which the loop then
takes: no C helpers, rows not in end order (``take`` gives it a batch of one
thread's rows as it came, and sorts the batch only when it declines), an interval
that gave its rows back (``full``) or would hold more than ``MAX_HELD`` rows, a
step whose row cannot come any more (a later step's row, or a
``trainer.epoch``/``trainer.run`` row around its start, ended first), rows, times,
names or step attributes of unusual types (see the C function's comment), a names
index with a key that is not an exact str.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._accel import SPEEDUPS as _speedups
from .._spans import SpanRow

if TYPE_CHECKING:
    from ._detail import DetailFilter, _Lane

__all__ = ["light_lane_fast", "take_lane_fast"]


def take_lane_fast(
    filt: DetailFilter, lane: _Lane, group: list[SpanRow], out: list[Any], summaries: list[int]
) -> bool:
    """Take ``group`` (one thread's rows, in end order) as ``DetailFilter._take_lane``
    does, or return False without changing anything."""
    from . import _detail

    cur = lane.cur
    if _speedups is None or not lane.exact or (cur is not None and cur.full):
        return False
    starts = lane.starts
    taken = _speedups.fold_lane(
        group,
        list(starts),
        None if cur is None else (cur.start, cur.rows, cur.inner),
        lane.announce,
        lane,
        lane.names,
        lane.index,
        _detail._STEP,
        _detail.STEP_LEVEL_EVENTS,
        _detail._ENCLOSING,
        _detail.MAX_HELD,
        len(out),
        _detail.HOOKS,
        SpanRow,
    )
    if taken is None:
        return False
    rows, spots, popped, lane.announce, nxt, folded, steps = taken
    out += rows
    summaries += spots
    for _ in range(popped):
        starts.popleft()
    if nxt is None:
        lane.cur = None
    else:
        lane.cur = kept = _detail._Interval(nxt[0])
        kept.rows, kept.inner = nxt[1], nxt[2]
    filt.spans_summarised += folded
    filt.steps_summarised += steps
    return True


def light_lane_fast(
    filt: DetailFilter, lane: _Lane, group: list[SpanRow], out: list[Any], summaries: list[int]
) -> bool:
    """Take ``group`` (one thread's rows, in end order) of a lane with light steps only,
    as ``DetailFilter._take_lane`` does (``_speedups.light_lane``), or return False
    without changing anything."""
    from . import _detail

    if _speedups is None or not lane.exact or lane.cur is not None or lane.starts:
        return False
    taken = _speedups.light_lane(
        group,
        list(lane.light),
        lane.announce,
        lane,
        lane.names,
        lane.index,
        _detail._STEP,
        _detail.HOOKS,
        SpanRow,
        len(out),
    )
    if taken is None:
        return False
    rows, spots, popped, lane.announce, spans, steps, lost = taken
    out += rows
    summaries += spots
    for _ in range(popped):
        lane.light.popleft()
    filt.spans_summarised += spans
    filt.steps_summarised += steps
    filt.light_lost += lost
    return True
