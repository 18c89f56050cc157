"""The column-wise twin of ``DetailFilter._take_lane``: one thread's rows of a batch at once.

The pure-Python loop of :mod:`._detail` is the reference; this path gives the same
rows, aggregates and lane state for the common case and declines (returns False,
having changed nothing) for everything else, which the loop then takes: no C
helpers, a ``trainer.epoch``/``trainer.run`` row in the batch (it may end a step
whose row never comes), a step whose row never came, an interval that gave its
rows back (``full``) or would hold more than ``MAX_HELD`` rows. The columns come
from the C ``span_columns``; the rest is NumPy, and Python only per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .._accel import SPEEDUPS as _speedups

if TYPE_CHECKING:
    from .._spans import SpanRow
    from ._detail import DetailFilter, _Lane

__all__ = ["take_lane_fast"]

_HOOK, _FULL, _STEP, _ENCLOSING = 0, 1, 2, 3  # _detail._K_*


def take_lane_fast(
    filt: DetailFilter, lane: _Lane, group: list[SpanRow], out: list[Any], summaries: list[int]
) -> bool:
    """Take ``group`` (one thread's rows, in end order) as ``DetailFilter._take_lane``
    does, or return False without changing anything."""
    from ._detail import MAX_HELD, Summary, _Interval

    cur = lane.cur
    if _speedups is None or (cur is not None and cur.full):
        return False
    held = cur.rows if cur is not None else []
    h = len(held)
    combo = held + group if h else group
    cols = _speedups.span_columns(combo)
    names, statuses = cols[0], cols[2]
    if type(names) is not tuple or type(statuses) is not tuple:
        return False
    codes = np.frombuffer(names[0], dtype=np.int32)
    uniques = names[1]
    kinds_of = filt._kinds
    kind_u = np.array(
        [kinds_of.get(u) if u in kinds_of else filt._kind(u) for u in uniques], dtype=np.int8
    )
    kind = kind_u[codes]
    if (kind[h:] == _ENCLOSING).any():
        return False
    err_u = np.array([s == "ERROR" for s in statuses[1]], dtype=bool)
    is_err = err_u[np.frombuffer(statuses[0], dtype=np.int32)]
    start = np.frombuffer(cols[7], dtype=np.int64)
    end = np.frombuffer(cols[8], dtype=np.int64)
    span_ids = np.frombuffer(cols[5], dtype=np.uint64)
    parents = np.frombuffer(cols[6], dtype=np.uint64)
    published = list(lane.starts)
    m = len(published)
    # the step rows, in order: which close an interval, which are detailed
    step_pos = np.flatnonzero(kind == _STEP)
    closes: list[int] = []  # positions of the step rows that close intervals 0, 1, ...
    flags: list[bool] = []  # the announce flag of each close
    announce = lane.announce
    c = 0
    for i, st, en in zip(
        step_pos.tolist(), start[step_pos].tolist(), end[step_pos].tolist(), strict=True
    ):
        head = published[c] if c < m else 0
        # the step row of interval c; one that ends where it starts is an earlier step
        if c < m and (en > head or (en == head and st >= head)):
            if st > head:
                return False  # the interval's step row never came: the loop's case
            closes.append(i)
            flags.append(announce)
            announce = False
            c += 1
        else:
            announce = True  # a detailed step
    k = len(closes)
    n = len(combo)
    s_arr = np.asarray(published if m else [0], dtype=np.int64)
    # the interval each row falls in: the closes before it (held rows: interval 0)
    iv = np.searchsorted(np.asarray(closes, dtype=np.int64), np.arange(n), side="left")
    iv[:h] = 0
    in_iv = (iv < m) & (start >= s_arr[np.minimum(iv, max(m - 1, 0))])
    in_iv[:h] = True
    hook = in_iv & (kind == _HOOK) & ~is_err
    hook[:h] = True
    inner = in_iv & ~hook & (kind != _STEP)
    step_end = end[np.asarray(closes, dtype=np.int64)] if k else np.zeros(1, dtype=np.int64)
    closed = iv < k
    end_of_iv = step_end[np.minimum(iv, max(k - 1, 0))]
    fold = hook & closed & (end <= end_of_iv)
    late = hook & closed & (end > end_of_iv)  # ended after its step: in full
    carried = hook & ~closed
    if hook.any() and int(np.bincount(iv[hook]).max()) > MAX_HELD:
        return False  # the loop gives such an interval's rows back
    counted = (fold | (inner & closed & (end <= end_of_iv))) if k else fold
    # -- from here on, the lane changes ----------------------------------------------
    emit = ~(hook & ~late)  # every row but the folded and the carried ones
    emit[:h] &= late[:h]
    emit_idx = np.flatnonzero(emit).tolist()
    base = len(out)
    out.extend(map(combo.__getitem__, emit_idx))
    aggregates: list[dict[str, list[int]]] = [{} for _ in range(k)]
    if k:
        dur = np.maximum(end - start, 0)
        cp, cd = parents[counted], dur[counted]
        if cur is not None and cur.inner:  # interval 0's rows in full, from batches before
            last = int(step_end[0])
            extra = [(p, d) for _s, e, p, d in cur.inner if e <= last]
            if extra:
                cp = np.concatenate((cp, np.array([p for p, _ in extra], dtype=np.uint64)))
                cd = np.concatenate((cd, np.array([d for _, d in extra], dtype=np.int64)))
        by = np.argsort(cp, kind="stable")
        sp = cp[by]
        cuts = np.flatnonzero(sp[1:] != sp[:-1]) + 1
        uniq = sp[np.concatenate(([0], cuts))] if len(sp) else sp
        sums = np.add.reduceat(cd[by], np.concatenate(([0], cuts))) if len(sp) else cd
        fi = np.flatnonzero(fold)
        fid = span_ids[fi]
        pos = np.minimum(np.searchsorted(uniq, fid), max(len(uniq) - 1, 0))
        has = (pos < len(uniq)) & (uniq[pos] == fid) if len(uniq) else np.zeros(len(fi), bool)
        own = dur[fi] - np.where(has, sums[pos] if len(uniq) else 0, 0)
        fiv, fcode, fdur = iv[fi], codes[fi], dur[fi]
        order = np.lexsort((fi, fcode, fiv))  # by interval, name, first appearance
        if len(order):
            siv, scode = fiv[order], fcode[order]
            cut = np.flatnonzero((siv[1:] != siv[:-1]) | (scode[1:] != scode[:-1])) + 1
            heads = np.concatenate(([0], cut))
            tot = np.add.reduceat(fdur[order], heads).tolist()
            slf = np.add.reduceat(own[order], heads).tolist()
            cnt = np.diff(np.concatenate((heads, [len(order)]))).tolist()
            first = fi[order][heads]
            hiv, hcode = siv[heads].tolist(), scode[heads].tolist()
            # names in the order of their first row in the step (as the loop folds them)
            for j in np.lexsort((first, siv[heads])).tolist():
                aggregates[hiv[j]][uniques[hcode[j]]] = [tot[j], slf[j], cnt[j]]
        filt.spans_summarised += len(fi)
        filt.steps_summarised += k
        spots = np.searchsorted(np.asarray(emit_idx, dtype=np.int64), closes).tolist()
        for j, p in enumerate(closes):
            at = base + spots[j]
            out[at] = Summary(combo[p], lane, aggregates[j], flags[j])
            summaries.append(at)
        for _ in range(k):
            lane.starts.popleft()
    lane.announce = announce
    # the interval left open: its held rows and its rows written in full so far
    rest = np.flatnonzero(carried).tolist()
    kept_inner = np.flatnonzero(inner & ~closed & (np.arange(n) >= h)).tolist()
    old_inner = cur.inner if cur is not None and k == 0 else []
    if rest or kept_inner or old_inner:
        nxt = _Interval(published[k] if k < m else published[-1])
        nxt.rows = list(map(combo.__getitem__, rest))
        nxt.inner = old_inner + [
            (int(start[i]), int(end[i]), int(parents[i]), max(0, int(end[i] - start[i])))
            for i in kept_inner
        ]
        lane.cur = nxt
    else:
        lane.cur = None
    return True
