"""Which training step each span belongs to, and each step's wall time.

One definition of a step serves ppetrace's Trainer, ``ppetrace.instrument()``
and ``LightningProfiler`` alike (README, "What a step covers"):

A training step is one ``trainer.step`` span; it starts when the loader has
handed over its batch. Its wall time runs from the end of the previous
``trainer.step`` under the same parent span on the same thread (for the
first step, from the start of its first ``trainer.fetch_batch`` or, without
one, its own start) to its end. It splits into:

- ``data_wait_ns``: the wait for the batch, counted once wherever the fetch
  sits: every ``trainer.fetch_batch`` sibling between the previous step and
  this one (the Trainer's and instrument()'s layout: one fetch, or one per
  loader when a loop zips two, or also one whose batch a ``break`` threw
  away), plus any ``trainer.fetch_batch`` inside the step (a loop that
  fetches from inside its step), each taken once;
- ``compute_ns``: the ``trainer.step`` span itself, less the fetches inside it;
- ``between_ns``: the rest of the wall time (loop overhead between steps),
  without sibling ``trainer.validation`` and ``trainer.checkpoint`` spans,
  which are not step time and are left out of ``wall_ns`` as well.

The wall time also splits by what ran (:mod:`exporters._parts`): ``data_wait_ns``,
``forward_ns``, ``backward_ns``, ``optimizer_ns`` and ``other_ns``, which add up
to ``wall_ns``.

Parents come from span ids, and from time where ids cannot know them: a span
recorded after the fact (``instrument()`` records ``trainer.step`` when it
ends) encloses spans that were recorded as its siblings, and those are
nested under it by time on the same thread (:mod:`exporters._nesting`).
A span belongs to a step when it is that ``trainer.step``, one of that step's
``trainer.fetch_batch`` spans, or a descendant of either. Steps are numbered per
process in start order (``step_index``); the first ``warmup_steps`` of each
process are warmup. A step inside a window of a scheduled profiler
(``frame.attrs["profile_windows"]``) is ``profiled``: its profiling slowed it,
so reports and comparisons leave it out, as they do the warmup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ._accel import SPEEDUPS as _speedups
from ._aggregates import Aggregates
from ._names import SAVE_WINDOW_EVENT
from ._nesting import effective_parents, self_times
from ._pandas import objects
from ._parts import on_step_thread, part_sums, summarised_part_sums
from .frame import _inherit, _parent_positions

__all__ = [
    "FETCH",
    "MODULE_FORWARD",
    "NOT_STEP_TIME",
    "STEP",
    "STEP_WALL",
    "StepAssignment",
    "assign_steps",
    "event_labels",
    "left_out_steps",
    "name_codes",
]

STEP = "trainer.step"
#: compare's name for each step's wall time (``wall_ns``): no span has it
STEP_WALL = "step.wall"
FETCH = "trainer.fetch_batch"
#: Sibling spans between steps that are not counted as step time.
NOT_STEP_TIME = (
    "trainer.validation",
    "trainer.checkpoint",
    "trainer.loader_start",  # iter(loader): the workers' start
    "trainer.loader_end",  # the iterator's end: the workers' shutdown
    SAVE_WINDOW_EVENT,
)
_BATCH_SIZE_COLUMNS = ("ppetrace.batch_size", "batch_size")
STEP_COLUMNS = (
    "step_index",
    "pid",
    "rank",
    "epoch",
    "step",
    "batch_idx",
    "batch_size",
    "start_ns",
    "end_ns",
    "wall_ns",
    "data_wait_ns",
    "forward_ns",
    "backward_ns",
    "optimizer_ns",
    "other_ns",
    "compute_ns",
    "between_ns",
    "device_ns",
    "warmup",
    "profiled",
    "failed",
)
#: the ``stage`` values of spans that are not training: ``compare`` and the step report
#: count them (and the spans below them) as validation
NOT_TRAINING_STAGES = ("val", "test", "predict")


@dataclass
class StepAssignment:
    """``step_row``: for each frame row, the row of its ``trainer.step`` (-1 if none).
    ``steps``: one row per ``trainer.step``, indexed by its frame row, in start order
    per process, with ``step_index``, ``warmup``, ``profiled`` (inside a profiled
    window), ``failed`` (ERROR status) and the wall-time split.
    ``self_ns``: each row's self time with the parents found by time, or ``None``
    when time changed no parent (the frame's ``self_ns`` is right then).
    ``ppos``: each row's parent position (by id, then by time; -1 for none).
    ``on_thread``: whether each row is inside a step on that step's thread.
    ``names``: ``pd.factorize`` of the frame's names (codes, uniques), for the tables.
    With aggregates of summarised steps, ``self_ns`` is always given: a summarised
    step's ``trainer.step`` row then has the self time of its aggregated spans taken
    off its own (exactly its self time, unless a span written in full in such a step,
    an ERROR span, had aggregated children)."""

    step_row: np.ndarray
    steps: pd.DataFrame
    self_ns: np.ndarray | None = None
    ppos: np.ndarray | None = None
    on_thread: np.ndarray | None = None
    names: tuple[np.ndarray, np.ndarray] | None = None


def _numeric(frame: pd.DataFrame, column: str, rows: np.ndarray) -> np.ndarray:
    if column not in frame.columns:
        return np.full(len(rows), np.nan)
    values = pd.to_numeric(frame[column].iloc[rows], errors="coerce")
    return np.asarray(values, dtype=float)


def _batch_sizes(frame: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
    for col in _BATCH_SIZE_COLUMNS:
        if col in frame.columns:
            return _numeric(frame, col, rows)
    return np.full(len(rows), np.nan)


def _scan(group: np.ndarray, time: np.ndarray, kind: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Order items by (group, time, kind); return the order and each position's group start."""
    order = np.lexsort((kind, time, group))
    g = group[order]
    new = np.ones(len(g), dtype=bool)
    new[1:] = g[1:] != g[:-1]
    starts = np.maximum.accumulate(np.where(new, np.arange(len(g)), 0))
    return order, starts


def name_codes(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """``pd.factorize`` of the frame's names: int64 codes and the names (objects),
    computed once and shared by the step assignment, the aggregates and the tables.
    In C where it is built (``_speedups.dict_encode``, its twin for str and None: a
    row whose name is the same object as the row before's costs a pointer compare)."""
    names = frame["name"].to_numpy(dtype=object)
    encoded = _speedups.dict_encode(names.tolist()) if _speedups is not None else None
    if encoded is not None:
        codes, uniques = encoded
        return np.frombuffer(codes, dtype=np.int32).astype(np.int64), objects(uniques)
    codes, uniques = pd.factorize(names)
    return np.asarray(codes, dtype=np.int64), np.asarray(uniques, dtype=object)


#: the span of a module call; with ``instrument(module_depth > 1)`` its ``ppetrace.module``
#: is the class name for the outermost call and a dotted path for the submodules inside it
MODULE_FORWARD = "module.forward"
_MODULE = "ppetrace.module"


def event_labels(
    frame: pd.DataFrame, coded: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """The events the tables and ``compare`` count, as ``coded`` (:func:`name_codes`): each
    name, except that a ``module.forward`` of a submodule (``ppetrace.module`` a dotted
    path, such as ``Net.encoder``) is the event ``module.forward [Net.encoder]``. Those
    calls run inside the outermost module's ``module.forward``: under one name, their
    time would count twice in its inclusive total and per-step sum, and its count, mean
    and percentiles would mix the model with its parts."""
    codes, uniques = coded
    if _MODULE not in frame.columns:
        return coded
    at = np.flatnonzero(uniques == MODULE_FORWARD)
    if not len(at):
        return coded
    rows = np.flatnonzero(codes == at[0])
    modules = frame[_MODULE].to_numpy(dtype=object)[rows]
    inner = np.fromiter(
        (isinstance(m, str) and "." in m for m in modules), dtype=bool, count=len(rows)
    )
    if not inner.any():
        return coded
    sub, paths = pd.factorize(modules[inner])
    out = codes.copy()
    out[rows[inner]] = len(uniques) + np.asarray(sub, dtype=np.int64)
    labels = np.array([f"{MODULE_FORWARD} [{p}]" for p in paths], dtype=object)
    return out, np.concatenate([np.asarray(uniques, dtype=object), labels])


def assign_steps(
    frame: pd.DataFrame,
    warmup_steps: int,
    aggregates: Aggregates | None = None,
    coded: tuple[np.ndarray, np.ndarray] | None = None,
) -> StepAssignment:
    """Find the steps of ``frame`` and assign every span to one (see the module doc).

    ``aggregates`` (of ``frame``'s summarised steps, :mod:`exporters._aggregates`) add
    their self times to the parts of their steps (:func:`exporters._parts.summarised_part_sums`);
    the parts of a summarised step whose aggregates cannot be read are NaN.
    ``coded``: :func:`name_codes` of ``frame``, when the caller has them."""
    n = len(frame)
    pid = frame["pid"].to_numpy(np.int64)
    tid = frame["tid"].to_numpy(np.int64)
    parent = frame["parent_id"].to_numpy(np.uint64)
    t0 = int(frame["start_ns"].min()) if n else 0
    # times relative to the first span: exact in float64 (NaN-able) arrays
    start = frame["start_ns"].to_numpy(np.int64) - t0
    end = frame["end_ns"].to_numpy(np.int64) - t0
    span_ids = frame["span_id"].to_numpy(np.uint64)
    ppos = _parent_positions(span_ids, parent, pid) if n else np.zeros(0, np.int64)
    ppos, by_time = effective_parents(ppos, parent, start, end, pid, tid)
    if by_time:  # group siblings under the parents found by time
        parent = np.where(ppos >= 0, span_ids[np.where(ppos >= 0, ppos, 0)], parent)
    # the names as integer codes: one hashing pass, then integer comparisons
    codes, uniques = name_codes(frame) if coded is None else coded
    where = {name: i for i, name in enumerate(uniques.tolist()) if isinstance(name, str)}
    step_rows = np.flatnonzero(codes == where.get(STEP, -2))
    fetch_rows = np.flatnonzero(codes == where.get(FETCH, -2))
    excl = [where[name] for name in NOT_STEP_TIME if name in where]
    excl_rows = np.flatnonzero(np.isin(codes, excl)) if excl else np.zeros(0, np.int64)
    m = len(step_rows)

    # siblings: the same process, thread and parent span
    rows = np.concatenate([step_rows, fetch_rows, excl_rows])
    if len(rows):
        keys = pd.DataFrame({"p": pid[rows], "t": tid[rows], "g": parent[rows].view(np.int64)})
        # one id per (pid, tid, parent): hashed, which is several times faster than
        # np.unique(axis=0); only equality of the ids matters
        group_all = keys.groupby(["p", "t", "g"], sort=False).ngroup().to_numpy(np.int64)
    else:
        group_all = np.zeros(0, dtype=np.int64)
    g_step = group_all[:m]
    g_fetch = group_all[m : m + len(fetch_rows)]
    g_excl = group_all[m + len(fetch_rows) :]
    s_start, s_end = start[step_rows], end[step_rows]

    # the previous step in the same group, and the fetches between it and this step: all
    # of them (two loaders zipped, or a fetch whose batch a `break` threw away) are the
    # step's data wait, not only the last one
    prev_end = np.full(m, np.nan)
    k = len(fetch_rows)
    owner = np.full(k, -1, dtype=np.int64)  # per fetch: the step (index) it waits for
    group = np.concatenate([g_fetch, g_step])
    time = np.concatenate([end[fetch_rows], s_start])
    kind = np.concatenate([np.zeros(k, np.int64), np.ones(m, np.int64)])  # fetch first
    order, gstart = _scan(group, time, kind)
    if len(order):
        pos = np.arange(len(order))
        is_step = order >= k
        last_step = np.maximum.accumulate(np.where(is_step, pos, -1))
        prev_step = np.concatenate([[-1], last_step[:-1]])  # strictly before
        sp = pos[is_step]
        step_i = order[sp] - k  # index into step_rows
        has_prev = prev_step[sp] >= gstart[sp]
        prev_end[step_i[has_prev]] = s_end[order[prev_step[sp][has_prev]] - k]
        # each fetch's next step in its group (scanning from the end)
        big = len(order)
        nxt = np.minimum.accumulate(np.where(is_step, pos, big)[::-1])[::-1]
        fp = pos[~is_step]
        nx = nxt[fp]
        valid = nx < big
        group_sorted = group[order]
        valid[valid] &= group_sorted[nx[valid]] == group_sorted[fp[valid]]
        f_i = order[fp[valid]]  # index into fetch_rows
        s_i = order[nx[valid]] - k
        ok = np.isnan(prev_end[s_i]) | (start[fetch_rows[f_i]] >= prev_end[s_i])
        owner[f_i[ok]] = s_i[ok]
    owned = owner >= 0
    own_rows, own_steps = fetch_rows[owned], owner[owned]
    data_wait = np.zeros(m, dtype=np.int64)
    np.add.at(data_wait, own_steps, end[own_rows] - start[own_rows])
    # which step each span belongs to: nearest ancestor (or self) that is a step or its fetch
    anchor = np.full(n, np.nan)
    anchor[step_rows] = step_rows
    anchor[own_rows] = step_rows[own_steps]
    step_row = np.where(np.isnan(filled := _inherit(anchor, ppos)), -1, filled).astype(np.int64)
    inner = _inner_fetches(fetch_rows, own_rows, step_row, ppos, n)
    inner_wait = np.zeros(m, dtype=np.int64)
    if len(inner):
        index_of = np.full(n, -1, dtype=np.int64)
        index_of[step_rows] = np.arange(m)
        np.add.at(inner_wait, index_of[step_row[inner]], end[inner] - start[inner])
    gap_start = s_start.astype(float)  # without a step before it: from its first fetch
    np.minimum.at(gap_start, own_steps, start[own_rows].astype(float))
    wall = s_end - np.where(np.isnan(prev_end), gap_start, prev_end)

    # validation / checkpoint siblings between two steps are not step time
    excluded = np.zeros(m)
    if len(excl_rows) and m:
        e = len(excl_rows)
        group = np.concatenate([g_excl, g_step])
        time = np.concatenate([start[excl_rows], s_start])
        kind = np.concatenate([np.zeros(e, np.int64), np.ones(m, np.int64)])
        order, gstart = _scan(group, time, kind)
        is_step = order >= e
        pos = np.arange(len(order))
        big = len(order)
        # the next step at or after each position (scan from the end), within the group
        nxt = np.minimum.accumulate(np.where(is_step, pos, big)[::-1])[::-1]
        group_sorted = group[order]
        xp = pos[~is_step]
        nx = nxt[xp]
        valid = nx < big
        valid[valid] &= group_sorted[nx[valid]] == group_sorted[xp[valid]]
        x_i = order[xp[valid]]
        s_i = order[nx[valid]] - e
        xr = excl_rows[x_i]
        inside = (end[xr] <= s_start[s_i]) & (
            np.isnan(prev_end[s_i]) | (start[xr] >= prev_end[s_i])
        )
        np.add.at(excluded, s_i[inside], (end[xr] - start[xr])[inside].astype(float))
    wall_ns = np.rint(wall - excluded).astype(np.int64)
    compute = s_end - s_start - inner_wait
    data_wait = data_wait + inner_wait
    wall_ns = np.maximum(wall_ns, data_wait + compute)
    between = wall_ns - data_wait - compute
    own_self = self_times(end - start, ppos, pid, tid) if by_time else None
    self_all = own_self if own_self is not None else frame["self_ns"].to_numpy(np.int64)
    on_thread = on_step_thread(step_row, pid, tid)
    sums = part_sums((codes, uniques), ppos, step_row, on_thread, self_all, step_rows)
    if aggregates is not None and len(aggregates.summarised):
        sums += summarised_part_sums(aggregates, step_rows, n)
        self_all = self_all - aggregates.per_step(n)  # a copy: the frame's stays as it is
        own_self = self_all
    forward, backward, optimizer = sums[:, 1], sums[:, 2], sums[:, 3]
    other = wall_ns - data_wait - forward - backward - optimizer
    if aggregates is not None and len(aggregates.unknown):  # their hooks' time is unknown
        lost = np.isin(step_rows, aggregates.unknown)
        forward, backward, optimizer, other = (
            np.where(lost, np.nan, v) for v in (forward, backward, optimizer, other)
        )

    # number the steps per process in start order
    by_start = np.lexsort((s_start, pid[step_rows]))
    step_index = np.zeros(m, dtype=np.int64)
    if m:
        p = pid[step_rows][by_start]
        new = np.ones(m, dtype=bool)
        new[1:] = p[1:] != p[:-1]
        first = np.maximum.accumulate(np.where(new, np.arange(m), 0))
        step_index[by_start] = np.arange(m) - first
    steps = pd.DataFrame(
        {
            "step_index": step_index,
            "pid": pid[step_rows],
            "rank": frame["rank"].iloc[step_rows].to_numpy(),
            "epoch": frame["epoch"].iloc[step_rows].to_numpy(),
            "step": frame["step"].iloc[step_rows].to_numpy(),
            "batch_idx": frame["batch_idx"].iloc[step_rows].to_numpy(),
            "batch_size": _batch_sizes(frame, step_rows),
            "start_ns": s_start + t0,
            "end_ns": s_end + t0,
            "wall_ns": wall_ns,
            "data_wait_ns": data_wait,
            "forward_ns": forward,
            "backward_ns": backward,
            "optimizer_ns": optimizer,
            "other_ns": other,
            "compute_ns": compute,
            "between_ns": between,
            "device_ns": _numeric(frame, "device_dur_ns", step_rows),
            "warmup": step_index < warmup_steps,
            "profiled": _profiled(
                frame.attrs.get("profile_windows"), pid[step_rows], s_start + t0, s_end + t0
            ),
            # cut off by an exception (ERROR status): no sample of a whole step
            "failed": (
                frame["status"].iloc[step_rows].to_numpy(dtype=object) == "ERROR"
                if "status" in frame.columns
                else np.zeros(m, dtype=bool)
            ),
        },
        index=pd.Index(step_rows, name="row"),
    ).iloc[by_start]
    return StepAssignment(
        step_row, steps[list(STEP_COLUMNS)], own_self, ppos, on_thread, (codes, uniques)
    )


def left_out_steps(steps: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The steps that reports and comparisons leave out, as bool arrays over ``steps``
    (of :func:`assign_steps`): the warmup, the profiled steps past the warmup, and the
    failed steps (ERROR status: cut off by an exception) that are neither."""
    warmup = steps["warmup"].to_numpy(dtype=bool)
    profiled = steps["profiled"].to_numpy(dtype=bool) & ~warmup
    return warmup, profiled, steps["failed"].to_numpy(dtype=bool) & ~warmup & ~profiled


def _profiled(windows: Any, pid: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Which steps overlap a profiled window of their process
    (``frame.attrs["profile_windows"]``, see :func:`exporters.read_chrome_trace`).
    Overlap, not inclusion: ``instrument()`` opens a step when its fetch ends, a few µs
    before the profilers open their window, and a window opens and closes between
    steps, so no step outside it overlaps it."""
    inside = np.zeros(len(pid), dtype=bool)
    for w in windows if isinstance(windows, list) else ():
        try:
            inside |= (pid == int(w["pid"])) & (start < w["end_ns"]) & (end > w["start_ns"])
        except (KeyError, TypeError, ValueError):
            continue  # not a window: it leaves no step out
    return inside


def _inner_fetches(
    fetch_rows: np.ndarray, sibling: np.ndarray, step_row: np.ndarray, ppos: np.ndarray, n: int
) -> np.ndarray:
    """The ``trainer.fetch_batch`` rows inside a step (not its sibling fetch), outermost
    only: a fetch inside another fetch is already counted by it."""
    if not len(fetch_rows):
        return fetch_rows
    cand = fetch_rows[step_row[fetch_rows] >= 0]
    cand = cand[~np.isin(cand, sibling)]
    if not len(cand):
        return cand
    mark = np.full(n, np.nan)
    mark[fetch_rows] = fetch_rows
    nearest = _inherit(mark, ppos)  # the row itself or its nearest fetch ancestor
    up = ppos[cand]
    return cand[(up < 0) | np.isnan(nearest[np.where(up >= 0, up, 0)])]
