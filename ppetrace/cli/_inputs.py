"""Reading the traces a command is given: one file, a folder or a glob, a run's parts
once, and the one-line errors of a file that cannot be read."""

from __future__ import annotations

import glob
import os
import warnings
from pathlib import Path
from typing import IO, Any

from ._io import _BadInput

__all__ = ["_in_file", "_read_frame", "_trace_paths", "_unreadable"]


def _in_file(path: str, message: str) -> str:
    """``message`` about the trace ``path``, naming the file if it does not already."""
    if path in message:
        return message
    return f"In {path}: {message}"


def _unreadable(path: str, exc: OSError) -> _BadInput:
    return _BadInput(
        f"Expected a readable trace file at {path}, but reading it failed: "
        f"{exc.strerror or exc}. Check the path and its permissions."
    )


def _read_frame(path: str, err: IO[str]) -> Any:
    import exporters

    if os.path.isdir(path):
        raise _BadInput(
            f"Expected a trace file for TRACE, but {path} is a folder. Pass one file; for a "
            f"folder of rank files, merge them first (ppetrace merge merged.json {path}) and "
            "report on the merged file."
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", exporters.TraceTruncatedWarning)
        try:
            frame = exporters.read_chrome_trace(path)
        except FileNotFoundError as exc:
            raise _BadInput(str(exc)) from None
        except exporters.TraceError as exc:
            raise _BadInput(_in_file(path, str(exc))) from None
        except OSError as exc:
            raise _unreadable(path, exc) from None
    for w in caught:
        if issubclass(w.category, exporters.TraceTruncatedWarning):
            err.write(f"ppetrace: warning: {w.message}\n")
    if len(frame) == 0:
        raise _BadInput(
            f"Expected spans (complete 'X' events) in {path}, but the trace has no span "
            "events. Pass a trace written by a run that recorded spans."
        )
    return frame


_TRACE_SUFFIXES = (".json", ".json.gz")


def _trace_paths(spec: str, label: str, err: IO[str] | None = None) -> list[str]:
    """The trace files that BASE or CAND names: a file, a folder's ``*.json`` and
    ``*.json.gz`` files, or the files a glob matches; sorted by name. A run written in
    parts counts once: by its part 0, which brings the others. Stale later parts are left
    out, with a warning on ``err`` (None: without one, for a second look at the same
    files)."""
    path = Path(spec)
    if path.is_dir():
        found = sorted(
            str(p) for p in path.iterdir() if p.is_file() and p.name.endswith(_TRACE_SUFFIXES)
        )
        if not found:
            raise _BadInput(
                f"Expected trace files (*.json or *.json.gz) in the folder {spec} given as "
                f"{label}, but it has none."
            )
        return _first_parts(found, err)
    if path.exists() or not glob.has_magic(spec):
        return [spec]
    found = sorted(p for p in glob.glob(spec) if Path(p).is_file())
    if not found:
        raise _BadInput(
            f"Expected {label} to be a trace file, a folder of traces or a glob that matches "
            f"trace files, but the glob {spec!r} matches no file."
        )
    return _first_parts(found, err)


def _first_parts(paths: list[str], err: IO[str] | None) -> list[str]:
    """``paths`` without the later parts of a run whose part 0 is among them, and without
    stale later parts (with a warning on ``err``: :func:`exporters.chrome.first_parts`)."""
    from exporters.chrome._split import StaleTracePartWarning, first_parts

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", StaleTracePartWarning)
        kept = {p.resolve() for p in first_parts(paths)}
    for w in caught:
        if err is not None and issubclass(w.category, StaleTracePartWarning):
            err.write(f"ppetrace: warning: {w.message}\n")
    return [p for p in paths if Path(p).resolve() in kept]
