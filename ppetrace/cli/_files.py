"""``ppetrace merge OUT IN...`` and ``ppetrace repair TRACE [OUT]``: writing trace files."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import IO, Any

from ._inputs import _in_file, _unreadable
from ._io import _BadInput, check_parent
from ._parse import EXIT_OK, _int_at_least

__all__ = ["add_merge_and_repair", "merge", "repair"]

_MERGE_DOC = (
    "Merge per-rank or per-process trace files into one timeline, keeping each "
    "process's pid and name and applying the clock offsets in their otherData."
)

_REPAIR_DOC = (
    "Write a strict JSON copy of a trace that a killed run cut off, closed after its last "
    "complete event, for viewers that need strict JSON (Perfetto UI, speedscope). The JSON "
    "object form and its otherData are kept. OUT may be TRACE itself."
)


def add_merge_and_repair(sub: Any) -> None:
    """Add the ``merge`` and ``repair`` commands to the subparsers ``sub``."""
    merge = sub.add_parser(
        "merge", help="merge per-rank traces into one timeline", description=_MERGE_DOC
    )
    merge.add_argument("out", metavar="OUT", help="the merged trace to write")
    merge.add_argument("inputs", metavar="IN", nargs="+", help="traces to merge")
    merge.add_argument(
        "--max-part-bytes",
        type=_int_at_least(1 << 20, "--max-part-bytes"),
        default=None,
        metavar="N",
        help="write OUT in parts of about N bytes (OUT, then OUT's stem.1.json, ...), each "
        "a whole trace that viewers open; report, compare and merge read them as one run "
        "from OUT (default: one file)",
    )

    repair = sub.add_parser(
        "repair", help="close a cut-off trace as strict JSON", description=_REPAIR_DOC
    )
    repair.add_argument("trace", metavar="TRACE", help="the cut-off trace (.json or .json.gz)")
    repair.add_argument(
        "out", metavar="OUT", nargs="?", help="where to write (default: TRACE.repaired.json)"
    )


def _count(n: int, noun: str) -> str:
    """``1 trace``, ``2 traces``, ``1,024 events``, ``2 processes``."""
    plural = noun + ("es" if noun.endswith("s") else "s")
    return f"{n:,} {noun if n == 1 else plural}"


def _not_writable(out: str, exc: OSError) -> _BadInput:
    return _BadInput(
        f"Expected a writable file path for OUT (the merged trace to write), but writing "
        f"{out} failed: {exc.strerror or exc}. Pass a file path in a folder you can write to."
    )


def _events(merged: Any) -> int:
    """The merged trace's event count, without parsing it when the merger counted them."""
    count = getattr(merged, "event_count", None)
    return count if isinstance(count, int) else len(merged.events)


def merge(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    import exporters

    if Path(args.out).is_dir():
        raise _BadInput(
            f"Expected a file path for OUT (the merged trace to write), but {args.out} is a "
            f"directory. Pass a file name, such as {Path(args.out) / 'merged.json'}."
        )
    check_parent(args.out, "OUT")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", exporters.TraceTruncatedWarning)
        try:
            merged = exporters.merge_traces(
                args.out, args.inputs, max_part_bytes=args.max_part_bytes
            )
        except FileNotFoundError as exc:
            if exc.filename is None:  # a missing input, named in the message
                raise _BadInput(str(exc)) from None
            raise _not_writable(args.out, exc) from None
        except exporters.TraceError as exc:
            hint = ""
            if str(exc).endswith("the file is empty."):  # a rank killed as it started
                hint = (
                    " A process killed as it started leaves an empty file: merge the other "
                    "files by name, leaving that one out."
                )
            raise _BadInput(str(exc) + hint) from None
        except OSError as exc:
            if exc.filename is not None and str(exc.filename) in args.inputs:
                raise _unreadable(str(exc.filename), exc) from None
            raise _not_writable(args.out, exc) from None
    for w in caught:
        if issubclass(w.category, exporters.TraceTruncatedWarning):
            err.write(f"ppetrace: warning: {w.message}\n")
    processes = len(merged.metadata.get("processes", {}))
    traces = len(merged.metadata.get("merged_from", ()))  # a folder's files, a run's parts once
    parts = getattr(merged, "parts", [args.out])
    where = args.out if len(parts) < 2 else f"{args.out} and {_count(len(parts) - 1, 'more part')}"
    out.write(
        f"Merged {_count(traces, 'trace')} ({_count(_events(merged), 'event')}, "
        f"{_count(processes, 'process')}) into {where}\n"
    )
    return EXIT_OK


def _closed(path: Path) -> bool:
    """Whether a plain JSON trace ends with ``]}`` (its writer closed it): read from its
    end, so that a complete multi-GB trace is not copied to learn it was complete."""
    if path.name.endswith(".gz") or not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 64))
            tail = f.read()
    except OSError:
        return False
    return tail.rstrip().endswith(b"]}")


def _nothing_to_repair(out: IO[str], trace: str, why: str) -> int:
    """Say that a complete trace gets no copy (one beside it counts twice in a folder)."""
    out.write(
        f"{trace} {why} (complete): nothing to repair, no copy written (pass OUT to write "
        "one anyway)\n"
    )
    return EXIT_OK


def _cut_parts(trace: str) -> list[Path]:
    """The later parts of the run whose part 0 is ``trace`` that are cut off (plain JSON
    parts without their closing ``]}``)."""
    import exporters

    try:
        parts = exporters.trace_parts(trace)
    except (OSError, exporters.TraceError):
        return []
    return [p for p in parts[1:] if not p.name.endswith(".gz") and not _closed(p)]


def _part_number(trace: str) -> int | None:
    """The part number of a later part of a run (``otherData.part`` >= 1), else None."""
    from exporters.chrome._ranks import read_header

    try:
        header = read_header(Path(trace))
    except (OSError, ValueError):
        return None
    part = None if header is None else header.other_data.get("part")
    return part if type(part) is int and part >= 1 else None


def repair(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    import exporters

    if args.out is None and _closed(Path(args.trace)):
        code = _nothing_to_repair(out, args.trace, "ends with its closing ]}")
        for part in _cut_parts(args.trace):  # the run's last part is the one a kill cuts
            out.write(
                f"but {part}, a later part of its run, is cut off: `ppetrace repair {part} "
                f"{part}` closes it in place (the run's parts are read by their names)\n"
            )
        return code
    try:
        done = exporters.repair_chrome_trace(args.trace, args.out)
    except FileNotFoundError as exc:
        raise _BadInput(str(exc)) from None
    except exporters.TraceError as exc:
        raise _BadInput(_in_file(args.trace, str(exc))) from None
    except OSError as exc:
        raise _BadInput(
            f"Expected to write the repaired copy of {args.trace}, but that failed: "
            f"{exc.strerror or exc}. Pass an OUT path in a folder you can write to."
        ) from None
    if not done.truncated and args.out is None:
        # a copy of a complete trace beside it would count twice in a folder of runs
        Path(done.path).unlink(missing_ok=True)
        return _nothing_to_repair(out, args.trace, f"has {_count(done.events, 'event')}")
    state = "cut off; closed after its last complete event" if done.truncated else "complete"
    out.write(f"Wrote {done.path}: {_count(done.events, 'event')} ({args.trace} was {state})\n")
    number = _part_number(args.trace)
    if number is not None and Path(done.path).resolve() != Path(args.trace).resolve():
        out.write(
            f"{args.trace} is part {number} of a run, whose parts are read by their names, so "
            f"the run is not read with this copy: `ppetrace repair {args.trace} "
            f"{args.trace}` closes the part in place\n"
        )
    return EXIT_OK
