"""Parents by time on one thread, where parent ids say less than the clock.

Spans recorded with a ``with`` block know their parent when they start.
Some spans are recorded without entering the context that gives later spans
their parent: ``ppetrace.instrument()`` records its ``trainer.step`` and
``trainer.optimizer_step`` after the fact, and ``LightningProfiler`` records
Lightning's actions that way. The spans that ran inside them in time were
recorded with the parent that was current then: an ancestor of the span
that really contains them (a sibling, for instrument()'s steps).

:func:`effective_parents` repairs exactly that case, and spans whose parent is not in
the trace at all (below), and nothing else: a span
whose innermost enclosing span on the same process and thread (by time) lies
below its parent by id (and not below the span itself) gets that enclosing
span as its parent. On a trace whose ids already nest (ppetrace's Trainer,
any ``with``-block tracer) the innermost enclosing span on the thread is the
parent, and every span keeps it. Input: the frame's id columns and times as
arrays; output: parent row positions (``-1`` for a root) and whether any was
changed.
"""

from __future__ import annotations

import numpy as np

from ._accel import SPEEDUPS as _speedups
from .frame import _depth

__all__ = ["effective_parents", "self_times"]


def _enclosing(order: np.ndarray, end: np.ndarray, thread: np.ndarray) -> np.ndarray:
    """For each row, the row of the innermost span on its thread that encloses it
    (starts no later and ends no earlier; the longer first at equal starts), or -1.

    The rows in ``order`` are sorted by thread, start and longest first; for each
    position the answer is the nearest earlier position on the same thread whose
    end is not before this one's end (all nearest larger values): in one pass with a
    stack in C where it is built (``_speedups.enclosing_sorted``), else by pointer
    jumping in numpy (:func:`_enclosing_py`, its twin).
    """
    n = len(order)
    if _speedups is not None and n:
        out = np.empty(n, dtype=np.int64)
        _speedups.enclosing_sorted(
            np.ascontiguousarray(order, dtype=np.int64),
            np.ascontiguousarray(end, dtype=np.int64),
            np.ascontiguousarray(thread, dtype=np.int64),
            out,
        )
        return out
    return _enclosing_py(order, end, thread)


def _enclosing_py(order: np.ndarray, end: np.ndarray, thread: np.ndarray) -> np.ndarray:
    """:func:`_enclosing` by pointer jumping in numpy (the C path's twin)."""
    n = len(order)
    e = end[order]
    th = thread[order]
    pos = np.arange(n)
    first = np.ones(n, dtype=bool)
    first[1:] = th[1:] != th[:-1]
    thread_start = np.maximum.accumulate(np.where(first, pos, 0))
    # a cheap filter: the largest end so far on the thread (exclusive) must reach ours
    code = np.cumsum(first) - 1
    low = int(e.min())
    width = int(e.max()) - low + 1
    if width * (int(code[-1]) + 1) < (1 << 62):
        keyed = code * width + (e - low)
    else:  # ranks keep the order in fewer bits
        rank = np.unique(e, return_inverse=True)[1].reshape(-1).astype(np.int64)
        keyed = code * (n + 1) + rank
    running = np.maximum.accumulate(keyed)
    before = np.concatenate([[-1], running[:-1]])
    maybe = (~first) & (before >= keyed)
    p = np.where(maybe, pos - 1, -1)
    live = np.flatnonzero(maybe)
    while live.size:
        cand = p[live]
        ok = e[cand] >= e[live]
        live = live[~ok]
        if not live.size:
            break
        nxt = p[p[live]]
        nxt = np.where(nxt >= thread_start[live], nxt, -1)
        p[live] = nxt
        live = live[nxt >= 0]
    out = np.full(n, -1, dtype=np.int64)
    found = p >= 0
    out[order[found]] = order[p[found]]
    return out


def _root(ppos: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The root (the ancestor without a parent) of each of ``rows``."""
    cur = rows.copy()
    for _ in range(len(ppos)):  # bounded: ids never make a cycle, but a frame could
        up = ppos[cur]
        climbing = up >= 0
        if not climbing.any():
            break
        cur[climbing] = up[climbing]
    return cur


def _thread_codes(pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """One int64 per (pid, tid) pair, equal exactly for equal pairs."""
    tid_fits = len(tid) and int(tid.min()) >= 0 and int(tid.max()) < (1 << 32)
    if tid_fits and int(pid.min()) >= -(1 << 30) and int(pid.max()) < (1 << 30):
        return (pid.astype(np.int64) << 32) | tid.astype(np.int64)
    return np.unique(np.stack([pid, tid], axis=1), axis=0, return_inverse=True)[1].reshape(-1)


def effective_parents(
    ppos: np.ndarray,
    parent_id: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    pid: np.ndarray,
    tid: np.ndarray,
) -> tuple[np.ndarray, bool]:
    """Parent positions with the spans that enclose a span in time, below its parent by
    id, made its parent.

    ``ppos`` holds each row's parent position by id (-1: root or absent) and
    ``parent_id`` the parent ids. A row whose innermost enclosing span on the
    same pid and tid descends from the row's parent (the same ``ppos``, or the
    same absent ``parent_id``, at the row's depth) but not from the row itself
    is moved under it. Returns the positions and whether any changed.
    """
    n = len(ppos)
    if n < 2:
        return ppos, False
    thread = _thread_codes(pid, tid)
    order = np.lexsort((-(end - start), start, thread))
    enc = _enclosing(order, end, thread)
    # a span whose parent is not in the trace (a summarised step's hook, folded, above a
    # span written in full; a foreign OpenTelemetry span) goes under the innermost span
    # that encloses it on its thread, if any
    orphans = np.flatnonzero((ppos < 0) & (parent_id != 0) & (enc >= 0))
    if len(orphans):  # never under its own descendant (spans of equal times)
        orphans = orphans[_root(ppos, enc[orphans]) != orphans]
    if len(orphans):
        ppos = ppos.copy()
        ppos[orphans] = enc[orphans]
    rows = np.flatnonzero((enc >= 0) & (enc != ppos))
    if not len(rows):
        return ppos, bool(len(orphans))
    depth = _depth(ppos)
    # climb from the enclosing span to the row's own depth: the span there must be a
    # child of the row's parent (so the enclosing one lies below that parent) and not
    # the row itself (a span is never moved below its own descendant)
    cur = enc[rows]
    rows = rows[depth[cur] >= depth[rows]]
    cur = enc[rows]
    up = depth[cur] - depth[rows]
    while True:
        climbing = up > 0
        if not climbing.any():
            break
        cur[climbing] = ppos[cur[climbing]]
        up[climbing] -= 1
    same_parent = (ppos[cur] == ppos[rows]) & (
        (ppos[rows] >= 0) | (parent_id[cur] == parent_id[rows])
    )
    moved = rows[same_parent & (cur != rows)]
    if not len(moved):
        return ppos, bool(len(orphans))
    out = ppos.copy()
    out[moved] = enc[moved]
    return out, True


def self_times(dur: np.ndarray, ppos: np.ndarray, pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """``dur`` minus the direct children's durations on the same thread (the frame's rule)."""
    has = ppos >= 0
    safe = np.where(has, ppos, 0)
    same = has & (tid[safe] == tid) & (pid[safe] == pid)
    child = np.zeros(len(dur), dtype=np.int64)
    np.add.at(child, ppos[same], dur[same])
    return dur - child
