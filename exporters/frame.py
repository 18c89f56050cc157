"""Spans as a pandas DataFrame: one row per span, in a documented schema.

Build one from live spans with :func:`spans_to_frame` (OpenTelemetry
``ReadableSpan``s, or ppetrace's :class:`~exporters.SpanBatch`/
:class:`~exporters.SpanRow`) or from a file with
:func:`exporters.read_chrome_trace`. Both give the same columns:

==================  ========  =====================================================
column              dtype     meaning
==================  ========  =====================================================
``name``            string    the span name (event name), e.g. ``trainer.step``
``span_id``         uint64    the span id
``parent_id``       uint64    the parent's span id; 0 for a root (kept when the parent
                              is not in the frame, e.g. a user's OTel span exported
                              elsewhere: such a span has ``depth`` 0)
``trace_id``        string    the trace id as 32 hex digits (missing if unknown)
``start_ns``        int64     start, epoch nanoseconds
``end_ns``          int64     end, epoch nanoseconds
``dur_ns``          int64     ``end_ns - start_ns`` (saturated at the int64 bounds)
``self_ns``         int64     ``dur_ns`` minus the durations of the direct children
                              on the same thread (children on other threads run
                              concurrently and are not subtracted)
``depth``           int64     number of ancestors present in the frame (0 = root)
                              (children and ancestors by parent id; in a trace of
                              ``instrument()`` or ``LightningProfiler``, whose
                              ``otherData`` says ``"ppetrace.nesting": "time"``
                              (they record spans after the fact), by time on their
                              thread, as :mod:`exporters._nesting` finds them, and
                              ``epoch`` and ``step`` are inherited along those)
``pid``             int64     process id
``tid``             int64     thread id
``rank``            Int64     process rank (``ppetrace.rank``), ``<NA>`` if unknown
``epoch``           Int64     ``ppetrace.epoch``, inherited from the nearest
                              ancestor that has it
``step``            Int64     ``ppetrace.step`` (the global optimizer step),
                              inherited the same way
``batch_idx``       Int64     ``ppetrace.batch_idx`` (not inherited)
``stage``           string    ``ppetrace.stage`` (missing if absent)
``status``          string    ``UNSET``, ``OK`` or ``ERROR``
``error``           string    ``"Type: message"`` and traceback on failure, else ``""``
``device_dur_ns``   float64   ``ppetrace.device_dur_ns`` (device time), NaN if absent
*other attributes*  inferred  every other attribute, one column named by its key
                              (e.g. ``ppetrace.device``, ``ppetrace.batch_size``)
==================  ========  =====================================================

The standard ``ppetrace.`` attributes lose their prefix (``ppetrace.epoch`` ->
``epoch``, ``ppetrace.step`` -> ``step``, ``ppetrace.stage`` -> ``stage``,
``ppetrace.batch_idx`` -> ``batch_idx``, ``ppetrace.rank`` -> ``rank``,
``ppetrace.device_dur_ns`` -> ``device_dur_ns``). Rows keep the order in which
the spans were given. "string" is pandas 3's ``str`` dtype in Python storage
(``exporters._pandas.STRING_DTYPE``; it compares equal to ``"str"``), or
``object`` on pandas 2: distinct strings are shared, not copied per row into
pyarrow, and any Python string fits (pyarrow refuses lone surrogates).
Integer attribute columns with missing values are nullable ``Int64``; float
ones are float64 with NaN; booleans are ``boolean``; strings are strings;
mixed or tuple values are objects.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain, repeat
from operator import itemgetter as _get
from typing import Any

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike
from opentelemetry.sdk.trace import ReadableSpan

from ._accel import SPEEDUPS as _speedups
from ._pandas import Coded, dataframe, objects, strings, strings_from_codes
from ._spans import SpanBatch, SpanRow, rows_from_readable_spans

__all__ = ["COLUMNS", "RENAMED_ATTRIBUTES", "empty_frame", "spans_to_frame"]

#: The columns every frame has, in order; other attributes follow, sorted.
COLUMNS = (
    "name",
    "span_id",
    "parent_id",
    "trace_id",
    "start_ns",
    "end_ns",
    "dur_ns",
    "self_ns",
    "depth",
    "pid",
    "tid",
    "rank",
    "epoch",
    "step",
    "batch_idx",
    "stage",
    "status",
    "error",
    "device_dur_ns",
)

#: Attribute keys that become standard columns without their ``ppetrace.`` prefix.
RENAMED_ATTRIBUTES = {
    "ppetrace.epoch": "epoch",
    "ppetrace.step": "step",
    "ppetrace.stage": "stage",
    "ppetrace.batch_idx": "batch_idx",
    "ppetrace.rank": "rank",
    "ppetrace.device_dur_ns": "device_dur_ns",
}
_INHERITED = ("epoch", "step")
_INT_COLUMNS = ("epoch", "step", "batch_idx", "rank")
_NONE = type(None)


def empty_frame() -> pd.DataFrame:
    """A frame with the standard columns and no rows."""
    return _build([], [], [], [], [], [], np.zeros(0, np.int64), [], np.zeros(0, float), [], [], [])


def spans_to_frame(
    spans: Iterable[ReadableSpan] | Iterable[SpanRow] | Iterable[SpanBatch] | SpanBatch,
) -> pd.DataFrame:
    """One row per span (schema: this module's doc).

    ``spans`` is an iterable of OpenTelemetry ``ReadableSpan``s, a
    :class:`SpanBatch`, an iterable of batches, or an iterable of
    :class:`SpanRow` (then ``pid`` is this process and ``rank`` unknown).
    """
    if isinstance(spans, SpanBatch):
        batches: list[SpanBatch] = [spans]
    else:
        items = list(spans)
        if not items:
            return empty_frame()
        first = items[0]
        if isinstance(first, SpanBatch):
            batches = items  # type: ignore[assignment]
        elif isinstance(first, SpanRow):
            batches = [SpanBatch(rows=items, resource={}, pid=os.getpid())]  # type: ignore[arg-type]
        elif isinstance(first, ReadableSpan):
            batches = rows_from_readable_spans(items)  # type: ignore[arg-type]
        else:
            raise TypeError(
                "Expected OpenTelemetry ReadableSpans, SpanRows or SpanBatches, but received "
                f"{type(first).__name__}."
            )
    rows: list[SpanRow] = []
    pids: list[int] = []
    ranks: list[float] = []
    counts: list[int] = []
    for batch in batches:
        if not isinstance(batch, SpanBatch):
            raise TypeError(
                f"Expected every item to be a SpanBatch, but received {type(batch).__name__}."
            )
        rows.extend(batch.rows)
        rank = (batch.resource or {}).get("ppetrace.rank")
        pids.append(int(batch.pid))
        ranks.append(float(rank) if isinstance(rank, int) else np.nan)
        counts.append(len(batch.rows))
    if not rows:
        return empty_frame()
    n = len(rows)
    names: Sequence[Any] | Coded
    trace_ids: Sequence[Any] | Coded
    statuses: Sequence[Any] | Coded
    errors: Sequence[Any] | Coded
    if _speedups is not None:  # the same columns, taken out of the rows in C
        names, trace_ids, statuses, errors, attrs, sid, pid_, st, en, td = _speedups.span_columns(
            rows
        )
        names, trace_ids, statuses, errors = (
            Coded.of(v) if type(v) is tuple else v for v in (names, trace_ids, statuses, errors)
        )
        span_ids = np.frombuffer(sid, dtype=np.uint64)
        parent_ids = np.frombuffer(pid_, dtype=np.uint64)
        starts = np.frombuffer(st, dtype=np.int64)
        ends = np.frombuffer(en, dtype=np.int64)
        tids = np.frombuffer(td, dtype=np.int64)
    else:
        names = list(map(_get(0), rows))
        span_ids = np.fromiter(map(_get(1), rows), dtype=np.uint64, count=n)
        parent_ids = np.fromiter(map(_get(2), rows), dtype=np.uint64, count=n)
        trace_ids = list(map(_get(3), rows))
        starts = np.fromiter(map(_get(4), rows), dtype=np.int64, count=n)
        ends = np.fromiter(map(_get(5), rows), dtype=np.int64, count=n)
        tids = np.fromiter(map(_get(6), rows), dtype=np.int64, count=n)
        attrs = list(map(_get(7), rows))
        statuses = list(map(_get(8), rows))
        errors = list(map(_get(9), rows))
    return _build(
        names,
        span_ids,
        parent_ids,
        _hex_trace_ids(trace_ids),
        starts,
        ends,
        np.repeat(np.asarray(pids, dtype=np.int64), counts),
        tids,
        np.repeat(np.asarray(ranks, dtype=float), counts),
        attrs,
        statuses,
        errors,
    )


def _hex_trace_ids(trace_ids: Sequence[Any] | Coded) -> Sequence[Any] | Coded:
    """Trace ids (ints) as 32 hex digits."""
    if isinstance(trace_ids, Coded):
        return Coded(trace_ids.codes, [f"{t:032x}" for t in trace_ids.uniques])
    cache = {t: f"{t:032x}" for t in set(trace_ids)}
    return list(map(cache.__getitem__, trace_ids))


def _column(values: list[Any]) -> Any:
    """A list of attribute values as a typed column."""
    types = set(map(type, values))
    has_none = _NONE in types
    types.discard(_NONE)
    if types == {int}:
        try:
            if has_none:  # nullable ints: exact (a float64 detour rounds above 2**53)
                return pd.array(values, dtype="Int64")
            return np.array(values, dtype=np.int64)
        except (OverflowError, ValueError, TypeError):
            return objects(values)
    if types and types <= {int, float}:
        return np.array(values, dtype=float)
    if types == {bool}:
        return pd.array(values, dtype="boolean")
    return objects(values)  # 1-d: tuples stay values


def _typed_column(attrs: Sequence[Mapping[str, Any]], key: str) -> Any:
    """The typed column of one attribute key (:func:`_column` of :func:`_values`)."""
    if _speedups is None:
        return _column(_values(attrs, key))
    rows = attrs if type(attrs) is list else list(attrs)
    return _from_c(*_speedups.typed_column(rows, key))  # the same column, typed in C


def _from_c(kind: str, data: Any, extra: Any) -> Any:
    """A column from the C helpers' ``(kind, data, extra)`` (see exporters/_speedups.c)."""
    if kind == "i":
        ints = np.frombuffer(data, dtype=np.int64)
        if extra is None:
            return ints
        return pd.arrays.IntegerArray(ints, np.frombuffer(extra, dtype=np.bool_))
    if kind == "f":
        return np.frombuffer(data, dtype=np.float64)
    if kind == "b":
        return pd.arrays.BooleanArray(
            np.frombuffer(data, dtype=np.bool_), np.frombuffer(extra, dtype=np.bool_)
        )
    if kind == "s":
        return strings_from_codes(np.frombuffer(data, dtype=np.int32), extra)
    return _column(data)


def _attribute_columns(attrs: Sequence[Mapping[str, Any]], skip: frozenset[str]) -> dict[Any, Any]:
    """Every attribute key but those in ``skip``, sorted, with its typed column."""
    table = None
    if _speedups is not None and type(attrs) is list:
        table = _speedups.attr_table(attrs, skip)  # every key in one pass over the rows, in C
    if table is not None:
        found, typed = table
        by_key = dict(zip(found, typed, strict=True))
        try:
            keys = sorted(found)
        except TypeError:  # keys that are not all strings: first-seen order
            keys = found
        return {key: _from_c(*by_key[key]) for key in keys}
    try:
        keys = sorted(set().union(*attrs).difference(skip))
    except TypeError:  # keys that are not all strings
        keys = [k for k in dict.fromkeys(chain.from_iterable(attrs)) if k not in skip]
    return {key: _typed_column(attrs, key) for key in keys}


def _values(attrs: Sequence[Mapping[str, Any]], key: str) -> list[Any]:
    try:
        return list(map(dict.get, attrs, repeat(key)))  # type: ignore[arg-type]
    except TypeError:  # a Mapping that is not a dict
        return [a.get(key) for a in attrs]


def _as_float(column: Any) -> np.ndarray:
    """A numeric column as float64 with NaN for missing; raises TypeError otherwise."""
    arr = pd.array(column) if not isinstance(column, np.ndarray) else column
    if isinstance(arr, np.ndarray) and arr.dtype == object:
        raise TypeError("not numeric")
    return np.asarray(pd.to_numeric(pd.Series(arr), errors="raise"), dtype=float)


def _parent_positions(span_ids: np.ndarray, parent_ids: np.ndarray, pids: np.ndarray) -> np.ndarray:
    """For each row, the row position of its parent, or -1 (root, or parent not present).

    With unique span ids, in C where it is built (``_speedups.parent_positions``, one
    hash table; this function's pandas path is its twin)."""
    if _speedups is not None:
        sid = np.ascontiguousarray(span_ids, dtype=np.uint64)
        par = np.ascontiguousarray(parent_ids, dtype=np.uint64)
        out = np.empty(len(sid), dtype=np.int64)
        if _speedups.parent_positions(sid, par, out):
            return out
    return _parent_positions_py(span_ids, parent_ids, pids)


def _parent_positions_py(
    span_ids: np.ndarray, parent_ids: np.ndarray, pids: np.ndarray
) -> np.ndarray:
    """:func:`_parent_positions` in pandas (the C path's twin, and the path for ids that
    occur more than once)."""
    index = pd.Index(span_ids)
    if index.is_unique:
        pos = index.get_indexer(parent_ids)
    else:
        multi = pd.MultiIndex.from_arrays([pids, span_ids])
        if multi.is_unique:
            pos = multi.get_indexer(pd.MultiIndex.from_arrays([pids, parent_ids]))
        else:  # the same id twice in one process: the latest one wins
            where: dict[tuple[int, int], int] = {}
            for i, key in enumerate(zip(pids.tolist(), span_ids.tolist(), strict=True)):
                where[key] = i
            pos = np.array(
                [
                    where.get(key, -1)
                    for key in zip(pids.tolist(), parent_ids.tolist(), strict=True)
                ],
                dtype=np.int64,
            )
    pos = np.asarray(pos, dtype=np.int64)
    pos[parent_ids == 0] = -1
    return pos


def _depth(ppos: np.ndarray) -> np.ndarray:
    """Each row's number of ancestors (n + 1 where the chain up meets a cycle); in C
    where it is built (``_speedups.depths``), :func:`_depth_py` being its twin."""
    if _speedups is not None and len(ppos):
        out = np.empty(len(ppos), dtype=np.int64)
        _speedups.depths(np.ascontiguousarray(ppos, dtype=np.int64), out)
        return out
    return _depth_py(ppos)


def _depth_py(ppos: np.ndarray) -> np.ndarray:
    """:func:`_depth` a level at a time in numpy (the C path's twin)."""
    n = len(ppos)
    depth = np.zeros(n, dtype=np.int64)
    cur = ppos.copy()
    live = np.flatnonzero(cur >= 0)
    steps = 0
    while live.size and steps <= n:
        depth[live] += 1
        cur[live] = ppos[cur[live]]
        live = live[cur[live] >= 0]
        steps += 1
    return depth


def _inherit(values: np.ndarray, ppos: np.ndarray) -> np.ndarray:
    """Fill NaN entries from the nearest ancestor that has a value."""
    out, _ = _inherit_masked(values, np.isnan(values), ppos)
    return out


_INT64 = (np.dtype(np.int64), pd.Int64Dtype())


def _inherit_ints(values: Any, ppos: np.ndarray) -> pd.arrays.IntegerArray:
    """:func:`_inherit` for whole numbers (int64, or Int64 with missing values)."""
    if isinstance(values, np.ndarray):  # nothing missing, so nothing to inherit
        return pd.arrays.IntegerArray(values.copy(), np.zeros(len(values), dtype=np.bool_))
    data = np.asarray(values.to_numpy(dtype=np.int64, na_value=0), dtype=np.int64)
    return pd.arrays.IntegerArray(*_inherit_masked(data, np.asarray(values.isna()), ppos))


def _inherit_masked(
    values: np.ndarray, missing: np.ndarray, ppos: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Copies of ``values`` and ``missing`` with each missing entry taken from the
    nearest ancestor (through the parent positions ``ppos``) that has a value.

    In C where it is built (``_speedups.nearest_valued``: each row's source found once,
    rather than a numpy pass per level); :func:`_inherit_masked_py` is its twin."""
    if _speedups is not None and len(values):
        src = np.empty(len(values), dtype=np.int64)
        _speedups.nearest_valued(
            np.ascontiguousarray(missing, dtype=np.bool_),
            np.ascontiguousarray(ppos, dtype=np.int64),
            src,
        )
        return values[src], np.asarray(missing, dtype=np.bool_)[src]
    return _inherit_masked_py(values, missing, ppos)


def _inherit_masked_py(
    values: np.ndarray, missing: np.ndarray, ppos: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_inherit_masked` level by level in numpy (the C path's twin)."""
    out, out_missing = values.copy(), missing.astype(np.bool_, copy=True)
    todo = np.flatnonzero(missing & (ppos >= 0))
    anc = ppos[todo]
    guard = 0
    while todo.size and guard <= len(values):
        found = ~missing[anc]
        out[todo[found]] = values[anc[found]]
        out_missing[todo[found]] = False
        keep = ~found
        todo = todo[keep]
        anc = ppos[anc[keep]]
        alive = anc >= 0
        todo = todo[alive]
        anc = anc[alive]
        guard += 1
    return out, out_missing


_INT64_INFO = np.iinfo(np.int64)


def _saturating_diff(end: np.ndarray, start: np.ndarray) -> np.ndarray:
    """``end - start`` in int64, saturated at the int64 bounds where the true difference
    (of absurd times, 292 years apart) does not fit, instead of wrapping around."""
    dur = end - start
    wrapped = ((end ^ start) & (end ^ dur)) < 0
    if wrapped.any():
        bound = np.where(end > start, _INT64_INFO.max, _INT64_INFO.min)
        dur = np.where(wrapped, bound, dur)
    return dur


def _build(
    names: Sequence[str] | Coded,
    span_ids: ArrayLike,
    parent_ids: ArrayLike,
    trace_ids: Sequence[str | None] | Coded,
    starts: ArrayLike,
    ends: ArrayLike,
    pids: ArrayLike,
    tids: ArrayLike,
    ranks: ArrayLike,
    attrs: Sequence[Mapping[str, Any]],
    statuses: Sequence[str] | Coded,
    errors: Sequence[str] | Coded,
    *,
    skip: frozenset[str] = frozenset(),
    attr_columns: Mapping[Any, Any] | None = None,
    by_time: bool = False,
) -> pd.DataFrame:
    """The frame from column-wise inputs (shared by the span and the file readers).

    The string columns come as sequences or dictionary-encoded (:class:`Coded`).
    Attribute keys in ``skip`` are ignored (the reserved ``args`` of a Chrome event).
    ``attr_columns`` (key -> typed column, as :func:`_attribute_columns` makes
    them) stands for ``attrs`` when the caller typed the columns itself. ``by_time``:
    parents by time on each thread where ids say less (:mod:`exporters._nesting`).
    """
    n = len(names)
    sid = np.asarray(span_ids, dtype=np.uint64) if n else np.zeros(0, np.uint64)
    par = np.asarray(parent_ids, dtype=np.uint64) if n else np.zeros(0, np.uint64)
    start = np.asarray(starts, dtype=np.int64) if n else np.zeros(0, np.int64)
    end = np.asarray(ends, dtype=np.int64) if n else np.zeros(0, np.int64)
    tid = np.asarray(tids, dtype=np.int64) if n else np.zeros(0, np.int64)
    pid = np.asarray(pids, dtype=np.int64)
    dur = _saturating_diff(end, start)
    ppos = _parent_positions(sid, par, pid) if n else np.zeros(0, np.int64)
    if by_time and n > 1:  # spans recorded after the fact: their parents by time
        from ._nesting import effective_parents

        ppos, _ = effective_parents(ppos, par, start, end, pid, tid)
    has_parent = ppos >= 0
    safe = np.where(has_parent, ppos, 0)
    same_thread = has_parent & (tid[safe] == tid) & (pid[safe] == pid)
    child = np.zeros(n, dtype=np.int64)
    np.add.at(child, ppos[same_thread], dur[same_thread])
    columns: dict[str, Any] = {
        "name": strings(names),
        "span_id": sid,
        "parent_id": par,
        "trace_id": strings(trace_ids),
        "start_ns": start,
        "end_ns": end,
        "dur_ns": dur,
        "self_ns": dur - child,
        "depth": _depth(ppos),
        "pid": pid,
        "tid": tid,
    }
    extra: dict[str, Any] = {}
    standard: dict[str, Any] = {}
    if attr_columns is None:
        attr_columns = _attribute_columns(attrs, skip)
    for key, col in attr_columns.items():
        target = RENAMED_ATTRIBUTES.get(key)
        if target is None:
            extra[key] = col
        else:
            standard[target] = col
    # rank: the span's own attribute, else the process's
    rank = np.asarray(ranks, dtype=float)
    if "rank" in standard:
        try:
            own = _as_float(standard["rank"])
            rank = np.where(np.isnan(own), rank, own)
        except (TypeError, ValueError):
            pass
    standard["rank"] = rank
    for col in _INT_COLUMNS:
        values = standard.get(col)
        if values is None:
            values = np.full(n, np.nan)
        if isinstance(values, (pd.arrays.IntegerArray, np.ndarray)) and values.dtype in _INT64:
            # whole numbers already: no float detour, which would round above 2**53
            columns[col] = (
                _inherit_ints(values, ppos) if col in _INHERITED else pd.array(values, "Int64")
            )
            continue
        try:
            arr = _as_float(values)
        except (TypeError, ValueError):
            columns[col] = values  # not numbers: kept as they are
            continue
        if col in _INHERITED:
            arr = _inherit(arr, ppos)
        whole = arr[~np.isnan(arr)]
        if not (np.all(np.abs(whole) < 2**63) and np.all(whole == np.floor(whole))):
            columns[col] = arr  # not whole numbers (a step of 1.5): floats, as they are
            continue
        columns[col] = pd.array(arr, dtype="Int64")
    columns["stage"] = standard.get("stage", np.full(n, None, dtype=object))
    columns["status"] = strings(statuses)
    columns["error"] = strings(errors)
    dev = standard.get("device_dur_ns")
    if dev is None:
        columns["device_dur_ns"] = np.full(n, np.nan)
    else:
        try:
            columns["device_dur_ns"] = _as_float(dev)
        except (TypeError, ValueError):
            columns["device_dur_ns"] = dev
    ordered = {c: columns[c] for c in COLUMNS}
    for key in sorted(extra):
        name = key if key not in ordered else f"attr.{key}"
        ordered[name] = extra[key]
    return dataframe(ordered, index=pd.RangeIndex(n))
