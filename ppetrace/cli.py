"""The ``ppetrace`` command line: ``run`` a script traced; ``report``, ``compare``,
``merge`` and ``repair`` trace files.

``report``, ``compare`` and ``merge`` run without torch: they import only
:mod:`exporters` (which needs pandas, scipy and the OpenTelemetry SDK) and
:mod:`ppetrace._version`. ``run`` imports :mod:`ppetrace.integrations` (and
torch) when it starts the script, and exits with the script's own exit code.

Exit codes: 0 on success (``compare``: no gated regression), 1 when
``compare`` finds a gated regression, 2 on bad input (a missing file, a
file that is not a JSON trace, runs with no event in common, a bad option;
with ``--strict-env``, runs from different environments). Bad input gets a
one-line error, never a traceback; so does any unexpected error
(``ppetrace: error: <Type>: <message>``, exit code 2, so that it is never
taken for a regression). A cut-off trace is read up to its last complete
event, with a one-line warning.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

from exporters._defaults import (
    DEFAULT_ALPHA,
    DEFAULT_GATE,
    DEFAULT_MIN_EFFECT,
    DEFAULT_MIN_EFFECT_NS,
    DEFAULT_NOISE_FLOOR,
    DEFAULT_THRESHOLD,
)
from ppetrace._cli_args import join_negative_values
from ppetrace._cli_html import add_html_option, write_html
from ppetrace._cli_io import _BadInput, _emit, _write
from ppetrace._version import __version__

__all__ = ["main", "parse_duration_ns", "parse_gate", "parse_percent", "parse_threshold"]

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (and exit code 2) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(
            EXIT_BAD_INPUT,
            f"{self.prog}: error: {message} (see '{self.prog} --help')\n",
        )


def parse_percent(text: str, *, option: str = "--threshold") -> float:
    """``"5%"`` -> 0.05; a bare fraction (``"0.05"``) is accepted too.

    Raises ``ValueError`` naming ``option`` for anything that is not a
    percentage between 0% and 1000%.
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
            f"{option}, but received {text!r}."
        ) from None
    if value < 0:
        raise ValueError(
            f"Expected a positive {option} (it applies to slowdowns and speedups alike), but "
            f"received {text!r}. Pass its size, such as {raw.lstrip('-')}."
        )
    if value != value or not (0.0 <= value <= 10.0):
        raise ValueError(f"Expected a {option} between 0% and 1000%, but received {text!r}.")
    return value


def parse_threshold(text: str) -> float:
    """``"5%"`` -> 0.05 for ``--threshold`` (see :func:`parse_percent`)."""
    return parse_percent(text, option="--threshold")


_UNITS = {"ns": 1.0, "us": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9}


def parse_duration_ns(text: str, *, option: str = "--min-effect-abs") -> float:
    """``"1us"`` -> 1000.0: a non-negative duration with a unit (ns, us or µs, ms, s).

    Raises ``ValueError`` naming ``option`` otherwise.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ns|us|µs|ms|s)\s*", text)
    if match is None:
        raise ValueError(
            f"Expected a duration with a unit such as '1us', '500ns' or '0.2ms' for {option}, "
            f"but received {text!r}."
        )
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_gate(text: str) -> str | list[str]:
    """``"all"`` -> ``"all"``; ``"a,b"`` -> ``["a", "b"]`` (the events to gate).

    Raises ``ValueError`` for a list with no name in it.
    """
    if text.strip() == "all":
        return "all"
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(
            f"Expected event names separated by commas (or 'all') for --gate, but received "
            f"{text!r}. Pass, for example, --gate trainer.step,module.train_step."
        )
    return names


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
        description="Run a script traced; report on, compare and merge ppetrace Chrome traces.",
        epilog="Exit codes: 0 ok, 1 gated regression (compare), 2 bad input; run: the script's.",
    )
    parser.add_argument("--version", action="version", version=f"ppetrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_run(sub)

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
    add_html_option(report)

    comp = sub.add_parser(
        "compare",
        help="compare candidate runs with baseline runs",
        description=_COMPARE_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    comp.add_argument(
        "base", metavar="BASE", help="the baseline: a trace, a folder of traces or a quoted glob"
    )
    comp.add_argument(
        "candidate",
        metavar="CAND",
        help="the candidate: a trace, a folder of traces or a quoted glob",
    )
    comp.add_argument(
        "--gate",
        default=None,
        metavar="EVENTS",
        help="events that can fail the comparison: names separated by commas, or 'all' "
        f"(default: {','.join(DEFAULT_GATE)}; the others are informational)",
    )
    comp.add_argument(
        "--noise-floor",
        default=f"{DEFAULT_NOISE_FLOOR:.1%}",
        metavar="PCT",
        help="run-to-run CV of the median step assumed at least, what one run per side is "
        "judged against (default: %(default)s, measured here; see the README)",
    )
    comp.add_argument(
        "--threshold",
        default=f"{DEFAULT_THRESHOLD:.0%}",
        metavar="PCT",
        help="smallest relative change that counts (default: %(default)s)",
    )
    comp.add_argument(
        "--min-effect",
        default=f"{DEFAULT_MIN_EFFECT:.0%}",
        metavar="PCT",
        help="smallest absolute change that counts, as a share of the base's median "
        "trainer.step (default: %(default)s)",
    )
    comp.add_argument(
        "--min-effect-abs",
        default=f"{DEFAULT_MIN_EFFECT_NS / 1000:g}us",
        metavar="DURATION",
        help="... and never less than this (default: %(default)s)",
    )
    comp.add_argument(
        "--alpha",
        type=_alpha,
        default=DEFAULT_ALPHA,
        metavar="P",
        help="significance level after Holm correction over the gated events "
        "(default: %(default)s)",
    )
    comp.add_argument(
        "--strict-env",
        action="store_true",
        help="exit with 2 when the runs' environments differ (default: warn)",
    )
    comp.add_argument("--format", choices=("table", "md", "json"), default="table", dest="fmt")
    comp.add_argument("--output", "-o", metavar="FILE", help="write here instead of stdout")
    add_html_option(comp)
    _add_warmup(comp)
    comp.add_argument(
        "--rank",
        type=_int_at_least(0, "--rank"),
        default=None,
        metavar="R",
        help="compare one rank of multi-rank traces (default: every rank's steps are samples)",
    )
    comp.add_argument(
        "--min-samples",
        type=_int_at_least(1, "--min-samples"),
        default=5,
        metavar="N",
        help="fewest samples a run needs for an event to count (default: 5)",
    )

    merge = sub.add_parser(
        "merge", help="merge per-rank traces into one timeline", description=_MERGE_DOC
    )
    merge.add_argument("out", metavar="OUT", help="the merged trace to write")
    merge.add_argument("inputs", metavar="IN", nargs="+", help="traces to merge")

    repair = sub.add_parser(
        "repair", help="close a cut-off trace as strict JSON", description=_REPAIR_DOC
    )
    repair.add_argument("trace", metavar="TRACE", help="the cut-off trace (.json or .json.gz)")
    repair.add_argument(
        "out", metavar="OUT", nargs="?", help="where to write (default: TRACE.repaired.json)"
    )
    return parser


def _add_run(sub: Any) -> None:
    from ppetrace.integrations._run import add_parser

    add_parser(sub, int_at_least=_int_at_least, add_warmup=_add_warmup)


_REPORT_DOC = (
    "Print where each training step's time goes: per event count, total, mean, "
    "p50/p90/p99, max, self time and share of step time; per step wall time, data "
    "wait, compute and other; throughput."
)
_COMPARE_DOC = """\
Compare the runs of a candidate with the runs of a baseline, event by event.

Each run gives one number per event, the median of its per-step samples;
runs are the samples, because every run has its own offset. With one run per
side the change is judged against the noise floor (the run-to-run CV of the
median step); with three runs or more in all, against the runs' own scatter
where that is larger. A verdict needs a significant change (Holm over the
gated events) beyond the threshold and beyond the minimum effect. Only gated
events (default: trainer.step) can fail: exit code 1. Each field of the
recorded environment that differs is named in a warning (exit code 2 with
--strict-env).

Examples:
  ppetrace compare base.json cand.json
  ppetrace compare runs/base runs/cand --format md -o comment.md
  ppetrace compare 'runs/base-*.json' 'runs/cand-*.json' --gate all
"""
_MERGE_DOC = (
    "Merge per-rank or per-process trace files into one timeline, keeping each "
    "process's pid and name and applying the clock offsets in their otherData."
)

_REPAIR_DOC = (
    "Write a strict JSON copy of a trace that a killed run cut off, closed after its last "
    "complete event, for viewers that need strict JSON (Perfetto UI, speedscope). The JSON "
    "object form and its otherData are kept. OUT may be TRACE itself."
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
        raise _BadInput(
            f"Expected spans (complete 'X' events) in {path}, but the trace has no span "
            "events. Pass a trace written by a run that recorded spans."
        )
    return frame


def _report(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    import exporters

    frame = _read_frame(args.trace, err)
    report = exporters.step_report(frame, warmup_steps=args.warmup)
    _emit(exporters.render(report, args.fmt, top=args.top), args.output, out)
    if args.output is not None:
        err.write(f"ppetrace: wrote {args.output}\n")
    write_html(args.html, lambda: exporters.render_html(report), err)
    return EXIT_OK


_TRACE_SUFFIXES = (".json", ".json.gz")


def _trace_paths(spec: str, label: str) -> list[str]:
    """The trace files that BASE or CAND names: a file, a folder's ``*.json`` and
    ``*.json.gz`` files, or the files a glob matches; sorted by name. A run written in
    parts counts once: by its part 0, which brings the others."""
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
        return _first_parts(found)
    if path.exists() or not glob.has_magic(spec):
        return [spec]
    found = sorted(p for p in glob.glob(spec) if Path(p).is_file())
    if not found:
        raise _BadInput(
            f"Expected {label} to be a trace file, a folder of traces or a glob that matches "
            f"trace files, but the glob {spec!r} matches no file."
        )
    return _first_parts(found)


def _first_parts(paths: list[str]) -> list[str]:
    """``paths`` without the later parts of a run whose part 0 is among them."""
    import exporters

    later = {Path(q).resolve() for p in paths for q in exporters.trace_parts(p)[1:]}
    return [p for p in paths if Path(p).resolve() not in later]


def _summaries(
    spec: str, label: str, warmup: int, err: IO[str], rank: int | None = None
) -> list[Any]:
    """One RunSummary per run: the files of one run (rank files sharing a trace id) count
    as one."""
    import exporters

    frames = [_read_frame(path, err) for path in _trace_paths(spec, label)]
    out = []
    for run in exporters.group_runs(frames):
        try:
            summary = exporters.summarize_run(
                run, warmup_steps=warmup, source=run.attrs.get("path"), rank=rank
            )
        except ValueError as exc:
            raise _BadInput(str(exc)) from None
        out.append(summary)
    return out


def _same_files(base: str, candidate: str) -> str:
    """``"file x.json"`` (``"files ..."``) when BASE and CAND name the same trace files,
    else ``""``."""
    files = [sorted({Path(p).resolve() for p in _trace_paths(s, "")}) for s in (base, candidate)]
    if files[0] != files[1]:
        return ""
    return f"file {base}" if len(files[0]) == 1 else f"{len(files[0])} files"


def _compare_options(args: argparse.Namespace) -> dict[str, Any]:
    try:
        return {
            "threshold": parse_threshold(args.threshold),
            "noise_floor": parse_percent(args.noise_floor, option="--noise-floor"),
            "min_effect": parse_percent(args.min_effect, option="--min-effect"),
            "min_effect_ns": parse_duration_ns(args.min_effect_abs),
            "gate": None if args.gate is None else parse_gate(args.gate),
        }
    except ValueError as exc:
        raise _BadInput(str(exc)) from None


def _compare(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    import exporters

    options = _compare_options(args)
    if options["noise_floor"] > 1.0 or options["min_effect"] > 1.0:
        raise _BadInput(
            "Expected --noise-floor and --min-effect of at most 100%, but received "
            f"{args.noise_floor} and {args.min_effect}."
        )
    base = _summaries(args.base, "BASE", args.warmup, err, args.rank)
    candidate = _summaries(args.candidate, "CAND", args.warmup, err, args.rank)
    try:
        comparison = exporters.compare(
            base,
            candidate,
            alpha=args.alpha,
            min_samples=max(2, args.min_samples),
            **options,
        )
    except exporters.TraceError as exc:
        raise _BadInput(str(exc)) from None
    same = _same_files(args.base, args.candidate)
    if same:
        _write(
            err, f"ppetrace: warning: BASE and CAND are the same {same}, so they can only match.\n"
        )
    if args.fmt != "table" or args.output is not None:  # the table shows them itself
        for warning in comparison.environment_warnings:
            _write(err, f"ppetrace: warning: {warning}\n")
    _emit(exporters.render_comparison(comparison, args.fmt), args.output, out)
    if args.output is not None:
        verdict = "gated regression" if comparison.has_regression else "no gated regression"
        err.write(f"ppetrace: wrote {args.output} ({verdict})\n")
    write_html(args.html, lambda: exporters.render_comparison_html(comparison), err)
    if args.strict_env and not comparison.environment_recorded:
        _write(
            err,
            "ppetrace compare: error: Expected environment records in the traces "
            "(--strict-env), but no run has one (traces written by an older ppetrace or "
            "another program). Re-record the runs with this ppetrace, or drop --strict-env.\n",
        )
        return EXIT_BAD_INPUT
    if args.strict_env and comparison.environment_warnings:
        n = len(comparison.environment_warnings)
        _write(
            err,
            f"ppetrace compare: error: Expected runs from one environment (--strict-env), but "
            f"{n} environment field{'s differ' if n != 1 else ' differs'} (see the "
            "warnings above). Run both sides on the same machine and settings, or drop "
            "--strict-env.\n",
        )
        return EXIT_BAD_INPUT
    return EXIT_REGRESSION if comparison.has_regression else EXIT_OK


def _run(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from ppetrace.integrations._run import BadRunInput, end_by, options_from, run

    try:
        result = run(options_from(args), err=err)
    except BadRunInput as exc:
        raise _BadInput(str(exc)) from None
    return end_by(result)  # the script's exit code, or its signal


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
    traces = len(merged.metadata.get("merged_from", ()))  # a folder's files, a run's parts once
    out.write(
        f"Merged {_count(traces, 'trace')} ({_count(_events(merged), 'event')}, "
        f"{_count(processes, 'process')}) into {args.out}\n"
    )
    return EXIT_OK


def _repair(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    import exporters

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
    state = "cut off; closed after its last complete event" if done.truncated else "complete"
    out.write(f"Wrote {done.path}: {_count(done.events, 'event')} ({args.trace} was {state})\n")
    return EXIT_OK


_COMMANDS: dict[str, Callable[[argparse.Namespace, IO[str], IO[str]], int]] = {
    "run": _run,
    "report": _report,
    "compare": _compare,
    "merge": _merge,
    "repair": _repair,
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
            args = parser.parse_args(join_negative_values(sys.argv[1:] if argv is None else argv))
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
