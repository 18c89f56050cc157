"""The ``ppetrace`` command: its parser, its commands and :func:`main`."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import IO

from ppetrace._version import __version__

from ._args import join_negative_values
from ._compare import add_compare, compare
from ._files import add_merge_and_repair, merge, repair
from ._io import _BadInput, _write
from ._memory import keep_freed_memory
from ._parse import EXIT_BAD_INPUT, _Parser
from ._report import add_report, report
from ._run import add_run, run

__all__ = ["build_parser", "main"]


def build_parser() -> _Parser:
    """The argument parser of the ``ppetrace`` command."""
    parser = _Parser(
        prog="ppetrace",
        description="Run a script traced; report on, compare and merge ppetrace Chrome traces.",
        epilog="Exit codes: 0 ok, 1 gated regression (compare), 2 bad input; run: the script's.",
    )
    parser.add_argument("--version", action="version", version=f"ppetrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    add_run(sub)
    add_report(sub)
    add_compare(sub)
    add_merge_and_repair(sub)
    parser.commands = dict(sub.choices)
    return parser


_COMMANDS: dict[str, Callable[[argparse.Namespace, IO[str], IO[str]], int]] = {
    "run": run,
    "report": report,
    "compare": compare,
    "merge": merge,
    "repair": repair,
}


#: the commands that read traces and exit, for which :func:`keep_freed_memory` pays
_READING = frozenset({"report", "compare", "merge"})


def main(
    argv: Sequence[str] | None = None,
    *,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run the ``ppetrace`` command with ``argv`` (default: ``sys.argv[1:]``); return the
    exit code. ``stdout``/``stderr`` default to the process's streams. Run as the
    process's own command (``argv`` None), ``report``, ``compare`` and ``merge`` first
    tune glibc's allocator for reading (:mod:`ppetrace.cli._memory`)."""
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    parser = build_parser()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            args, extra = parser.parse_known_args(
                join_negative_values(sys.argv[1:] if argv is None else argv)
            )
            if extra:  # reported by the command's own parser, which points to its help
                command = parser.commands.get(args.command or "", parser)
                hint = ""
                if args.command == "report" and not extra[0].startswith("-"):  # a 2nd trace
                    hint = (
                        "; report reads one trace (a run's parts are found from its first): "
                        "to set two traces side by side, use ppetrace compare BASE NEW"
                    )
                if args.command == "compare" and not extra[0].startswith("-"):  # a glob
                    hint = (
                        "; compare takes one BASE and one CAND: quote a glob so that ppetrace "
                        "expands it ('base/*.json'), or give a folder of runs"
                    )
                command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    except SystemExit as exc:  # --help, --version or a usage error
        code = exc.code
        return code if isinstance(code, int) else EXIT_BAD_INPUT
    if args.command is None:
        parser.print_help(out)
        return EXIT_BAD_INPUT
    if argv is None and args.command in _READING:  # this process is the command: it exits
        keep_freed_memory()
    try:
        try:
            code = _COMMANDS[args.command](args, out, err)
            if argv is None:  # a reader that went away (| head) is found here, not at exit
                out.flush()
            return code
        except _BadInput as exc:
            _write(err, f"ppetrace {args.command}: error: {exc}\n")
            return EXIT_BAD_INPUT
        except KeyboardInterrupt:
            err.write("ppetrace: interrupted\n")
            return 130
        except BrokenPipeError:
            raise
        except Exception as exc:  # last resort: one line, and never exit 1 ("regression")
            message = " ".join(str(exc).split()) or "(no message)"
            _write(err, f"ppetrace: error: {type(exc).__name__}: {message}\n")
            return EXIT_BAD_INPUT
    except BrokenPipeError:  # never exit 1 ("regression") for a closed pipe
        return _pipe_closed()


#: the exit code for output that nobody reads any more: as a process that SIGPIPE ended
EXIT_PIPE = 128 + 13


def _pipe_closed() -> int:
    """The reader of our output went away: point stdout and stderr at /dev/null, so that
    the interpreter's last flush says nothing, and return :data:`EXIT_PIPE`."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(devnull, stream.fileno())
    os.close(devnull)
    return EXIT_PIPE
