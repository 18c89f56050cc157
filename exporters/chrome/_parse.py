"""Decoding Chrome trace files with msgspec: bytes in, chunks of events out.

Takes in: a path (plain or gzip, a UTF-8 BOM allowed). Hands on: the
document's top-level keys (``otherData`` and the rest) and the trace events in
chunks of :class:`Event` structs, or, for :func:`document`, the whole parsed
document.

ppetrace writes one event per line between a header line ending in
``"traceEvents":[`` and a closing ``]}``. Such a file is read a block of lines
at a time (:func:`stream`), each block decoded with msgspec into
:class:`Event` structs that hold only the fields a frame needs (no dict per
event; a span's ``attrs`` stay raw JSON bytes), so memory stays near the size
of the columns rather than of the events. Any other layout, and a block that
does not decode, falls back to parsing the whole document. A file cut off by a
killed writer is read up to its last complete event (``truncated``).
"""

from __future__ import annotations

import codecs
import json
import os
import zlib
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec

from .._errors import TraceError

__all__ = ["Event", "Parsed", "TypedEvent", "document", "stream"]

_BLOCK = 16 << 20  # bytes read (or decompressed) at a time: ~50,000 events
_BOM = b"\xef\xbb\xbf"
_GZIP = b"\x1f\x8b"
_MARKER = b'"traceEvents":['
_UNSET: Any = msgspec.UNSET


class Event(msgspec.Struct, gc=False):
    """The fields of a trace event that a frame needs; the others are skipped.

    Any JSON value is accepted in each field (a frame decides what it can
    use); ``span_id`` is ``UNSET`` when the key is absent, ``attrs`` is the raw
    JSON of the span's attributes (empty when absent).
    """

    ph: Any = None
    name: Any = ""
    pid: Any = 0
    tid: Any = 0
    ts: Any = None
    dur: Any = 0
    span_id: Any = _UNSET
    parent_id: Any = None
    status: Any = "UNSET"
    attrs: msgspec.Raw = msgspec.Raw()
    args: Any = None


class TypedEvent(msgspec.Struct, gc=False):
    """:class:`Event` with the types ppetrace writes, checked while decoding: a block of
    such events needs no check of its values in Python. A block whose values have
    other types is decoded as :class:`Event` instead."""

    ph: str = ""
    name: str = ""
    pid: int = 0
    tid: int = 0
    ts: float | None = None
    dur: float = 0.0
    span_id: str | msgspec.UnsetType = _UNSET
    parent_id: str | None = None
    status: str = "UNSET"
    attrs: msgspec.Raw = msgspec.Raw()
    args: dict[str, Any] | None = None


_TYPED = msgspec.json.Decoder(list[TypedEvent])
_EVENTS = msgspec.json.Decoder(list[Event])
_ANY = msgspec.json.Decoder()


@dataclass
class Parsed:
    """A trace file's top-level keys (``top``) and whether it was cut off."""

    top: dict[str, Any] = field(default_factory=dict)
    truncated: bool = False


def _blocks(path: Path, parsed: Parsed) -> Generator[bytes, None, None]:
    """The file's bytes a block at a time, gunzipped when it is gzip.

    A gzip stream cut off before its end ends the blocks early and sets
    ``parsed.truncated``; corrupt gzip data is a :class:`TraceError`.
    """
    try:
        f: IO[bytes] = open(path, "rb")  # noqa: SIM115 - closed below, with the generator
    except FileNotFoundError:
        raise FileNotFoundError(
            f"Expected a trace file at {path}, but there is no such file."
        ) from None
    except IsADirectoryError:
        raise TraceError(f"Expected a trace file at {path}, but it is a directory.") from None
    with f:
        try:
            first = f.read(_BLOCK)
        except IsADirectoryError:
            raise TraceError(f"Expected a trace file at {path}, but it is a directory.") from None
        if first[:2] != _GZIP:
            yield from _read_ahead(f, first)
            return
        yield from _gunzip(path, f, first, parsed)


def _read_ahead(f: IO[bytes], first: bytes) -> Generator[bytes, None, None]:
    """``first``, then the rest of ``f`` a block at a time. Where the process may use two
    CPUs and the file is larger than a block, the next block is read on a thread while
    the caller scans this one (a read lets go of the GIL); the read in flight is waited
    for when the caller stops early, before the file is closed."""
    if _cpus() < 2 or len(first) < _BLOCK:
        while first:
            yield first
            first = f.read(_BLOCK)
        return
    pool = ThreadPoolExecutor(1, thread_name_prefix="ppetrace-read")
    try:
        block = first
        while block:
            ahead = pool.submit(f.read, _BLOCK)
            yield block
            block = ahead.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _gunzip(path: Path, f: IO[bytes], data: bytes, parsed: Parsed) -> Generator[bytes, None, None]:
    d = zlib.decompressobj(wbits=31)
    while True:
        try:
            out = d.decompress(data)
        except zlib.error as exc:
            raise TraceError(
                f"Expected gzip-compressed trace data in {path}, but the gzip data is corrupt "
                f"({exc}). The file was damaged after it was written; a cut-off file reads up "
                "to its last event, a corrupt one does not."
            ) from None
        if out:
            yield out
        if d.eof:  # the end of a gzip member: another may follow
            rest = d.unused_data
            if not rest:
                rest = f.read(_BLOCK)
                if not rest:
                    return
            if rest[:2] != _GZIP:  # trailing bytes that are not gzip: ignored
                return
            d = zlib.decompressobj(wbits=31)
            data = rest
            continue
        data = f.read(_BLOCK)
        if not data:
            parsed.truncated = True  # cut off inside the stream
            tail = d.flush()
            if tail:
                yield tail
            return


def _strip_bom(data: bytes) -> bytes:
    return data[len(_BOM) :] if data.startswith(_BOM) else data


#: Reads a block of whole lines straight into columns: ``scan(buffer, start, end)`` gives
#: a chunk for the reader, or None to have those lines decoded into events here.
Scan = Callable[[bytes | bytearray, int, int], Any]


def stream(path: Path, parsed: Parsed, scan: Scan | None = None) -> Iterator[Any] | None:
    """The events of a file in ppetrace's one-event-per-line layout, a block at a time.

    Returns None when the file has another layout (then use :func:`document`).
    Fills ``parsed.top`` with the header's keys (and any after the events) and
    ``parsed.truncated``. Iterating raises :class:`_Fallback` when a block does
    not decode: the caller then reads the whole document. With ``scan``, each
    block of whole lines goes to it first (the C line scanner of
    ``SpanColumns.scan``); the lines it declines are decoded here.
    """
    blocks = _blocks(path, parsed)
    head = b""
    for block in blocks:
        head = _strip_bom(head + block) if not head else head + block
        if b"\n" in head or len(head) > _BLOCK:
            break
    line, _, rest = head.partition(b"\n")
    line = line.strip()
    if not (line.startswith(b"{") and line.endswith(_MARKER)):
        blocks.close()
        return None
    try:
        top = _ANY.decode(line + b"]}")
    except (msgspec.DecodeError, RecursionError):
        blocks.close()
        return None
    if not isinstance(top, dict):
        blocks.close()
        return None
    top.pop("traceEvents", None)
    parsed.top = top
    return _lines(blocks, rest, parsed, scan)


class _Fallback(Exception):
    """A block of lines that did not decode as events: read the whole document instead."""


def _lines(
    blocks: Iterator[bytes], rest: bytes, parsed: Parsed, scan: Scan | None = None
) -> Iterator[Any]:
    with _Worker() as worker:
        yield from _lines_with(blocks, rest, parsed, scan, worker)


def _lines_with(
    blocks: Iterator[bytes], rest: bytes, parsed: Parsed, scan: Scan | None, worker: _Worker
) -> Iterator[Any]:
    pending = rest
    for block in blocks:
        if scan is not None:  # the block's whole lines scanned where they are: no copy
            scanned = _scan_in_place(pending, block, scan, worker)
            if scanned is not None:
                pending = block[block.rfind(b"\n") + 1 :]
                yield from (chunk for chunk in scanned if len(chunk))
                continue
        buf = bytearray(b"[")  # "[" + whole lines, decoded in place (one copy of the block)
        buf += pending
        buf += block
        cut = buf.rfind(b"\n")
        if cut < 0:
            pending = bytes(buf[1:])
            continue
        pending = bytes(buf[cut + 1 :])
        scanned = scan(buf, 1, cut + 1) if scan is not None else None
        if scanned is not None:
            if len(scanned):
                yield scanned
            continue
        if scan is not None and b"\n]" in buf:  # the end of the events, scanned up to it
            lines = bytes(buf[1 : cut + 1])
            at, scanned = _scan_until_end(lines, scan)
            if scanned is not None:  # (then the msgspec ways below would not decode)
                _read_tail(lines[at:] + pending + b"".join(blocks), parsed)
                if len(scanned):
                    yield scanned
                return
        events = _decode_in_place(buf, cut)
        if events is None:
            events = _try_decode(bytes(buf[1 : cut + 1]))
        if events is None:  # the end of the events array may be in this block
            lines = bytes(buf[1 : cut + 1])
            events = _until_end(lines, pending + b"".join(blocks), parsed, scan)
            if events:
                yield events
            return
        if events:
            yield events
    # the last line: the end of the array, or a line cut off by a killed writer
    events = _try_decode(pending)
    if events is None and _array_end(pending) >= 0:
        events = _until_end(pending, b"", parsed)
        if events:
            yield events
        return
    parsed.truncated = True
    if events is None:  # cut off inside an event: drop what is incomplete
        events = _complete_lines(pending)
    if events:
        yield events


def _scan_in_place(
    pending: bytes, block: bytes, scan: Scan, worker: _Worker
) -> tuple[Any, ...] | None:
    """The line that ``pending`` ends with the block's first line, and the block's other
    whole lines, as ``scan`` reads them; None when it reads either not, or either has
    lines that are no spans other than metadata (``M``) events, such as a part's
    process and thread names (the caller then reads them as one buffer, whose events
    msgspec decodes all with one type: ``B``/``E`` pairs are matched among them)."""
    first, last = block.find(b"\n"), block.rfind(b"\n")
    if first < 0:
        return None
    head = bytearray(pending + block[: first + 1])
    scanned = scan(head, 0, len(head))
    if scanned is None or not _only_metadata(scanned.others):
        return None
    body = _scan_halves(block, first + 1, last + 1, scan, worker)
    if body is None or not all(_only_metadata(half.others) for half in body):
        return None
    return (scanned, *body)


def _only_metadata(events: list[Any]) -> bool:
    return all(e.ph == "M" for e in events)


class _Worker:
    """The thread that scans the second halves of one file's blocks: started at the
    first such half, and stopped (the half in flight waited for) when the file is read
    or its reading stops. One thread per file rather than per block: in a profile of
    reading a 1.5 GB run (90 blocks), starting a thread per block took 0.28 s."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ppetrace-scan")
        return self._pool.submit(fn, *args)

    def __enter__(self) -> _Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _scan_halves(
    data: bytes, start: int, end: int, scan: Scan, worker: _Worker
) -> tuple[Any, ...] | None:
    """``scan`` of the whole lines ``data[start:end]``, in order: in two halves at once
    (the second on ``worker``'s thread) where the process may use two CPUs and the
    range is large, since the C scanner lets go of the GIL while it scans; None when a
    half is declined."""
    mid = -1
    if end - start >= _SPLIT_BYTES and _cpus() > 1:
        mid = data.find(b"\n", start + (end - start) // 2, end - 1)
    if mid < 0:
        one = scan(data, start, end)
        return None if one is None else (one,)
    second = worker.submit(scan, data, mid + 1, end)
    try:
        first = scan(data, start, mid + 1)
    except BaseException:
        wait([second])  # not left scanning a block that is let go of
        raise
    last = second.result()  # its error, if any, raised here
    return None if first is None or last is None else (first, last)


def _cpus() -> int:
    """The CPUs this process may run on (cached)."""
    global _CPUS
    if _CPUS is None:
        try:
            _CPUS = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not on Linux
            _CPUS = os.cpu_count() or 1
    return _CPUS


_CPUS: int | None = None
_SPLIT_BYTES = 1 << 20  # a block's lines are scanned in two halves from this size on


def _decode_in_place(buf: bytearray, end: int) -> list[Any] | None:
    """The events of ``buf[1:end]`` (``buf`` starts with ``[``; lines of ``event,``):
    the last comma becomes the array's ``]`` and the buffer is decoded as it is. None
    when the lines do not end with a comma or do not decode."""
    last = end - 1
    while last > 0 and buf[last] in b" \t\r\n":
        last -= 1
    if last <= 0 or buf[last] != 0x2C:  # ","
        return None
    buf[last] = 0x5D  # "]"
    view = memoryview(buf)[: last + 1]  # the events' raw attrs keep views of it alive
    try:
        return _TYPED.decode(view)
    except msgspec.ValidationError:
        try:
            return _EVENTS.decode(view)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass
    except (msgspec.DecodeError, RecursionError):
        pass
    buf[last] = 0x2C  # as it was, for the caller's other ways of reading it
    return None


def _try_decode(data: bytes) -> list[Any] | None:
    """The events of whole lines (``event,`` each), or None when they do not decode:
    :class:`TypedEvent` structs where their values have ppetrace's types, else
    :class:`Event` structs."""
    body = data.strip().rstrip(b",")
    if not body:
        return []
    text = b"[" + body + b"]"
    try:
        return _TYPED.decode(text)
    except msgspec.ValidationError:
        pass
    except (msgspec.DecodeError, RecursionError):
        return None
    try:
        return _EVENTS.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def _array_end(data: bytes) -> int:
    """Where the line that closes the events array (``]...``) starts in ``data``, or -1."""
    if data.startswith(b"]"):
        return 0
    at = data.find(b"\n]")
    return at + 1 if at >= 0 else -1


def _until_end(data: bytes, more: bytes, parsed: Parsed, scan: Scan | None = None) -> Any:
    """The events of ``data`` before the line that closes the array; what follows that
    line (with ``more``) are top-level keys. :class:`_Fallback` when there is no such
    line or the events before it do not decode."""
    at, scanned = _scan_until_end(data, scan)
    if at < 0:
        raise _Fallback
    if scanned is not None:
        _read_tail(data[at:] + more, parsed)
        return scanned
    events = _try_decode(data[:at])
    if events is None:
        raise _Fallback
    _read_tail(data[at:] + more, parsed)
    return events


def _scan_until_end(data: bytes, scan: Scan | None) -> tuple[int, Any]:
    """Where the line that closes the events array starts in ``data`` (-1: nowhere), and
    the lines before it as ``scan`` reads them (None: not read). Whole events before a
    line that starts with ``]`` leave nothing after that line that makes the block one
    JSON array, so a block read here is one that the msgspec ways would not decode."""
    at = _array_end(data)
    head = data[:at].rstrip() if at >= 0 else b""
    if scan is None or not head:
        return at, None
    return at, scan(bytearray(head + b",\n"), 0, len(head) + 2)  # the last one's comma


def _complete_lines(data: bytes) -> list[Any]:
    """The events of the complete lines of a cut-off last block (its last few lines
    dropped until the rest decodes)."""
    lines = data.strip().split(b"\n")
    for keep in range(len(lines) - 1, max(len(lines) - 4, 0) - 1, -1):
        events = _try_decode(b"\n".join(lines[:keep]))
        if events is not None:
            return events
    raise _Fallback


def _read_tail(tail: bytes, parsed: Parsed) -> None:
    """The top-level keys after the events array (``]}`` alone for ppetrace's files)."""
    try:
        doc = _ANY.decode(b'{"traceEvents":[' + tail.strip())
    except (msgspec.DecodeError, RecursionError):
        parsed.truncated = True  # "]" without its "}": cut off after the last event
        return
    if isinstance(doc, dict):
        doc.pop("traceEvents", None)
        parsed.top.update(doc)


def document(path: Path) -> tuple[Any, bool]:
    """The whole parsed document of any trace file and whether it was cut off.

    Raises :class:`TraceError` for a file that is empty, not UTF-8 or not JSON
    (and not a cut-off JSON document either).
    """
    parsed = Parsed()
    data = _strip_bom(b"".join(_blocks(path, parsed)))
    if not data.strip():
        raise TraceError(f"Expected a Chrome trace in {path}, but the file is empty.")
    stripped = data.lstrip()
    if not stripped.startswith((b"{", b"[")):
        try:  # a partial character at the end of the prefix is no error
            codecs.getincrementaldecoder("utf-8")().decode(stripped[:4096])
        except UnicodeDecodeError:
            raise TraceError(
                f"Expected a JSON Chrome trace in {path}, but it is not UTF-8 text."
            ) from None
        start = stripped[:20].decode("utf-8", "replace")
        raise TraceError(
            f"Expected a JSON Chrome trace in {path}, but the file is not JSON "
            f"(it starts with {start!r})."
        )
    try:
        return _ANY.decode(data), parsed.truncated
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        pass
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(
            f"Expected a JSON Chrome trace in {path}, but it is not UTF-8 text."
        ) from None
    try:
        doc, cut = _recover(text)
        return doc, cut or parsed.truncated
    except RecursionError:
        raise TraceError(
            f"Expected a JSON Chrome trace in {path}, but its JSON nests deeper than can be "
            "read (thousands of levels): it is not a trace."
        ) from None
    except json.JSONDecodeError:
        raise TraceError(
            f"Expected a JSON Chrome trace in {path}, but the file is not valid JSON and no "
            "complete event could be recovered from it (is it cut off before its first event?)."
        ) from None


def _recover(text: str) -> tuple[Any, bool]:
    """Parse a JSON document that may be cut off: ``(document, was_cut)``.

    Python's own parser is used here: it also takes ``NaN`` and ``Infinity``,
    which other programs write into traces.
    """
    try:
        return json.loads(text), False
    except json.JSONDecodeError:
        pass
    body = text.rstrip()
    # one event per line: cut at the last complete line
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
    # any other document: close it after one of its last few '}'
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
