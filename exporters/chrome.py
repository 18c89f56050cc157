"""Chrome trace files: the streaming writer, the reader and the merger.

The file format
---------------

A JSON object in the Chrome "JSON Object Format", which Perfetto and the
``chrome://tracing`` viewer load::

    {"displayTimeUnit":"ns","otherData":{...},"traceEvents":[
    {"ph":"M","name":"process_name","pid":4242,"tid":0,
     "args":{"name":"ppetrace rank 0 (pid 4242)"}},
    {"ph":"X","cat":"trainer","name":"trainer.step","pid":4242,"tid":4242,"ts":1.500,"dur":2.250,
     "args":{"span_id":"...","parent_id":"...","ppetrace.step":3,"status":"UNSET"}},
    ...
    ]}

- ``otherData`` holds the run's metadata: ``service_name``, ``trace_id``
  (32 hex digits), ``ppetrace_version``, ``host``, ``pid``, ``rank``,
  ``start_time_ns`` (epoch ns of the first span), ``origin_ns`` and
  ``clock_offset_ns``, plus the whole OpenTelemetry ``resource``.
- ``ts`` is in microseconds **relative to** ``otherData["origin_ns"]`` (an
  epoch time in ns, a whole second at or before the first span), written
  from integer nanoseconds as a decimal with exactly three fractional digits,
  so no precision is lost and float64 viewers keep nanoseconds for runs of
  up to ~100 days. A span that started before the origin (one that was open
  when the exporter was created) gets a negative ``ts``. ``dur`` is in µs
  the same way.
- ``clock_offset_ns`` (default 0) is how many ns to add to this file's times
  to put them on a reference clock; :func:`merge_traces` applies it.
- One ``X`` event per span: ``cat`` is the owner (the name's prefix before the
  first dot when it is ``trainer``, ``runtime``, ``module``, ``network``,
  ``callback`` or ``evaluator``, else ``user``), ``args`` holds the span's
  attributes plus ``span_id`` and ``parent_id`` (16 hex digits, all zeros for
  a root), ``status`` (``UNSET``/``OK``/``ERROR``) and, on failure, ``error``.
  Those four ``args`` keys are reserved: an attribute with one of these names
  is written as ``attr.<name>``.
- ``M`` events name each process (``process_name``, with the rank, and
  ``process_sort_index``) and each thread (``thread_name``).
- Each event is on its own line, so a file cut off by a killed process loses
  at most the event being written; :func:`read_chrome_trace` reads such a
  file and warns. A path ending in ``.gz`` is written as gzip, flushed after
  every batch so that a cut-off ``.json.gz`` is readable as well.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import math
import os
import re
import threading
import time
import warnings
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from json.encoder import encode_basestring_ascii as _quote
from operator import itemgetter
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import numpy as np
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from ._accel import SPEEDUPS as _speedups
from ._errors import TraceError
from ._spans import SpanBatch, SpanRow, rows_from_readable_spans

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "OWNERS",
    "ChromeTrace",
    "ChromeTraceExporter",
    "TraceTruncatedWarning",
    "load_chrome_trace",
    "merge_traces",
    "owner_of",
    "read_chrome_trace",
]

_log = logging.getLogger("exporters")


#: Event-name prefixes that name an owner (the ``cat`` of an ``X`` event).
OWNERS = frozenset({"trainer", "runtime", "module", "network", "callback", "evaluator"})
_RESERVED_ARGS = frozenset({"span_id", "parent_id", "status", "error"})
_NS_PER_S = 1_000_000_000
_CHUNK = 8192  # events per write call
_GZIP_LEVEL = 3


_ASYNC_BYTES = 1 << 20  # writes at least this large run on the writer thread
_PART_ROWS = 16_384  # events encoded at a time: about 5 MB of JSON


class _Appender:
    """Appends to the trace file in call order, a large write on a thread of its own.

    A part of 16,384 spans is about 5 MB of JSON. While the kernel copies one
    part into the file (the GIL is released meanwhile), the exporter encodes the
    next. At most one write is in flight: each call first waits for the one
    before, so a killed process loses at most the last batch, as with direct
    writes. An error of a write on the thread is returned by the next call
    (or by :meth:`wait`). In a forked child every write is direct.
    """

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def wait(self) -> BaseException | None:
        """Wait for the write in flight; return its error, if it failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        return error

    def append(self, data: bytes) -> BaseException | None:
        """Write ``data`` and flush, on the thread when large; return the error of the
        write before. An error of a direct write is raised."""
        error = self.wait()
        if len(data) >= _ASYNC_BYTES and os.getpid() == self._pid:
            self._thread = threading.Thread(
                target=self._write, args=(data,), name="exporters-chrome-writer"
            )
            self._thread.start()
        else:
            self.file.write(data)
            self.file.flush()
        return error

    def _write(self, data: bytes) -> None:
        try:
            self.file.write(data)
            self.file.flush()
        except BaseException as exc:  # reported by the next append or wait
            self._error = exc


class TraceTruncatedWarning(UserWarning):
    """A trace file was cut off (a killed process); only its complete events were read."""


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


class ChromeTraceExporter(SpanExporter):
    """Write spans to a Chrome trace file at ``path`` as they arrive (see the module doc).

    It is an OpenTelemetry ``SpanExporter`` (``export``/``shutdown``/
    ``force_flush``), and it has ``export_batch``, the fast path that
    ppetrace's recorder calls; both write the same events. Other components
    stream extra raw Chrome events into the same file with
    :meth:`add_events`. Nothing is held until the end: each call appends its
    events and flushes the file. A large batch (1 MB of JSON or more) is
    written on a writer thread while the caller goes on, at most one at a
    time; ``force_flush`` and ``shutdown`` wait for it. ``shutdown`` closes
    the JSON document.

    ``clock_offset_ns`` is stored in ``otherData`` for :func:`merge_traces`;
    ``metadata`` adds entries to ``otherData``. Write errors are logged and
    counted in :attr:`errors`, never raised from ``export``/``export_batch``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock_offset_ns: int = 0,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(clock_offset_ns, bool) or not isinstance(clock_offset_ns, int):
            raise TypeError(
                f"Expected an int number of nanoseconds for clock_offset_ns, but received "
                f"{clock_offset_ns!r}."
            )
        self.path = Path(path)
        self.errors = 0
        self._lock = threading.RLock()
        self._created_ns = time.time_ns()
        self._origin_ns: int | None = None
        self._header_written = False
        self._closed = False
        self._first_event = True
        self._events_written = 0
        self._pid = os.getpid()
        self._other: dict[str, Any] = {
            "service_name": None,
            "trace_id": None,
            "ppetrace_version": None,
            "host": None,
            "pid": None,
            "rank": None,
            "start_time_ns": None,
            "origin_ns": None,
            "clock_offset_ns": clock_offset_ns,
            "resource": {},
        }
        if metadata:
            self._other.update(_json_safe(dict(metadata)))
        self._prefixes: dict[int, dict[str, str]] = {}
        # (attribute key, value type) -> value -> ',"key":value'
        self._values: dict[tuple[str, type], dict[Any, str]] = {}
        # caches of the C encoder: attribute key -> ',"key":', str value -> JSON literal
        self._heads: dict[Any, str] = {}
        self._strings: dict[str, str] = {}
        self._strs: dict[str, str] = {}
        self._seen_pids: set[int] = set()
        self._thread_names: dict[tuple[int, int], str | None] = {}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: _Appender | None = _Appender(_open_binary(self.path))

    def __repr__(self) -> str:
        return f"ChromeTraceExporter({str(self.path)!r})"

    # -- metadata ----------------------------------------------------------------

    @property
    def metadata(self) -> dict[str, Any]:
        """A copy of the run's metadata: the file's ``otherData`` (final once written)."""
        with self._lock:
            return json.loads(_dumps(self._other))

    @property
    def origin_ns(self) -> int:
        """The epoch time (ns) that ``ts`` 0 stands for. Reading it fixes it."""
        with self._lock:
            return self._fix_origin(None)

    @property
    def events_written(self) -> int:
        """How many events (``X``, ``M`` and added ones) are in the file so far."""
        return self._events_written

    def update_metadata(self, **values: Any) -> None:
        """Add entries to ``otherData``; only possible before the first event is written."""
        with self._lock:
            if self._header_written:
                raise RuntimeError(
                    f"Expected update_metadata before the first event of {self.path} is "
                    "written, but the header is already on disk. Pass metadata= to "
                    "ChromeTraceExporter instead."
                )
            self._other.update(_json_safe(values))

    def _fix_origin(self, earliest_ns: int | None) -> int:
        if self._origin_ns is None:
            t = self._created_ns if earliest_ns is None else min(earliest_ns, self._created_ns)
            self._origin_ns = (t // _NS_PER_S) * _NS_PER_S
            self._other["origin_ns"] = self._origin_ns
        return self._origin_ns

    def _take_resource(self, batch: SpanBatch) -> None:
        other = self._other
        res = batch.resource or {}
        if other["service_name"] is None:
            other["service_name"] = res.get("service.name")
            other["ppetrace_version"] = res.get("ppetrace.version")
            other["host"] = res.get("host.name")
            other["pid"] = batch.pid
            rank = res.get("ppetrace.rank")
            other["rank"] = int(rank) if isinstance(rank, int) else None
            other["resource"] = _json_safe(dict(res))
        if other["trace_id"] is None and batch.rows:
            other["trace_id"] = f"{batch.rows[0].trace_id:032x}"

    def _header(self, earliest_ns: int | None) -> str:
        origin = self._fix_origin(earliest_ns)
        if self._other["start_time_ns"] is None:
            self._other["start_time_ns"] = (
                earliest_ns if earliest_ns is not None else self._created_ns
            )
        if self._other["pid"] is None:
            self._other["pid"] = self._pid
        self._other["origin_ns"] = origin
        self._header_written = True
        return '{"displayTimeUnit":"ns","otherData":' + _dumps(self._other) + ',"traceEvents":['

    # -- writing -----------------------------------------------------------------

    def _write(
        self,
        events: list[str],
        earliest_ns: int | None = None,
        encoded: tuple[bytes, int] | None = None,
    ) -> None:
        """Append events (and the header, the first time) and flush. Lock held.

        ``events`` are single events; ``encoded`` is ``(bytes, count)``: count
        events already joined, each preceded by ``",\n"`` (``"\n"`` for the
        file's first event), as :func:`_encode_columns` makes them.
        """
        f = self._file
        if f is None:
            return
        try:
            text = "" if self._header_written else self._header(earliest_ns)
            if events:
                text += ("\n" if self._first_event else ",\n") + ",\n".join(events)
                self._first_event = False
            data = text.encode("ascii")
            if encoded is not None and encoded[1]:
                data = data + encoded[0] if data else encoded[0]
                self._first_event = False
            error = f.append(data)  # raises if a direct write fails
            self._events_written += len(events) + (encoded[1] if encoded is not None else 0)
            self._report(error)
        except Exception:
            self.errors += 1
            _log.exception("exporters: writing the Chrome trace %s failed", self.path)

    def _report(self, error: BaseException | None) -> None:
        """Count and log the error of a write that ran on the writer thread."""
        if error is not None:
            self.errors += 1
            _log.error(
                "exporters: writing the Chrome trace %s failed",
                self.path,
                exc_info=(type(error), error, error.__traceback__),
            )

    def _meta_events(self, pid: int, batch: SpanBatch, rows: Sequence[SpanRow]) -> list[str]:
        out: list[str] = []
        if pid not in self._seen_pids:
            self._seen_pids.add(pid)
            res = batch.resource or {}
            service = str(res.get("service.name") or "ppetrace")
            rank = res.get("ppetrace.rank")
            label = (
                f"{service} rank {rank} (pid {pid})"
                if isinstance(rank, int)
                else f"{service} (pid {pid})"
            )
            out.append(
                f'{{"ph":"M","name":"process_name","pid":{pid},"tid":0,'
                f'"args":{{"name":{_quote(label)}}}}}'
            )
            if isinstance(rank, int):
                out.append(
                    f'{{"ph":"M","name":"process_sort_index","pid":{pid},"tid":0,'
                    f'"args":{{"sort_index":{int(rank)}}}}}'
                )
        named = self._thread_names
        names = batch.thread_names
        for tid in dict.fromkeys(map(_get_tid, rows)):
            key = (pid, tid)
            real = names.get(tid)
            if key in named and (named[key] is not None or real is None):
                continue  # already named (a placeholder is replaced once a name is known)
            named[key] = real
            label = real or f"thread {tid}"
            out.append(
                f'{{"ph":"M","name":"thread_name","pid":{pid},"tid":{tid},'
                f'"args":{{"name":{_quote(label)}}}}}'
            )
        return out

    def _prefix(self, pid: int, name: str) -> str:
        """The start of an ``X`` event named ``name`` in process ``pid``, up to ``"tid":``."""
        return f'{{"ph":"X","cat":"{owner_of(name)}","name":{_quote(name)},"pid":{pid},"tid":'

    def _encode_spans(
        self, rows: Sequence[SpanRow], pid: int, first: bool
    ) -> Iterator[tuple[bytes, int]]:
        """Encode rows as ``X`` events, column by column (see :func:`_encode_columns`)."""
        return _encode_columns(self, rows, pid, self._origin_ns or 0, first)

    def export_batch(self, batch: SpanBatch) -> None:
        """Append a batch of spans (ppetrace's fast path). Errors are logged, not raised."""
        rows = batch.rows
        if not rows:
            return
        with self._lock:
            if self._file is None:
                _log.warning("exporters: %r is shut down; %d spans dropped", self, len(rows))
                return
            try:
                self._take_resource(batch)
                earliest = min(r.start_ns for r in rows) if not self._header_written else None
                if not self._header_written:
                    self._fix_origin(earliest)
                pid = batch.pid
                meta = self._meta_events(pid, batch, rows)
                first = self._first_event and not meta
                # a few MB at a time: one part is encoded while the one before is written
                for part in self._encode_spans(rows, pid, first):
                    self._write(meta, earliest, part)
                    meta, earliest = [], None
            except Exception:
                self.errors += 1
                _log.exception("exporters: encoding spans for %s failed", self.path)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Append OpenTelemetry spans (the ``SpanExporter`` path); same output as
        :meth:`export_batch`."""
        if self._file is None:
            return SpanExportResult.FAILURE
        try:
            batches = rows_from_readable_spans(spans)
        except Exception:
            self.errors += 1
            _log.exception("exporters: converting spans for %s failed", self.path)
            return SpanExportResult.FAILURE
        before = self.errors
        for batch in batches:
            self.export_batch(batch)
        ok = self.errors == before and self._file is not None
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def add_events(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Append raw Chrome trace events (profiler stacks, counters, device tracks...).

        Each event is a mapping with at least ``ph``. Give its time either as
        ``ts``/``dur`` in µs relative to :attr:`origin_ns`, or as
        ``ts_ns``/``dur_ns`` integers (epoch ns and ns), which are converted
        exactly. ``pid`` defaults to this process. Raises ``ValueError`` for an
        event without ``ph``; write errors are logged, not raised.
        """
        encoded: list[str] = []
        with self._lock:
            origin = self._fix_origin(None)
            for event in events:
                if not isinstance(event, Mapping) or not isinstance(event.get("ph"), str):
                    raise ValueError(
                        "Expected Chrome trace events as mappings with a 'ph' string, but "
                        f"received {event!r}."
                    )
                ev = dict(event)
                ts_ns = ev.pop("ts_ns", None)
                dur_ns = ev.pop("dur_ns", None)
                ev.setdefault("pid", self._other["pid"] or self._pid)
                lead = []
                if ts_ns is not None:
                    ev.pop("ts", None)
                    lead.append('"ts":' + _us(int(ts_ns) - origin))
                if dur_ns is not None:
                    ev.pop("dur", None)
                    lead.append('"dur":' + _us(max(0, int(dur_ns))))
                body = _dumps(ev)
                if lead:
                    body = "{" + ",".join(lead) + ("," if len(body) > 2 else "") + body[1:]
                encoded.append(body)
            if self._file is None:
                _log.warning("exporters: %r is shut down; %d events dropped", self, len(encoded))
                return
            self._write(encoded)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Flush the file to the operating system. Returns False on an I/O error."""
        with self._lock:
            if self._file is None:
                return True
            try:
                error = self._file.wait()
                self._report(error)
                self._file.file.flush()
                return error is None
            except Exception:
                self.errors += 1
                _log.exception("exporters: flushing %s failed", self.path)
                return False

    def shutdown(self) -> None:
        """Write the closing ``]}`` and close the file. Calling it again does nothing."""
        with self._lock:
            f = self._file
            if f is None:
                return
            self._file = None
            self._closed = True
            try:
                head = "" if self._header_written else self._header(None)
                self._report(f.append((head + "\n]}\n").encode("ascii")))
            except Exception:
                self.errors += 1
                _log.exception("exporters: closing %s failed", self.path)
            finally:
                try:
                    f.file.close()
                except Exception:
                    self.errors += 1
                    _log.exception("exporters: closing %s failed", self.path)

    def __enter__(self) -> ChromeTraceExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


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
    return "," + _quote(f"attr.{key}" if key in _RESERVED_ARGS else str(key)) + ":"


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


# -- reading ---------------------------------------------------------------------


@dataclass
class ChromeTrace:
    """The parsed content of a Chrome trace file.

    ``events`` are the raw event dicts, ``metadata`` is ``otherData`` (``{}``
    when absent), ``origin_ns`` the epoch ns that ``ts`` 0 stands for (0 for
    traces that do not record one) and ``truncated`` says whether the file
    was cut off.
    """

    events: list[dict[str, Any]]
    metadata: dict[str, Any] = field(default_factory=dict)
    origin_ns: int = 0
    truncated: bool = False
    path: str = ""

    @property
    def clock_offset_ns(self) -> int:
        """``otherData["clock_offset_ns"]``, or 0."""
        value = self.metadata.get("clock_offset_ns", 0)
        return int(value) if isinstance(value, (int, float)) else 0

    def to_frame(self) -> pd.DataFrame:
        """The spans (``X`` events, see :func:`read_chrome_trace`) as a frame."""
        from .frame import frame_from_chrome_events

        return frame_from_chrome_events(self.events, self.origin_ns, self.metadata)


def _read_bytes(path: Path) -> tuple[bytes, bool]:
    """The file's bytes, gunzipped when it is gzip; the flag says the gzip stream was cut."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"Expected a trace file at {path}, but there is no such file."
        ) from None
    except IsADirectoryError:
        raise TraceError(f"Expected a trace file at {path}, but it is a directory.") from None
    if data[:2] != b"\x1f\x8b":
        return data, False
    out = []
    truncated = False
    rest = data
    while rest:
        d = zlib.decompressobj(wbits=31)
        try:
            out.append(d.decompress(rest))
        except zlib.error:
            truncated = True
            break
        if not d.eof:
            truncated = True
            break
        rest = d.unused_data  # a concatenated gzip member
        if rest[:2] != b"\x1f\x8b":
            break
    return b"".join(out), truncated


def _recover(text: str) -> tuple[Any, bool]:
    """Parse a possibly cut-off trace document: ``(document, was_cut)``."""
    try:
        return json.loads(text), False
    except json.JSONDecodeError:
        pass
    body = text.rstrip()
    # ppetrace writes one event per line: cut at the last complete line.
    marker = '"traceEvents":['
    at = body.find(marker)
    if at >= 0 and body.startswith("{"):
        head = body[: at + len(marker)]
        lines = body[at + len(marker) :].split("\n")
        for keep in range(len(lines), max(len(lines) - 3, 0) - 1, -1):
            events = ",".join(x.rstrip().rstrip(",") for x in lines[:keep] if x.strip())
            events = events.rstrip(",")
            try:
                return json.loads(head + events + "]}"), True
            except json.JSONDecodeError:
                continue
    # Any other file: close the document after one of its last few '}'.
    closers = ("]}", "]", "}", "}]}", "}}")
    end = len(body)
    for _ in range(64):
        end = body.rfind("}", 0, end)
        if end < 0:
            break
        candidate = body[: end + 1]
        for closer in closers:
            try:
                return json.loads(candidate + closer), True
            except json.JSONDecodeError:
                continue
    raise json.JSONDecodeError("cannot recover", text, 0)


def load_chrome_trace(path: str | os.PathLike[str]) -> ChromeTrace:
    """Read a Chrome trace (JSON object or array form, plain or gzip) into a :class:`ChromeTrace`.

    A file cut off anywhere is read up to its last complete event, with a
    :class:`TraceTruncatedWarning`. Raises ``FileNotFoundError`` for a
    missing file and :class:`TraceError` for a file that is not JSON or not a
    trace.
    """
    p = Path(path)
    data, gz_cut = _read_bytes(p)
    if not data.strip():
        raise TraceError(f"Expected a Chrome trace in {p}, but the file is empty.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(
            f"Expected a JSON Chrome trace in {p}, but it is not UTF-8 text."
        ) from None
    stripped = text.lstrip()
    if not stripped.startswith(("{", "[")):
        raise TraceError(
            f"Expected a JSON Chrome trace in {p}, but the file is not JSON "
            f"(it starts with {stripped[:20]!r})."
        )
    try:
        doc, cut = _recover(text)
    except json.JSONDecodeError:
        raise TraceError(
            f"Expected a JSON Chrome trace in {p}, but the file is not valid JSON and no "
            "complete event could be recovered from it (is it cut off before its first event?)."
        ) from None
    truncated = cut or gz_cut
    if isinstance(doc, dict):
        events = doc.get("traceEvents")
        if not isinstance(events, list) and truncated:
            raise TraceError(
                f"The trace {p} is cut off before its first event (the process that wrote "
                "it probably stopped early); there is nothing to read."
            )
        if not isinstance(events, list):
            raise TraceError(
                f"Expected a Chrome trace in {p} (a JSON object with a 'traceEvents' list), "
                f"but its keys are {sorted(doc)[:8]}."
            )
        metadata = doc.get("otherData")
        metadata = dict(metadata) if isinstance(metadata, dict) else {}
    elif isinstance(doc, list):
        events, metadata = doc, {}
    else:
        raise TraceError(
            f"Expected a Chrome trace in {p} (a JSON object or array of events), but it "
            f"holds a JSON {type(doc).__name__}."
        )
    if events and not all(isinstance(e, dict) and "ph" in e for e in events[:100]):
        raise TraceError(
            f"Expected Chrome trace events (objects with a 'ph' field) in {p}, but found "
            f"{_describe(events[0])}."
        )
    events = [e for e in events if isinstance(e, dict)]
    origin = metadata.get("origin_ns", 0)
    origin_ns = int(origin) if isinstance(origin, int) and not isinstance(origin, bool) else 0
    if truncated:
        warnings.warn(
            f"The trace {p} is cut off (the process that wrote it probably stopped early); "
            f"read its first {len(events)} complete events.",
            TraceTruncatedWarning,
            stacklevel=2,
        )
    return ChromeTrace(events, metadata, origin_ns, truncated, str(p))


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_chrome_trace(path: str | os.PathLike[str]) -> pd.DataFrame:
    """The spans of a Chrome trace file as a frame (schema: :mod:`exporters.frame`).

    Reads ppetrace's own files and any Chrome trace made of ``X`` events (or
    ``B``/``E`` pairs). When some ``X`` events carry ``args.span_id`` (ppetrace
    files), only those are spans; events that other tools added (profiler
    stacks, kernels, counters) are left out. Without ids, parents are
    inferred from nesting per thread. ``frame.attrs`` holds ``metadata``
    (``otherData``), ``truncated``, ``path`` and, when the file has ``M`` events
    named ``ppetrace.table`` (``args``: ``name``, ``columns``, ``rows``; the
    Pyinstrument profiler writes ``top_functions``), ``tables``, which
    :func:`exporters.step_report` adds to its report. A cut-off file is read with
    a :class:`TraceTruncatedWarning`.
    """
    trace = load_chrome_trace(path)
    frame = trace.to_frame()
    tables = {
        str(e["args"]["name"]): {"columns": e["args"]["columns"], "rows": e["args"]["rows"]}
        for e in trace.events
        if e.get("ph") == "M"
        and e.get("name") == "ppetrace.table"
        and isinstance(e.get("args"), dict)
        and {"name", "columns", "rows"} <= set(e["args"])
    }
    if tables:
        frame.attrs["tables"] = tables  # plain data: pandas copies attrs around
    frame.attrs["metadata"] = trace.metadata
    frame.attrs["path"] = trace.path
    frame.attrs["truncated"] = trace.truncated
    return frame


# -- merging ---------------------------------------------------------------------

_RANK_RE = re.compile(r"\brank (\d+)\b")


def _event_ns(value: Any) -> int:
    """A ``ts`` read back from JSON (float or int µs) as integer ns."""
    if isinstance(value, int):
        return value * 1000
    return round(float(value) * 1000.0)


def _start_time(trace: ChromeTrace, base: int) -> int:
    """The trace's first span on the reference clock (``base`` when it does not say)."""
    start = trace.metadata.get("start_time_ns")
    if isinstance(start, int) and not isinstance(start, bool):
        return start + trace.clock_offset_ns
    return base


def merge_traces(
    out: str | os.PathLike[str], inputs: Sequence[str | os.PathLike[str]]
) -> ChromeTrace:
    """Merge per-rank or per-process trace files into one timeline at ``out``.

    Each input keeps its pid and process name; when two inputs share a pid,
    the later one gets a new, unused pid. Each input's
    ``otherData["clock_offset_ns"]`` is added to its times, and all times are
    rebased on the earliest origin. The merged ``otherData`` lists the inputs
    under ``merged_from``. Returns the merged trace; ``.json.gz`` outputs are
    gzip.
    """
    if not inputs:
        raise ValueError("Expected at least one trace file to merge, but received none.")
    traces = [load_chrome_trace(p) for p in inputs]
    bases = [t.origin_ns + t.clock_offset_ns for t in traces]
    origin = (min(bases) // _NS_PER_S) * _NS_PER_S
    used: set[int] = set()
    for t in traces:
        used.update(int(e["pid"]) for e in t.events if isinstance(e.get("pid"), int))
    taken: set[int] = set()
    merged: list[str] = []
    sources = []
    processes: dict[str, dict[str, Any]] = {}
    for trace, base in zip(traces, bases, strict=True):
        shift = base - origin
        pids = sorted({int(e["pid"]) for e in trace.events if isinstance(e.get("pid"), int)})
        remap: dict[int, int] = {}
        for pid in pids:
            if pid in taken:
                new = max(used | taken) + 1
                remap[pid] = new
                used.add(new)
                taken.add(new)
            else:
                remap[pid] = pid
                taken.add(pid)
        named = {
            e.get("pid")
            for e in trace.events
            if e.get("ph") == "M" and e.get("name") == "process_name"
        }
        rank = trace.metadata.get("rank")
        for pid in pids:
            if pid not in named:
                label = f"{Path(trace.path).name} (pid {pid})"
                merged.append(
                    f'{{"ph":"M","name":"process_name","pid":{remap[pid]},"tid":0,'
                    f'"args":{{"name":{_quote(label)}}}}}'
                )
            processes[str(remap[pid])] = {
                "source": trace.path,
                "original_pid": pid,
                "rank": rank if isinstance(rank, int) else None,
            }
        for e in trace.events:
            ev = dict(e)
            event_pid = ev.get("pid")
            if isinstance(event_pid, int) and event_pid in remap:
                ev["pid"] = remap[event_pid]
            if ev.get("ph") == "M" and ev.get("name") == "process_name":
                args = ev.get("args")
                if isinstance(args, dict):
                    m = _RANK_RE.search(str(args.get("name", "")))
                    info = processes.get(str(ev.get("pid")))
                    if m is not None and info is not None:
                        info["rank"] = int(m.group(1))
                    if isinstance(event_pid, int) and remap.get(event_pid, event_pid) != event_pid:
                        # a pid taken by an earlier input: say which file this track is
                        args = ev["args"] = dict(args)
                        args["name"] = f"{args.get('name', '')} [{Path(trace.path).name}]"
            ts = ev.pop("ts", None)
            body = _dumps(ev)
            if ts is not None and isinstance(ts, (int, float)):
                body = (
                    '{"ts":'
                    + _us(_event_ns(ts) + shift)
                    + ("," if len(body) > 2 else "")
                    + body[1:]
                )
            merged.append(body)
        sources.append(
            {
                "path": trace.path,
                "clock_offset_ns": trace.clock_offset_ns,
                "origin_ns": trace.origin_ns,
                "pids": {str(p): remap[p] for p in pids},
                "truncated": trace.truncated,
                "otherData": trace.metadata,
            }
        )
    other = {
        "origin_ns": origin,
        "clock_offset_ns": 0,
        "start_time_ns": min(_start_time(t, b) for t, b in zip(traces, bases, strict=True)),
        "processes": processes,
        "merged_from": sources,
    }
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with _open_for_writing(out_path) as f:
        f.write('{"displayTimeUnit":"ns","otherData":' + _dumps(other) + ',"traceEvents":[\n')
        for i in range(0, len(merged), _CHUNK):
            if i:
                f.write(",\n")
            f.write(",\n".join(merged[i : i + _CHUNK]))
        f.write("\n]}\n")
    return ChromeTrace([json.loads(x) for x in merged], other, origin, False, str(out_path))
