"""Repairing a cut-off trace: :func:`repair_chrome_trace` writes a closed, strict JSON copy.

A run killed with SIGKILL leaves a trace without its closing ``]}``: ppetrace's
own reader takes it, but other viewers (Perfetto, speedscope, ``json.load``)
need strict JSON. The Chrome trace format allows the array form to lack its
closing bracket, but ppetrace keeps the object form, which carries
``otherData``; so the repair closes the object instead.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, NamedTuple

from .._errors import TraceError
from ._encode import _json_safe
from ._parse import _MARKER, Parsed, _array_end, _blocks, _strip_bom, _try_decode, document

__all__ = ["CUT_EVENT", "Repaired", "repair_chrome_trace"]

#: the metadata event that ends a repaired copy of a cut-off trace
CUT_EVENT = "ppetrace.cut"


class Repaired(NamedTuple):
    """What :func:`repair_chrome_trace` did: the file it wrote, how many events that
    file holds, and whether the input was cut off (False: the copy is the same
    trace, closed as it was)."""

    path: Path
    events: int
    truncated: bool


def _default_out(path: Path) -> Path:
    name = path.name
    for suffix in (".json.gz", ".json", ".gz"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return path.with_name(name + ".repaired.json")


def repair_chrome_trace(
    path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None
) -> Repaired:
    """Write a strict JSON copy of the trace at ``path``, closed after its last complete event.

    ``out`` defaults to ``<name>.repaired.json`` beside ``path`` (plain JSON,
    also for a ``.json.gz`` input); it may be ``path`` itself (the file is
    then replaced once the copy is written). The JSON object form and its
    ``otherData`` are kept; an array-form trace stays an array. ppetrace's
    own files are copied line by line, byte for byte, in blocks (any size);
    other layouts are parsed whole and written one event per line.

    Raises ``FileNotFoundError`` for a missing file and :class:`TraceError`,
    naming the file, when nothing of it can be read as a trace.
    """
    src = Path(path)
    dst = _default_out(src) if out is None else Path(out)
    if dst.is_dir():
        raise TraceError(
            f"Expected a file path for the repaired copy of {src}, but {dst} is a directory. "
            f"Pass a file name, such as {dst / _default_out(src).name}."
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dst.name + ".", suffix=".tmp", dir=dst.parent)
    try:
        # mkstemp makes the file 0600: give it the mode a plain open() would (the umask's)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            result = _copy_lines(src, f)
            if result is None:
                f.seek(0)
                f.truncate()
                result = _rewrite(src, f)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Repaired(dst, *result)


def _copy_lines(src: Path, f: IO[bytes]) -> tuple[int, bool] | None:
    """Copy a file in ppetrace's one-event-per-line layout up to its last complete
    event; None when it has another layout."""
    parsed = Parsed()
    blocks = _blocks(src, parsed)
    head = b""
    for block in blocks:
        head = _strip_bom(head + block) if not head else head + block
        if b"\n" in head:
            break
    line, _, pending = head.partition(b"\n")
    line = line.strip()
    if not (line.startswith(b"{") and line.endswith(_MARKER)) or not _closes(line + b"]}"):
        blocks.close()
        return None
    f.write(line)
    count = 0
    tail = None
    for block in blocks:
        data = pending + block
        cut = data.rfind(b"\n")
        if cut < 0:
            pending = data
            continue
        pending = data[cut + 1 :]
        lines = data[: cut + 1]
        end = _array_end(lines)
        if end >= 0:
            lines, tail = lines[:end], lines[end:] + pending + b"".join(blocks)
        n = _write_events(f, lines, count)
        if n is None:
            return None
        count += n
        if tail is not None:
            break
    if tail is None:
        end = _array_end(pending)
        if end >= 0:
            pending, tail = pending[:end], pending[end:]
        n = _write_events(f, pending, count, last=tail is None)
        if n is None:
            return None
        count += n
    if tail is not None and not parsed.truncated and _closes(tail):
        f.write(b"\n" + tail.strip() + b"\n")  # it was whole: closed as it was
        return count, False
    f.write((",\n" if count else "\n").encode() + _dumps(_cut_event(src, _pid(line))).encode())
    f.write(b"\n]}\n")
    return count + 1, True  # (the cut event is one of the file's events)


def _pid(header: bytes) -> int:
    """The process of a ppetrace trace, from its header line's ``otherData.pid`` (0 when
    it records none)."""
    try:
        pid = json.loads(header + b"]}").get("otherData", {}).get("pid")
    except (ValueError, AttributeError, RecursionError):
        return 0
    return pid if type(pid) is int else 0


def _cut_event(src: Path, pid: int) -> dict[str, Any]:
    """The metadata event a repaired copy of a cut-off trace ends with: the copy is whole,
    but the run it records was cut off (``exporters.run_failure`` reads it)."""
    return {"ph": "M", "name": CUT_EVENT, "pid": pid, "tid": 0, "args": {"source": str(src)}}


def _closes(tail: bytes) -> bool:
    """Whether ``tail`` (from the line that closes the events array on; or a header
    closed with ``]}``) ends a JSON object."""
    text = tail.strip()
    if not text.startswith(b"{"):
        text = b'{"traceEvents":[' + text
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _write_events(f: IO[bytes], lines: bytes, before: int, *, last: bool = False) -> int | None:
    """Append the complete events of ``lines``; their number, or None when whole lines
    do not decode (another layout). With ``last``, incomplete last lines are dropped."""
    body = lines.strip().rstrip(b",")
    if not body:
        return 0
    events = _try_decode(body)
    if events is None and last:
        kept = body.split(b"\n")
        for keep in range(len(kept) - 1, max(len(kept) - 4, 0) - 1, -1):
            body = b"\n".join(kept[:keep]).strip().rstrip(b",")
            events = _try_decode(body)
            if events is not None:
                break
    if events is None:
        return None
    if events:
        f.write((b",\n" if before else b"\n") + body)
    return len(events)


def _rewrite(src: Path, f: IO[bytes]) -> tuple[int, bool]:
    """Any other layout: parse the whole document and write it one event per line."""
    doc, truncated = document(src)
    if isinstance(doc, list):
        events, top = doc, None
    elif isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        events, top = doc["traceEvents"], {k: v for k, v in doc.items() if k != "traceEvents"}
    else:
        raise TraceError(
            f"Expected a Chrome trace in {src} (a JSON object with a 'traceEvents' list, or "
            "an array of events), but it holds no event list; there is nothing to repair."
        )
    if top is None:
        f.write(b"[")
    else:
        head = _dumps(top)
        f.write((head[:-1] + ("," if len(head) > 2 else "") + '"traceEvents":[').encode())
    for i, event in enumerate(events):
        f.write((",\n" if i else "\n").encode() + _dumps(event).encode())
    if truncated:
        pid = (top or {}).get("otherData", {}).get("pid") if isinstance(top, dict) else None
        cut = _cut_event(src, pid if type(pid) is int else 0)
        f.write((",\n" if events else "\n").encode() + _dumps(cut).encode())
    f.write(b"\n]\n" if top is None else b"\n]}\n")
    return len(events) + truncated, truncated


def _dumps(value: Any) -> str:
    """Strict JSON (non-finite floats as strings), ASCII."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return json.dumps(_json_safe(value), separators=(",", ":"), allow_nan=False)
