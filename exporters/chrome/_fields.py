"""Event fields as checked columns: times, ids, pids, strings and attribute values.

The helpers of :mod:`._events`: each takes one field of a chunk of trace events
(a list of values) and gives a numpy column, or a :class:`~exporters.TraceError`
that says which value the frame cannot hold.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import numpy as np

from .._accel import SPEEDUPS as _speedups
from .._errors import TraceError

_UNSET: Any = msgspec.UNSET

#: The range of int64 nanoseconds (epoch times from about 1678 to 2262).
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
#: The largest ``ts``/``dur`` (µs) read: its ns stay inside int64.
_MAX_US = 9.2e15
#: The largest id that fits the ``uint64`` id columns.
_MAX_ID = (1 << 64) - 1


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _us_to_ns(values: list[Any] | np.ndarray, key: str) -> np.ndarray:
    """``ts`` or ``dur`` values (µs, int or float) as int64 ns (``round(x * 1000)``);
    :class:`TraceError` for one outside the int64 ns range (NaN and infinities too)."""
    try:
        arr = np.array(values, dtype=float)
    except OverflowError:  # an int too large for a float
        arr = np.array([float("inf") if abs(v) > _MAX_US else v for v in values], dtype=float)
    bad = ~(np.abs(arr) < _MAX_US)
    if bad.any():
        raise TraceError(
            f"Expected event '{key}' values in microseconds within the int64 nanosecond range "
            f"(|{key}| < 9.2e15), but received {_clip(_item(values[int(np.argmax(bad))]))}. "
            f"Fix the '{key}' of the events that were written wrong."
        )
    return np.rint(arr * 1000.0).astype(np.int64)


def _item(value: Any) -> Any:
    """A numpy scalar as the Python number it holds (for messages)."""
    return value.item() if isinstance(value, np.generic) else value


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


def _ints(values: list[Any], key: str, typed: bool = False) -> np.ndarray:
    """Integer process or thread ids (all ints when ``typed``); a value that is not an
    int becomes 0, an int outside int64 is a :class:`TraceError`."""
    if typed or set(map(type, values)) <= {int}:
        try:
            return np.array(values, dtype=np.int64)
        except OverflowError:
            pass
    out = [v if type(v) is int else 0 for v in values]
    for v in out:
        if not _I64_MIN <= v <= _I64_MAX:
            raise TraceError(
                f"Expected integer '{key}' values within the int64 range (|{key}| < 2**63), but "
                f"received {_clip(v)}. Fix the '{key}' of the events that were written wrong."
            )
    return np.array(out, dtype=np.int64)


def _strs(values: list[Any]) -> list[str]:
    if set(map(type, values)) <= {str}:
        return values
    return [v if type(v) is str else _text(v) for v in values]


def _text(value: Any) -> str:
    try:
        return str(value)
    except Exception:  # pragma: no cover - JSON values always have a str()
        return f"<{type(value).__name__}>"


class _NotHex(ValueError):
    """Span ids that are not hex at all: parents are inferred from nesting instead."""


def _hex_ids(values: list[Any], key: str) -> np.ndarray:
    """Span ids written as 16 hex digits (ints pass through; None is 0).

    Raises :class:`TraceError` for an id outside ``0..2**64-1`` (``"-1"``, 17 or
    more significant hex digits) and :class:`_NotHex` for one that is not hex
    at all (the caller then infers parents from nesting).
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
        if type(v) is int:
            n = v
        elif v is None or v is _UNSET:
            n = 0
        elif type(v) is str:
            try:
                n = int(v, 16)
            except ValueError:
                raise _NotHex from None
        else:
            raise _NotHex
        if not 0 <= n <= _MAX_ID:
            raise TraceError(
                f"Expected span ids of at most 16 hex digits (0 to ffffffffffffffff) in "
                f"{key}, but received {_clip(v)}. Fix the ids, or remove span_id and "
                "parent_id from every event so that parents are inferred from nesting."
            )
        out.append(n)
    return np.array(out, dtype=np.uint64)


class _Interner:
    """Strings as int32 codes into the distinct strings seen so far."""

    def remap(self, local: bytes, uniques: list[str]) -> np.ndarray:
        """Codes into a chunk's own ``uniques`` (int32 bytes) as codes into ours."""
        index = self.index
        for v in set(uniques).difference(index):
            index[v] = len(self.values)
            self.values.append(v)
        ours = np.fromiter(map(index.__getitem__, uniques), dtype=np.int32, count=len(uniques))
        return ours[np.frombuffer(local, dtype=np.int32)]

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.values: list[str] = []

    def codes(self, values: list[str]) -> np.ndarray:
        index = self.index
        encoded = _speedups.dict_encode(values) if _speedups is not None else None
        if encoded is not None:  # the chunk's own codes, in C, then mapped to ours
            return self.remap(*encoded)
        for v in set(values).difference(index):
            index[v] = len(self.values)
            self.values.append(v)
        return np.fromiter(map(index.__getitem__, values), dtype=np.int32, count=len(values))


def _decode_all(raws: list[bytes]) -> list[Any]:
    """Raw JSON values decoded in one call; one at a time (Python's parser for numbers
    msgspec refuses, such as 1e400) where the call fails; None where nothing can."""
    if not raws:
        return []
    try:
        return msgspec.json.decode(b"[" + b",".join(raws) + b"]")
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        pass
    out = []
    for raw in raws:
        try:
            out.append(msgspec.json.decode(raw))
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            try:
                out.append(json.loads(raw))
            except (ValueError, RecursionError):
                out.append(None)
    return out


def _take(column: Any, codes: np.ndarray) -> Any:
    """``column[codes]`` for a numpy array or a pandas extension array."""
    if isinstance(column, np.ndarray):
        return column[codes]
    return column.take(codes)


def _key(value: Any) -> Any:
    """A pid or tid usable as a dict key (a list from a foreign file is not)."""
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _infer_parents(
    start: np.ndarray, dur: np.ndarray, pids: np.ndarray, tids: np.ndarray
) -> tuple[list[int], list[int]]:
    """Ids 1..n and parents from nesting on each thread (events without span ids)."""
    n = len(start)
    order = np.lexsort((-dur, start, tids, pids))
    span_ids = list(range(1, n + 1))
    parents = [0] * n
    stack: list[tuple[int, int]] = []  # (end, row)
    key: tuple[int, int] | None = None
    s_list, e_list = start.tolist(), (start + dur).tolist()
    p_list, t_list = pids.tolist(), tids.tolist()
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
