"""Reading Chrome trace files: plain or gzip, object or array form, cut off or whole.

:func:`read_chrome_trace` gives the spans as a frame, built column by column
while the file is decoded (see ``_parse`` and ``_events``); :func:`load_chrome_trace`
gives every event as a dict, for code that edits events (the merger). Both
raise :class:`~exporters.TraceError` naming the file for any content they
cannot read, and read a cut-off file up to its last complete event with a
:class:`TraceTruncatedWarning` that points to :func:`repair_chrome_trace`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import TraceError
from .._names import PROFILE_WINDOW_EVENT
from ._encode import NONFINITE_KEY
from ._parse import Parsed, _Fallback, document, stream

if TYPE_CHECKING:
    import pandas as pd

    from ._events import SpanColumns


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
        """``otherData["clock_offset_ns"]`` (an int), or 0 when absent."""
        return _clock_offset(self.metadata, self.path)

    def to_frame(self) -> pd.DataFrame:
        """The spans (``X`` events, see :func:`read_chrome_trace`) as a frame."""
        from ._events import frame_from_chrome_events

        with _naming(self.path):
            return frame_from_chrome_events(self.events, self.origin_ns, self.metadata)


def _clock_offset(metadata: dict[str, Any], path: str) -> int:
    value = metadata.get("clock_offset_ns", 0)
    if type(value) is int:
        return value
    if type(value) is float and value == value and abs(value) < 2**63:
        return int(value)
    raise TraceError(
        f"Expected otherData.clock_offset_ns in {path or 'the trace'} to be a whole number "
        f"of nanoseconds, but received {_describe(value)}. Fix clock_offset_ns (0 when "
        "the file's clock is the reference)."
    )


@contextlib.contextmanager
def _naming(path: str) -> Iterator[None]:
    """Re-raise a :class:`TraceError` without the file's name as one that names it, and
    any other error that content can cause as a :class:`TraceError` naming the file."""
    try:
        yield
    except TraceError as exc:
        if path and path not in str(exc):
            raise TraceError(f"In {path}: {exc}") from None
        raise
    except RecursionError:
        raise TraceError(
            f"Expected a Chrome trace in {path}, but its JSON nests deeper than can be read "
            "(thousands of levels): it is not a trace."
        ) from None
    except (TypeError, ValueError, OverflowError, KeyError, IndexError) as exc:
        message = " ".join(str(exc).split())[:200] or "(no message)"
        raise TraceError(
            f"Expected a Chrome trace in {path}, but its content cannot be read as one "
            f"({type(exc).__name__}: {message}). Check the events' fields against the "
            "Chrome trace event format."
        ) from exc


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The cyclic garbage collector paused: decoding makes millions of objects, none in
    a cycle, and each collection would walk them all again."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _metadata(top: Any) -> dict[str, Any]:
    meta = top.get("otherData") if isinstance(top, dict) else None
    return dict(meta) if isinstance(meta, dict) else {}


def _origin(metadata: dict[str, Any]) -> Any:
    origin = metadata.get("origin_ns", 0)
    return origin if type(origin) is int else 0


def _events_of(doc: Any, p: Path, truncated: bool) -> tuple[list[Any], dict[str, Any]]:
    """The event list and metadata of a whole parsed document; :class:`TraceError`
    for a document that is not a trace."""
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
                f"but its keys are {sorted(map(str, doc))[:8]}."
            )
        metadata = _metadata(doc)
    elif isinstance(doc, list):
        events, metadata = doc, {}
    else:
        raise TraceError(
            f"Expected a Chrome trace in {p} (a JSON object or array of events), but it "
            f"holds a JSON {type(doc).__name__}."
        )
    if events and not all(isinstance(e, dict) and "ph" in e for e in events[:100]):
        bad = next(e for e in events[:100] if not (isinstance(e, dict) and "ph" in e))
        raise TraceError(
            f"Expected Chrome trace events (objects with a 'ph' field) in {p}, but found "
            f"{_describe(bad)}."
        )
    return [e for e in events if isinstance(e, dict)], metadata


def _warn_truncated(p: Path, count: int) -> None:
    warnings.warn(
        f"The trace {p} is cut off (the process that wrote it probably stopped early); "
        f"read its first {count} complete events. Other viewers need strict JSON: "
        f"`ppetrace repair {p}` (or exporters.repair_chrome_trace) writes a closed copy.",
        TraceTruncatedWarning,
        stacklevel=3,
    )


def _warn_cut_part(p: Path, index: int, count: int, events: int) -> None:
    """A part before the run's last is cut off: the run went on, its spans did not reach
    the file (a disk that filled, a copy cut short)."""
    warnings.warn(
        f"Part {index} of the {count} parts of the run, {p}, is cut off after its first "
        f"{events} complete events, and the parts after it were read: the spans it lost are "
        "missing (their steps are not counted), and the first step after the gap holds the "
        "gap in its wall time. Recover the part, or read the run up to it (`parts=False` "
        "on each part).",
        TraceTruncatedWarning,
        stacklevel=3,
    )


def _hint_later_part(p: Path, meta: dict[str, Any], parts: bool) -> None:
    """Reading a later part of a run (``otherData.part`` >= 1) as if it were the run: say
    which file the run starts with (the report's steps would be this part's only)."""
    part, first = meta.get("part"), meta.get("first_part")
    if parts and type(part) is int and part >= 1 and isinstance(first, str):
        warnings.warn(
            f"{p} is part {part} of a run whose first part is {p.parent / first}: read that "
            "file for the whole run (this reads the one part; parts=False says so on "
            "purpose).",
            TraceTruncatedWarning,  # (the run is read in part: the CLI says it, too)
            stacklevel=3,
        )


def load_chrome_trace(path: str | os.PathLike[str]) -> ChromeTrace:
    """Read a Chrome trace (JSON object or array form, plain or gzip) into a :class:`ChromeTrace`.

    A file cut off anywhere is read up to its last complete event, with a
    :class:`TraceTruncatedWarning`. Raises ``FileNotFoundError`` for a
    missing file and :class:`TraceError` (naming the file) for a file that is
    not JSON, not a trace, or corrupt gzip.
    """
    p = Path(path)
    with _naming(str(p)):
        doc, truncated = document(p)
        events, metadata = _events_of(doc, p, truncated)
        if truncated:
            _warn_truncated(p, len(events))
        return ChromeTrace(events, metadata, _origin(metadata), truncated, str(p))


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _read_columns(
    p: Path, into: SpanColumns | None = None
) -> tuple[SpanColumns, dict[str, Any], bool, int]:
    """The spans' columns of a file (added to ``into`` when given), its metadata, whether
    it was cut off, and its number of events."""
    from ._events import SpanColumns

    parsed = Parsed()
    columns = into if into is not None else SpanColumns()
    chunks = stream(p, parsed, columns.scan)
    if chunks is not None:
        mark = columns.mark()
        count = 0
        try:
            for chunk in chunks:
                columns.add(chunk)
                count += len(chunk)
            return columns, _metadata(parsed.top), parsed.truncated, count
        except _Fallback:  # a layout the line reader does not take: the whole document
            columns.reset(mark)
    doc, truncated = document(p)
    events, metadata = _events_of(doc, p, truncated)
    columns = into if into is not None else SpanColumns()
    columns.add_dicts(events)
    return columns, metadata, truncated, len(events)


def read_chrome_trace(path: str | os.PathLike[str], *, parts: bool = True) -> pd.DataFrame:
    """The spans of a Chrome trace file as a frame (schema: :mod:`exporters.frame`).

    Reads ppetrace's own files and any Chrome trace made of ``X`` events (or
    ``B``/``E`` pairs). When some ``X`` events carry a ``span_id`` (ppetrace
    files; older ones have it in ``args``), only those are spans; events that
    other tools added (profiler stacks, kernels, counters) are left out.
    Without ids, parents are inferred from nesting per thread and ``args``
    become attributes. ``frame.attrs`` holds ``metadata`` (``otherData``),
    ``truncated``, ``path`` and, when the file has ``M`` events named
    ``ppetrace.table`` (``args``: ``name``, ``columns``, ``rows``; the
    Pyinstrument profiler writes ``top_functions``), ``tables``, which
    :func:`exporters.step_report` adds to its report. The windows that ppetrace's
    scheduled profilers (``Pyinstrument``, ``TorchProfiler``) recorded are in
    ``frame.attrs["profile_windows"]``: dicts of ``profiler``, ``pid``,
    ``start_ns``, ``end_ns``, ``first_step`` and ``last_step``; the step report
    leaves the steps inside them out, as their profiling slows them.

    A run written in parts (``ChromeTraceExporter(max_part_bytes=...)``) is
    read whole from its first file: ``trace.json`` brings ``trace.1.json``,
    ``trace.2.json``, ... (see :func:`exporters.trace_parts`), and
    ``frame.attrs["parts"]`` lists the files read (when there are several).
    ``parts=False`` reads the one file given, as does naming a later part.

    JSON has no NaN or infinity, so the writer stores such a float attribute as the
    object ``{"ppetrace.float": "NaN"}`` (or ``"Infinity"``, ``"-Infinity"``), which
    every JSON parser takes; they are read back as floats, also inside lists, and a
    column of numbers and them is float64. (Files of ppetrace 0.1 before this had the
    bare strings, which stay strings.)

    ``frame.attrs["metadata"]`` is the file's ``otherData``, plus ``ppetrace.final``:
    the writer's closing counts of summarised steps when the file has them (and
    ``run_error`` when the run recorded that it failed), and ``ppetrace.cut``: the
    sources of the repaired copies of cut-off traces it holds (``ppetrace repair``).
    A cut-off file is read up to its last complete event with a
    :class:`TraceTruncatedWarning`. Raises ``FileNotFoundError`` for a missing
    file and :class:`TraceError`, naming the file, for anything else it cannot
    read. ppetrace's files are read a block of lines at a time, straight into
    columns by a C line scanner (where ``exporters._speedups`` is built; msgspec
    decodes the lines it declines, and every line without it), so memory stays
    near the size of the frame. The scanner lets go of the GIL, so where the
    process may use two CPUs, the two halves of each large block are scanned at
    once (the second on one worker thread per file), and the next block is read
    on a thread meanwhile.
    """
    from ._split import missing_part, run_parts

    p = Path(path)
    paths = run_parts(p) if parts and p.is_file() else [p]
    lost = missing_part(p, paths, warn=True) if parts and p.is_file() else None
    columns: SpanColumns | None = None
    cut = False
    metadata: dict[str, Any] = {}
    with _no_gc():
        for i, q in enumerate(paths):
            with _naming(str(q)):
                columns, meta, truncated, count = _read_columns(q, columns)
            if truncated and i < len(paths) - 1:
                _warn_cut_part(q, i, len(paths), count)
            elif truncated:
                _warn_truncated(q, count)
            cut = cut or truncated
            if i == 0:
                metadata = meta
                _hint_later_part(q, meta, parts)
        assert columns is not None
        with _naming(str(p)):
            frame = columns.frame(_origin(metadata), metadata)
            tables = _tables(columns.meta)
            windows = _profile_windows(columns.meta, _origin(metadata))
        _restore_nonfinite(frame)
    if windows:
        frame.attrs["profile_windows"] = windows
    if tables:
        frame.attrs["tables"] = tables  # plain data: pandas copies attrs around
    final = _final_counts(columns.meta)
    if final:  # the writer's closing counts (ChromeTraceExporter, "Final counts")
        metadata = {**metadata, "ppetrace.final": final}
    repaired = [  # (an event without args, or without a source, still says it was cut)
        str(e.args.get("source") or p) if type(e.args) is dict else str(p)
        for e in columns.meta
        if e.name == "ppetrace.cut"
    ]
    if repaired:  # repaired copies of cut-off traces (ppetrace repair), also once merged
        metadata = {**metadata, "ppetrace.cut": repaired}
    frame.attrs["metadata"] = metadata
    frame.attrs["path"] = str(p)
    frame.attrs["truncated"] = cut
    if lost is not None:  # the run goes on in parts that were not read: it is cut here
        frame.attrs["missing_part"] = lost
    if len(paths) > 1:
        frame.attrs["parts"] = [str(q) for q in paths]
    return frame


def _profile_windows(meta: list[Any], origin_ns: int) -> list[dict[str, Any]]:
    """The profiled windows of the ``ppetrace.profile_window`` events (malformed ones
    are skipped: they only decide which steps a report leaves out)."""
    out = []
    for e in meta:
        args = e.args
        if e.name != PROFILE_WINDOW_EVENT or type(args) is not dict or type(e.pid) is not int:
            continue
        ts, dur = e.ts, e.dur
        if not (_number(ts) and _number(dur) and abs(ts) < 1e15 and 0 <= dur < 1e15):
            continue
        start = origin_ns + round(ts * 1000)
        out.append(
            {
                "profiler": str(args.get("profiler", "")),
                "pid": e.pid,
                "start_ns": start,
                "end_ns": start + round(dur * 1000),
                "first_step": args.get("first_step"),
                "last_step": args.get("last_step"),
            }
        )
    return out


def _number(value: Any) -> bool:
    return type(value) is int or type(value) is float


def _final_counts(meta: list[Any]) -> dict[str, Any]:
    """The ``args`` of the ``ppetrace.final`` events (a merged trace has one per process:
    their ``steps_summarised`` and ``spans_summarised`` are added up, the rest taken from
    the first; when several processes recorded a ``run_error``, ``run_errors`` lists them
    all)."""
    out: dict[str, Any] = {}
    errors: list[str] = []  # every process's run_error (a rank's crash, the others' knock-on)
    for e in meta:
        if e.name != "ppetrace.final" or type(e.args) is not dict:
            continue
        for key, value in e.args.items():
            if key in _SUMMED and key in out and type(value) is int and type(out[key]) is int:
                out[key] += value
            else:
                out.setdefault(key, value)
        error = e.args.get("run_error")
        if isinstance(error, str) and error not in errors:
            errors.append(error)
    if len(errors) > 1:
        out["run_errors"] = errors
    return out


_SUMMED = frozenset({"steps_summarised", "spans_summarised"})


def _tables(meta: list[Any]) -> dict[str, Any]:
    """The ``ppetrace.table`` events' tables: name -> ``{"columns", "rows"}``."""
    tables = {}
    for e in meta:
        args = e.args
        if (
            e.name == "ppetrace.table"
            and type(args) is dict
            and {"name", "columns", "rows"} <= set(args)
        ):
            tables[str(args["name"])] = {"columns": args["columns"], "rows": args["rows"]}
    return tables


_NONFINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}
#: what pandas calls a column of several types (where the writer's objects can be)
_MIXED = frozenset({"mixed", "mixed-integer", "mixed-integer-float"})


def _float_of(value: Any) -> Any:
    """The float that the writer's ``{"ppetrace.float": "NaN"}`` object stands for (also
    inside a list), else ``value`` itself."""
    kind = type(value)
    if kind is dict and len(value) == 1:
        text = value.get(NONFINITE_KEY)
        return _NONFINITE.get(text, value) if type(text) is str else value
    if (kind is list or kind is tuple) and any(type(v) is dict for v in value):
        return kind(map(_float_of, value))
    return value


def _restore_nonfinite(frame: pd.DataFrame) -> None:
    """Give the non-finite float attributes back (see :func:`read_chrome_trace`), in
    place: a column of numbers and them becomes float64."""
    import pandas as pd

    for name in frame.columns:
        column = frame[name]
        if column.dtype != object:
            continue  # numbers alone, or strings alone (pandas 3's str dtype)
        if pd.api.types.infer_dtype(column, skipna=True) not in _MIXED:
            continue  # one type throughout (strings on pandas 2): no object among them
        restored = column.map(_float_of, na_action="ignore")
        types = restored.map(type, na_action="ignore")
        if types.isin([int, float]).sum() == restored.notna().sum():  # not bool
            restored = restored.astype("float64")
        frame[name] = restored
