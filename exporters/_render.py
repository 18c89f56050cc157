"""Small helpers shared by the report and comparison renderers: units and tables."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import pandas as pd

__all__ = [
    "fmt_count",
    "fmt_ns",
    "fmt_pct",
    "json_records",
    "json_value",
    "markdown",
    "md_code",
    "md_text",
    "text_table",
]


def _missing(value: Any) -> bool:
    if value is None or value is pd.NA:
        return True
    try:
        return bool(isinstance(value, float) and math.isnan(value))
    except TypeError:
        return False


def fmt_ns(value: Any) -> str:
    """Nanoseconds in a human unit with three significant digits: ``1.23 ms``."""
    if _missing(value):
        return "–"
    ns = float(value)
    sign = "-" if ns < 0 else ""
    ns = abs(ns)
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale * 0.9995:
            return f"{sign}{_three_digits(ns / scale)} {unit}"
    return f"{sign}{ns:.0f} ns"


def _three_digits(v: float) -> str:
    """``v`` (>= 0.9995) to three significant digits: 9.999 -> ``10.0``."""
    if round(v, 2) < 10:
        return f"{v:.2f}"
    if round(v, 1) < 100:
        return f"{v:.1f}"
    return f"{v:.0f}"


def fmt_pct(value: Any, *, signed: bool = False) -> str:
    """A fraction as a percentage: ``0.1234`` -> ``12.3%`` (``+12.3%`` when signed)."""
    if _missing(value):
        return "–"
    v = float(value) * 100.0
    if math.isinf(v):
        return "+inf%" if v > 0 else "-inf%"
    return f"{v:+.1f}%" if signed else f"{v:.1f}%"


def fmt_count(value: Any) -> str:
    """An integer with thousands separators, ``–`` when missing."""
    if _missing(value):
        return "–"
    return f"{int(value):,}"


def text_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, left: Collection[int] = (0,)
) -> str:
    """An aligned plain-text table; the columns at the positions ``left`` are left-aligned,
    the others (numbers) right-aligned."""
    widths = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(widths[i]) if i in left else c.rjust(widths[i]) for i, c in enumerate(cells)
        ]
        return "  ".join(parts).rstrip()

    out = [line(header), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


_NEWLINES = re.compile(r"\r\n|[\r\n\u2028\u2029\x0b\x0c\x85]")
# characters with a meaning in inline Markdown (CommonMark and GitHub's extensions)
_MD_ESCAPE = re.compile(r"[\\`*\[\]|~]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
_HTML = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def md_text(text: str) -> str:
    """``text`` as inert inline Markdown: no HTML, link, image, emphasis, strike-through,
    code or table cell boundary can come out of it, and it stays on one line.

    ``&``, ``<`` and ``>`` become entities; backslashes, backticks, ``*``, ``[``, ``]``,
    ``|``, ``~`` and ``_`` (unless between letters or digits, where it cannot emphasise)
    are backslash-escaped; line breaks become spaces.
    """
    one_line = _NEWLINES.sub(" ", str(text))
    escaped = _MD_ESCAPE.sub(lambda m: "\\" + m.group(0), one_line)
    return "".join(_HTML.get(ch, ch) for ch in escaped)


def md_code(text: str, *, in_table: bool = True) -> str:
    """``text`` as a Markdown code span: shown verbatim, so nothing in it is markup and
    GitHub does not turn ``@name`` or ``#123`` into mentions or links. The fence is one
    backtick longer than the longest run of backticks inside; line breaks become spaces;
    in a table (``in_table``) pipes are escaped, which GitHub undoes inside code spans."""
    one_line = _NEWLINES.sub(" ", str(text))
    longest = max((len(run) for run in re.findall(r"`+", one_line)), default=0)
    fence = "`" * (longest + 1)
    if one_line.startswith(("`", " ")) or one_line.endswith(("`", " ")) or not one_line:
        one_line = f" {one_line} "
    if in_table:
        one_line = one_line.replace("|", "\\|")
    return f"{fence}{one_line}{fence}"


def markdown(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    left: Collection[int] = (0,),
    code: Collection[int] = (),
) -> str:
    """A GitHub-flavoured Markdown table; the columns at the positions ``left`` are
    left-aligned. Every cell is escaped (:func:`md_text`); the cells of the columns at
    the positions ``code`` (names that come from the traced program) are code spans
    (:func:`md_code`)."""

    def cell(i: int, text: str) -> str:
        return md_code(text) if i in code else md_text(text)

    out = ["| " + " | ".join(md_text(h) for h in header) + " |"]
    out.append("|" + "|".join(":---" if i in left else "---:" for i in range(len(header))) + "|")
    out.extend("| " + " | ".join(cell(i, c) for i, c in enumerate(r)) + " |" for r in rows)
    return "\n".join(out)


def json_value(value: Any) -> Any:
    """A value made JSON-safe: numpy scalars to Python, NaN/NA to ``None``."""
    if _missing(value):
        return None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        v = float(value)
        return v if math.isfinite(v) else None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    return value


def json_records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """A frame as a list of JSON-safe dicts."""
    cols = list(frame.columns)
    return [
        {str(c): json_value(v) for c, v in zip(cols, row, strict=True)}
        for row in frame.itertuples(index=False, name=None)
    ]
