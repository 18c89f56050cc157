"""Per-rank trace files: their header, updating it in place, and folders of them.

A run of several processes (torchrun ranks) writes one file per rank into a
folder (``trace.ranks/rank<R>.json``). Each file carries the top-level
``distributedInfo`` (``rank``, ``world_size``, ``backend``) that
HolisticTraceAnalysis reads, and the clock fields in ``otherData``:

- ``clock_offset_ns``: ns to add to the file's times to put them on rank 0's
  clock; ``clock_error_ns``: the bound on its error;
- ``clock_sync``: ``{"start": {...}, "end": {...}}``, each measurement's
  ``offset_ns``, ``error_ns``, ``rtt_ns``, ``at_ns`` (on this rank's clock) and
  ``rounds``. :func:`exporters.merge_traces` corrects a drift between the two
  when it is larger than their errors together.

:func:`read_header` reads only the head of a file; :func:`update_other_data`
rewrites ``otherData`` in place when the writer left room for it
(``ChromeTraceExporter(header_reserve=...)``), and the whole file otherwise.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import TraceError
from ._encode import _dumps

__all__ = ["TraceHeader", "check_one_run", "read_header", "trace_files", "update_other_data"]

_HEAD = b'{"displayTimeUnit":"ns","otherData":'
_EVENTS = b',"traceEvents":['
_SUFFIXES = (".json", ".json.gz")


@dataclass(frozen=True)
class TraceHeader:
    """The head of a trace file written by :class:`exporters.ChromeTraceExporter`.

    ``other_data`` and ``distributed_info`` (``None`` when absent) as parsed;
    ``start``/``end``: the byte span of ``otherData``'s JSON; ``room``: the
    spaces after it; ``events_at``: the offset of the first byte after
    ``"traceEvents":[``.
    """

    other_data: dict[str, Any]
    distributed_info: dict[str, Any] | None
    start: int
    end: int
    room: int
    events_at: int

    @property
    def rank(self) -> int | None:
        """The rank from ``distributedInfo``, else from ``otherData``; ``None`` if neither."""
        for source in (self.distributed_info or {}, self.other_data):
            rank = source.get("rank")
            if isinstance(rank, int) and not isinstance(rank, bool):
                return rank
        return None


def _parse_header(head: bytes) -> TraceHeader | None:
    if not head.startswith(_HEAD):
        return None
    text = head.decode("ascii", errors="replace")
    decoder = json.JSONDecoder()
    start = len(_HEAD)
    try:
        other, end = decoder.raw_decode(text, start)
    except json.JSONDecodeError:
        return None
    rest = text[end:]
    room = len(rest) - len(rest.lstrip(" "))
    at = end + room
    distributed = None
    key = ',"distributedInfo":'
    if text.startswith(key, at):
        try:
            distributed, at = decoder.raw_decode(text, at + len(key))
        except json.JSONDecodeError:
            return None
    if not text.startswith(_EVENTS.decode(), at) or not isinstance(other, dict):
        return None
    return TraceHeader(
        other,
        distributed if isinstance(distributed, dict) else None,
        start,
        end,
        room,
        at + len(_EVENTS),
    )


def _open_read(path: Path) -> Any:
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")


def read_header(path: str | os.PathLike[str], *, limit: int = 1 << 20) -> TraceHeader | None:
    """The header of a ppetrace trace file, reading at most ``limit`` bytes; ``None`` for
    a file that does not start the way ChromeTraceExporter writes one."""
    with _open_read(Path(path)) as f:
        head = f.read(limit)
    at = head.find(_EVENTS)
    if at < 0:
        return None
    return _parse_header(head[: at + len(_EVENTS)])


def update_other_data(path: str | os.PathLike[str], values: dict[str, Any]) -> None:
    """Add ``values`` to the ``otherData`` of a closed trace file written by
    :class:`exporters.ChromeTraceExporter`. In place when the new ``otherData`` fits in
    the room the writer left (``header_reserve``), else by rewriting the file (through a
    temporary file and a rename). Raises :class:`~exporters.TraceError` for a file that
    did not come from ChromeTraceExporter."""
    p = Path(path)
    header = read_header(p)
    if header is None:
        raise TraceError(
            f"Expected a trace file written by ChromeTraceExporter at {p}, but its head is "
            "not one. Update the otherData of files written by ppetrace only."
        )
    other = {**header.other_data, **values}
    new = _dumps(other).encode("ascii")
    room = header.end - header.start + header.room
    gz = p.name.endswith(".gz")
    if not gz and len(new) <= room:
        with open(p, "r+b") as f:
            f.seek(header.start)
            f.write(new + b" " * (room - len(new)))
        return
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        with _open_read(p) as src:
            head = src.read(header.start)
            src.read(room)
            with gzip.open(tmp, "wb") if gz else open(tmp, "wb") as dst:
                dst.write(head + new)
                shutil.copyfileobj(src, dst, 1 << 22)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def trace_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The trace files (``*.json``, ``*.json.gz``) directly in ``folder``, ordered by
    rank (``distributedInfo``, else ``otherData``), then by name; files without a rank
    come last."""
    found = [p for p in Path(folder).iterdir() if p.is_file() and p.name.endswith(_SUFFIXES)]

    def key(p: Path) -> tuple[int, int, str]:
        try:
            header = read_header(p, limit=1 << 16)
        except OSError:
            header = None
        rank = header.rank if header is not None else None
        return (1, 0, p.name) if rank is None else (0, rank, p.name)

    return sorted(found, key=key)


def check_one_run(items: Sequence[Any]) -> None:
    """Refuse rank files (and merged traces, by their ranks) that cannot be one run (the
    inputs of :func:`merge_traces`, with ``header``, ``rank``, ``metadata`` and ``path``): a
    rank given twice, or ranks of different runs (trace ids), of different calls of one
    job (``run_id``: two ``fit`` calls of one script share the trace id) or of different
    ``LightningProfiler`` stages of one run (``ppetrace.stage``), which would give a timeline
    and a per-rank report of runs that never ran together. Files without a rank (of
    other processes) merge with anything."""
    seen: dict[int, str] = {}
    runs: dict[str, str] = {}
    calls: dict[str, str] = {}
    stages: dict[str, str] = {}
    for item in items:
        info = item.header.distributed_info if item.header is not None else None
        world = info.get("world_size") if isinstance(info, dict) else None
        ranks: Any
        if isinstance(world, int) and world > 1 and item.rank is not None:
            ranks = [item.rank]  # a rank's file of a torchrun run
        else:
            ranks = item.metadata.get("ranks")  # a merged trace: its ranks
            if not isinstance(ranks, list) or len(ranks) < 2:
                continue  # one process's file: a process of its own
        _one_of(
            runs,
            item,
            "trace_id",
            "Expected the rank files of one run (one trace id), but {} and {} come from "
            "different runs (trace ids {}). Merge the files of one run: its trace.ranks/ "
            "folder.",
        )
        _one_of(  # two calls of one job (the Trainer's, LightningProfiler's rank files)
            calls,
            item,
            "run_id",
            "Expected the rank files of one run, but {} and {} come from different calls "
            "of one job (run ids {}: two fit, validate or test calls of a script share its "
            "trace id). Merge the rank files of one call: its trace.ranks/ folder.",
        )
        _one_of(  # a LightningProfiler stage's file
            stages,
            item,
            "ppetrace.stage",
            "Expected the rank files of one stage, but {} and {} come from different "
            "Lightning stages ({}) of the run. Merge the rank files of one stage.",
        )
        for rank in ranks:
            if isinstance(rank, int) and rank in seen:
                raise TraceError(
                    f"Expected each rank once, but rank {rank} is in {seen[rank]} and in "
                    f"{item.path}. Merge the rank files of one run, or its merged trace "
                    "alone."
                )
            if isinstance(rank, int):
                seen[rank] = item.path


def _one_of(seen: dict[str, str], item: Any, key: str, message: str) -> None:
    """Note the value of ``key`` in ``item``'s metadata (a non-empty str) in ``seen``
    (value -> the first file that had it); a second value raises :class:`TraceError` with
    ``message`` formatted with the two files and the values."""
    value = item.metadata.get(key)
    if not isinstance(value, str) or not value:
        return
    seen.setdefault(value, item.path)
    if len(seen) > 1:
        first, other = (seen[v] for v in seen)
        raise TraceError(message.format(first, other, ", ".join(seen)))
