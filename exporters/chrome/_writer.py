"""The streaming writer of Chrome trace files: :class:`ChromeTraceExporter`."""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from json.encoder import encode_basestring_ascii as _quote
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from .._spans import SpanBatch, SpanRow, rows_from_readable_spans
from ._appender import _Appender
from ._detail import DetailFilter, final_event, write_held, write_summarised
from ._encode import (
    _NS_PER_S,
    _dumps,
    _encode_columns,
    _json_safe,
    _open_binary,
    _us,
    distinct_tids,
    owner_of,
)
from ._split import _NAMING, MIN_PART_BYTES, _check_part_bytes, part_path
from ._summary_api import SummaryAPI

__all__ = ["FINAL_EVENT", "ChromeTraceExporter"]

#: The name of the ``M`` event that :meth:`ChromeTraceExporter.shutdown` writes last, with
#: the run's final counts in its ``args`` (see the class doc, "Summarised steps").
FINAL_EVENT = "ppetrace.final"

_log = logging.getLogger("exporters")
_START = operator.attrgetter("start_ns")  # a row's start, without a generator's frames


class ChromeTraceExporter(SummaryAPI, SpanExporter):
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

    ``max_part_bytes`` (None: one file) writes the run in parts: once a part
    holds at least that many bytes of JSON (counted before gzip), the next
    write closes it and goes on in the next part, ``trace.1.json``,
    ``trace.2.json``, ... (``t.json.gz``: ``t.1.json.gz``). A part ends
    between events, so it can exceed the size by one write (at most 16,384
    spans, about 5 MB). Each part is a whole Chrome trace: the run's
    ``otherData`` plus ``part`` (its index) and ``first_part`` (part 0's file
    name), and the ``M`` events that name the processes and threads so far.
    :attr:`parts` lists the files; :func:`read_chrome_trace` given part 0
    reads them all. With ``header_reserve``, every part's header has the room
    (``update_run_other_data`` updates them all).

    **Summarised steps.** :meth:`summarise_step` (called by whoever drives the
    steps, on the training thread) asks for the step that starts at
    ``start_ns`` on thread ``tid`` to be *summarised*: its hook-level rows
    (every row of that thread that starts at or after ``start_ns``, up to the
    step's own ``trainer.step`` row, except the names in
    :data:`STEP_LEVEL_EVENTS` and ERROR rows) are not written; their per-event
    aggregates are written as attributes of the step's ``trainer.step`` row instead:

    - ``ppetrace.hooks`` (str): one entry per name of the names list in force,
      in its order, ``;``-separated; an entry is empty when the event did not
      occur in the step, else ``total_ns``, ``total_ns/self_ns`` or
      ``total_ns/self_ns/count`` (integers, ns; ``self_ns`` is written when it
      differs from ``total_ns`` or count is not 1, ``count`` when it is not 1);
      trailing empty entries are left out. Total is the sum of the rows'
      durations, self the total minus their direct children's durations,
      count the number of rows. A ``trainer.step`` row with ``ppetrace.hooks``
      (even ``""``) is a summarised step; one without it had full detail.
    - ``ppetrace.hook_names`` (str): the names list, ``;``-separated (``%`` and
      ``;`` in a name percent-encoded as ``%25`` and ``%3B``), in force
      for this row and the later step rows of the same ``pid``/``tid`` until
      the next one; a new list extends the previous one. It is written on the
      first summarised step of each thread, the first after a detailed step,
      whenever a new name appears, and the first of each part.

    A summarised step's rows are held until its ``trainer.step`` row arrives (at
    most 65,536); those of a step whose row cannot come any more, and every
    held row at ``shutdown``, are written in full (see ``_detail``). A killed
    process loses the open step's rows, as it loses that step's own row.
    :attr:`spans_summarised`/:attr:`steps_summarised` count what was folded.

    **Light steps.** A loop whose recorder takes a summarised step's spans as
    aggregates itself, without rows (``ppetrace.tracing._light``: the Trainer,
    while this exporter is its only sink), publishes them with the callable that
    :meth:`light_summariser` returns, when the step ends and before its row is
    made. The ``trainer.step`` row that starts at the published start is then
    written with those aggregates, in the same attributes. Their spans count in
    :attr:`spans_summarised`; those of a step whose row never comes (dropped, or
    after ``shutdown``) in :attr:`light_spans_lost` and in the final counts'
    ``light_spans_lost`` (present when not 0).

    **Final counts.** ``otherData`` is written first, so the counts known only
    at the end go in the last event that :meth:`shutdown` writes, in the part
    being written then: ``{"ph":"M","name":"ppetrace.final","pid":P,"tid":0,
    "args":{"steps_summarised":int,"spans_summarised":int,"parts":int,...}}``
    plus the entries given to :meth:`add_final_metadata` (ppetrace's Trainer
    adds ``switched_at_step``: int or null). It is written only by a clean
    ``shutdown`` of an exporter that summarised a step or was given final
    metadata; a run that was killed has no such event, and its counts must be
    derived from the rows themselves (the step rows with ``ppetrace.hooks``).
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
        max_part_bytes: int | None = None,
        _min_part_bytes: int = MIN_PART_BYTES,
    ) -> None:
        """``_min_part_bytes`` is for tests only: the smallest ``max_part_bytes`` taken."""
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
        self._max_part = _check_part_bytes(max_part_bytes, _min_part_bytes)
        self.path = Path(path)
        self._part = 0  # the index of the part being written
        self._part_path = self.path
        self._part_bytes = 0  # bytes written to it
        self._paths = [self.path]
        # (name, pid, tid) -> the M event that names a process or thread, for later parts
        self._naming: dict[tuple[Any, Any, Any], str] = {}
        self.errors = 0
        self.spans_lost = 0
        self._bytes = 0  # written to every part
        self._detail = DetailFilter()
        self._final: dict[str, Any] = {}
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
    def parts(self) -> list[Path]:
        """The files written so far: ``[path]``, then the later parts (``max_part_bytes``)."""
        with self._lock:
            return list(self._paths)

    @property
    def spans_in_flight(self) -> int:
        """Spans accepted by :meth:`export_batch` that a large write still carries to the
        file on the writer thread (``stats()`` counts them as buffered, not delivered)."""
        f = self._file
        return f.in_flight() if f is not None else 0

    @property
    def bytes_written(self) -> int:
        """Bytes of JSON written so far, over every part (counted before gzip)."""
        return self._bytes

    def add_final_metadata(self, **values: Any) -> None:
        """Add entries to the closing ``ppetrace.final`` event (see "Final counts")."""
        with self._lock:
            self._final.update(_json_safe(values))

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
        other = self._other
        if self._max_part is not None:
            other = {**other, "part": self._part, "first_part": self.path.name}
        head = '{"displayTimeUnit":"ns","otherData":' + _dumps(other) + " " * self._reserve
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
            if (
                self._max_part is not None
                and self._header_written
                and self._part_bytes >= self._max_part
            ):
                f = self._next_part(f)
                if f is None:
                    self.spans_lost += spans
                    return
                here = set(events)
                events = [e for e in self._naming.values() if e not in here] + events
            text = "" if self._header_written else self._header(earliest_ns)
            if events:
                text += ("\n" if self._first_event else ",\n") + ",\n".join(events)
                self._first_event = False
            head = text.encode("ascii")
            body: bytes | memoryview = b""
            if encoded is not None and encoded[1]:
                body = encoded[0]  # ",\n" cut from the first event of a part, not copied:
                body = memoryview(body)[1:] if self._first_event and body[:1] == b"," else body
                self._first_event = False
            error, lost = f.wait()
            if error is not None:  # the write before failed: this one is not made
                self._report(error, lost)
                self.spans_lost += spans
                return
            if head and body:  # one after the other: a part's MB are not copied to join
                f.append(head)  # small: a direct write, which raises if it fails
            f.append(body or head, spans)  # raises if a direct write fails
            size = len(head) + len(body)
            self._part_bytes += size
            self._bytes += size
            if self._bytes >= self._detail.alarm_bytes:
                self._detail.ring()
            self._events_written += len(events) + (encoded[1] if encoded is not None else 0)
        except Exception as exc:
            self._fail(exc, spans)

    def _next_part(self, f: _Appender) -> _Appender | None:
        """Close the part being written and open the next one (None if that failed: then
        the exporter is broken). Lock held."""
        error, lost = f.wait()
        if error is not None:
            self._report(error, lost)
            return None
        f.append(b"\n]}\n")  # raises if the write fails
        self._bytes += 4
        self._report(*f.wait())
        if self._broken:
            return None
        f.file.close()  # raises on an error: then the exporter is broken
        path = part_path(self.path, self._part + 1)
        self._file = nxt = _Appender(_open_binary(path))
        self._part += 1
        self._part_path = path
        self._paths.append(path)
        self._part_bytes = 0
        self._header_written = False
        self._first_event = True
        return nxt

    def _fail(self, exc: BaseException, spans: int) -> None:
        """A write failed: count it and its spans, log it once, write nothing more."""
        self.errors += 1
        self.spans_lost += spans
        self.last_error = f"writing {self._part_path} failed: {type(exc).__name__}: {exc}"
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
        if f is None or self._part_path.name.endswith(".gz"):
            return
        with contextlib.suppress(OSError):
            os.truncate(self._part_path, f.good)

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
            event = (
                f'{{"ph":"M","name":"process_name","pid":{pid},"tid":0,'
                f'"args":{{"name":{_quote(label)}}}}}'
            )
            out.append(event)
            self._naming["process_name", pid, 0] = event
            if isinstance(rank, int):
                event = (
                    f'{{"ph":"M","name":"process_sort_index","pid":{pid},"tid":0,'
                    f'"args":{{"sort_index":{int(rank)}}}}}'
                )
                out.append(event)
                self._naming["process_sort_index", pid, 0] = event
        named = self._thread_names
        names = batch.thread_names
        for tid in distinct_tids(rows):
            key = (pid, tid)
            real = names.get(tid)
            if key in named and (named[key] is not None or real is None):
                continue  # already named (a placeholder is replaced once a name is known)
            named[key] = real
            label = real or f"thread {tid}"
            event = (
                f'{{"ph":"M","name":"thread_name","pid":{pid},"tid":{tid},'
                f'"args":{{"name":{_quote(label)}}}}}'
            )
            out.append(event)
            self._naming["thread_name", pid, tid] = event
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
                earliest = min(map(_START, rows)) if not self._header_written else None
                if not self._header_written:
                    self._fix_origin(earliest)
                pid = batch.pid
                meta = self._meta_events(pid, batch, rows)
                first = self._first_event and not meta
                # a few MB at a time: one part is encoded while the one before is written
                if self._broken:
                    self.spans_lost += len(rows)
                    return
                detail = self._detail
                if detail.active and not detail.pending():
                    detail.idle()  # nothing to fold: no cost but this test
                elif detail.active:
                    out, summaries = detail.take(pid, rows)
                    rows = out
                    if summaries:
                        written = write_summarised(self, out, summaries, pid, meta, earliest)
                        return
                for part in self._encode_spans(rows, pid, first):
                    self._write(meta, earliest, part, spans=part[1])
                    written += part[1]
                    meta, earliest = [], None
            except Exception as exc:
                self.errors += 1
                self.spans_lost += max(0, len(rows) - written)
                self.last_error = f"encoding spans for {self.path} failed: {exc}"
                _log.exception("exporters: encoding spans for %s failed", self.path)

    def _switching(self) -> int:
        """1 if the next write opens the next part, else 0. Lock held."""
        return int(
            self._max_part is not None
            and self._header_written
            and self._part_bytes >= self._max_part
        )

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
                if ev["ph"] == "M" and ev.get("name") in _NAMING:
                    key = (ev.get("name"), ev.get("pid"), ev.get("tid", 0))
                    with contextlib.suppress(TypeError):  # an unhashable pid: not repeated
                        self._naming[key] = body
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
            try:
                if not self._broken:
                    write_held(self, _log)
                    final = final_event(self, FINAL_EVENT)
                    if final is not None:
                        self._write([final])
            except Exception as exc:
                self._fail(exc, 0)
            f = self._file  # the held rows may have opened the next part
            if f is None:
                return
            self._file = None
            self._closed = True
            try:
                if self._broken:
                    self._report(*f.wait())
                else:
                    head = "" if self._header_written else self._header(None)
                    closing = (head + "\n]}\n").encode("ascii")
                    self._bytes += len(closing)
                    self._report(*f.append(closing))
                    self._report(*f.wait())
            except Exception as exc:
                self._fail(exc, 0)
            finally:
                try:
                    f.file.close()
                except Exception as exc:
                    if not self._broken:
                        self._fail(exc, 0)
                if self._broken and not self._part_path.name.endswith(".gz"):
                    # closing may have flushed buffered bytes of the failed write
                    with contextlib.suppress(OSError):
                        os.truncate(self._part_path, f.good)

    def __enter__(self) -> ChromeTraceExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
