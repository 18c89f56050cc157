"""Chrome trace events as a span frame (the schema of :mod:`exporters.frame`).

Takes in: events in chunks (:class:`~._parse.Event` structs from the reader,
or plain dicts, or the C line scanner's columns); hands on: the frame.
:class:`SpanColumns` turns each chunk into columns at once (numbers in numpy
arrays, names and statuses as codes, each span's raw ``attrs`` JSON as a code
into the distinct ones, which the scanner hands over already taken apart by
key), so no dict per event outlives its chunk; attributes are decoded and typed
once per distinct value, at the end (:mod:`._attrs`).

Spans are the ``X`` events (and ``B``/``E`` pairs) with a ``span_id``:
ppetrace's own, whose ``span_id``, ``parent_id``, ``status`` and ``attrs`` sit
beside ``ts`` (``args`` holds only an ``error``), or those of older files,
which keep them all in ``args``. A trace without ids at all (another tool's)
has ids given from nesting on each thread, and its ``args`` as attributes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from .._accel import SPEEDUPS as _speedups
from .._errors import TraceError
from .._pandas import Coded
from .._spans import BY_TIME, NESTING
from ..frame import _attribute_columns, _build, empty_frame
from ._attrs import KeyValues, append_values, by_key, split_columns, split_rows
from ._encode import RANK_RE, RESERVED_ARGS
from ._fields import (
    _I64_MAX,
    _I64_MIN,
    _UNSET,
    _check_origin,
    _decode_all,
    _hex_ids,
    _infer_parents,
    _Interner,
    _ints,
    _key,
    _NotHex,
    _strs,
    _take,
    _text,
    _us_to_ns,
)
from ._parse import _EVENTS, _TYPED, Event, TypedEvent

__all__ = ["SpanColumns", "frame_from_chrome_events"]

_NUMBER = frozenset({int, float})
_NONE = type(None)

#: The fields _speedups.event_columns reads, in its order.
_FIELDS = ("name", "pid", "tid", "ts", "dur", "span_id", "parent_id", "status", "attrs", "args")
_ph = attrgetter("ph")
_name = attrgetter("name")
_pid = attrgetter("pid")
_tid = attrgetter("tid")
_ts = attrgetter("ts")
_dur = attrgetter("dur")
_span_id = attrgetter("span_id")
_parent_id = attrgetter("parent_id")
_status = attrgetter("status")
_attrs = attrgetter("attrs")
_args = attrgetter("args")


@dataclass
class _Part:
    """The columns of one chunk's candidate spans."""

    names: np.ndarray
    start: np.ndarray  # ns after the origin
    dur: np.ndarray
    pid: np.ndarray
    tid: np.ndarray
    span_id: np.ndarray
    parent_id: np.ndarray
    has_id: np.ndarray
    status: np.ndarray
    errors: list[str] | None  # None: no error in the chunk
    attrs: np.ndarray  # codes into SpanColumns._attr_items (0, no attrs, where split)
    #: the scanner's attributes, taken apart by key: per key, the code among that key's
    #: values (SpanColumns._key_values) of each of the chunk's distinct attrs objects
    #: (-1: the object lacks the key), and each row's object (``split_rows``)
    split: dict[str, np.ndarray] | None = None
    split_rows: np.ndarray | None = None


@dataclass
class _Scanned:
    """A block of lines read by ``_speedups.scan_events``: its spans' columns (the tuple
    ``event_columns`` gives) and its other events (no ``X`` among them)."""

    columns: tuple[Any, ...]
    others: list[Any]

    def __len__(self) -> int:
        return len(self.columns[2]) // 8 + len(self.others)


class SpanColumns:
    """The spans of a trace, gathered chunk by chunk, then made a frame (module doc)."""

    def __init__(self) -> None:
        self._parts: list[_Part] = []
        self.meta: list[Event] = []  # "M" events: process names (ranks) and tables
        self._pairs: list[Event] = []  # "B"/"E" events, in file order
        self._names = _Interner()
        self._statuses = _Interner()
        # each distinct attribute value: its raw JSON (decoded at the end; b"" for none)
        self._attr_index: dict[bytes, int] = {b"": 0}
        self._attr_items: list[bytes] = [b""]
        self._attr_dicts: dict[int, dict[str, Any]] = {}  # code -> a value given as a dict
        # each key's raw values (JSON), chunk after chunk: distinct within a chunk
        self._key_values: dict[str, KeyValues] = {}
        self._id_key = "span_id"
        self._not_hex = False
        self._dicts = False

    def mark(self) -> tuple[Any, ...]:
        """Where the columns stand now, for :meth:`reset`."""
        values = {key: len(v.runs) for key, v in self._key_values.items()}
        return (
            len(self._parts),
            len(self.meta),
            len(self._pairs),
            self._id_key,
            self._not_hex,
            values,
        )

    def reset(self, mark: tuple[Any, ...]) -> None:
        """Drop what was taken since :meth:`mark` gave ``mark`` (a file read again)."""
        parts, meta, pairs, self._id_key, self._not_hex, runs = mark
        del self._parts[parts:], self.meta[meta:], self._pairs[pairs:]
        # the dropped chunks' attribute values too: a column is typed by its key's values
        self._key_values = {
            key: v.keep(runs[key]) for key, v in self._key_values.items() if key in runs
        }

    def scan(self, buffer: bytes | bytearray, start: int, end: int) -> _Scanned | None:
        """The lines ``buffer[start:end]`` (whole lines of ppetrace's layout) read into
        columns by the C line scanner, for :meth:`add`; None where it is not built, or
        when a line it declines is an ``X`` event or does not decode (the caller then
        decodes the block into events: the pure-Python twin of this path)."""
        if _speedups is None:
            return None
        *cols, spans = _speedups.scan_events(buffer, start, end)
        if not spans:
            return _Scanned(tuple(cols), [])
        lines = [bytes(buffer[a:b]).rstrip() for a, b in zip(spans[::2], spans[1::2], strict=True)]
        if not all(line.endswith(b",") for line in lines):
            return None  # the end of the events, or a layout of the msgspec path's to judge
        text = b"[" + b",".join(line[:-1] for line in lines) + b"]"
        others: list[Any]
        try:
            others = _TYPED.decode(text)
        except msgspec.ValidationError:
            try:
                others = _EVENTS.decode(text)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                return None
        except (msgspec.DecodeError, RecursionError):
            return None
        if any(e.ph == "X" for e in others):
            return None  # spans in the lines declined: the whole block the msgspec way
        return _Scanned(tuple(cols), others)

    def add(self, events: list[Event] | _Scanned) -> None:
        """Take a chunk of events (only the columns are kept)."""
        if isinstance(events, _Scanned):
            if len(events.columns[2]):
                self._add_columns(*events.columns)
            if events.others:
                self.add(events.others)
            return
        phases = list(map(_ph, events))
        if phases.count("X") == len(phases):
            if events:  # an empty chunk (a trace with no events) adds nothing
                self._add_x(events)
            return
        xs = []
        for event, ph in zip(events, phases, strict=True):
            if ph == "X":
                xs.append(event)
            elif ph == "M":
                self.meta.append(event)
            elif ph == "B" or ph == "E":
                self._pairs.append(event)
        if xs:
            self._add_x(xs)

    def add_dicts(self, events: Sequence[Any]) -> None:
        """Take events given as dicts (anything else in the list is skipped)."""
        self._dicts = True
        try:
            self.add([_event(e) for e in events if isinstance(e, Mapping)])
        finally:
            self._dicts = False

    def _add_x(self, xs: list[Any]) -> None:
        typed = type(xs[0]) is TypedEvent  # values of ppetrace's types, checked by msgspec
        if typed and _speedups is not None and not self._dicts:
            cols = _speedups.event_columns(xs, _FIELDS, self._attr_index, self._attr_items)
            if cols is not None:  # the same columns as below, in one pass in C
                self._add_columns(*cols)
                return
        ts = list(map(_ts, xs))
        if (typed and None in ts) or (not typed and not set(map(type, ts)) <= _NUMBER):
            keep = [type(t) in _NUMBER for t in ts]  # an event without a time is no span
            xs, ts = list(compress(xs, keep)), list(compress(ts, keep))
            if not xs:
                return
        durs = list(map(_dur, xs))
        if not typed and not set(map(type, durs)) <= _NUMBER:
            durs = [d if type(d) in _NUMBER else 0 for d in durs]
        sids = list(map(_span_id, xs))
        if self._dicts:  # attrs are dicts already, not raw JSON
            self._add_slow(xs, ts, durs, sids)
            return
        if _UNSET in sids:  # ids in args (older files) or none (another tool's trace)
            own = [s is not _UNSET for s in sids]
            if not any(own):
                self._add_slow(xs, ts, durs, sids)
                return
            other = [not x for x in own]  # ppetrace's spans the fast way, others one by one
            self._add_slow(*(list(compress(c, other)) for c in (xs, ts, durs, sids)))
            xs, ts, durs, sids = (list(compress(c, own)) for c in (xs, ts, durs, sids))
        n = len(xs)
        args = list(map(_args, xs))
        errors = None
        if args.count(None) != n:
            errors = _strs([a.get("error", "") if type(a) is dict else "" for a in args])
        names, statuses = list(map(_name, xs)), list(map(_status, xs))
        if not typed:
            names, statuses = _strs(names), _strs(statuses)
        raws = list(map(bytes, map(_attrs, xs)))
        index, items = self._attr_index, self._attr_items
        for raw in set(raws).difference(index):
            index[raw] = len(items)
            items.append(raw)
        self._parts.append(
            _Part(
                self._names.codes(names),
                _us_to_ns(ts, "ts"),
                np.maximum(_us_to_ns(durs, "dur"), 0),
                _ints(list(map(_pid, xs)), "pid", typed),
                _ints(list(map(_tid, xs)), "tid", typed),
                self._ids(sids, "span_id"),
                self._ids(list(map(_parent_id, xs)), "parent_id"),
                np.ones(n, dtype=np.bool_),
                self._statuses.codes(statuses),
                errors,
                np.fromiter(map(index.__getitem__, raws), dtype=np.int64, count=n),
            )
        )

    def _add_columns(
        self,
        names: tuple[bytes, list[str]],
        statuses: tuple[bytes, list[str]],
        *arrays: Any,
    ) -> None:
        """A chunk's columns from ``_speedups.event_columns`` (attribute codes into
        ``_attr_items``) or ``_speedups.scan_events`` (codes into the chunk's own distinct
        attrs objects, then those objects taken apart by key, or whole)."""
        ts, dur, pid, tid, sid, par, attrs, *info = arrays
        n = len(ts) // 8
        codes = np.frombuffer(attrs, dtype=np.int64)
        split = None
        if info and type(info[0]) is tuple:  # by key: each key's values after the others'
            keys, values, key_codes = info[0]
            split = {
                key: append_values(
                    self._key_values, key, raws, np.frombuffer(local, dtype=np.int32)
                )
                for key, raws, local in zip(keys, values, key_codes, strict=True)
            }
        elif info:  # whole objects (one could not be taken apart): into _attr_items
            index, items = self._attr_index, self._attr_items
            glob = np.empty(len(info[0]), dtype=np.int64)
            for j, raw in enumerate(info[0]):
                code = index.get(raw)
                if code is None:
                    code = index[raw] = len(items)
                    items.append(raw)
                glob[j] = code
            codes = glob[codes]
        self._parts.append(
            _Part(
                self._names.remap(*names),
                _us_to_ns(np.frombuffer(ts, dtype=np.float64), "ts"),
                np.maximum(_us_to_ns(np.frombuffer(dur, dtype=np.float64), "dur"), 0),
                np.frombuffer(pid, dtype=np.int64),
                np.frombuffer(tid, dtype=np.int64),
                np.frombuffer(sid, dtype=np.uint64),
                np.frombuffer(par, dtype=np.uint64),
                np.ones(n, dtype=np.bool_),
                self._statuses.remap(*statuses),
                None,
                np.zeros(n, dtype=np.int64) if split is not None else codes,
                split,
                codes if split is not None else None,
            )
        )

    def _ids(self, values: list[Any], key: str) -> np.ndarray:
        try:
            return _hex_ids(values, key)
        except _NotHex:
            self._not_hex = True
            return np.zeros(len(values), dtype=np.uint64)

    def _add_slow(self, xs: list[Event], ts: list[Any], durs: list[Any], sids: list[Any]) -> None:
        """Events whose ids, status and attributes may sit in ``args``, one at a time."""
        n = len(xs)
        span_ids: list[Any] = []
        parents: list[Any] = []
        statuses: list[Any] = []
        errors: list[Any] = []
        codes = np.zeros(n, dtype=np.int64)
        has_id = np.zeros(n, dtype=np.bool_)
        items = self._attr_items
        for i, (event, sid) in enumerate(zip(xs, sids, strict=True)):
            args = event.args if type(event.args) is dict else {}
            if sid is not _UNSET:  # ppetrace's own layout
                has_id[i] = True
                span_ids.append(sid)
                parents.append(event.parent_id)
                statuses.append(event.status)
                errors.append(args.get("error", ""))
                given: Any = event.attrs  # raw JSON, or a dict (add_dicts)
                if isinstance(given, msgspec.Raw):
                    raw = bytes(given)
                    code = self._attr_index.get(raw)
                    if code is None:
                        code = self._attr_index[raw] = len(items)
                        items.append(raw)
                    codes[i] = code
                elif type(given) is dict and given:
                    codes[i] = len(items)
                    self._attr_dicts[len(items)] = given
                    items.append(b"")
                continue
            if "span_id" in args:  # an older ppetrace file: all of it in args
                has_id[i] = True
                self._id_key = "args.span_id"
            span_ids.append(args.get("span_id"))
            parents.append(args.get("parent_id"))
            statuses.append(args.get("status", "UNSET"))
            errors.append(args.get("error", ""))
            attrs = {k: v for k, v in args.items() if k not in RESERVED_ARGS}
            if attrs:
                codes[i] = len(items)
                self._attr_dicts[len(items)] = attrs
                items.append(b"")
        key = self._id_key if has_id.any() else "span_id"
        self._parts.append(
            _Part(
                self._names.codes(_strs(list(map(_name, xs)))),
                _us_to_ns(ts, "ts"),
                np.maximum(_us_to_ns(durs, "dur"), 0),
                _ints(list(map(_pid, xs)), "pid"),
                _ints(list(map(_tid, xs)), "tid"),
                self._ids(span_ids, key),
                self._ids(parents, key.replace("span_id", "parent_id")),
                has_id,
                self._statuses.codes(_strs(statuses)),
                _strs(errors),
                codes,
            )
        )

    def _add_pairs(self) -> None:
        """``X`` equivalents of matched ``B``/``E`` pairs (args merged, ``E``'s win)."""
        stacks: dict[tuple[Any, Any], list[Event]] = {}
        out: list[Event] = []
        for e in self._pairs:
            key = (_key(e.pid), _key(e.tid))
            if e.ph == "B":
                stacks.setdefault(key, []).append(e)
                continue
            stack = stacks.get(key)
            if not stack:
                continue
            begin = stack.pop()
            try:
                dur = float(e.ts) - float(begin.ts)
            except (TypeError, ValueError, OverflowError):
                continue
            args = dict(begin.args) if type(begin.args) is dict else {}
            if type(e.args) is dict:
                args.update(e.args)
            out.append(msgspec.structs.replace(begin, ph="X", dur=dur, args=args))
        self._pairs = []
        if out:
            self._add_x(out)

    def frame(self, origin_ns: Any, metadata: Mapping[str, Any]) -> pd.DataFrame:
        """The frame of every span taken so far (schema: :mod:`exporters.frame`).

        Raises :class:`~exporters.TraceError` for values the frame cannot hold: span
        ids outside ``0..2**64-1``, an ``origin_ns`` or span times outside int64
        nanoseconds, and non-finite ``ts``/``dur``.
        """
        self._add_pairs()
        parts = self._parts
        if not parts or not sum(len(p.start) for p in parts):
            return empty_frame()
        col = {
            f: np.concatenate([getattr(p, f) for p in parts])
            for f in ("names", "start", "dur", "pid", "tid", "span_id", "parent_id")
        }
        has_id = np.concatenate([p.has_id for p in parts])
        statuses = np.concatenate([p.status for p in parts])
        codes = np.concatenate([p.attrs for p in parts])
        split = split_rows(parts)
        errors: Any = None
        if any(p.errors is not None for p in parts):
            errors = [e for p in parts for e in (p.errors or [""] * len(p.start))]
        self._parts = []
        with_ids = bool(has_id.any())
        if with_ids and not has_id.all():  # only spans: other tools' events are not
            for f in col:
                col[f] = col[f][has_id]
            statuses, codes = statuses[has_id], codes[has_id]
            split = {key: c[has_id] for key, c in split.items()}
            if errors is not None:
                errors = list(compress(errors, has_id.tolist()))
        n = len(col["start"])
        origin = _check_origin(origin_ns)
        ts, dur = col["start"], col["dur"]
        first = int(ts.min()) + origin
        wraps = bool((ts > _I64_MAX - dur).any())  # ts + dur past int64
        last = _I64_MAX + 1 if wraps else int((ts + dur).max()) + origin
        if first < _I64_MIN or last > _I64_MAX:
            raise TraceError(
                "Expected span times (otherData.origin_ns plus each event's ts and dur) within "
                f"the int64 nanosecond range, but with origin_ns={origin} they reach beyond it. "
                "Fix origin_ns or the events' ts and dur."
            )
        start = ts + origin
        span_ids: Any
        parent_ids: Any
        if with_ids and not self._not_hex:
            span_ids, parent_ids = col["span_id"], col["parent_id"]
        else:
            span_ids, parent_ids = _infer_parents(start, dur, col["pid"], col["tid"])
        ranks = _ranks(col["pid"], _rank_by_pid(self.meta, metadata))
        trace_id = metadata.get("trace_id")
        trace_ids = (
            Coded(np.zeros(n, dtype=np.int32), [trace_id]) if type(trace_id) is str else [None] * n
        )
        return _build(
            Coded(col["names"], self._names.values),
            span_ids,
            parent_ids,
            trace_ids,
            start,
            start + dur,
            col["pid"],
            col["tid"],
            ranks,
            [],
            Coded(statuses, self._statuses.values),
            errors if errors is not None else Coded(np.zeros(n, dtype=np.int32), [""]),
            attr_columns=self._attr_columns(codes, split, dropped=with_ids and not has_id.all()),
            by_time=metadata.get(NESTING) == BY_TIME,
        )

    def _attr_columns(
        self, codes: np.ndarray, split: dict[str, np.ndarray], *, dropped: bool
    ) -> dict[Any, Any]:
        """Every attribute's typed column: typed once over the distinct attribute
        values, then spread over the rows by their codes. ``codes``: each row's code
        into ``_attr_items``; ``split``: per key, each row's code into that key's
        values in ``_key_values`` (-1 where the row has no such value), for the rows
        that the C scanner read (their ``codes`` are 0, no attributes). ``dropped``:
        rows were left out (events that are no spans), so some values may be no row's."""
        items, given = self._attr_items, self._attr_dicts
        key_values = self._key_values
        self._attr_items, self._attr_index, self._attr_dicts = [b""], {b"": 0}, {}
        self._key_values = {}
        seen = np.zeros(len(items), dtype=np.bool_)
        seen[codes] = True  # only the values of rows still present (spans, not others)
        rows = codes
        if not seen.all():
            used = np.flatnonzero(seen)
            position = np.zeros(len(items), dtype=np.int64)
            position[used] = np.arange(len(used))
            rows = position[codes]
            given = {int(position[c]): d for c, d in given.items() if seen[c]}
            items = list(map(items.__getitem__, used.tolist()))
        if split:
            return by_key(key_values, split, items, given, rows, dropped)
        apart = _speedups.attr_split(items) if _speedups is not None and not given else None
        if apart is not None:  # each key's distinct values decoded, not each object
            keys, key_codes, values = apart
            return split_columns(keys, key_codes, values, rows)
        dicts = _decode_all([x or b"{}" for x in items])
        if set(map(type, dicts)) != {dict}:
            dicts = [x if type(x) is dict else {} for x in dicts]
        for code, value in given.items():
            dicts[code] = value
        columns = _attribute_columns(dicts, frozenset())
        return {key: _take(column, rows) for key, column in columns.items()}


def _event(d: Mapping[str, Any]) -> Event:
    """An :class:`Event` from an event dict (its ``attrs`` kept as the dict)."""
    return Event(
        ph=d.get("ph"),
        name=d.get("name", ""),
        pid=d.get("pid", 0),
        tid=d.get("tid", 0),
        ts=d.get("ts"),
        dur=d.get("dur", 0),
        span_id=d.get("span_id", _UNSET),
        parent_id=d.get("parent_id"),
        status=d.get("status", "UNSET"),
        attrs=d.get("attrs", msgspec.Raw()),
        args=d.get("args"),
    )


def _ranks(pid: np.ndarray, by_pid: dict[int, int]) -> np.ndarray:
    """Each row's rank by its pid (NaN where ``by_pid`` has none): ``Series.map`` of the
    dict, but by one comparison pass per process when there are few (a trace has one
    process per rank), rather than a lookup per row."""
    if len(by_pid) > 16:
        return pd.Series(pid).map(by_pid).to_numpy(dtype=float)
    out = np.full(len(pid), np.nan)
    for key, rank in by_pid.items():
        out[pid == key] = rank
    return out


def _rank_by_pid(events: Sequence[Event], metadata: Mapping[str, Any]) -> dict[int, int]:
    ranks: dict[int, int] = {}
    pid, rank = metadata.get("pid"), metadata.get("rank")
    if type(pid) is int and type(rank) is int:
        ranks[pid] = rank
    for e in events:
        if e.name == "process_name" and type(e.args) is dict and type(e.pid) is int:
            m = RANK_RE.search(_text(e.args.get("name", "")))
            if m is not None:
                ranks[e.pid] = int(m.group(1))
    processes = metadata.get("processes")
    if isinstance(processes, Mapping):
        for key, info in processes.items():
            if isinstance(info, Mapping) and type(info.get("rank")) is int:
                try:
                    ranks[int(key)] = info["rank"]
                except (TypeError, ValueError):
                    continue
    return ranks


def frame_from_chrome_events(
    events: Sequence[Mapping[str, Any]], origin_ns: Any, metadata: Mapping[str, Any]
) -> pd.DataFrame:
    """The spans among Chrome trace events (dicts) as a frame (see
    :func:`exporters.read_chrome_trace` and :meth:`SpanColumns.frame`)."""
    columns = SpanColumns()
    columns.add_dicts(events)
    return columns.frame(origin_ns, metadata)
