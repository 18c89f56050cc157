"""The option types of the ``ppetrace`` command line: percentages, durations, gates,
counts; the parser with one-line errors, and the exit codes."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_OK",
    "EXIT_REGRESSION",
    "fraction_note",
    "parse_duration_ns",
    "parse_gate",
    "parse_percent",
    "parse_threshold",
]

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (and exit code 2) instead of the usage block.

    ``commands`` holds the parsers of the subcommands (set by ``build_parser``), so
    that an argument left over is reported by its command's parser, with its help."""

    commands: dict[str, argparse.ArgumentParser] = {}  # noqa: RUF012 - replaced, never mutated

    def error(self, message: str) -> NoReturn:
        self.exit(
            EXIT_BAD_INPUT,
            f"{self.prog}: error: {message} (see '{self.prog} --help')\n",
        )


def parse_percent(text: str, *, option: str = "--threshold") -> float:
    """``"5%"`` -> 0.05; a bare fraction (``"0.05"``) is accepted too.

    Raises ``ValueError`` naming ``option`` for anything that is not a
    percentage between 0% and 1000%, and for a bare number of 1 or more (``1``
    could mean 1% or 100%).
    """
    raw = str(text).strip()
    percent = raw.endswith("%")
    try:
        value = float(raw[:-1]) / 100.0 if percent else float(raw)
    except ValueError:
        raise ValueError(
            f"Expected a percentage such as '5%' (or a fraction below 1 such as 0.05) for "
            f"{option}, but received {text!r}."
        ) from None
    if not percent and value >= 1.0:  # '1' is 1% or 100%: too easy to misread either way
        raise ValueError(
            f"Expected a percentage such as '5%' (or a fraction below 1 such as 0.05) for "
            f"{option}, but received {text!r}, which could mean {raw}% or {value:.0%}. "
            f"Write the percent sign: '{raw}%'."
        )
    if value < 0:
        raise ValueError(
            f"Expected a non-negative {option} (it applies to slowdowns and speedups alike), but "
            f"received {text!r}. Pass its size, such as "
            f"{raw.lstrip('-') + ('%' if not percent and value <= -1.0 else '')}."
        )
    if value != value or not (0.0 <= value <= 10.0):
        raise ValueError(f"Expected a {option} between 0% and 1000%, but received {text!r}.")
    return value


def fraction_note(text: str, *, option: str) -> str | None:
    """The line that tells how a bare number given for a percentage option was read (a
    fraction: ``0.5`` is 50%), or None when ``text`` has its percent sign. A gate that is
    ten or a hundred times laxer than meant must not pass silently."""
    raw = str(text).strip()
    if raw.endswith("%"):
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return (
        f"ppetrace: note: {option} {raw} is read as a fraction, {value:.4g} = {value * 100:.4g}%; "
        f"for {raw} percent write '{raw}%'.\n"
    )


def parse_threshold(text: str) -> float:
    """``"5%"`` -> 0.05 for ``--threshold`` (see :func:`parse_percent`)."""
    return parse_percent(text, option="--threshold")


_UNITS = {"ns": 1.0, "us": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9}


def parse_duration_ns(text: str, *, option: str = "--min-effect-abs") -> float:
    """``"1us"`` -> 1000.0: a non-negative duration with a unit (ns, us or µs, ms, s).

    Raises ``ValueError`` naming ``option`` otherwise.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ns|us|µs|ms|s)\s*", text)
    if match is None and re.fullmatch(
        r"\s*-\s*[0-9.]+(?:[eE][-+]?[0-9]+)?\s*(ns|us|µs|ms|s)\s*", text
    ):
        raise ValueError(
            f"Expected a non-negative duration for {option} (it applies to slowdowns and "
            f"speedups alike), but received {text!r}. Pass its size, such as "
            f"{text.strip().lstrip('-').strip()!r}."
        )
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
    kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
        minimum, f"an integer of at least {minimum:,}"
    )

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {kind} for {name}, but received {text!r}")
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
