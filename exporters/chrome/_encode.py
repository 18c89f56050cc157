"""Encoding spans as Chrome trace JSON: values, events, and the file's open/dump helpers.

The pure-Python twin of the C helpers in ``exporters/_speedups.c``
(``encode_attrs``, ``encode_x_batch``): both give byte-identical output.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from json.encoder import encode_basestring_ascii as _quote
from operator import itemgetter
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import numpy as np

from .._accel import SPEEDUPS as _speedups
from .._spans import SpanRow

if TYPE_CHECKING:
    from ._writer import ChromeTraceExporter


OWNERS = frozenset({"trainer", "runtime", "module", "network", "callback", "evaluator"})
#: ``args`` keys that are not attributes (an attribute of that name is written ``attr.<name>``).
RESERVED_ARGS = frozenset({"span_id", "parent_id", "status", "error"})
#: A process name that carries a rank (``"ppetrace rank 3"``).
RANK_RE = re.compile(r"\brank (\d+)\b")
_NS_PER_S = 1_000_000_000
_CHUNK = 8192  # events per write call
_GZIP_LEVEL = 3


_PART_ROWS = 16_384  # events encoded at a time: about 5 MB of JSON


def owner_of(name: str) -> str:
    """The ``cat`` of a span: its name's prefix before the first dot if that is an owner,
    else ``"user"``."""
    head, dot, _ = name.partition(".")
    return head if dot and head in OWNERS else "user"


def _us(ns: int) -> str:
    """Integer nanoseconds as exact decimal microseconds, e.g. ``-1`` -> ``"-0.001"``."""
    if ns >= 0:
        return f"{ns // 1000}.{ns % 1000:03d}"
    ns = -ns
    return f"-{ns // 1000}.{ns % 1000:03d}"


def _encode_value(v: Any) -> str:
    """One attribute value as JSON (bool before int: ``True`` is ``true``, not ``1``)."""
    if v is True:
        return "true"
    if v is False:
        return "false"
    if v is None:
        return "null"
    if isinstance(v, int):
        return str(int(v))
    if isinstance(v, float):
        if math.isfinite(v):
            return repr(v)
        return '"NaN"' if v != v else ('"Infinity"' if v > 0 else '"-Infinity"')
    if isinstance(v, str):
        return _quote(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_encode_value(x) for x in v) + "]"
    return _quote(str(v))


def _json_safe(value: Any) -> Any:
    """``value`` with non-finite floats replaced by strings and unknown objects by ``str``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return json.dumps(_json_safe(value), separators=(",", ":"), allow_nan=False)


def _open_for_writing(path: Path) -> IO[str]:
    return io.TextIOWrapper(_open_binary(path), encoding="ascii", newline="\n", write_through=False)


def _open_binary(path: Path) -> IO[bytes]:
    """The file, gzipped when its name ends in ``.gz``. Everything written is ASCII."""
    if path.name.endswith(".gz"):
        return cast(
            IO[bytes], gzip.GzipFile(filename=str(path), mode="wb", compresslevel=_GZIP_LEVEL)
        )
    return open(path, "wb")  # buffered: it writes a large batch through, whole


_FRAC = tuple(f"{i:03d}" for i in range(1000))
_NONE = type(None)
_VALUE_CACHE_LIMIT = 16_384


def _hex16(values: list[int]) -> list[str]:
    """64-bit ids as 16 lowercase hex digits each."""
    big = np.array(values, dtype=np.uint64).astype(">u8").tobytes().hex()
    return [big[i : i + 16] for i in range(0, 16 * len(values), 16)]


def _hex16_repeated(values: list[int]) -> list[str]:
    """Like :func:`_hex16` for ids that repeat (parents): each distinct id is formatted once."""
    distinct = list(set(values))
    table = dict(zip(distinct, _hex16(distinct), strict=True))
    return list(map(table.__getitem__, values))


def _split_us(ns: np.ndarray) -> tuple[list[str], list[str]]:
    """Integer ns as the integer and 3-digit fraction parts of decimal µs."""
    whole = list(map(str, (ns // 1000).tolist()))
    frac = list(map(_FRAC.__getitem__, (ns % 1000).tolist()))
    neg = np.flatnonzero(ns < 0)
    for i in neg.tolist():  # -1 ns is "-0.001", not floor division's "-1.999"
        mag = -int(ns[i])
        whole[i] = f"-{mag // 1000}"
        frac[i] = _FRAC[mag % 1000]
    return whole, frac


def _head_of(key: Any) -> str:
    """``,"key":`` for an attribute key (keys that clash with ppetrace's args get ``attr.``)."""
    return "," + _quote(f"attr.{key}" if key in RESERVED_ARGS else str(key)) + ":"


def _key_order(key: Any) -> tuple[str, str]:
    """A sort key for attribute keys of mixed types (strings among themselves as usual)."""
    return type(key).__name__, str(key)


def _attribute_strings(exporter: ChromeTraceExporter, attrs: list[Mapping[str, Any]]) -> list[str]:
    """Each row's attributes as ``,"key":value...`` (JSON), built one key at a time.

    Values of one key and one type are encoded once per distinct value
    (cached); mixed-type keys go through the general encoder per row.
    """
    n = len(attrs)
    if _speedups is not None:  # the same strings, built in C (None: use the code below)
        encoded = _speedups.encode_attrs(
            attrs, exporter._heads, exporter._strings, _head_of, _encode_value
        )
        if encoded is not None:
            return encoded
    try:
        keys = sorted(set().union(*attrs))  # sorted: the same output on every run
    except TypeError:  # keys that are not all strings: strings still in sorted order
        keys = sorted(set().union(*attrs), key=_key_order)
    if not keys:
        return [""] * n
    columns = []
    caches = exporter._values
    for key in keys:
        try:
            col = list(map(dict.get, attrs, repeat(key)))  # type: ignore[arg-type]
        except TypeError:  # a Mapping that is not a dict
            col = [a.get(key) for a in attrs]
        head = _head_of(key)
        try:
            distinct = set(col)
        except TypeError:  # an unhashable value
            distinct = None
        kind = None
        if distinct is not None:
            kinds = set(map(type, distinct))
            kinds.discard(_NONE)
            if kinds == {str} or kinds == {tuple}:
                kind = kinds.pop()  # str (or tuple) never equals another type's value
            elif len(kinds) == 1:
                # equal values of different types (True == 1 == 1.0) hide in a set
                kinds = set(map(type, col))
                kinds.discard(_NONE)
                if len(kinds) == 1:
                    kind = kinds.pop()
        if kind is not None and distinct is not None:
            cache = caches.get((key, kind))
            if cache is None or len(cache) > _VALUE_CACHE_LIMIT:
                cache = caches[(key, kind)] = {None: ""}
            try:
                for v in distinct.difference(cache):
                    cache[v] = head + _encode_value(v)
                columns.append(list(map(cache.__getitem__, col)))
                continue
            except TypeError:  # an unhashable value inside a tuple
                pass
        columns.append(["" if v is None else head + _encode_value(v) for v in col])
    if len(columns) == 1:
        return columns[0]
    return list(map("".join, zip(*columns, strict=True)))


def _encode_columns(
    exporter: ChromeTraceExporter, rows: Sequence[SpanRow], pid: int, origin: int, first: bool
) -> Iterator[tuple[bytes, int]]:
    """Encode ``X`` events for ``rows`` with the work done per column, not per row.

    Yields ``(data, count)`` parts of at most :data:`_PART_ROWS` events: the
    events joined, each preceded by ``",\n"`` (``"\n"`` for the very first one
    when ``first``), ready to append to the file. Rows are written in (start,
    longest first) order, so that a parent comes before a child that starts at
    the same nanosecond (Perfetto nests equal timestamps by file order).
    """
    n = len(rows)
    if _speedups is not None:
        rows = rows if type(rows) is list else list(rows)
        cols = _speedups.span_columns(rows)
        start = np.frombuffer(cols[7], dtype=np.int64)
        end = np.frombuffer(cols[8], dtype=np.int64)
    else:
        start = np.fromiter(map(_get_start, rows), dtype=np.int64, count=n)
        end = np.fromiter(map(_get_end, rows), dtype=np.int64, count=n)
    if n > 1:
        d = np.diff(start)
        if (d < 0).any() or ((d == 0) & (np.diff(end) > 0)).any():
            order = np.lexsort((-end, start))
            rows = [rows[i] for i in order.tolist()]
            start = start[order]
            end = end[order]
    prefixes = exporter._prefixes.get(pid)
    if prefixes is None:
        prefixes = exporter._prefixes[pid] = {}
    strs = exporter._strs
    if _speedups is not None:  # the same events, assembled in C
        # the distinct names and statuses: uniques of the encoded columns
        names, statuses = _distinct(cols[0]), _distinct(cols[2])
        _add_prefixes(exporter, prefixes, pid, names, strs, statuses)
        caches = (exporter._heads, exporter._strings, _head_of, _encode_value, origin, _quote)
        every: list[str] | None = None  # the whole batch's attribute strings, once needed
        for lo in range(0, n, _PART_ROWS):
            part = rows[lo : lo + _PART_ROWS]
            head = first and lo == 0
            encoded = None
            if every is None:
                encoded = _speedups.encode_x_batch(part, prefixes, strs, None, *caches, head)
            if encoded is None:  # attributes that need the Python encoder, as for the batch
                if every is None:
                    every = _attribute_strings(exporter, list(map(_get_attrs, rows)))
                some = every[lo : lo + _PART_ROWS]
                encoded = _speedups.encode_x_batch(part, prefixes, strs, some, *caches, head)
            yield encoded, len(part)
        return
    names = list(map(_get_name, rows))
    statuses = list(map(_get_status, rows))
    _add_prefixes(exporter, prefixes, pid, set(names), strs, set(statuses))
    attrs = _attribute_strings(exporter, list(map(_get_attrs, rows)))
    errors = [',"error":' + _quote(e) if e else "" for e in map(_get_error, rows)]
    ts_whole, ts_frac = _split_us(start - origin)
    dur_whole, dur_frac = _split_us(np.maximum(end - start, 0))
    events = [
        f'{pre}{tid},"ts":{tw}.{tf},"dur":{dw}.{df},"args":{{"span_id":"{sid}",'
        f'"parent_id":"{par}"{attrs},"status":{st}{err}}}}}'
        for pre, tid, tw, tf, dw, df, sid, par, attrs, st, err in zip(
            map(prefixes.__getitem__, names),
            map(_get_tid, rows),
            ts_whole,
            ts_frac,
            dur_whole,
            dur_frac,
            _hex16(list(map(_get_span_id, rows))),
            _hex16_repeated(list(map(_get_parent_id, rows))),
            attrs,
            map(strs.__getitem__, statuses),
            errors,
            strict=True,
        )
    ]
    for lo in range(0, n, _PART_ROWS):
        sep = "\n" if first and lo == 0 else ",\n"
        some = events[lo : lo + _PART_ROWS]
        yield (sep + ",\n".join(some)).encode("ascii"), len(some)


def _distinct(column: Any) -> list[Any]:
    """The distinct values of a column from ``span_columns``: encoded or a list."""
    if type(column) is not tuple:
        return list(set(column))
    codes, uniques = column
    missing = bool((np.frombuffer(codes, dtype=np.int32) < 0).any())
    return [*uniques, None] if missing else list(uniques)


def _add_prefixes(
    exporter: ChromeTraceExporter,
    prefixes: dict[str, str],
    pid: int,
    names: Iterable[str],
    strs: dict[str, str],
    statuses: Iterable[str],
) -> None:
    """Cache the event prefix of each new name and the JSON literal of each new status."""
    for name in set(names).difference(prefixes):
        prefixes[name] = exporter._prefix(pid, name)
    for status in set(statuses).difference(strs):
        strs[status] = _quote(status)


_get_name = itemgetter(0)
_get_span_id = itemgetter(1)
_get_parent_id = itemgetter(2)
_get_start = itemgetter(4)
_get_end = itemgetter(5)
_get_tid = itemgetter(6)
_get_attrs = itemgetter(7)
_get_status = itemgetter(8)
_get_error = itemgetter(9)
