"""``ppetrace run``: a script or module traced through ``instrument()`` (the command's
options and the run itself live in :mod:`ppetrace.integrations._run`, imported only by
this command: the others run without torch)."""

from __future__ import annotations

import argparse
from typing import IO, Any

from ._io import _BadInput
from ._parse import _add_warmup, _int_at_least

__all__ = ["add_run", "run"]


def add_run(sub: Any) -> None:
    """Add the ``run`` command to the subparsers ``sub``."""
    from ppetrace.integrations._run import add_parser

    add_parser(sub, int_at_least=_int_at_least, add_warmup=_add_warmup)


def run(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from ppetrace.integrations._run import BadRunInput, end_by, options_from
    from ppetrace.integrations._run import run as _run

    try:
        result = _run(options_from(args), err=err)
    except BadRunInput as exc:
        raise _BadInput(str(exc)) from None
    return end_by(result)  # the script's exit code, or its signal
