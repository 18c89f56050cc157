"""Reading Chrome trace files: plain or gzip, object or array form, cut off or whole."""

from __future__ import annotations

import json
import os
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import TraceError

if TYPE_CHECKING:
    import pandas as pd


class TraceTruncatedWarning(UserWarning):
    """A trace file was cut off (a killed process); only its complete events were read."""


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
        from ._events import frame_from_chrome_events

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
