"""A span frame's attribute columns, typed once per distinct value (see :mod:`._events`).

Two inputs. Whole raw ``attrs`` objects (JSON bytes, as msgspec hands them over, or
dicts given), one code per row into the distinct ones: taken apart by key in C
(``_speedups.attr_split``) or decoded whole. And the C line scanner's chunks, whose
distinct objects came already taken apart by key: per key, the chunk's raw values and
each object's code among them. Either way each key's values are decoded once, typed
as :func:`exporters.frame._column` types them, then spread over the rows by code.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np
import pandas as pd

from .._accel import SPEEDUPS as _speedups
from .._pandas import strings_from_codes
from ..frame import _column
from ._fields import _decode_all, _take

__all__ = ["KeyValues", "append_values", "by_key", "split_columns", "split_rows"]

_NONE = type(None)


def split_columns(
    keys: list[str], codes: list[bytearray], values: list[list[bytes]], rows: np.ndarray
) -> dict[str, Any]:
    """The attribute columns from ``_speedups.attr_split`` of the distinct raw attributes
    (``rows``: each row's code into them), typed as :meth:`SpanColumns._attr_columns`
    types the decoded objects: by :func:`exporters.frame._column` of the key's values."""
    out = {}
    for k in sorted(range(len(keys)), key=keys.__getitem__):
        uniques = _decode_all(values[k])
        out[keys[k]] = _coded_column(uniques, np.frombuffer(codes[k], dtype=np.int32)[rows])
    return out


class KeyValues:
    """One key's values, chunk after chunk: raw JSON (a list of bytes), or whole numbers
    already (int64, where the scanner found a chunk's values all small integers)."""

    __slots__ = ("count", "runs")

    def __init__(self) -> None:
        self.runs: list[list[bytes] | np.ndarray] = []
        self.count = 0

    def add(self, run: list[bytes] | np.ndarray) -> int:
        """Add a chunk's values; returns the code of its first."""
        offset = self.count
        self.runs.append(run)
        self.count += len(run)
        return offset

    def keep(self, runs: int) -> KeyValues:
        """Only the first ``runs`` chunks' values (the others' chunks were dropped)."""
        del self.runs[runs:]
        self.count = sum(map(len, self.runs))
        return self

    def decoded(self) -> list[Any] | np.ndarray:
        """Every value, by code: an int64 array when all are whole numbers from the
        scanner, else a list of the decoded values (the numbers as ints)."""
        ints = [r for r in self.runs if isinstance(r, np.ndarray)]
        if ints and len(ints) == len(self.runs):
            return np.concatenate(ints)
        if not ints:
            return _decode_all(list(chain.from_iterable(self.runs)))
        out: list[Any] = []
        for r in self.runs:
            out.extend(r.tolist() if isinstance(r, np.ndarray) else _decode_all(r))
        return out


def append_values(
    key_values: dict[str, KeyValues], key: str, raws: list[bytes] | bytearray, local: np.ndarray
) -> np.ndarray:
    """``raws`` (raw JSON, or int64 bytes from the scanner) added after the key's values,
    and ``local`` (codes into ``raws``, -1 for none) made codes into them all. A value
    may so occur more than once among a key's values (once per chunk that has it): the
    column is typed over its values and spread over its rows by code, so that is the
    same column, and no table of every distinct value is kept."""
    run = np.frombuffer(raws, dtype=np.int64) if isinstance(raws, bytearray) else raws
    offset = key_values.setdefault(key, KeyValues()).add(run)
    return np.where(local >= 0, local + offset, -1).astype(np.int32, copy=False)


def split_rows(parts: Sequence[Any]) -> dict[str, np.ndarray]:
    """Per key of the scanner's split attributes, every row's code into the key's
    values (-1: none; every row of a chunk read otherwise)."""
    keys = dict.fromkeys(key for p in parts if p.split is not None for key in p.split)
    out = {}
    for key in keys:
        pieces = []
        for p in parts:
            table = p.split.get(key) if p.split is not None else None
            if table is None:
                pieces.append(np.full(len(p.start), -1, dtype=np.int32))
            else:
                pieces.append(table[p.split_rows])
        out[key] = np.concatenate(pieces)
    return out


def by_key(
    key_values: dict[str, KeyValues],
    split: dict[str, np.ndarray],
    items: list[bytes],
    given: dict[int, dict[str, Any]],
    rows: np.ndarray,
    dropped: bool,
) -> dict[Any, Any]:
    """The attribute columns when some rows came taken apart by key (``split``, codes
    into ``key_values``) and the others as codes (``rows``) into whole objects
    (``items``, or ``given`` dicts): each key's values decoded once, the whole objects'
    values added to them, then typed as :func:`_coded_column` types them."""
    codes = dict(split)
    extra: dict[Any, list[Any]] = {}  # per key, decoded values after its raw ones
    whole = len(items) > 1 or bool(given)
    apart = None
    if whole and _speedups is not None and not given:
        apart = _speedups.attr_split(items)
    if apart is not None:  # the objects' raw values join the key's raw values
        for key, item_codes, raws in zip(*apart, strict=True):
            local = np.frombuffer(item_codes, dtype=np.int32)[rows]
            codes[key] = _either(codes.get(key), append_values(key_values, key, raws, local))
    elif whole:  # objects decoded whole (an odd key, or dicts given): their values
        dicts = _decode_all([x or b"{}" for x in items])
        dicts = [x if type(x) is dict else {} for x in dicts]
        for code, value in given.items():
            dicts[code] = value
        for key in dict.fromkeys(k for d in dicts for k in d):
            base = key_values[key].count if key in key_values else 0
            has = np.fromiter((key in d for d in dicts), np.bool_, len(dicts))
            values = [d.get(key) for d in dicts]
            local = np.where(has, base + np.arange(len(dicts)), -1)[rows]
            extra[key] = values
            codes[key] = _either(codes.get(key), local.astype(np.int32))
    try:
        keys = sorted(codes)
    except TypeError:  # keys that are not all strings (dicts given): first-seen order
        keys = list(codes)
    out = {}
    for key in keys:
        decoded = key_values[key].decoded() if key in key_values else []
        key_codes = codes[key]
        if isinstance(decoded, np.ndarray) and not dropped and key not in extra:
            out[key] = _coded_ints(decoded, key_codes)
            continue
        values = decoded.tolist() if isinstance(decoded, np.ndarray) else decoded
        if dropped or key in extra:  # values of no row: not to type the column by
            values, key_codes = _used([*values, *extra.get(key, [])], key_codes)
        out[key] = _coded_column(values, key_codes)
    return out


def _coded_ints(uniques: np.ndarray, codes: np.ndarray) -> Any:
    """:func:`_coded_column` of whole numbers given as int64 (``uniques``, not empty):
    int64, or Int64 where a row has none (code -1), as :func:`_column` types ints."""
    missing = codes < 0
    values = uniques[codes]  # code -1 takes the last value: masked below
    if not missing.any():
        return values
    return pd.arrays.IntegerArray(np.where(missing, 0, values), missing)


def _either(first: np.ndarray | None, second: np.ndarray) -> np.ndarray:
    """Each row's code from ``first`` where it has one (>= 0), else from ``second``."""
    return second if first is None else np.where(first >= 0, first, second)


def _used(uniques: list[Any], codes: np.ndarray) -> tuple[list[Any], np.ndarray]:
    """Only the values some row has (those of rows that are no spans are dropped),
    renumbered: :func:`_coded_column` types a column by its values."""
    seen = np.zeros(len(uniques), dtype=np.bool_)
    seen[codes[codes >= 0]] = True
    if seen.all():
        return uniques, codes
    kept = np.flatnonzero(seen)
    position = np.full(len(uniques) + 1, -1, dtype=np.int32)  # [-1]: stays -1
    position[kept] = np.arange(len(kept), dtype=np.int32)
    return [uniques[i] for i in kept.tolist()], position[codes]


def _coded_column(uniques: list[Any], codes: np.ndarray) -> Any:
    """``_column`` of ``uniques[codes[i]]`` (None where the code is -1) for each row,
    typed once over the distinct values: its types and whether one is missing (None)
    are those of the rows (every distinct value is some row's)."""
    missing = codes < 0
    types = set(map(type, uniques))
    if types == {str} or types == {str, _NONE}:
        present = [u for u in uniques if u is not None]
        position = np.full(len(uniques) + 1, -1, dtype=np.int32)  # [-1]: the last, -1
        position[[i for i, u in enumerate(uniques) if u is not None]] = np.arange(len(present))
        return strings_from_codes(position[codes], present)
    if not missing.any():
        return _take(_column(uniques), codes)
    table = _column([*uniques, None])  # the rows' values and types, None included
    return _take(table, np.where(missing, len(uniques), codes))
