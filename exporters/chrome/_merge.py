"""Merging per-rank or per-process trace files into one timeline."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii as _quote
from pathlib import Path
from typing import Any

from .._errors import TraceError
from ._encode import _CHUNK, _NS_PER_S, RANK_RE, _dumps, _open_for_writing, _us
from ._reader import ChromeTrace, load_chrome_trace


def _event_ns(value: Any, path: str) -> int:
    """A ``ts`` read back from JSON (float or int µs) as integer ns; a :class:`TraceError`
    naming the file for a value that is not finite."""
    if isinstance(value, int):
        return value * 1000
    ns = float(value) * 1000.0
    if ns != ns or abs(ns) == float("inf"):
        raise TraceError(
            f"Expected finite event 'ts' values (µs) in {path}, but an event has ts={value!r}. "
            "Fix or drop that event before merging."
        )
    return round(ns)


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
                label = Path(trace.path).name  # viewers add the pid themselves
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
                    m = RANK_RE.search(str(args.get("name", "")))
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
                    + _us(_event_ns(ts, trace.path) + shift)
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
