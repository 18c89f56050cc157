"""``ppetrace run``: run a script or module as ``__main__`` under :func:`instrument`.

Takes in: a script path or a module name (``-m``), its arguments and the run
options (parsed by :mod:`ppetrace.cli`). It runs the target as ``python
script.py`` / ``python -m module`` would (``sys.argv``, ``sys.path[0]``,
``__main__``), writes the trace when the target ends, also when it raises, is
interrupted (Ctrl-C) or terminated (SIGTERM), prints the step report to
stderr and returns the target's own exit code. A signal is re-raised once the
trace is written, so the caller sees the process end by it, as without
ppetrace. Under torchrun each rank writes ``<trace>.ranks/rank<R>.json``
(:mod:`._ranks`); once the script has started its process group, the ranks
share rank 0's trace id and measure their clocks, and at its end rank 0 merges
the rank files into ``<trace>`` (:mod:`._run_ranks`); rank 0 alone says so and
prints its report, the other ranks say where their file is. No process group is
ever created here.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

from ._ranks import RankInfo, rank_info, rank_trace_path

__all__ = [
    "BadRunInput",
    "RunOptions",
    "RunResult",
    "add_parser",
    "default_trace_path",
    "reserve_trace_path",
    "end_by",
    "options_from",
    "run",
]

PROFILES = ("pyinstrument", "torch")


class BadRunInput(Exception):
    """Input that ``ppetrace run`` refuses before running anything (one line, exit 2)."""


class _Terminated(BaseException):
    """Raised in the main thread by SIGTERM, so that the trace gets written."""

    __qualname__ = "Terminated"  # the broken-off step's error text: "Terminated: ..."


@dataclass
class RunOptions:
    """What ``ppetrace run`` was asked to do (see ``ppetrace run --help``)."""

    script: str | None = None
    module: str | None = None
    args: list[str] = field(default_factory=list)
    trace: str | None = None
    report: bool = True
    module_depth: int = 1
    warmup: int = 1
    profile: list[str] = field(default_factory=list)
    schedule: str | None = None
    #: ``--detail``: "auto", "all" or N (one step in N in full, from the start)
    detail: str = "auto"
    #: ``--max-trace-bytes`` (None: instrument()'s default, about 1 GB)
    max_trace_bytes: int | None = None


RUN_DOC = (
    "Run a Python script (or -m module) as __main__ with every DataLoader fetch, outer "
    "module call, backward and optimizer step traced, no code changes. Writes the Chrome "
    "trace when the script ends (also on an exception, Ctrl-C or SIGTERM), prints the step "
    "report to stderr and exits with the script's exit code. Options go before the script (or -m "
    "MODULE); everything after it is the script's, untouched."
)


def add_parser(
    sub: Any,
    *,
    int_at_least: Callable[[int, str], Callable[[str], int]],
    add_warmup: Callable[[argparse.ArgumentParser], None],
) -> argparse.ArgumentParser:
    """Add the ``run`` command to the ``ppetrace`` command's subparsers ``sub``, with the
    command line's own option types (``int_at_least(minimum, name)``, ``add_warmup``)."""
    run = sub.add_parser(
        "run",
        help="run a script or module traced (no code changes)",
        description=RUN_DOC,
        usage="ppetrace run [options] (script.py | -m module) [args ...]",
    )
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m")
    run.add_argument(
        "--trace",
        metavar="PATH",
        help="the trace to write (default: ppetrace-<script>-<timestamp>.json)",
    )
    run.add_argument("--no-report", dest="report", action="store_false", help="no step report")
    run.add_argument(
        "--module-depth",
        type=int_at_least(0, "--module-depth"),
        default=1,
        metavar="N",
        help="trace module calls down to this depth (1: outermost, 0: none; default: 1)",
    )
    add_warmup(run)
    run.add_argument(
        "--profile",
        action="append",
        choices=PROFILES,
        default=[],
        help="add a deep profiler on a schedule (repeat for both)",
    )
    run.add_argument(
        "--schedule",
        metavar="W,WU,A,R",
        help="the profilers' schedule: wait,warmup,active,repeat steps (default: 0,1,3,1)",
    )
    run.add_argument(
        "--detail",
        default="auto",
        metavar="all|auto|N",
        help="which steps keep every span: 'auto' every step until the trace holds "
        "--max-trace-bytes, then 1 step in 1,000 (the others keep their step spans and "
        "each hook's count, total and self time); 'all' every step; N: 1 step in N from "
        "the start (default: auto)",
    )
    run.add_argument(
        "--max-trace-bytes",
        type=int_at_least(1, "--max-trace-bytes"),
        default=None,
        metavar="BYTES",
        help="the trace size at which --detail auto switches (default: 1000000000)",
    )
    run.add_argument(
        "target", nargs=argparse.REMAINDER, metavar="script.py [args ...]", help=argparse.SUPPRESS
    )
    # argparse would read the script's options as ours (-m x --epochs 1): split first
    parse = run.parse_known_args

    def parse_known_args(
        args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ours, target = split_target(run, sys.argv[1:] if args is None else list(args))
        parsed, rest = parse(ours, namespace)
        parsed.target = target
        return parsed, rest

    setattr(run, "parse_known_args", parse_known_args)  # noqa: B010 (mypy: no method-assign)
    return run


def split_target(parser: argparse.ArgumentParser, args: list[str]) -> tuple[list[str], list[str]]:
    """``ppetrace run``'s ``args`` split into its own options (up to ``-m MODULE``
    included) and the target's: the script path and everything after it, or everything
    after ``-m MODULE``, untouched. A ``--`` before the target ends the options and is
    dropped; one after it is the script's."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return args[:i], args[i + 1 :]
        if arg == "-m":
            return args[: i + 2], args[i + 2 :]
        if arg.startswith("-m") and not arg.startswith("--"):  # -mMODULE
            return args[: i + 1], args[i + 1 :]
        if not arg.startswith("-") or arg == "-":
            return args[:i], args[i:]
        i += 1
        name = arg.split("=", 1)[0]
        names = [n for n in parser._option_string_actions if n.startswith(name)]
        action = parser._option_string_actions.get(name)
        if action is None and len(names) == 1:  # an abbreviation, as argparse allows
            action = parser._option_string_actions[names[0]]
        if action is not None and action.nargs != 0 and "=" not in arg:
            i += 1  # its value
    return args, []


def options_from(args: argparse.Namespace) -> RunOptions:
    """The :class:`RunOptions` of a parsed ``ppetrace run`` command line."""
    rest = list(args.target)
    if args.module is not None:
        script, script_args = None, rest
    else:
        script, script_args = (rest[0], rest[1:]) if rest else (None, [])
    return RunOptions(
        script=script,
        module=args.module,
        args=script_args,
        trace=args.trace,
        report=args.report,
        module_depth=args.module_depth,
        warmup=args.warmup,
        profile=list(args.profile),
        schedule=args.schedule,
        detail=args.detail,
        max_trace_bytes=args.max_trace_bytes,
    )


@dataclass(frozen=True)
class RunResult:
    """How the target ended: its exit ``code``, the ``signal`` that ended it (SIGINT for
    Ctrl-C, SIGTERM) or None, and the ``trace`` written."""

    code: int
    signal: int | None
    trace: Path


def end_by(result: RunResult) -> int:
    """End this process as the target ended: by its signal (re-raised with the default
    handler, so the caller sees the process end by it), else return its exit code."""
    if result.signal is not None:
        sys.stderr.flush()
        signal.signal(result.signal, signal.SIG_DFL)
        os.kill(os.getpid(), result.signal)
    return result.code


def default_trace_path(
    target: str, ranks: RankInfo | None, now: _dt.datetime | None = None
) -> Path:
    """``ppetrace-<script stem>-<YYYYmmdd-HHMMSS>.json`` in the working directory. Under
    torchrun the ranks must agree on one name: the run id replaces the time."""
    stem = Path(target).stem if target.endswith(".py") else target.rsplit(".", 1)[-1]
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in stem) or "script"
    if ranks is not None:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID") or ""
        tag = run_id if run_id and run_id != "none" else f"ppid{os.getppid()}"
    else:
        tag = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return Path(f"ppetrace-{stem}-{tag}.json")


def reserve_trace_path(path: Path) -> Path:
    """The default trace path, taken atomically (an empty file made with ``O_EXCL``): when
    another run started in the same second has it, the name with this process's id."""
    pid = os.getpid()
    for candidate in (path, path.with_name(f"{path.name[: -len('.json')]}-{pid}.json")):
        try:
            fd = os.open(candidate, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            continue
        except OSError:
            return candidate  # a folder that cannot be written: said when the trace is
        os.close(fd)
        return candidate
    return path.with_name(f"{path.name[: -len('.json')]}-{pid}-{time.time_ns()}.json")


def _schedule(text: str | None) -> Any:
    from ..profilers import Schedule

    if text is None:
        return Schedule()
    parts = [p.strip() for p in text.split(",")]
    try:
        wait, warmup, active, repeat = (int(p) for p in parts)
    except ValueError:
        raise BadRunInput(
            "Expected --schedule as four integers wait,warmup,active,repeat (e.g. 1,1,3,1), "
            f"but received {text!r}."
        ) from None
    try:
        return Schedule(wait=wait, warmup=warmup, active=active, repeat=repeat)
    except (TypeError, ValueError) as exc:
        raise BadRunInput(
            f"Expected a valid --schedule wait,warmup,active,repeat, but {text!r} is not: "
            f"{str(exc).rstrip('.')}. Give wait, warmup and repeat >= 0 and active >= 1, "
            "e.g. 1,1,3,1."
        ) from None


def _detail(opts: RunOptions) -> dict[str, Any]:
    """``instrument()``'s ``trace_detail`` and ``max_trace_bytes`` for ``--detail`` and
    ``--max-trace-bytes``."""
    from ..profilers import Schedule

    out: dict[str, Any] = {}
    if opts.max_trace_bytes is not None:
        out["max_trace_bytes"] = opts.max_trace_bytes
    text = opts.detail.strip()
    if opts.max_trace_bytes is not None and text != "auto":
        raise BadRunInput(
            f"Expected --max-trace-bytes only with --detail auto (the size at which it "
            f"switches to windows), but received --detail {opts.detail}, which does not "
            "switch. Leave out one of the two options."
        )
    if text in ("auto", "all"):
        out["trace_detail"] = text
        return out
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise BadRunInput(
            f"Expected --detail all, auto or a positive integer N (1 step in N with every "
            f"span), but received {opts.detail!r}. Pass --detail all to keep every span."
        )
    out["trace_detail"] = Schedule(wait=n - 1, warmup=0, active=1, repeat=0)
    return out


def _profilers(opts: RunOptions) -> list[Any]:
    if opts.schedule is not None and not opts.profile:
        raise BadRunInput(
            "Expected --profile pyinstrument or --profile torch with --schedule, but received "
            "--schedule alone. Add the profiler that the schedule is for."
        )
    if not opts.profile:
        return []
    schedule = _schedule(opts.schedule)
    from ..profilers import Pyinstrument, TorchProfiler

    kinds = {"pyinstrument": Pyinstrument, "torch": TorchProfiler}
    return [kinds[name](schedule=schedule) for name in dict.fromkeys(opts.profile)]


def _check_target(opts: RunOptions) -> tuple[str, str]:
    """("script", absolute path) or ("module", name); bad input raises :class:`BadRunInput`."""
    if opts.module is not None:
        name = opts.module
        saved = sys.path[0] if sys.path else None
        _set_path0(os.getcwd())  # as python -m: the module is found from here
        try:
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.submodule_search_locations is not None:
                spec = importlib.util.find_spec(name + ".__main__")
                if spec is None:
                    raise BadRunInput(
                        f"Expected a module or a package with a __main__ module for -m, but "
                        f"{name!r} is a package without one. Name its module, e.g. -m {name}.train."
                    )
        except BadRunInput:
            raise
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if missing and (name == missing or name.startswith(missing + ".")):
                spec = None  # the module itself, or its package, is missing
            else:
                raise BadRunInput(_import_failed(name, exc)) from None
        except Exception as exc:
            raise BadRunInput(_import_failed(name, exc)) from None
        finally:
            if saved is not None:
                sys.path[0] = saved
        if spec is None:
            raise BadRunInput(
                f"Expected an importable module for -m, but no module named {name!r} was found. "
                "Check the name, the working directory and that its package is installed."
            )
        return "module", name
    if opts.script is None:
        raise BadRunInput(
            "Expected a script to run (ppetrace run [options] script.py [args...]) or -m "
            "module, but received neither. Name the script, or -m and a module, after the "
            "options."
        )
    path = Path(opts.script)
    if not path.exists():
        raise BadRunInput(
            f"Expected a Python script at {opts.script}, but no such file exists. Check the "
            f"path; a relative one starts at the working directory, {os.getcwd()}."
        )
    if path.is_dir() and not (path / "__main__.py").is_file():
        raise BadRunInput(
            f"Expected a Python script at {opts.script}, but it is a folder without "
            "__main__.py. Name the script inside it, or add a __main__.py."
        )
    return "script", str(path.resolve())


def _import_failed(name: str, exc: BaseException) -> str:
    message = " ".join(str(exc).split()).rstrip(".")
    return (
        f"Expected an importable module for -m, but importing {name!r} failed: "
        f"{type(exc).__name__}: {message}. Fix the error that importing it raises."
    )


def run(opts: RunOptions, *, err: IO[str] | None = None) -> RunResult:
    """Run ``opts``'s target under :func:`instrument` and write the trace; return how it
    ended (:func:`end_by` ends the process the same way). Bad input raises
    :class:`BadRunInput` before anything runs."""
    err = sys.stderr if err is None else err
    profilers = _profilers(opts)
    detail = _detail(opts)
    kind, target = _check_target(opts)
    try:
        ranks = rank_info()
    except ValueError as exc:
        raise BadRunInput(str(exc)) from None
    # absolute now: the script may change the working directory (os.chdir, Hydra)
    if opts.trace:
        given = Path(os.path.abspath(opts.trace))  # (absolute and without "..")
    else:
        given = default_trace_path(opts.module or target, ranks).absolute()
        if ranks is None:
            given = reserve_trace_path(given)
    if given.is_dir():
        raise BadRunInput(
            f"Expected a file path for --trace, but {given} is a folder. Pass a file path "
            f"such as {given / 'trace.json'}."
        )
    # instrument() puts a rank's spans in its own file: this one
    trace = given if ranks is None else rank_trace_path(given, ranks.rank)
    rank0 = ranks is None or ranks.rank == 0
    try:
        trace.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadRunInput(
            f"Expected a folder for the trace that can be created, but making {trace.parent} "
            f"failed: {exc.strerror or exc}. Pass --trace with a path in a folder you can "
            "write to."
        ) from None

    from ._instrument import instrument

    handle = instrument(
        trace_path=given, module_depth=opts.module_depth, profilers=profilers, **detail
    )
    ranked = None
    if ranks is not None and ranks.world_size > 1:
        from ._run_ranks import RankRun

        ranked = RankRun(handle, given)
        ranked.install()
    code, sig, failure = 0, None, None
    try:
        code, sig, failure = _execute(kind, target, opts.args, err)
        if ranked is not None and code == 0 and sig is None:
            ranked.finish()  # the group is still alive: rank 0 merges now
    finally:
        try:
            if ranked is not None:
                ranked.uninstall()
            handle.close(failure, exit_code=code)  # the step it broke off: ERROR
        finally:
            err.write(f"ppetrace: wrote {trace}\n")
            if ranked is not None and ranked.merged_written and rank0:  # rank 0 merged
                err.write(f"ppetrace: merged the rank traces into {given}\n")
            err.flush()
    if opts.report and rank0:
        _print_report(
            given if ranked is not None and ranked.merged_written else trace, opts.warmup, err
        )
    return RunResult(code, sig, trace)


def _execute(
    kind: str, target: str, args: Sequence[str], err: IO[str]
) -> tuple[int, int | None, BaseException | None]:
    """Run the target as ``__main__``; return (exit code, signal that ended it or None,
    the exception that ended it or None: not ``sys.exit``)."""
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    old_term: Any = None
    if threading.current_thread() is threading.main_thread():
        # in front of ppetrace.tracing's own (which flushes and ends the process at once):
        # the script unwinds, the open step ends, the trace is written, then the process
        # ends by the signal (end_by)
        old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if kind == "script":
            sys.argv = [target, *args]
            folder = target if os.path.isdir(target) else os.path.dirname(target)
            _set_path0(folder)
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = [target, *args]  # runpy puts the module's file in argv[0]
            _set_path0(os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        return 0, None, None
    except SystemExit as exc:
        return _exit_code(exc.code, err), None, None
    except KeyboardInterrupt as exc:
        _print_exception(exc, err)
        return 130, signal.SIGINT, exc
    except _Terminated as exc:
        err.write("ppetrace: terminated (SIGTERM)\n")
        return 143, signal.SIGTERM, exc
    except BaseException as exc:
        _print_exception(exc, err)
        return 1, None, exc
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated("the process got SIGTERM")


def _set_path0(folder: str) -> None:
    if sys.path:
        sys.path[0] = folder
    else:
        sys.path.append(folder)


def _exit_code(code: Any, err: IO[str]) -> int:
    """``sys.exit(code)`` as Python ends a process with it (a message is printed)."""
    from ._instrument import _exit_status  # the status the OS keeps: 256 is 0

    if code is not None and not isinstance(code, int):
        err.write(f"{code}\n")
    return _exit_status(code)


def _print_exception(exc: BaseException, err: IO[str]) -> None:
    """The traceback as Python prints it for the script, without runpy's and our frames."""
    tb: TracebackType | None = exc.__traceback__
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__ or "runpy")}
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename != "<frozen runpy>" and os.path.abspath(filename) not in ours:
            break
        tb = tb.tb_next
    err.write("".join(traceback.format_exception(type(exc), exc, tb)))
    err.flush()


def _print_report(trace: Path, warmup: int, err: IO[str]) -> None:
    """The step report of the written trace, to ``err``; a failure is one line."""
    import warnings

    try:
        import exporters

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", exporters.TraceTruncatedWarning)
            frame = exporters.read_chrome_trace(trace)
        if len(frame) == 0:
            err.write(
                "ppetrace: no spans were recorded (no DataLoader, module, backward or "
                "optimizer step ran).\n"
            )
            return
        report = exporters.step_report(frame, warmup_steps=warmup)
        err.write(exporters.render(report, "table"))
    except Exception as exc:  # the script's exit code stands; say why there is no report
        err.write(f"ppetrace: no report: {type(exc).__name__}: {exc}\n")
    err.flush()
