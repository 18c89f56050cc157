"""Encoding spans as Chrome trace JSON: values, events, and the file's open/dump helpers.

The pure-Python twin of the C helpers in ``exporters/_speedups.c``
(``encode_attrs``, ``encode_x_events``, ``distinct_ints``): both give
byte-identical output for every input (tests/exporters/test_encoder_fuzz.py
compares them on generated batches). The C path reads every row's values with
the GIL held and formats the events of a large batch with it released, so a
writer thread takes little GIL time from the training thread. Two rules hold on
both paths:

- A value that cannot be encoded (a ``__repr__`` or ``__str__`` that raises,
  an int with more digits than ``str()`` allows) is written as the string
  ``"<unencodable: TypeName>"``; its row and its batch are written as usual.
- Times are exact: ``ts = start - origin`` and ``dur = max(end - start, 0)``
  are computed without overflow for any int64 times.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import io
import json
import math
import os
import re
import stat
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


OWNERS = frozenset({"trainer", "runtime", "module", "network", "callback", "evaluator", "dist"})
#: ``args`` keys that are not attributes in files written before the attributes moved to
#: ``attrs`` (there, an attribute of that name was written ``attr.<name>``).
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


def _unencodable(v: Any) -> str:
    """The JSON string written for a value that cannot be encoded."""
    return _quote(f"<unencodable: {type(v).__name__}>")


def _encode_value(v: Any) -> str:
    """One attribute value as JSON (bool before int: ``True`` is ``true``, not ``1``).

    Never raises for a bad value: one that cannot be encoded becomes
    ``"<unencodable: TypeName>"`` (module doc)."""
    try:
        return _encode_value_or_raise(v)
    except Exception:
        return _unencodable(v)


def _encode_value_or_raise(v: Any) -> str:
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
        return _NONFINITE_JSON["NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")]
    if isinstance(v, str):
        return _quote(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_encode_value(x) for x in v) + "]"
    text = str(v)
    if not isinstance(text, str):  # a str() of a str subclass that returns itself
        raise TypeError("str() did not return a str")
    return _quote(text)


#: the key of the object that stands for a non-finite float attribute (JSON has no NaN or
#: infinity); read_chrome_trace gives the float back
NONFINITE_KEY = "ppetrace.float"
_NONFINITE_JSON = {
    text: f'{{"{NONFINITE_KEY}":"{text}"}}' for text in ("NaN", "Infinity", "-Infinity")
}


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


def _replace_old(path: Path) -> IO[bytes] | None:
    """The file at ``path`` opened anew for writing, when a regular file of ours (a trace
    of an earlier run) is there: removed, then created with its permissions, exclusively
    and without following a symlink (so nobody can slip one in between). Opening it with
    ``"wb"`` would truncate it, and truncating a file written moments ago costs
    milliseconds on ext4 (it writes the old pages out first, ``auto_da_alloc``): 3.7 ms
    for 300 kB here, against 0.4 ms to remove it. None where that does not apply (no
    file, a symlink, a file with other links or another owner, anything but a regular
    file, Windows): the caller opens the path as ``open`` does."""
    try:
        st = os.lstat(path)
        if not (
            stat.S_ISREG(st.st_mode)
            and st.st_nlink == 1
            and st.st_uid == os.geteuid()
            and os.access(path, os.W_OK)  # a read-only file fails in open(), as before
        ):
            return None
        os.unlink(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags, stat.S_IMODE(st.st_mode))
    except (OSError, AttributeError):  # (no os.geteuid on Windows: written over)
        return None  # open() says what is wrong, if anything
    return open(fd, "wb")  # buffered: it writes a large batch through, whole


def _open_binary(path: Path) -> IO[bytes]:
    """The file, gzipped when its name ends in ``.gz``. Everything written is ASCII."""
    raw = _replace_old(path)
    if path.name.endswith(".gz"):
        gz = gzip.GzipFile(filename=str(path), mode="wb", compresslevel=_GZIP_LEVEL, fileobj=raw)
        if raw is not None:
            gz.myfileobj = raw  # type: ignore[assignment]  # closed with it, as its own
        return cast(IO[bytes], gz)
    return raw if raw is not None else open(path, "wb")  # buffered: a large batch whole


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


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _diff_us(hi: np.ndarray, lo: np.ndarray | int) -> tuple[list[str], list[str]]:
    """``hi - lo`` (int64 ns; ``lo`` may be any int) as exact decimal µs parts.

    int64 subtraction wraps where the difference leaves int64; those entries
    (found by their signs) are computed again with Python ints."""
    if isinstance(lo, int) and not _INT64_MIN <= lo <= _INT64_MAX:
        return _split_exact([h - lo for h in hi.tolist()])
    low = np.int64(lo) if isinstance(lo, int) else lo
    diff = hi - low
    wrapped = np.flatnonzero(((hi ^ low) & (hi ^ diff)) < 0)
    if not wrapped.size:
        return _split_us(diff)
    whole, frac = _split_us(diff)
    his = hi[wrapped].tolist()
    los = [lo] * len(his) if isinstance(lo, int) else low[wrapped].tolist()
    exact_whole, exact_frac = _split_exact([h - x for h, x in zip(his, los, strict=True)])
    for j, i in enumerate(wrapped.tolist()):
        whole[i], frac[i] = exact_whole[j], exact_frac[j]
    return whole, frac


def _split_exact(ns: list[int]) -> tuple[list[str], list[str]]:
    """Python-int ns as the integer and 3-digit fraction parts of decimal µs."""
    parts = [_us(x).split(".") for x in ns]
    return [p[0] for p in parts], [p[1] for p in parts]


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
    """``,"key":`` for an attribute key.

    A key whose ``str()`` raises is written ``"<unencodable: TypeName>"``."""
    try:
        return "," + _quote(str(key)) + ":"
    except Exception:
        return "," + _unencodable(key) + ":"


def _key_order(key: Any) -> tuple[str, str]:
    """A sort key for attribute keys of mixed types (strings among themselves as usual)."""
    try:
        return type(key).__name__, str(key)
    except Exception:
        return type(key).__name__, ""


def _sorted_keys(attrs: list[Mapping[str, Any]]) -> list[Any]:
    """Every key of the rows, sorted: the same order on every run and on both paths."""
    try:
        keys = set().union(*attrs)
    except Exception:  # a mapping that cannot be iterated: the keys of the others
        keys = set()
        for a in attrs:
            with contextlib.suppress(Exception):
                keys.update(a)
    try:
        return sorted(keys)
    except Exception:  # keys that are not all strings: strings still in sorted order
        return sorted(keys, key=_key_order)


def _column_values(attrs: list[Mapping[str, Any]], key: Any) -> list[Any]:
    """The value of ``key`` in each row (None where absent)."""
    try:
        return list(map(dict.get, attrs, repeat(key)))  # type: ignore[arg-type]
    except Exception:  # a Mapping that is not a dict, or a key whose __eq__ raises
        return [_get_or_unencodable(a, key) for a in attrs]


def _get_or_unencodable(attrs: Mapping[str, Any], key: Any) -> Any:
    try:
        return attrs.get(key)
    except Exception:
        return _Unencodable(attrs)


class _Unencodable:
    """Stands for a value that could not even be read (its mapping's ``get`` raised)."""

    __slots__ = ("source",)

    def __init__(self, source: Any) -> None:
        self.source = source

    def __str__(self) -> str:
        return f"<unencodable: {type(self.source).__name__}>"


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
    keys = _sorted_keys(attrs)  # sorted: the same output on every run
    if not keys:
        return [""] * n
    # every value is read before any is encoded: the snapshot the C encoder takes too
    values = [_column_values(attrs, key) for key in keys]
    columns = []
    for key, col in zip(keys, values, strict=True):
        head = _head_of(key)
        cached = _cached_column(exporter, key, head, col)
        if cached is None:
            cached = ["" if v is None else head + _encode_value(v) for v in col]
        columns.append(cached)
    if len(columns) == 1:
        return columns[0]
    return list(map("".join, zip(*columns, strict=True)))


_CACHED_KINDS = frozenset({str, int, float, bool})


def _cached_column(
    exporter: ChromeTraceExporter, key: Any, head: str, col: list[Any]
) -> list[str] | None:
    """The encoded column through the exporter's per-(key, type) value cache, or None
    (then encode per row). Only columns of one exact type among str, int, float and
    bool are cached: values of those that compare equal encode alike, but for
    ``-0.0 == 0.0``, which is left to the per-row encoding."""
    kinds = set(map(type, col))
    kinds.discard(_NONE)
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind not in _CACHED_KINDS:
        return None
    distinct = set(col)
    if kind is float and 0.0 in distinct:
        return None  # -0.0 == 0.0: a cache would write one for the other
    caches = exporter._values
    cache = caches.get((key, kind))
    if cache is None or len(cache) > _VALUE_CACHE_LIMIT:
        cache = caches[(key, kind)] = {None: ""}
    for v in distinct.difference(cache):
        cache[v] = head + _encode_value(v)
    return list(map(cache.__getitem__, col))


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
    rows = list(rows)  # ours: a row's __index__ may change the caller's list meanwhile
    n = len(rows)
    # the C encoder takes origin as an int64; an origin below that (floored to the
    # second from a start near -2**63) goes the exact Python way
    fast = _speedups if _INT64_MIN <= origin <= _INT64_MAX else None
    prefixes = exporter._prefixes.get(pid)
    if prefixes is None:
        prefixes = exporter._prefixes[pid] = {}
    strs = exporter._strs
    if fast is not None:  # the same events, ordered and assembled in C
        prefix_of = functools.partial(exporter._prefix, pid)
        caches = (exporter._heads, exporter._strings, _head_of, _encode_value, origin, _quote)
        tail = (prefix_of, first, _PART_ROWS)
        parts = fast.encode_x_events(rows, prefixes, strs, None, *caches, *tail)
        if parts is None:  # attributes that need the Python encoder, as for the batch
            # in the Python path's order: which of two equal keys (a str and a str
            # subclass) stands for both in the batch's key set depends on it
            rows = _in_order(rows)[0]
            every = _attribute_strings(exporter, list(map(_get_attrs, rows)))
            parts = fast.encode_x_events(rows, prefixes, strs, every, *caches, *tail)
        for lo, data in zip(range(0, n, _PART_ROWS), parts, strict=True):
            yield data, min(_PART_ROWS, n - lo)
        return
    rows, start, end = _in_order(rows)
    names = list(map(_get_name, rows))
    statuses = list(map(_get_status, rows))
    _add_prefixes(exporter, prefixes, pid, set(names), strs, set(statuses))
    attrs = [
        ',"attrs":{' + a[1:] + "}" if a else ""
        for a in _attribute_strings(exporter, list(map(_get_attrs, rows)))
    ]
    errors = [',"args":{"error":' + _quote(e) + "}" if e else "" for e in map(_get_error, rows)]
    ts_whole, ts_frac = _diff_us(start, origin)
    dur_whole, dur_frac = _diff_us(np.maximum(end, start), start)
    events = [
        f'{pre}{tid},"ts":{tw}.{tf},"dur":{dw}.{df},"span_id":"{sid}",'
        f'"parent_id":"{par}","status":{st}{attrs}{err}}}'
        for pre, tid, tw, tf, dw, df, sid, par, attrs, st, err in zip(
            map(prefixes.__getitem__, names),
            np.fromiter(map(_get_tid, rows), dtype=np.int64, count=n).tolist(),
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


def _in_order(rows: list[SpanRow]) -> tuple[list[SpanRow], np.ndarray, np.ndarray]:
    """The rows in (start, longest first) order, stable, with their start and end times."""
    n = len(rows)
    start = np.fromiter(map(_get_start, rows), dtype=np.int64, count=n)
    end = np.fromiter(map(_get_end, rows), dtype=np.int64, count=n)
    if n > 1:
        # compared, not subtracted: no overflow for any int64 times
        earlier = start[1:] < start[:-1]
        longer = (start[1:] == start[:-1]) & (end[1:] > end[:-1])
        if earlier.any() or longer.any():
            order = np.lexsort((~end, start))  # ~end: descending end, without overflow
            return [rows[i] for i in order.tolist()], start[order], end[order]
    return rows, start, end


def distinct_tids(rows: Sequence[SpanRow]) -> list[Any]:
    """The rows' distinct thread ids, in the order they first occur."""
    if _speedups is not None and type(rows) is list:
        tids = _speedups.distinct_ints(rows, 6)  # None: a tid that is not an exact int
        if tids is not None:
            return cast(list[Any], tids)
    return list(dict.fromkeys(map(_get_tid, rows)))


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
