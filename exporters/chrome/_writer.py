"""The streaming writer of Chrome trace files: :class:`ChromeTraceExporter`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from json.encoder import encode_basestring_ascii as _quote
from pathlib import Path
from typing import IO, Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from .._spans import SpanBatch, SpanRow, rows_from_readable_spans
from ._encode import (
    _NS_PER_S,
    _dumps,
    _encode_columns,
    _get_tid,
    _json_safe,
    _open_binary,
    _us,
    owner_of,
)

__all__ = ["ChromeTraceExporter"]

_log = logging.getLogger("exporters")

_ASYNC_BYTES = 1 << 20  # writes at least this large run on the writer thread


class _Appender:
    """Appends to the trace file in call order, a large write on a thread of its own.

    A part of 16,384 spans is about 5 MB of JSON. While the kernel copies one
    part into the file (the GIL is released meanwhile), the exporter encodes the
    next. At most one write is in flight: each call first waits for the one
    before, so a killed process loses at most the last batch, as with direct
    writes. An error of a write on the thread is returned by the next call
    (or by :meth:`wait`), with the number of spans that write held. In a
    forked child every write is direct.
    """

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._spans = 0  # spans in the write in flight
        self.good = 0  # bytes written and flushed without an error

    def wait(self) -> tuple[BaseException | None, int]:
        """Wait for the write in flight; return its error (or None) and its span count."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        spans, self._spans = self._spans, 0
        return error, spans if error is not None else 0

    def append(self, data: bytes, spans: int = 0) -> tuple[BaseException | None, int]:
        """Write ``data`` (holding ``spans`` spans) and flush, on the thread when large;
        return the error of the write before, and its span count. An error of a direct
        write is raised."""
        before = self.wait()
        if len(data) >= _ASYNC_BYTES and os.getpid() == self._pid:
            self._spans = spans
            self._thread = threading.Thread(
                target=self._write, args=(data,), name="exporters-chrome-writer"
            )
            self._thread.start()
        else:
            self.file.write(data)
            self.file.flush()
            self.good += len(data)
        return before

    def _write(self, data: bytes) -> None:
        try:
            self.file.write(data)
            self.file.flush()
            self.good += len(data)
        except BaseException as exc:  # reported by the next append or wait
            self._error = exc


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
    ``metadata`` adds entries to ``otherData``. ``origin_ns`` fixes the epoch
    time (this process's clock) that ``ts`` 0 stands for (default: the first
    span's start, floored to the second). ``distributed_info`` is written as
    the top-level ``distributedInfo`` object that HolisticTraceAnalysis reads
    (``rank``, ``world_size``, ``backend``). ``header_reserve`` leaves that
    many spaces after ``otherData``, so that
    :func:`exporters.chrome.update_other_data` can rewrite it in place once the
    file is closed (values known only at the end, such as a second clock
    measurement). Write errors are logged and
    counted, never raised from ``export``/``export_batch``: :attr:`errors`
    counts failed operations, :attr:`spans_lost` the spans of accepted batches
    that did not reach the file, and :attr:`last_error` holds the last error's
    text. After a failed write (a full disk) the exporter writes nothing more:
    the file keeps what was written before it (readable as a cut-off trace),
    and the spans of every later batch count in :attr:`spans_lost`.
    ppetrace's ``stats()`` reports them per sink as ``exporter_error``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock_offset_ns: int = 0,
        metadata: Mapping[str, Any] | None = None,
        origin_ns: int | None = None,
        distributed_info: Mapping[str, Any] | None = None,
        header_reserve: int = 0,
    ) -> None:
        for name, value in (("clock_offset_ns", clock_offset_ns), ("origin_ns", origin_ns)):
            if (value is not None or name == "clock_offset_ns") and (
                isinstance(value, bool) or not isinstance(value, int)
            ):
                raise TypeError(
                    f"Expected an int number of nanoseconds for {name}, but received {value!r}."
                )
        if isinstance(header_reserve, bool) or not isinstance(header_reserve, int):
            raise TypeError(
                f"Expected an int number of bytes for header_reserve, but received "
                f"{header_reserve!r}."
            )
        self.path = Path(path)
        self.errors = 0
        self.spans_lost = 0
        self.last_error: str | None = None
        self._broken = False
        self._lock = threading.RLock()
        self._created_ns = time.time_ns()
        self._origin_ns: int | None = origin_ns
        self._distributed = None if distributed_info is None else _json_safe(dict(distributed_info))
        self._reserve = max(0, header_reserve)
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
        head = '{"displayTimeUnit":"ns","otherData":' + _dumps(self._other) + " " * self._reserve
        if self._distributed is not None:
            # spaced as Kineto writes it: HolisticTraceAnalysis finds the rank with the
            # pattern '"rank":\s+(\d+)', on the first line that has it
            head += ',"distributedInfo":' + json.dumps(
                self._distributed, separators=(", ", ": "), ensure_ascii=True
            )
        return head + ',"traceEvents":['

    # -- writing -----------------------------------------------------------------

    def _write(
        self,
        events: list[str],
        earliest_ns: int | None = None,
        encoded: tuple[bytes, int] | None = None,
        spans: int = 0,
    ) -> None:
        """Append events (and the header, the first time) and flush. Lock held.

        ``events`` are single events; ``encoded`` is ``(bytes, count)``: count
        events already joined, each preceded by ``",\n"`` (``"\n"`` for the
        file's first event), as :func:`_encode_columns` makes them. ``spans``:
        how many spans this write holds (counted as lost if it fails).
        """
        f = self._file
        if f is None:
            return
        if self._broken:
            self.spans_lost += spans
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
            error, lost = f.wait()
            if error is not None:  # the write before failed: this one is not made
                self._report(error, lost)
                self.spans_lost += spans
                return
            f.append(data, spans)  # raises if a direct write fails
            self._events_written += len(events) + (encoded[1] if encoded is not None else 0)
        except Exception as exc:
            self._fail(exc, spans)

    def _fail(self, exc: BaseException, spans: int) -> None:
        """A write failed: count it and its spans, log it once, write nothing more."""
        self.errors += 1
        self.spans_lost += spans
        self.last_error = f"writing {self.path} failed: {type(exc).__name__}: {exc}"
        if not self._broken:
            self._broken = True
            self._cut()
            _log.error(
                "exporters: %s; the file keeps what was written before, and the spans of "
                "later batches are counted as lost (spans_lost)",
                self.last_error,
                exc_info=(type(exc), exc, exc.__traceback__),
            )

    def _cut(self) -> None:
        """Cut a plain file back to its last whole write (a failed write can leave part
        of an event); best effort, never raises."""
        f = self._file
        if f is None or self.path.name.endswith(".gz"):
            return
        with contextlib.suppress(OSError):
            os.truncate(self.path, f.good)

    def _report(self, error: BaseException | None, spans: int = 0) -> None:
        """Count and log the error of a write that ran on the writer thread."""
        if error is not None:
            self._fail(error, spans)

    def _meta_events(self, pid: int, batch: SpanBatch, rows: Sequence[SpanRow]) -> list[str]:
        out: list[str] = []
        if pid not in self._seen_pids:
            self._seen_pids.add(pid)
            res = batch.resource or {}
            service = str(res.get("service.name") or "ppetrace")
            rank = res.get("ppetrace.rank")
            # no "(pid N)": Perfetto and speedscope add the pid to the name themselves
            label = f"{service} rank {rank}" if isinstance(rank, int) else service
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
                self.spans_lost += len(rows)
                return
            written = 0
            try:
                self._take_resource(batch)
                earliest = min(r.start_ns for r in rows) if not self._header_written else None
                if not self._header_written:
                    self._fix_origin(earliest)
                pid = batch.pid
                meta = self._meta_events(pid, batch, rows)
                first = self._first_event and not meta
                # a few MB at a time: one part is encoded while the one before is written
                if self._broken:
                    self.spans_lost += len(rows)
                    return
                for part in self._encode_spans(rows, pid, first):
                    self._write(meta, earliest, part, spans=part[1])
                    written += part[1]
                    meta, earliest = [], None
            except Exception as exc:
                self.errors += 1
                self.spans_lost += len(rows) - written
                self.last_error = f"encoding spans for {self.path} failed: {exc}"
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
        before = (self.errors, self.spans_lost)
        for batch in batches:
            self.export_batch(batch)
        ok = (self.errors, self.spans_lost) == before and self._file is not None
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
                error, spans = self._file.wait()
                self._report(error, spans)
                if self._broken:
                    return False
                self._file.file.flush()
                return error is None
            except Exception as exc:
                self._fail(exc, 0)
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
                if self._broken:
                    self._report(*f.wait())
                else:
                    head = "" if self._header_written else self._header(None)
                    self._report(*f.append((head + "\n]}\n").encode("ascii")))
                    self._report(*f.wait())
            except Exception as exc:
                self._fail(exc, 0)
            finally:
                try:
                    f.file.close()
                except Exception as exc:
                    if not self._broken:
                        self._fail(exc, 0)
                if self._broken and not self.path.name.endswith(".gz"):
                    # closing may have flushed buffered bytes of the failed write
                    with contextlib.suppress(OSError):
                        os.truncate(self.path, f.good)

    def __enter__(self) -> ChromeTraceExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
