"""Command-line arguments argparse would misread: a negative value such as ``-5%`` after
an option that takes a value is taken as an option of its own."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["join_negative_values"]

#: ``compare``'s options whose value may be written as a negative number.
VALUE_OPTIONS = ("--threshold", "--noise-floor", "--min-effect", "--min-effect-abs")
_NEGATIVE = re.compile(r"-\.?[0-9]")


def join_negative_values(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``compare --threshold -5%`` written as ``--threshold=-5%`` (for each
    of :data:`VALUE_OPTIONS`), so that the option's own parser can refuse the value in a
    sentence; anything else (other commands, such as ``run``'s script arguments) is
    unchanged."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command != "compare":
        return list(argv)
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        if arg in VALUE_OPTIONS and i + 1 < len(argv) and _NEGATIVE.match(argv[i + 1]):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out
