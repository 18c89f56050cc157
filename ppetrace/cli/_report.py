"""``ppetrace report TRACE``: where each training step's time goes."""

from __future__ import annotations

import argparse
from typing import IO, Any

from ._html import add_html_option, write_html
from ._inputs import _read_frame
from ._io import _emit
from ._parse import EXIT_OK, _add_warmup, _int_at_least

__all__ = ["add_report", "report"]

_REPORT_DOC = (
    "Print where each training step's time goes: per event count, total, mean, "
    "p50/p90/p99, max, self time and share of step time; per step wall time, data "
    "wait, compute and other; throughput."
)


def add_report(sub: Any) -> None:
    """Add the ``report`` command to the subparsers ``sub``."""
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


def report(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    import exporters

    frame = _read_frame(args.trace, err)
    report = exporters.step_report(frame, warmup_steps=args.warmup)
    _emit(exporters.render(report, args.fmt, top=args.top), args.output, out)
    if args.output is not None:
        err.write(f"ppetrace: wrote {args.output}\n")
    write_html(args.html, lambda: exporters.render_html(report), err)
    return EXIT_OK
