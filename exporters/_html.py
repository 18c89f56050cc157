"""The frame of the HTML pages: one self-contained file with plotly.js inlined.

A :class:`Page` collects headings, paragraphs, tables and charts (plotly.js
figure specs as plain dicts) and :meth:`Page.html` writes one document: the
plotly.js bundle of the installed ``plotly`` package and every figure's data
inline, and a Content-Security-Policy that allows no request of any kind
(``default-src 'none'``), so the page works offline and a browser refuses to
fetch anything for it. Text from traces (event names, paths) is escaped.
"""

from __future__ import annotations

import html
import importlib.util
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["HTML_EXTRA_HINT", "HtmlDependencyError", "Page", "plotly_js", "to_json"]

#: How to get plotly, named in the error when it is missing.
HTML_EXTRA_HINT = "pip install 'ppetrace[html]'"

_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; img-src data: blob:; font-src data:"
)

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.5rem auto;
max-width:1200px;color:#222;padding:0 1rem}
h1{font-size:1.5rem}h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0}
th,td{padding:.2rem .6rem;border-bottom:1px solid #eee;text-align:right;white-space:nowrap}
th:first-child,td:first-child{text-align:left}th{background:#f6f6f6}
.chart{width:100%;height:420px}.note{color:#555;font-size:.9rem}
.hint{background:#fff6d6;padding:.4rem .6rem;border-left:4px solid #e0b000}
.verdict-regression{color:#b00020;font-weight:600}
.verdict-improvement{color:#1b7f3b;font-weight:600}
dl{display:grid;grid-template-columns:max-content auto;gap:.2rem 1rem}dt{color:#555}dd{margin:0}
"""


class HtmlDependencyError(ImportError):
    """plotly (the ``html`` extra) is not installed."""


def plotly_js() -> str:
    """The plotly.js bundle of the installed ``plotly`` package (read from its
    ``package_data``, without importing plotly)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or spec.origin is None:
        raise HtmlDependencyError(
            "Expected the plotly package for HTML pages, but it is not installed; "
            f"install it with: {HTML_EXTRA_HINT}"
        )
    bundle = Path(spec.origin).parent / "package_data" / "plotly.min.js"
    try:
        return bundle.read_text(encoding="utf-8")
    except OSError as exc:
        raise HtmlDependencyError(
            f"Expected plotly's JavaScript bundle at {bundle}, but it cannot be read "
            f"({exc.strerror or exc}); reinstall plotly with: {HTML_EXTRA_HINT}"
        ) from None


def esc(text: Any) -> str:
    """``text`` as HTML text (quotes too)."""
    return html.escape(str(text), quote=True)


def to_json(value: Any) -> str:
    """``value`` as compact JSON: arrays and lists of numbers written in bulk, NaN and
    infinities as ``null``, floats to 6 significant digits (the page's size)."""
    if isinstance(value, dict):
        pairs = ",".join(f"{json.dumps(str(k))}:{to_json(v)}" for k, v in value.items())
        return "{" + pairs + "}"
    if isinstance(value, np.ndarray) and value.dtype.kind in "fiu":
        return _numbers(value.astype(float, copy=False).ravel().tolist())
    if isinstance(value, (list, tuple, np.ndarray)):
        items = list(value)
        if all(type(v) in (float, int) for v in items):
            return _numbers(items)
        return "[" + ",".join(to_json(v) for v in items) + "]"
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return _numbers([float(value)])[1:-1]
    if value is None:
        return "null"
    return json.dumps(str(value))


def _numbers(values: list[Any]) -> str:
    return "[" + ",".join(f"{v:.6g}" if math.isfinite(v) else "null" for v in values) + "]"


class Page:
    """An HTML document under construction (see the module doc)."""

    def __init__(self, title: str) -> None:
        self.title = title
        self._body: list[str] = [f"<h1>{esc(title)}</h1>"]
        self._figures: dict[str, dict[str, Any]] = {}

    def heading(self, text: str) -> None:
        self._body.append(f"<h2>{esc(text)}</h2>")

    def paragraph(self, text: str, *, cls: str = "note") -> None:
        self._body.append(f'<p class="{cls}">{esc(text)}</p>')

    def facts(self, items: Sequence[tuple[str, str]]) -> None:
        """A two-column list of ``(label, value)``."""
        rows = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in items)
        self._body.append(f"<dl>{rows}</dl>")

    def table(
        self,
        header: Sequence[str],
        rows: Sequence[Sequence[str]],
        *,
        row_classes: Sequence[str] | None = None,
        table_id: str | None = None,
    ) -> None:
        head = "".join(f"<th>{esc(h)}</th>" for h in header)
        body = []
        for i, row in enumerate(rows):
            cls = f' class="{esc(row_classes[i])}"' if row_classes and row_classes[i] else ""
            body.append(f"<tr{cls}>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>")
        ident = f' id="{esc(table_id)}"' if table_id else ""
        self._body.append(f"<table{ident}><thead><tr>{head}</tr></thead><tbody>")
        self._body.append("".join(body) + "</tbody></table>")

    def chart(
        self,
        chart_id: str,
        data: list[dict[str, Any]],
        layout: dict[str, Any],
        *,
        height: int = 420,
    ) -> None:
        """A plotly.js figure drawn into ``<div id=chart_id>``."""
        full = {"margin": {"t": 50, "r": 20, "b": 50, "l": 60}, **layout}
        self._figures[chart_id] = {"data": data, "layout": full}
        self._body.append(
            f'<div id="{esc(chart_id)}" class="chart" style="height:{int(height)}px"></div>'
        )

    def html(self) -> str:
        """The document: one file, plotly.js and the data inline, no request allowed."""
        figures = to_json(self._figures).replace("</", "<\\/")  # never closes the script element
        script = (
            "const FIGURES=" + figures + ";\n"
            "for (const [id, fig] of Object.entries(FIGURES)) {\n"
            "  Plotly.newPlot(id, fig.data, fig.layout,"
            " {displaylogo: false, responsive: true});\n"
            "}\n"
        )
        js = plotly_js().replace("</script", "<\\/script")
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
            f"<title>{esc(self.title)}</title>\n<style>{_STYLE}</style>\n"
            f"<script>{js}</script>\n</head><body>\n"
            + "\n".join(self._body)
            + f"\n<script>\n{script}</script>\n</body></html>\n"
        )
