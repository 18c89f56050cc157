"""How a run failed, from its trace: :func:`run_failure` (``compare`` refuses a verdict on
such a run, and the step report says so)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

__all__ = ["FAILURE_EVENTS", "run_failure"]

#: the spans whose ERROR status means the run itself failed: its training code raised
#: through them (a fit that raised, a step cut off by an exception, a thread that died)
FAILURE_EVENTS = ("trainer.run", "trainer.epoch", "trainer.step", "trainer.validation")


def run_failure(frame: pd.DataFrame) -> str | None:
    """How the run of ``frame`` failed, in words, or ``None`` when nothing says it did.

    A run failed when:

    - its trace is cut off (``frame.attrs["truncated"]``: the process was killed, or
      still runs), or was before ``ppetrace repair`` closed it (the metadata's
      ``ppetrace.cut``, from the repaired copy's closing event) or ``ppetrace merge``
      took it in (``otherData.merged_from[i].truncated``); or a part of it is missing
      before a later one (``frame.attrs["missing_part"]``);
    - the run recorded how it ended as an error: ``run_error`` in its closing
      ``ppetrace.final`` event (``instrument()`` and ``ppetrace run``: the exception
      that ended the script or the ``with`` block, a non-zero exit code, a training
      thread that died; ``LightningProfiler``: an exception that left an action);
    - one of :data:`FAILURE_EVENTS` ended with an ERROR status (the Trainer's fit
      raised, a step was cut off by an exception); ``sys.exit(0)`` is no error.

    Its steps up to then are real, but they are not the code's speed: a crash at step 50
    of 100 compares warm-up-heavy steps, or none of the slow ones.
    """
    parts = []
    meta = frame.attrs.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    cut = _strings(meta.get("ppetrace.cut"))  # repaired copies of cut-off traces
    merged = meta.get("merged_from")
    if isinstance(merged, list):  # ppetrace merge's inputs that were cut off
        cut += [
            str(m.get("path"))
            for m in merged
            if isinstance(m, Mapping) and m.get("truncated") is True
        ]
    if frame.attrs.get("truncated") or cut:
        where = _strings(frame.attrs.get("truncated_paths")) or cut
        which = f" ({', '.join(where)})" if where and where != _paths(frame) else ""
        was = "was cut off" if cut and not frame.attrs.get("truncated") else "is cut off"
        parts.append(f"its trace{which} {was} (the process was killed, or still runs)")
    lost = frame.attrs.get("missing_part")
    if type(lost) is int:
        parts.append(f"its trace's part {lost} is missing (the parts after it were not read)")
    final = meta.get("ppetrace.final")
    final = final if isinstance(final, Mapping) else {}
    ended = _strings(final.get("run_errors")) or _strings([final.get("run_error")])
    texts = [_first_line(e) for e in ended if e.strip()]
    if texts:  # (each process's, in a merged trace: the cause and the knock-on errors)
        more = f"; and {len(texts) - 4} more" if len(texts) > 4 else ""
        parts.append(f"it ended with an error ({'; '.join(texts[:4])}{more})")
    if "status" in frame.columns and len(frame):
        names = frame["name"].to_numpy(dtype=object)
        failed = (frame["status"].to_numpy(dtype=object) == "ERROR") & np.isin(
            names, FAILURE_EVENTS
        )
        rows = np.flatnonzero(failed)
        errors = (
            frame["error"].to_numpy(dtype=object)[rows]
            if "error" in frame.columns
            else np.full(len(rows), "", dtype=object)
        )
        clean = np.array([_clean_exit(e) for e in errors], dtype=bool)  # sys.exit(0)
        rows, errors = rows[~clean], errors[~clean]
        if len(rows):
            counts = [(name, int((names[rows] == name).sum())) for name in FAILURE_EVENTS]
            what = ", ".join(f"{n} {name} span{'s' if n != 1 else ''}" for name, n in counts if n)
            texts = [_first_line(e) for e in errors if isinstance(e, str) and e.strip()]
            parts.append(f"{what} ended with an error" + (f" ({texts[0]})" if texts else ""))
    return "; ".join(parts) if parts else None


def _strings(value: object) -> list[str]:
    """The strings of a list (anything else: none), as metadata from a file may hold."""
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _paths(frame: pd.DataFrame) -> list[str]:
    """The files a frame was read from (one, unless rank files were joined)."""
    path = frame.attrs.get("path")
    return str(path).split(" + ") if path else []


def _first_line(text: str) -> str:
    """An error text's first line, without a bare trailing colon, at most 120 characters."""
    first = text.strip().splitlines()[0].rstrip()
    first = first[:-1] if first.endswith(":") else first
    return first[:117] + "..." if len(first) > 120 else first


def _clean_exit(error: object) -> bool:
    """Whether an error text (its first line: the recorder adds the traceback) is
    ``sys.exit()``, ``sys.exit(0)`` or ``sys.exit(None)``."""
    if not isinstance(error, str) or not error.strip():
        return False
    return _first_line(error) in ("SystemExit", "SystemExit: 0", "SystemExit: None")
