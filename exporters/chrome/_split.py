"""A run written in parts (``ChromeTraceExporter(max_part_bytes=...)``): their names and
how to find them.

Part 0 is the path given (``trace.json``); part ``i`` is ``trace.<i>.json``
(``t.json.gz`` -> ``t.<i>.json.gz``; a name without ``.json`` gets ``.<i>``
appended). Every part is a whole Chrome trace whose ``otherData`` is the
run's, plus ``part`` (its index) and ``first_part`` (part 0's file name). A
part belongs to the run of part 0 when its header says so: ``part`` is its
index, ``first_part`` names part 0, and ``start_time_ns``, ``origin_ns`` and
``pid`` are part 0's. The parts are found by name, in order, up to the first index that is
missing (the count is not known when part 0 is closed, so no part records it).
"""

from __future__ import annotations

import os
import re
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._errors import TraceError
from ._ranks import read_header, trace_files, update_other_data

__all__ = [
    "expand_inputs",
    "StaleTracePartWarning",
    "first_parts",
    "part_path",
    "run_parts",
    "trace_parts",
    "update_run_other_data",
]

_HEAD_LIMIT = 1 << 16
MIN_PART_BYTES = 1 << 20  # the smallest max_part_bytes
#: ``M`` events that name a process or thread: every part repeats them
_NAMING = frozenset({"process_name", "process_sort_index", "thread_name", "thread_sort_index"})


def _check_part_bytes(value: int | None, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"Expected max_part_bytes to be None or an int of at least {minimum} bytes, "
            f"but received {value!r}. Pass a larger size, such as 1 << 30 for "
            "1 GiB parts, or None for one file."
        )
    return value


def part_path(first: Path, index: int) -> Path:
    """The path of part ``index`` of the run whose part 0 is ``first``."""
    if index == 0:
        return first
    name = first.name
    for suffix in (".json.gz", ".json"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return first.with_name(f"{name[: -len(suffix)]}.{index}{suffix}")
    return first.with_name(f"{name}.{index}")


def _other(path: Path) -> dict[str, Any] | None:
    try:
        # most headers fit in 64 KB; a large otherData (a long environment) gets 1 MB
        header = read_header(path, limit=_HEAD_LIMIT) or read_header(path)
    except (OSError, EOFError, ValueError, zlib.error):  # unreadable, or corrupt gzip
        return None
    return None if header is None else header.other_data


def _belongs(first: dict[str, Any], first_name: str, other: dict[str, Any] | None, i: int) -> bool:
    return (
        other is not None
        and other.get("part") == i
        and other.get("first_part") == first_name
        and other.get("start_time_ns") == first.get("start_time_ns")
        and other.get("origin_ns") == first.get("origin_ns")
        and other.get("pid") == first.get("pid")
    )


def run_parts(path: str | Path) -> list[Path]:
    """Every part of the run whose part 0 is ``path``, in order (``[path]`` for a file
    written in one piece, or one that is not part 0)."""
    first = Path(path)
    return _parts_of(first, _other(first))


def _parts_of(first: Path, other: dict[str, Any] | None) -> list[Path]:
    """:func:`run_parts` given part 0's ``otherData`` (None: unreadable)."""
    if other is None or other.get("part") != 0 or not isinstance(other.get("first_part"), str):
        return [first]
    out = [first]
    while True:
        nxt = part_path(first, len(out))
        if not nxt.is_file() or not _belongs(other, first.name, _other(nxt), len(out)):
            return out
        out.append(nxt)


def missing_part(first: Path, found: Sequence[Path], *, warn: bool = False) -> int | None:
    """The number of a part missing from the run whose part 0 is ``first`` and whose
    parts :func:`run_parts` ``found``: the first one not found when a later part of the
    same run is on disk (a part deleted or lost in a copy), else None. With ``warn``, a
    ``TraceTruncatedWarning`` says so."""
    other = _other(first) if found else None
    if other is None or other.get("part") != 0:
        return None
    gap = len(found)
    for later in _part_numbers(first, gap)[:8]:  # the nearest later parts on disk
        nxt = part_path(first, later)
        if _belongs(other, first.name, _other(nxt), later):
            if warn:
                from ._reader import TraceTruncatedWarning

                read = f"its parts 0 to {gap - 1}" if gap > 1 else "its part 0"
                warnings.warn(
                    f"Part {gap} of the run {first} is missing, though a later part is "
                    f"there: read {read} only, so the steps after them are not counted. Put "
                    "the part back (it is named like the others, with its number before "
                    ".json).",
                    TraceTruncatedWarning,
                    stacklevel=4,
                )
            return gap
    return None


def _part_numbers(first: Path, after: int) -> list[int]:
    """The numbers above ``after`` of the files beside ``first`` named as its later parts
    (:func:`part_path`), in order: however many parts a gap lost."""
    name = first.name
    for suffix in (".json.gz", ".json"):
        if name.endswith(suffix) and len(name) > len(suffix):
            pattern = re.escape(name[: -len(suffix)]) + r"\.([1-9][0-9]*)" + re.escape(suffix)
            break
    else:
        pattern = re.escape(name) + r"\.([1-9][0-9]*)"
    try:
        names = os.listdir(first.parent)
    except OSError:  # a folder that cannot be listed: the next few numbers, probed
        return [k for k in range(after + 1, after + 4) if part_path(first, k).is_file()]
    found = (re.fullmatch(pattern, n) for n in names)
    return sorted(k for k in (int(m.group(1)) for m in found if m) if k > after)


def trace_parts(path: str | os.PathLike[str]) -> list[Path]:
    """The files of the run whose first file is ``path``, in order: ``[path]`` for a run
    written in one file, else ``[path, <stem>.1.json, ...]`` (written with
    ``ChromeTraceExporter(max_part_bytes=...)``; each part's header is checked)."""
    return run_parts(Path(path))


def update_run_other_data(path: str | os.PathLike[str], values: dict[str, Any]) -> None:
    """:func:`~exporters.chrome._ranks.update_other_data` on every part of the run whose
    part 0 is ``path`` (on ``path`` alone for a run written in one file): each part's
    ``otherData`` is the run's, so each gets ``values`` (in place where its writer left
    room, ``header_reserve``)."""
    for part in run_parts(Path(path)):  # found before any header changes
        update_other_data(part, values)


def first_parts(paths: Sequence[str | Path]) -> list[Path]:
    """``paths`` without the files that are part 1, 2, ... of a run whose part 0 is among
    them (reading part 0 reads those too), in the order given. A later part whose part 0
    is among them but does not take it is left out too: one of that run past a missing
    part without a word (reading part 0 warns of the gap, :func:`missing_part`), one left
    over from an earlier run that wrote more parts under the same name with a warning: it
    is not a run."""
    found = [Path(p) for p in paths]
    headers = [_other(p) for p in found]  # each file's header, read once
    pairs = list(zip(found, headers, strict=True))
    taken = {q.resolve() for p, h in pairs for q in _parts_of(p, h)[1:]}
    given = {p.resolve(): h for p, h in pairs}
    out = []
    for p, other in pairs:
        if p.resolve() in taken:
            continue
        part = None if other is None else other.get("part")
        first = None if other is None else other.get("first_part")
        if (
            isinstance(part, int)
            and part > 0
            and isinstance(first, str)
            and (p.parent / first).resolve() in given
        ):
            head = given[(p.parent / first).resolve()]
            if head is not None and _belongs(head, first, other, part):
                continue  # past a missing part of that run: its reader warns of the gap
            warnings.warn(
                f"{p} is part {part} of a run named {first}, but {first} does not lead to "
                "it (a part left over from an earlier run under the same name): it is "
                "left out. Delete it, or read it alone by naming it.",
                StaleTracePartWarning,
                stacklevel=2,
            )
            continue
        out.append(p)
    return out


class StaleTracePartWarning(UserWarning):
    """A folder or glob holds a later part of a trace that its part 0 does not lead to."""


def _is_output(p: Path, target: Path) -> bool:
    """Whether ``p`` is the merge's output ``target`` (resolved) or one of its later parts."""
    r = p.resolve()
    if r == target:
        return True
    if r.parent != target.parent:
        return False
    name = target.name
    for suffix in (".json.gz", ".json"):
        if name.endswith(suffix) and len(name) > len(suffix):
            stem = re.escape(name[: -len(suffix)])
            return re.fullmatch(stem + r"\.[1-9][0-9]*" + re.escape(suffix), r.name) is not None
    return re.fullmatch(re.escape(name) + r"\.[1-9][0-9]*", r.name) is not None


def expand_inputs(inputs: Sequence[str | os.PathLike[str]], out_path: Path) -> list[Path]:
    """The inputs of a merge into ``out_path``, folders expanded (leaving out the output
    and its parts when an earlier merge wrote them there), one path per run; refuses the
    output itself, a run's own trace as the output, or one run given twice."""
    target = out_path.resolve()
    found_all: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = []
            for f in trace_files(p):
                if not _is_output(f, target):
                    found.append(f)
                elif "merged_from" not in (_other(f) or {}):  # a run's own trace: kept
                    raise TraceError(
                        f"Expected OUT to be a file that is not among the inputs, but "
                        f"{out_path} would overwrite the trace {f} of the folder {p} while "
                        "it is read. Write the merged trace to another path."
                    )
            if not found:
                raise TraceError(
                    f"Expected trace files (*.json or *.json.gz) in the folder {p} to merge, "
                    "but it has none."
                )
            found_all.extend(found)
        elif _is_output(p, target):
            raise TraceError(
                f"Expected OUT to be a file that is not among the inputs, but {out_path} "
                f"would overwrite the input {p} while it is read. Write the merged trace to "
                "another path."
            )
        else:
            found_all.append(p)
    runs = first_parts(found_all)  # a run in parts is one input: its part 0
    seen: dict[Path, Path] = {}
    for p in runs:
        key = p.resolve()
        if key in seen:
            raise TraceError(
                f"Expected each trace once, but {p} is given more than once (also as "
                f"{seen[key]}, or through its folder): its spans would be counted twice. "
                "Drop the repeat."
            )
        seen[key] = p
    return runs
