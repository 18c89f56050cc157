"""The ``ppetrace`` command line: ``report``, ``compare`` and ``merge`` trace files.

Runs without torch: it imports only :mod:`exporters` (which needs pandas,
scipy and the OpenTelemetry SDK) and :mod:`ppetrace._version`.

Exit codes: 0 on success (``compare``: no significant regression), 1 when
``compare`` finds a significant regression, 2 on bad input (a missing file,
a file that is not a JSON trace, runs with no event in common, a bad
option). Bad input gets a one-line error, never a traceback; so does any
unexpected error (``ppetrace: error: <Type>: <message>``, exit code 2, so
that it is never taken for a regression). A cut-off trace is read up to its
last complete event, with a one-line warning.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

from ppetrace._version import __version__

__all__ = ["main", "parse_threshold"]

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_BAD_INPUT = 2


class _BadInput(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (and exit code 2) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(
            EXIT_BAD_INPUT,
            f"{self.prog}: error: {message} (see '{self.prog} --help')\n",
        )


def parse_threshold(text: str) -> float:
    """``"5%"`` -> 0.05; a bare fraction (``"0.05"``) is accepted too.

    Raises ``ValueError`` for anything that is not a percentage between 0%
    and 1000%.
    """
    raw = str(text).strip()
    try:
        if raw.endswith("%"):
            value = float(raw[:-1]) / 100.0
        else:
            value = float(raw)
            if value > 1.0:
                raise ValueError
    except ValueError:
        raise ValueError(
            f"Expected a percentage such as '5%' (or a fraction such as 0.05) for "
            f"--threshold, but received {text!r}."
        ) from None
    if value != value or not (0.0 <= value <= 10.0):
        raise ValueError(f"Expected a --threshold between 0% and 1000%, but received {text!r}.")
    return value


def _alpha(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0.0 < value < 1.0):
        raise argparse.ArgumentTypeError(
            f"expected a probability between 0 and 1 for --alpha, but received {text!r}"
        )
    return value


def _int_at_least(minimum: int, name: str) -> Callable[[str], int]:
    """An argparse type: an int of at least ``minimum`` (0: non-negative, 1: positive)."""
    kind = "non-negative" if minimum == 0 else "positive"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected a {kind} integer for {name}, but received {text!r}"
            )
        return value

    return parse


def _add_warmup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--warmup",
        type=_int_at_least(0, "--warmup"),
        default=1,
        metavar="N",
        help="steps to leave out at the start of each process (default: 1)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ppetrace`` command."""
    parser = _Parser(
        prog="ppetrace",
        description="Report on, compare and merge ppetrace Chrome trace files.",
        epilog="Exit codes: 0 ok, 1 significant regression (compare), 2 bad input.",
    )
    parser.add_argument("--version", action="version", version=f"ppetrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    report = sub.add_parser(
        "report", help="per-event and per-step time of one trace", description=_REPORT_DOC
    )
    report.add_argument("trace", metavar="TRACE", help="a Chrome trace (.json or .json.gz)")
    report.add_argument(
        "--format", choices=("table", "md", "csv", "json"), default="table", dest="fmt"
    )
    _add_warmup(report)
    report.add_argument(
        "--top",
        type=_int_at_least(1, "--top"),
        default=None,
        metavar="K",
        help="show only the K events with the most total time",
    )
    report.add_argument("--output", "-o", metavar="FILE", help="write here instead of stdout")

    comp = sub.add_parser(
        "compare", help="compare a candidate run with a baseline", description=_COMPARE_DOC
    )
    comp.add_argument("base", metavar="BASE", help="the baseline trace")
    comp.add_argument("candidate", metavar="CAND", help="the candidate trace")
    comp.add_argument(
        "--threshold",
        default="5%",
        metavar="PCT",
        help="smallest relative change that counts, e.g. 5%% (default: 5%%)",
    )
    comp.add_argument(
        "--alpha",
        type=_alpha,
        default=0.01,
        metavar="P",
        help="significance level after Holm correction (default: 0.01)",
    )
    comp.add_argument("--format", choices=("table", "md", "json"), default="table", dest="fmt")
    comp.add_argument("--output", "-o", metavar="FILE", help="write here instead of stdout")
    _add_warmup(comp)
    comp.add_argument(
        "--min-samples",
        type=_int_at_least(1, "--min-samples"),
        default=5,
        metavar="N",
        help="fewest samples per run for a verdict (default: 5)",
    )

    merge = sub.add_parser(
        "merge", help="merge per-rank traces into one timeline", description=_MERGE_DOC
    )
    merge.add_argument("out", metavar="OUT", help="the merged trace to write")
    merge.add_argument("inputs", metavar="IN", nargs="+", help="traces to merge")
    return parser


_REPORT_DOC = (
    "Print where each training step's time goes: per event count, total, mean, "
    "p50/p90/p99, max, self time and share of step time; per step wall time, data "
    "wait, compute and other; throughput."
)
_COMPARE_DOC = (
    "Compare per-step samples of each event between two runs (Mann-Whitney U, Holm "
    "correction, bootstrap CI). Exits with 1 when an event regressed significantly "
    "and by more than the threshold."
)
_MERGE_DOC = (
    "Merge per-rank or per-process trace files into one timeline, keeping each "
    "process's pid and name and applying the clock offsets in their otherData."
)


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
        raise _BadInput(f"Expected spans (complete 'X' events) in {path}, but the trace has none.")
    return frame


def _write(stream: IO[str], text: str) -> None:
    """Write ``text``; characters the stream cannot encode (a lone surrogate in a
    span name, an emoji on a Latin-1 terminal) are written as backslash escapes."""
    try:
        stream.write(text)
    except UnicodeEncodeError:
        encoding = getattr(stream, "encoding", None) or "utf-8"
        stream.write(text.encode(encoding, "backslashreplace").decode(encoding))


def _emit(text: str, output: str | None, out: IO[str]) -> None:
    if output is None:
        _write(out, text)
        return
    try:
        Path(output).write_text(text, encoding="utf-8", errors="backslashreplace")
    except OSError as exc:
        raise _BadInput(
            f"Expected a writable file path for --output, but writing {output} failed: "
            f"{exc.strerror or exc}. Pass a file path in a folder you can write to."
        ) from None


def _report(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    import exporters

    frame = _read_frame(args.trace, err)
    report = exporters.step_report(frame, warmup_steps=args.warmup)
    _emit(exporters.render(report, args.fmt, top=args.top), args.output, out)
    if args.output is not None:
        err.write(f"ppetrace: wrote {args.output}\n")
    return EXIT_OK


def _compare(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    import exporters

    try:
        threshold = parse_threshold(args.threshold)
    except ValueError as exc:
        raise _BadInput(str(exc)) from None
    base = _read_frame(args.base, err)
    candidate = _read_frame(args.candidate, err)
    try:
        comparison = exporters.compare(
            base,
            candidate,
            threshold=threshold,
            alpha=args.alpha,
            min_samples=max(2, args.min_samples),
            warmup_steps=args.warmup,
        )
    except exporters.TraceError as exc:
        raise _BadInput(str(exc)) from None
    _emit(exporters.render_comparison(comparison, args.fmt), args.output, out)
    if args.output is not None:
        verdict = "significant regression" if comparison.has_regression else "no regression"
        err.write(f"ppetrace: wrote {args.output} ({verdict})\n")
    return EXIT_REGRESSION if comparison.has_regression else EXIT_OK


def _count(n: int, noun: str) -> str:
    """``1 trace``, ``2 traces``, ``1,024 events``, ``2 processes``."""
    plural = noun + ("es" if noun.endswith("s") else "s")
    return f"{n:,} {noun if n == 1 else plural}"


def _not_writable(out: str, exc: OSError) -> _BadInput:
    return _BadInput(
        f"Expected a writable file path for OUT (the merged trace to write), but writing "
        f"{out} failed: {exc.strerror or exc}. Pass a file path in a folder you can write to."
    )


def _merge(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    import exporters

    if Path(args.out).is_dir():
        raise _BadInput(
            f"Expected a file path for OUT (the merged trace to write), but {args.out} is a "
            f"directory. Pass a file name, such as {Path(args.out) / 'merged.json'}."
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", exporters.TraceTruncatedWarning)
        try:
            merged = exporters.merge_traces(args.out, args.inputs)
        except FileNotFoundError as exc:
            if exc.filename is None:  # a missing input, named in the message
                raise _BadInput(str(exc)) from None
            raise _not_writable(args.out, exc) from None
        except exporters.TraceError as exc:
            raise _BadInput(str(exc)) from None
        except OSError as exc:
            if exc.filename is not None and str(exc.filename) in args.inputs:
                raise _unreadable(str(exc.filename), exc) from None
            raise _not_writable(args.out, exc) from None
    for w in caught:
        if issubclass(w.category, exporters.TraceTruncatedWarning):
            err.write(f"ppetrace: warning: {w.message}\n")
    processes = len(merged.metadata.get("processes", {}))
    out.write(
        f"Merged {_count(len(args.inputs), 'trace')} ({_count(len(merged.events), 'event')}, "
        f"{_count(processes, 'process')}) into {args.out}\n"
    )
    return EXIT_OK


_COMMANDS: dict[str, Callable[[argparse.Namespace, IO[str], IO[str]], int]] = {
    "report": _report,
    "compare": _compare,
    "merge": _merge,
}


def main(
    argv: Sequence[str] | None = None,
    *,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run the ``ppetrace`` command with ``argv`` (default: ``sys.argv[1:]``); return the
    exit code. ``stdout``/``stderr`` default to the process's streams."""
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    parser = build_parser()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version or a usage error
        code = exc.code
        return code if isinstance(code, int) else EXIT_BAD_INPUT
    if args.command is None:
        parser.print_help(out)
        return EXIT_BAD_INPUT
    try:
        return _COMMANDS[args.command](args, out, err)
    except _BadInput as exc:
        _write(err, f"ppetrace {args.command}: error: {exc}\n")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        err.write("ppetrace: interrupted\n")
        return 130
    except Exception as exc:  # last resort: one line, and never exit 1 ("regression")
        message = " ".join(str(exc).split()) or "(no message)"
        _write(err, f"ppetrace: error: {type(exc).__name__}: {message}\n")
        return EXIT_BAD_INPUT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
