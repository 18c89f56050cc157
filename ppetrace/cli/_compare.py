"""``ppetrace compare BASE CAND``: candidate runs against baseline runs, with a gate."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import IO, Any

from exporters._defaults import (
    DEFAULT_ALPHA,
    DEFAULT_GATE,
    DEFAULT_MIN_EFFECT,
    DEFAULT_MIN_EFFECT_NS,
    DEFAULT_NOISE_FLOOR,
    DEFAULT_THRESHOLD,
)

from ._html import add_html_option, write_html
from ._inputs import _read_frame, _trace_paths
from ._io import _BadInput, _emit, _write
from ._parse import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_REGRESSION,
    _add_warmup,
    _alpha,
    _int_at_least,
    fraction_note,
    parse_duration_ns,
    parse_gate,
    parse_percent,
    parse_threshold,
)

__all__ = ["add_compare", "compare"]

_COMPARE_DOC = """\
Compare the runs of a candidate with the runs of a baseline, event by event.

Each run gives one number per event, the median of its per-step samples (an
event's total time in a step: per step, where the report's figures are per
call); runs are the samples, because every run has its own offset, and copies
of one run's file count once. With one run per side the change is judged
against the noise floor (the run-to-run CV of the median step); with three
runs or more in all, against the runs' own scatter where that is larger. A
verdict needs a significant change (Holm over the gated events) beyond the
threshold and beyond the minimum effect. Only gated events (default:
trainer.step and step.wall) can fail: exit code 1. A gated change beyond the
threshold that is not significant is shown inconclusive. A comparison in which
no gated event has enough steps on both sides to decide (a candidate that
ended early, a cut-off trace, a warmup as long as the run) cannot fail, so it
exits with 2 unless --allow-no-verdict. So does a comparison with a run that
failed (its fit raised, a step ended with an error, or its trace is cut off),
unless --allow-failed-runs: steps up to a crash are no measure of the code's
speed. Each field of the recorded environment that differs is named in a
warning (exit code 2 with --strict-env).

Examples:
  ppetrace compare base.json cand.json
  ppetrace compare runs/base runs/cand --format md -o comment.md
  ppetrace compare 'runs/base-*.json' 'runs/cand-*.json' --gate all
"""


def add_compare(sub: Any) -> None:
    """Add the ``compare`` command to the subparsers ``sub``."""
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
    comp.add_argument(
        "--allow-no-verdict",
        action="store_true",
        help="exit with 0 when no gated event can be decided (default: 2, as such a "
        "comparison cannot catch a regression)",
    )
    comp.add_argument(
        "--allow-failed-runs",
        action="store_true",
        help="decide on runs that failed (a fit that raised, an ERROR step, a cut-off "
        "trace) as on any other (default: exit with 2, as their steps do not stand for "
        "the code's speed)",
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


def _summaries(
    spec: str,
    label: str,
    warmup: int,
    err: IO[str],
    rank: int | None = None,
    identities: set[Any] | None = None,
) -> list[Any]:
    """One RunSummary per run: the files of one run (rank files sharing a trace id) count
    as one, and a copy of a file counts once. ``identities`` gets each file's
    ``exporters.run_identity``."""
    import exporters

    frames = [_read_frame(path, err) for path in _trace_paths(spec, label, err)]
    if identities is not None:
        identities.update(filter(None, map(exporters.run_identity, frames)))
    frames, copies = exporters.drop_copies(frames)
    for copy, original in copies:
        _write(
            err,
            f"ppetrace: warning: {label}: {copy} is a copy of {original} (the same run: trace "
            "id, rank, process, start and spans; or a rank file that merged trace holds); it "
            "counts once, as one run can only be one sample.\n",
        )
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
    """A warning's text when BASE and CAND share trace files: ``"are the same file x.json,
    so they can only match"`` (``"... N files ..."``), ``"share ..."`` for some of them;
    else ``""``."""
    files = [sorted({Path(p).resolve() for p in _trace_paths(s, "")}) for s in (base, candidate)]
    if files[0] == files[1]:
        same = f"file {base}" if len(files[0]) == 1 else f"{len(files[0])} files"
        return f"are the same {same}, so they can only match"
    shared = sorted(set(files[0]) & set(files[1]))
    if not shared:
        return ""
    names = ", ".join(str(p) for p in shared[:3]) + (", ..." if len(shared) > 3 else "")
    return (
        f"share {len(shared)} run{'s' if len(shared) != 1 else ''} ({names}): the same run on "
        "both sides makes them look alike"
    )


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


def compare(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    import exporters

    options = _compare_options(args)
    if options["noise_floor"] > 1.0 or options["min_effect"] > 1.0:
        raise _BadInput(
            "Expected --noise-floor and --min-effect of at most 100%, but received "
            f"{args.noise_floor} and {args.min_effect}."
        )
    for option, text in (
        ("--threshold", args.threshold),
        ("--noise-floor", args.noise_floor),
        ("--min-effect", args.min_effect),
    ):
        note = fraction_note(text, option=option)
        if note is not None:
            _write(err, note)
    sides: tuple[set[Any], set[Any]] = (set(), set())
    base = _summaries(args.base, "BASE", args.warmup, err, args.rank, sides[0])
    candidate = _summaries(args.candidate, "CAND", args.warmup, err, args.rank, sides[1])
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
    shared = len(sides[0] & sides[1])
    if not same and shared:  # copies of one recording under other names
        same = (
            f"share {shared} run{'s' if shared != 1 else ''} (copies of one recording under "
            "other names): the same run on both sides makes them look alike"
        )
    if same:
        _write(err, f"ppetrace: warning: BASE and CAND {same}.\n")
    if args.fmt != "table" or args.output is not None:  # the table shows them itself
        for warning in comparison.environment_warnings:
            _write(err, f"ppetrace: warning: {warning}\n")
    _emit(exporters.render_comparison(comparison, args.fmt), args.output, out)
    if args.output is not None:
        verdict = (
            "a run failed"
            if comparison.runs_failed and not args.allow_failed_runs
            else "gated regression"
            if comparison.has_regression
            else "no gated regression"
        )
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
            f"{n} environment field{'s differ' if n != 1 else ' differs'} ("
            + "; ".join(comparison.environment_warnings)
            + "). Run both sides on the same machine and settings, or drop --strict-env.\n",
        )
        return EXIT_BAD_INPUT
    if comparison.runs_failed and not args.allow_failed_runs:
        lines = [
            f"{side}: {line}" for side, runs in comparison.failed_runs.items() for line in runs
        ]
        _write(
            err,
            "ppetrace compare: error: Expected runs that ended without an error, but "
            + ("this one" if len(lines) == 1 else f"these {len(lines)}")
            + " failed ("
            + "; ".join(lines)
            + "). Steps up to a failure are no measure of the code's speed, so the "
            "comparison is no verdict. Fix the failure and record the run again, or pass "
            "--allow-failed-runs to decide on the steps they ran.\n",
        )
        return EXIT_BAD_INPUT
    if not comparison.decided and not args.allow_no_verdict:
        gated = ", ".join(comparison.gated) or "none of the gated events is in both runs"
        _write(
            err,
            "ppetrace compare: error: Expected at least one gated event with enough steps in "
            f"both runs to decide on, but there is none ({gated}; see the notes above), so "
            "this comparison cannot catch a regression. Check that the candidate ran to the "
            "end, lower --warmup, or choose --gate; --allow-no-verdict accepts it.\n",
        )
        return EXIT_BAD_INPUT
    return EXIT_REGRESSION if comparison.has_regression else EXIT_OK
