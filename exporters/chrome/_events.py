"""Chrome trace events as a span frame (the schema of :mod:`exporters.frame`).

Span ids come from ``args`` where present; events without them get ids from
their nesting on each thread. ``B``/``E`` pairs count as complete events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import compress
from operator import methodcaller
from typing import Any

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from .._errors import TraceError
from ..frame import _build, empty_frame
from ._encode import RANK_RE, RESERVED_ARGS

__all__ = ["frame_from_chrome_events"]


def _rank_by_pid(
    events: Sequence[Mapping[str, Any]], metadata: Mapping[str, Any]
) -> dict[int, int]:
    ranks: dict[int, int] = {}
    pid, rank = metadata.get("pid"), metadata.get("rank")
    if isinstance(pid, int) and isinstance(rank, int):
        ranks[pid] = rank
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            args = e.get("args")
            p = e.get("pid")
            if isinstance(args, dict) and isinstance(p, int):
                m = RANK_RE.search(str(args.get("name", "")))
                if m is not None:
                    ranks[p] = int(m.group(1))
    processes = metadata.get("processes")
    if isinstance(processes, Mapping):
        for key, info in processes.items():
            if isinstance(info, Mapping) and isinstance(info.get("rank"), int):
                try:
                    ranks[int(key)] = int(info["rank"])
                except ValueError:
                    continue
    return ranks


def _complete_events(
    events: Sequence[Mapping[str, Any]], phases: list[Any]
) -> list[Mapping[str, Any]]:
    """``X`` events plus ``X`` equivalents of matched ``B``/``E`` pairs."""
    out: list[Mapping[str, Any]] = list(compress(events, [p == "X" for p in phases]))
    if "B" not in phases:
        return out
    stacks: dict[tuple[Any, Any], list[Mapping[str, Any]]] = {}
    for e in events:
        ph = e.get("ph")
        if ph == "B":
            stacks.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        elif ph == "E":
            stack = stacks.get((e.get("pid"), e.get("tid")))
            if stack:
                begin = stack.pop()
                args = dict(begin.get("args") or {})
                args.update(e.get("args") or {})
                try:
                    dur = float(e["ts"]) - float(begin["ts"])
                except (KeyError, TypeError, ValueError):
                    continue
                out.append({**begin, "ph": "X", "dur": dur, "args": args})
    return out


def _ns(values: np.ndarray) -> np.ndarray:
    """µs values read from JSON as exact integer ns (``round(x * 1000)``)."""
    return np.rint(values * 1000.0).astype(np.int64)


#: The range of int64 nanoseconds (epoch times from about 1678 to 2262).
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
#: The largest ``ts``/``dur`` (µs) read: its ns stay inside int64.
_MAX_US = 9.2e15
#: The largest id that fits the ``uint64`` id columns.
_MAX_ID = (1 << 64) - 1


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _us_to_ns(values: list[Any], key: str) -> np.ndarray:
    """``ts`` or ``dur`` values (µs) as int64 ns; :class:`TraceError` if one cannot be."""
    arr = np.array(values, dtype=float)
    bad = ~(np.abs(arr) < _MAX_US)  # NaN and infinities too
    if bad.any():
        raise TraceError(
            f"Expected event '{key}' values in microseconds within the int64 nanosecond range "
            f"(|{key}| < 9.2e15), but received {_clip(values[int(np.argmax(bad))])}. Fix the "
            f"'{key}' of the events that were written wrong."
        )
    return _ns(arr)


def _check_origin(origin_ns: Any) -> int:
    if (
        isinstance(origin_ns, bool)
        or not isinstance(origin_ns, (int, np.integer))
        or not _I64_MIN <= int(origin_ns) <= _I64_MAX
    ):
        raise TraceError(
            "Expected otherData.origin_ns to be epoch nanoseconds within the int64 range "
            f"(|origin_ns| < 2**63), but received {_clip(origin_ns)}. Fix origin_ns, or remove "
            "it to read the event times as they are."
        )
    return int(origin_ns)


def _ints(values: list[Any]) -> np.ndarray:
    """Integer ids (pid, tid); anything that is not an int becomes 0."""
    if set(map(type, values)) <= {int}:
        return np.array(values, dtype=np.int64)
    return np.array([v if type(v) is int else 0 for v in values], dtype=np.int64)


def _hex_ids(values: list[Any], key: str = "span_id") -> np.ndarray:
    """Span ids written as 16 hex digits (ints pass through; None is 0).

    Raises :class:`TraceError` for an id outside ``0..2**64-1`` (``"-1"``, 17 or
    more significant hex digits) and a plain ``ValueError`` for one that is not
    hex at all (the caller then infers parents from nesting).
    """
    if not values:
        return np.zeros(0, dtype=np.uint64)
    if set(map(type, values)) == {str} and set(map(len, values)) == {16}:
        try:
            return np.frombuffer(bytes.fromhex("".join(values)), dtype=">u8").astype(np.uint64)
        except ValueError:
            pass
    out = []
    for v in values:
        if isinstance(v, int):
            n = int(v)
        elif v is None:
            n = 0
        else:
            n = int(str(v), 16)
        if not 0 <= n <= _MAX_ID:
            raise TraceError(
                f"Expected span ids of at most 16 hex digits (0 to ffffffffffffffff) in "
                f"args.{key}, but received {_clip(v)}. Fix the ids, or remove span_id and "
                "parent_id from every event so that parents are inferred from nesting."
            )
        out.append(n)
    return np.array(out, dtype=np.uint64)


def _strs(values: list[Any]) -> list[Any]:
    return values if set(map(type, values)) <= {str} else [str(v) for v in values]


_get_ph = methodcaller("get", "ph")
_get_args = methodcaller("get", "args")
_get_ts = methodcaller("get", "ts")
_get_dur = methodcaller("get", "dur", 0)
_get_name = methodcaller("get", "name", "")
_get_pid = methodcaller("get", "pid", 0)
_get_tid = methodcaller("get", "tid", 0)
_get_span_id = methodcaller("get", "span_id")
_get_parent_id = methodcaller("get", "parent_id")
_get_status = methodcaller("get", "status", "UNSET")
_get_error = methodcaller("get", "error", "")
_has_span_id = methodcaller("__contains__", "span_id")


def frame_from_chrome_events(
    events: Sequence[Mapping[str, Any]], origin_ns: int, metadata: Mapping[str, Any]
) -> pd.DataFrame:
    """The spans among Chrome trace events as a frame (see :func:`exporters.read_chrome_trace`).

    Raises :class:`~exporters.TraceError` for values the frame cannot hold: span
    ids outside ``0..2**64-1``, an ``origin_ns`` or span times outside int64
    nanoseconds, and non-finite ``ts``/``dur``. Ids that are not hex at all are
    ignored and parents inferred from nesting, as for events without ids.
    """
    phases = list(map(_get_ph, events))
    meta_events = list(compress(events, [p == "M" for p in phases]))
    xs = _complete_events(events, phases)
    args = list(map(_get_args, xs))
    if set(map(type, args)) != {dict}:
        args = [a if isinstance(a, dict) else {} for a in args]
    has_id = list(map(_has_span_id, args))
    with_ids = any(has_id)
    if with_ids and not all(has_id):  # only spans; other tools' events are not
        xs = list(compress(xs, has_id))
        args = list(compress(args, has_id))
    ts = list(map(_get_ts, xs))
    if not set(map(type, ts)) <= {int, float}:
        ok = [type(t) in (int, float) for t in ts]
        xs, args, ts = list(compress(xs, ok)), list(compress(args, ok)), list(compress(ts, ok))
    n = len(xs)
    if n == 0:
        return empty_frame()
    origin_ns = _check_origin(origin_ns)
    ts_ns = _us_to_ns(ts, "ts")
    durs = list(map(_get_dur, xs))
    if not set(map(type, durs)) <= {int, float}:
        durs = [d if type(d) in (int, float) else 0 for d in durs]
    dur = np.maximum(_us_to_ns(durs, "dur"), 0)
    wraps = bool((ts_ns > _I64_MAX - dur).any())  # ts + dur past int64
    first = int(ts_ns.min()) + origin_ns
    last = _I64_MAX + 1 if wraps else int((ts_ns + dur).max()) + origin_ns
    if first < _I64_MIN or last > _I64_MAX:
        raise TraceError(
            "Expected span times (otherData.origin_ns plus each event's ts and dur) within the "
            f"int64 nanosecond range, but with origin_ns={origin_ns} they reach beyond it. Fix "
            "origin_ns or the events' ts and dur."
        )
    start = ts_ns + origin_ns
    pids = _ints(list(map(_get_pid, xs)))
    tids = _ints(list(map(_get_tid, xs)))
    span_ids: ArrayLike
    parent_ids: ArrayLike
    try:
        if not with_ids:
            raise ValueError("no ids")
        span_ids = _hex_ids(list(map(_get_span_id, args)), "span_id")
        parent_ids = _hex_ids(list(map(_get_parent_id, args)), "parent_id")
    except TraceError:
        raise
    except ValueError:
        span_ids, parent_ids = _infer_parents(start, dur, pids, tids)
    rank_of = _rank_by_pid(meta_events, metadata)
    ranks = pd.Series(pids).map(rank_of).to_numpy(dtype=float)
    trace_id = metadata.get("trace_id")
    trace_ids = [trace_id if isinstance(trace_id, str) else None] * n
    return _build(
        _strs(list(map(_get_name, xs))),
        span_ids,
        parent_ids,
        trace_ids,
        start,
        start + dur,
        pids,
        tids,
        ranks,
        args,
        _strs(list(map(_get_status, args))),
        _strs(list(map(_get_error, args))),
        skip=RESERVED_ARGS,
    )


def _infer_parents(
    start: np.ndarray, dur: np.ndarray, pids: np.ndarray, tids: ArrayLike
) -> tuple[list[int], list[int]]:
    """Ids 1..n and parents from nesting on each thread (events without span ids)."""
    n = len(start)
    tid = np.asarray(tids, dtype=np.int64)
    order = np.lexsort((-dur, start, tid, pids))
    span_ids = list(range(1, n + 1))
    parents = [0] * n
    stack: list[tuple[int, int]] = []  # (end, row)
    key: tuple[int, int] | None = None
    s_list, e_list = start.tolist(), (start + dur).tolist()
    p_list, t_list = pids.tolist(), tid.tolist()
    for i in order.tolist():
        k = (p_list[i], t_list[i])
        if k != key:
            stack = []
            key = k
        while stack and stack[-1][0] <= s_list[i]:
            stack.pop()
        if stack and e_list[i] <= stack[-1][0]:
            parents[i] = stack[-1][1] + 1
        stack.append((e_list[i], i))
    return span_ids, parents
