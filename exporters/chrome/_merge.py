"""Merging per-rank or per-process trace files into one timeline.

Inputs are files or folders of them (a torchrun run's ``trace.ranks/``), put in rank order.
Each input's times go onto the reference clock (rank 0's) by its ``otherData``: ``origin_ns
+ clock_offset_ns``, plus a linear drift correction when its ``clock_sync`` start and end
measurements differ by more than their errors together, and otherwise the one offset that
both allow best (the middle of the range the two bounds leave). Three ways, fastest first:

- a complete ppetrace file that needs no change (its times already on the reference
  clock, no pid taken by an earlier input, no drift: what the Trainer writes under
  torchrun on one host) is copied as text;
- a ppetrace file that needs new times or pids has its span lines edited as text (the
  ``ts`` and ``pid`` of each ``X`` event), other lines re-encoded;
- any other file (foreign, cut off) is parsed and every event re-encoded.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _quote
from pathlib import Path
from typing import Any

from .._errors import TraceError
from ._encode import _CHUNK, _NS_PER_S, RANK_RE, _dumps, _open_binary, _us
from ._ranks import TraceHeader, _open_read, check_one_run, read_header
from ._reader import ChromeTrace, TraceTruncatedWarning, _clock_offset, load_chrome_trace
from ._split import (
    _NAMING,
    MIN_PART_BYTES,
    _check_part_bytes,
    _other,
    expand_inputs,
    missing_part,
    part_path,
    run_parts,
)

_SPAN_LINE = b'{"ph":"X","cat":'
_PID_RE = re.compile(rb'"pid":(-?\d+)')
_NAMED = b'{"ph":"M","name":"process_name","pid":'
_PART = 1 << 24


def _event_ns(value: Any, path: str) -> int:
    """A ``ts`` read back from JSON (float or int µs) as integer ns; a :class:`TraceError`
    naming the file for a value that is not finite."""
    if isinstance(value, int):
        return value * 1000
    if (ns := float(value) * 1000.0) != ns or abs(ns) == float("inf"):
        raise TraceError(
            f"Expected finite event 'ts' values (µs) in {path}, but an event has ts={value!r}. "
            "Fix or drop that event before merging."
        )
    return round(ns)


def _text_ns(num: bytes, path: str) -> int:
    """A ``ts`` as written (``12.345``) as integer ns, exactly when it has three decimals."""
    head, dot, frac = num.partition(b".")
    if dot and len(frac) == 3 and frac.isdigit() and head.lstrip(b"-").isdigit():
        return int(head) * 1000 + (int(frac) if not head.startswith(b"-") else -int(frac))
    try:
        value = float(num)
    except ValueError:
        raise TraceError(
            f"Expected a number for an event's 'ts' in {path}, but read {num[:40]!r}."
        ) from None
    return _event_ns(value, path)


@dataclass
class _Drift:
    """A correction of the start measurement's offset (which the file's times carry): at
    own time ``t`` add ``shift + rate * (t - at_ns)`` ns."""

    at_ns: int
    rate: float
    shift: int = 0

    def extra(self, t_ns: int) -> int:
        return self.shift + round(self.rate * (t_ns - self.at_ns))


def _drift(metadata: dict[str, Any]) -> _Drift | None:
    """The correction the start and end clock measurements call for, or None: a linear
    drift when their offsets differ by more than their errors together; else one offset
    for the whole file, the middle of the range both bounds allow (the end measurement is
    often far tighter than the start's, taken while the group was still warming up)."""
    sync = metadata.get("clock_sync")
    if not isinstance(sync, dict):
        return None
    start, end = sync.get("start"), sync.get("end")
    if not isinstance(start, dict) or not isinstance(end, dict):
        return None
    try:
        first, last = int(start["offset_ns"]), int(end["offset_ns"])
        span = int(end["at_ns"]) - int(start["at_ns"])
        e1, e2 = int(start["error_ns"]), int(end["error_ns"])
    except (KeyError, TypeError, ValueError):
        return None
    delta = last - first
    if span > 0 and abs(delta) > e1 + e2:
        return _Drift(int(start["at_ns"]), delta / span)
    low, high = max(first - e1, last - e2), min(first + e1, last + e2)
    shift = (low + high) // 2 - first if low <= high else 0
    return _Drift(int(start["at_ns"]), 0.0, shift) if shift else None


@dataclass
class _Input:
    """One file to merge: its metadata, and its events as text (``body``) or parsed."""

    path: str
    metadata: dict[str, Any]
    origin_ns: int
    header: TraceHeader | None
    #: where the traceEvents of a complete ppetrace file lie in its (unzipped) bytes;
    #: None for any other file, which is parsed
    span: tuple[int, int] | None = None
    truncated: bool = False
    pids: list[int] = field(default_factory=list)
    named: set[int] = field(default_factory=set)
    #: ranks that process names give (``"... rank 3 ..."``), for parsed files
    named_ranks: dict[int, int] = field(default_factory=dict)
    #: the later parts of a run written in parts (``max_part_bytes``), merged as this input
    more: list[_Input] = field(default_factory=list)

    @property
    def clock_offset_ns(self) -> int:
        return _clock_offset(self.metadata, self.path)  # a TraceError when not a number

    @property
    def rank(self) -> int | None:
        if self.header is not None and self.header.rank is not None:
            return self.header.rank
        rank = self.metadata.get("rank")
        return rank if isinstance(rank, int) and not isinstance(rank, bool) else None

    def events(self) -> list[dict[str, Any]]:
        """The events of a parsed file, read again (one in memory at a time; warned once)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TraceTruncatedWarning)
            return load_chrome_trace(self.path).events

    def body(self) -> Iterator[bytes]:
        """The traceEvents text of a complete ppetrace file, in parts of at most 16 MB."""
        assert self.span is not None
        start, end = self.span
        with _open_read(Path(self.path)) as f:
            f.seek(start)
            left = end - start
            while left > 0:
                part = f.read(min(left, _PART))
                if not part:
                    break
                left -= len(part)
                yield part


def _load_run(path: Path) -> _Input:
    """An input, its later parts (``more``); a part missing before a later one: cut off."""
    item, parts = _load(path), run_parts(path)
    item.truncated |= missing_part(path, parts, warn=True) is not None
    for q in parts[1:]:
        part = _load(q)
        item.more.append(part)
        item.pids = sorted(set(item.pids) | set(part.pids))
        item.named |= part.named
        item.named_ranks.update(part.named_ranks)
        item.truncated = item.truncated or part.truncated
    return item


def _load(path: Path) -> _Input:
    header = None
    data = b""
    if path.is_file():
        header = read_header(path)
        if header is not None:
            with _open_read(path) as f:
                data = f.read()
    end = data.rfind(b"]", max(0, len(data) - 64))
    if header is not None and end >= 0 and data[end:].strip() == b"]}":
        start = header.events_at
        while start < end and data[start] in b" \r\n\t":
            start += 1
        while end > start and data[end - 1] in b" \r\n\t":
            end -= 1
        origin = header.other_data.get("origin_ns", 0)
        item = _Input(
            str(path),
            dict(header.other_data),
            origin if isinstance(origin, int) and not isinstance(origin, bool) else 0,
            header,
            span=(start, end),
        )
        item.named = _named_pids(data, start, end)
        item.pids = _pids(data, start, end, item.named | {item.metadata.get("pid")})
        return item
    del data
    trace = load_chrome_trace(path)  # foreign or cut off: parse every event
    item = _Input(str(path), trace.metadata, trace.origin_ns, header, truncated=trace.truncated)
    item.pids = sorted({int(e["pid"]) for e in trace.events if isinstance(e.get("pid"), int)})
    for e in trace.events:
        if e.get("ph") == "M" and e.get("name") == "process_name" and isinstance(e.get("pid"), int):
            item.named.add(int(e["pid"]))
            args = e.get("args")
            m = RANK_RE.search(str(args.get("name", ""))) if isinstance(args, dict) else None
            if m is not None:
                item.named_ranks[int(e["pid"])] = int(m.group(1))
    return item


def _named_pids(data: bytes, start: int, end: int) -> set[int]:
    """The pids of the ``process_name`` events ChromeTraceExporter writes."""
    found: set[int] = set()
    at = data.find(_NAMED, start, end)
    while at >= 0:
        m = _PID_RE.match(data, at + len(_NAMED) - 6)
        if m is not None:
            found.add(int(m.group(1)))
        at = data.find(_NAMED, at + 1, end)
    return found


def _pids(data: bytes, start: int, end: int, known: set[Any]) -> list[int]:
    """Every pid in ``data[start:end]``: ``known`` when counting shows there is no other,
    else found one by one."""
    known_ints = {k for k in known if isinstance(k, int) and not isinstance(k, bool)}
    total = data.count(b'"pid":', start, end)
    seen = 0
    present = []
    for pid in known_ints:
        n = sum(data.count(b'"pid":%d%s' % (pid, c), start, end) for c in (b",", b"}"))
        if n:
            present.append(pid)
        seen += n
    if seen == total:
        return sorted(present)
    return sorted({int(m) for m in _PID_RE.findall(data, start, end)})


def _start_time(item: _Input, base: int) -> int:
    """The input's first span on the reference clock (``base`` when it does not say)."""
    start = item.metadata.get("start_time_ns")
    if isinstance(start, int) and not isinstance(start, bool):
        return start + item.clock_offset_ns
    return base


class _Rewriter:
    """Puts one input's events on the merged timeline: ``shift`` ns, a drift, new pids."""

    def __init__(self, item: _Input, shift: int, drift: _Drift | None, remap: dict[int, int]):
        self.item = item
        self.shift = shift
        self.drift = drift
        self.remap = {k: v for k, v in remap.items() if k != v}

    def ns(self, own_ts_ns: int) -> int:
        """A ``ts`` in ns from the input's origin -> ns from the merged origin."""
        drift = self.drift
        if drift is None:
            return own_ts_ns + self.shift
        return own_ts_ns + self.shift + drift.extra(self.item.origin_ns + own_ts_ns)

    def event(self, e: dict[str, Any]) -> str:
        """One parsed event, re-encoded."""
        ev = dict(e)
        event_pid = ev.get("pid")
        if isinstance(event_pid, int) and event_pid in self.remap:
            ev["pid"] = self.remap[event_pid]
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            args = ev.get("args")
            if isinstance(args, dict) and isinstance(event_pid, int) and event_pid in self.remap:
                # a pid taken by an earlier input: say which file this track is
                args = ev["args"] = dict(args)
                args["name"] = f"{args.get('name', '')} [{Path(self.item.path).name}]"
        ts = ev.pop("ts", None)
        body = _dumps(ev)
        if ts is not None and isinstance(ts, (int, float)):
            body = (
                '{"ts":'
                + _us(self.ns(_event_ns(ts, self.item.path)))
                + ("," if len(body) > 2 else "")
                + body[1:]
            )
        return body

    def span_line(self, line: bytes) -> bytes:
        """An ``X`` event line as ChromeTraceExporter writes it, edited as text."""
        remap = self.remap
        if remap:
            m = _PID_RE.search(line)
            if m is not None:
                new = remap.get(int(m.group(1)))
                if new is not None:
                    line = b"%s%d%s" % (line[: m.start(1)], new, line[m.end(1) :])
        if self.shift or self.drift is not None:
            at = line.find(b'"ts":')
            if at >= 0:
                at += 5
                end = at
                while end < len(line) and line[end] not in b",}":
                    end += 1
                ts = _us(self.ns(_text_ns(line[at:end], self.item.path))).encode("ascii")
                line = line[:at] + ts + line[end:]
        return line

    def write(self, out: _EventWriter) -> None:
        """The input's events on the merged timeline, into ``out``."""
        item = self.item
        if item.span is None:
            for e in item.events():
                out.event(self.event(e).encode("ascii"))
            return
        if item.span[0] >= item.span[1]:
            return
        if not self.remap and not self.shift and self.drift is None:
            out.copy(item.body())  # as written: no event needs a change
            return
        rest = b""
        for part in item.body():
            lines = (rest + part).split(b"\n")
            rest = lines.pop()
            for raw in lines:
                self.line(raw, out)
        self.line(rest, out)

    def line(self, raw: bytes, out: _EventWriter) -> None:
        line = raw.rstrip().rstrip(b",")
        if not line:
            return
        if line.startswith(_SPAN_LINE):
            out.event(self.span_line(line))
        else:
            out.event(self.event(json.loads(line)).encode("ascii"))


#: a summarised step's aggregates; its names list; an event's process and thread
_HOOKS = b'"ppetrace.hooks"'
_NAMES_RE = re.compile(rb'"ppetrace\.hook_names":("(?:[^"\\]|\\.)*")')
_THREAD_RE = re.compile(rb'"pid":-?\d+,"tid":-?\d+')


class _EventWriter:
    """Writes the merged ``traceEvents`` at ``path``, separated by ``,\n``: one file, or
    with ``max_part_bytes`` a run in parts as :class:`ChromeTraceExporter` writes them
    (each part a whole trace whose ``otherData`` adds ``part`` and ``first_part``, and
    which repeats the ``M`` events that named processes and threads before it, and on
    each thread's first summarised step the names list in force, so that a part read
    alone reads whole)."""

    def __init__(self, path: Path, other: dict[str, Any], max_part_bytes: int | None) -> None:
        self.path, self.other, self.max_part = path, other, max_part_bytes
        self.paths: list[Path] = []
        self.naming: dict[bytes, None] = {}  # the naming events so far, in order (parts)
        self.pending: list[bytes] = []
        self.held = 0  # bytes pending
        self.count = 0  # events written one by one; -1 once a file was copied whole
        self.lists: dict[bytes, bytes] = {}  # thread -> its names list in force (JSON)
        self.listed: set[bytes] = set()  # the threads whose list is in this part
        self.f: Any = None
        self._open()

    def _open(self) -> None:
        index = len(self.paths)
        p = part_path(self.path, index)
        other = self.other
        if self.max_part is not None:
            other = {**other, "part": index, "first_part": self.path.name}
        self.f = _open_binary(p)
        self.paths.append(p)
        head = '{"displayTimeUnit":"ns","otherData":' + _dumps(other) + ',"traceEvents":[\n'
        self.f.write(head.encode("ascii"))
        self.size = len(head)
        self.first = True

    def event(self, text: bytes) -> None:
        if self.max_part is not None and _is_naming(text):
            self.naming.setdefault(text)
        self.pending.append(text)
        self.held += len(text) + 2
        if self.count >= 0:
            self.count += 1
        if len(self.pending) >= _CHUNK or (
            self.max_part is not None and self.size + self.held >= self.max_part
        ):
            self.flush()

    def copy(self, parts: Iterator[bytes]) -> None:
        """Events already joined by ``,\n`` (a file's traceEvents), written as they are
        (in parts: line by line, so that a part ends between events)."""
        if self.max_part is not None:
            rest = b""
            for part in parts:
                lines = (rest + part).split(b"\n")
                rest = lines.pop()
                for line in lines:
                    if line.strip():
                        self.event(line.rstrip().rstrip(b","))
            if rest.strip():
                self.event(rest.rstrip().rstrip(b","))
            return
        self.flush()
        for i, part in enumerate(parts):
            if i == 0 and not self.first:
                self.f.write(b",\n")
            self.f.write(part)
            self.first = False
        self.count = -1  # counted when asked for (_MergedTrace.event_count)

    def flush(self) -> None:
        if not self.pending:
            return
        if self.max_part is not None and not self.first and self.size >= self.max_part:
            self.f.write(b"\n]}\n")
            self.f.close()
            self._open()
            here = set(self.pending)
            self.pending = [e for e in self.naming if e not in here] + self.pending
            self.listed = set()
        if self.max_part is not None:
            self.pending = [(_HOOKS in e and self._listed(e)) or e for e in self.pending]
        data = (b"" if self.first else b",\n") + b",\n".join(self.pending)
        self.f.write(data)
        self.size += len(data)
        self.first, self.pending, self.held = False, [], 0

    def _listed(self, text: bytes) -> bytes:
        """A summarised step's event, with its thread's names list if this part lacks it."""
        thread = _THREAD_RE.search(text)
        key = thread.group(0) if thread else b""
        names = _NAMES_RE.search(text)
        if names is not None:
            self.lists[key] = names.group(1)
            self.listed.add(key)
            return text
        if key in self.listed or key not in self.lists or b'"attrs":{' not in text:
            return text
        self.listed.add(key)
        field = b'"attrs":{"ppetrace.hook_names":' + self.lists[key] + b","
        return text.replace(b'"attrs":{', field, 1)

    def close(self) -> None:
        self.flush()
        self.f.write(b"\n]}\n")
        self.f.close()


def _is_naming(text: bytes) -> bool:
    """Whether an event names a process or thread (every part repeats those)."""
    if b'"M"' not in text:
        return False
    try:
        event = json.loads(text)
    except ValueError:
        return False
    return isinstance(event, dict) and event.get("ph") == "M" and event.get("name") in _NAMING


class _MergedTrace(ChromeTrace):
    """The merged trace; its events are read back from the file when first asked for."""

    def __init__(self, metadata: dict[str, Any], origin_ns: int, paths: list[Path], count: int):
        super().__init__([], metadata, origin_ns, False, str(paths[0]))
        self._loaded: list[dict[str, Any]] | None = None
        self._count = count
        #: the files written: ``[out]``, or its parts (``max_part_bytes``)
        self.parts = [str(p) for p in paths]

    @property
    def event_count(self) -> int:
        """How many events the merged file holds (one per line)."""
        if self._count < 0:
            with _open_read(Path(self.path)) as f:
                self._count = max(0, f.read().count(b"\n") - 2)
        return self._count

    @property
    def events(self) -> list[dict[str, Any]]:
        if self._loaded is None:  # every part's (each repeats the naming events)
            self._loaded = [e for p in self.parts for e in load_chrome_trace(p).events]
        return self._loaded

    @events.setter
    def events(self, value: list[dict[str, Any]]) -> None:
        self._loaded = value if value else None


def merge_traces(
    out: str | os.PathLike[str],
    inputs: Sequence[str | os.PathLike[str]],
    *,
    max_part_bytes: int | None = None,
    _min_part_bytes: int = MIN_PART_BYTES,
) -> ChromeTrace:
    """Merge per-rank or per-process trace files into one timeline at ``out``.

    ``inputs`` are files or folders of trace files (a folder contributes every
    ``*.json``/``*.json.gz`` in it; a run written in parts is one input, read from
    its part 0 with every later part). They are merged in rank order
    (``distributedInfo``, else ``otherData`` rank; files without one last, in
    the order given), one process track each, sorted by rank in viewers. Each
    input keeps its pid and process name; when two inputs share a pid, the
    later one gets a new, unused pid and its process name the file name in
    brackets. Each input's ``otherData["clock_offset_ns"]`` is added to its
    times, and a drift between its ``clock_sync`` start and end measurements
    is corrected linearly when it exceeds their errors together (within them,
    one shift to the offset both allow best; ``merged_from`` records it as
    ``clock_correction_ns``); all times are rebased on the earliest origin. The
    merged ``otherData`` lists the inputs under ``merged_from``, each process's
    rank under ``processes``, the common ``trace_id`` if the inputs share one,
    ``ranks`` / ``world_size``,
    and the first input's ``environment`` (the lowest rank's) when it has one, and
    ``ppetrace.detail`` when every input that records one records the same.
    Returns the merged trace (its events are read from the file when first used);
    ``.json.gz`` outputs are gzip. ``max_part_bytes`` (None: one file) writes it in
    parts as :class:`ChromeTraceExporter` does (``out``, then ``<stem>.1.json``, ...;
    each part a whole trace that repeats the process and thread names; the result's
    ``parts`` lists them), removing later parts that an earlier merge into ``out`` left.
    """
    max_part = _check_part_bytes(max_part_bytes, _min_part_bytes)  # the minimum: tests
    if not inputs:
        raise ValueError("Expected at least one trace file to merge, but received none.")
    items = [_load_run(p) for p in expand_inputs(inputs, Path(out))]
    order = sorted(range(len(items)), key=lambda i: (items[i].rank is None, items[i].rank or 0, i))
    items = [items[i] for i in order]
    check_one_run(items)
    bases = [t.origin_ns + t.clock_offset_ns for t in items]
    origin = (min(bases) // _NS_PER_S) * _NS_PER_S
    used: set[int] = set()
    for t in items:
        used.update(t.pids)
    taken: set[int] = set()
    sources = []
    processes: dict[str, dict[str, Any]] = {}
    plans: list[tuple[list[_Rewriter], list[bytes]]] = []
    for item, base in zip(items, bases, strict=True):
        remap: dict[int, int] = {}
        for pid in item.pids:
            if pid in taken:
                new = max(used | taken) + 1
                remap[pid] = new
                used.add(new)
                taken.add(new)
            else:
                remap[pid] = pid
                taken.add(pid)
        names = []
        for pid in item.pids:
            if pid not in item.named:
                label = Path(item.path).name  # viewers add the pid themselves
                names.append(
                    f'{{"ph":"M","name":"process_name","pid":{remap[pid]},"tid":0,'
                    f'"args":{{"name":{_quote(label)}}}}}'.encode("ascii")
                )
            processes[str(remap[pid])] = {
                "source": item.path,
                "original_pid": pid,
                "rank": item.rank if item.rank is not None else item.named_ranks.get(pid),
            }
        drift = _drift(item.metadata)
        plans.append(
            ([_Rewriter(t, base - origin, drift, remap) for t in (item, *item.more)], names)
        )
        source = {
            "path": item.path,
            "clock_offset_ns": item.clock_offset_ns,
            # the correction the merge added to that offset (a drift's: at the start)
            "clock_correction_ns": 0 if drift is None else drift.shift,
            "origin_ns": item.origin_ns,
            "pids": {str(p): remap[p] for p in item.pids},
            "truncated": item.truncated,
            "otherData": item.metadata,
        }
        if item.more:
            source["parts"] = [item.path, *(t.path for t in item.more)]
        sources.append(source)
    ranks = sorted({t.rank for t in items if t.rank is not None})
    other: dict[str, Any] = {
        "origin_ns": origin,
        "clock_offset_ns": 0,
        "start_time_ns": min(_start_time(t, b) for t, b in zip(items, bases, strict=True)),
        "processes": processes,
        "merged_from": sources,
    }
    for key in ("trace_id", "run_id"):  # the ids the inputs share
        ids = {t.metadata.get(key) for t in items}
        if len(ids) == 1 and isinstance(next(iter(ids)), str):
            other[key] = next(iter(ids))
    # the report's Device line and compare's environment check read the top level: the
    env = next(  # first input's (the lowest rank's); every input's stays under merged_from
        (t.metadata.get("environment") for t in items if t.metadata.get("environment")), None
    )
    if isinstance(env, dict):
        other["environment"] = env
    # the trace_detail policy, when every input that has one has the same (the report's
    # detail line reads it); each input's stays under merged_from
    policies = [t.metadata.get("ppetrace.detail") for t in items]
    known = [p for p in policies if isinstance(p, dict)]
    if known and all(p == known[0] for p in known):
        other["ppetrace.detail"] = known[0]
    stages = {t.metadata.get("ppetrace.stage") for t in items} - {None}
    if len(stages) == 1:  # a LightningProfiler stage's (check_one_run refuses two)
        other["ppetrace.stage"] = stages.pop()
    if ranks:
        other["ranks"] = ranks
        sizes = {(t.header.distributed_info or {}).get("world_size") for t in items if t.header} - {
            None
        }
        other["world_size"] = sizes.pop() if len(sizes) == 1 else len(ranks)
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = _EventWriter(out_path, other, max_part)  # one input in memory at a time
    try:
        for rewriters, names in plans:
            for name in names:
                writer.event(name)
            for rewriter in rewriters:
                rewriter.write(writer)
    finally:
        writer.close()
    for stale in _stale_parts(out_path, len(writer.paths)):
        stale.unlink()
    return _MergedTrace(other, origin, writer.paths, writer.count)


def _stale_parts(out: Path, written: int) -> list[Path]:
    """Later parts of an earlier merge into ``out`` that this one did not write: part
    ``written``, ``written + 1``, ... while they exist and their header says so (a
    reader could take them for this merge's)."""
    stale: list[Path] = []
    while (p := part_path(out, written + len(stale))).is_file():
        other = _other(p)  # None: unreadable, or not written by ppetrace
        if not (
            other is not None
            and other.get("part") == written + len(stale)
            and other.get("first_part") == out.name
            and "merged_from" in other
        ):
            break
        stale.append(p)
    return stale
