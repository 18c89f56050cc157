"""exporters: spans -> Chrome trace files, pandas frames, step reports and comparisons.

This package never imports ``ppetrace`` or ``torch``: it works for any
OpenTelemetry program, and ``ppetrace report``/``compare`` run on a CI box
without torch. The data flows along the modules:

- :mod:`exporters.chrome`: :class:`ChromeTraceExporter` (an OpenTelemetry
  ``SpanExporter`` that streams a Chrome trace), :func:`read_chrome_trace`,
  :func:`load_chrome_trace`, :func:`merge_traces`, :func:`repair_chrome_trace` and
  :func:`trace_parts`
  (writer, reader, merger and repair in modules of their own);
- :mod:`exporters.frame`: :func:`spans_to_frame`, one row per span;
- :mod:`exporters.report`: :func:`step_report` and its renderers;
- :mod:`exporters.comparison`: :func:`compare` (runs as samples, a gate, a noise
  floor; :func:`summarize_run` reduces a run first) and its renderers;
- :mod:`exporters.html`: :func:`render_html` and :func:`render_comparison_html`,
  self-contained HTML pages with plotly charts (the ``ppetrace[html]`` extra).

``import exporters`` is cheap (ppetrace imports it on every start): the
modules above, with pandas and scipy, load on first use of a name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._errors import TraceError
from ._spans import SpanBatch, SpanRow, rows_from_readable_spans

if TYPE_CHECKING:
    from .chrome import (
        STEP_LEVEL_EVENTS as STEP_LEVEL_EVENTS,
    )
    from .chrome import (
        ChromeTrace as ChromeTrace,
    )
    from .chrome import (
        ChromeTraceExporter as ChromeTraceExporter,
    )
    from .chrome import (
        Repaired as Repaired,
    )
    from .chrome import (
        TraceTruncatedWarning as TraceTruncatedWarning,
    )
    from .chrome import (
        load_chrome_trace as load_chrome_trace,
    )
    from .chrome import (
        merge_traces as merge_traces,
    )
    from .chrome import (
        owner_of as owner_of,
    )
    from .chrome import (
        read_chrome_trace as read_chrome_trace,
    )
    from .chrome import (
        repair_chrome_trace as repair_chrome_trace,
    )
    from .chrome import (
        trace_parts as trace_parts,
    )
    from .comparison import (
        COMPARE_FORMATS as COMPARE_FORMATS,
    )
    from .comparison import (
        DEFAULT_NOISE_FLOOR as DEFAULT_NOISE_FLOOR,
    )
    from .comparison import (
        Comparison as Comparison,
    )
    from .comparison import (
        RunSummary as RunSummary,
    )
    from .comparison import (
        Verdict as Verdict,
    )
    from .comparison import (
        compare as compare,
    )
    from .comparison import (
        drop_copies as drop_copies,
    )
    from .comparison import (
        event_samples as event_samples,
    )
    from .comparison import (
        group_runs as group_runs,
    )
    from .comparison import (
        render_comparison as render_comparison,
    )
    from .comparison import (
        render_comparison_json as render_comparison_json,
    )
    from .comparison import (
        render_comparison_markdown as render_comparison_markdown,
    )
    from .comparison import (
        render_comparison_table as render_comparison_table,
    )
    from .comparison import (
        run_failure as run_failure,
    )
    from .comparison import (
        run_identity as run_identity,
    )
    from .comparison import (
        summarize_run as summarize_run,
    )
    from .frame import COLUMNS as COLUMNS
    from .frame import spans_to_frame as spans_to_frame
    from .html import render_comparison_html as render_comparison_html
    from .html import render_html as render_html
    from .report import (
        REPORT_FORMATS as REPORT_FORMATS,
    )
    from .report import STEP_PARTS as STEP_PARTS
    from .report import (
        Detail as Detail,
    )
    from .report import (
        RankReport as RankReport,
    )
    from .report import (
        StepReport as StepReport,
    )
    from .report import (
        Throughput as Throughput,
    )
    from .report import (
        render as render,
    )
    from .report import (
        render_csv as render_csv,
    )
    from .report import (
        render_json as render_json,
    )
    from .report import (
        render_markdown as render_markdown,
    )
    from .report import (
        render_table as render_table,
    )
    from .report import (
        step_report as step_report,
    )

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "ChromeTrace": ".chrome",
    "ChromeTraceExporter": ".chrome",
    "STEP_LEVEL_EVENTS": ".chrome",
    "TraceTruncatedWarning": ".chrome",
    "load_chrome_trace": ".chrome",
    "merge_traces": ".chrome",
    "owner_of": ".chrome",
    "read_chrome_trace": ".chrome",
    "Repaired": ".chrome",
    "repair_chrome_trace": ".chrome",
    "trace_parts": ".chrome",
    "COLUMNS": ".frame",
    "spans_to_frame": ".frame",
    "REPORT_FORMATS": ".report",
    "StepReport": ".report",
    "Detail": ".report",
    "RankReport": ".report",
    "Throughput": ".report",
    "render": ".report",
    "render_csv": ".report",
    "render_json": ".report",
    "render_markdown": ".report",
    "render_table": ".report",
    "step_report": ".report",
    "STEP_PARTS": ".report",
    "render_html": ".html",
    "render_comparison_html": ".html",
    "COMPARE_FORMATS": ".comparison",
    "DEFAULT_NOISE_FLOOR": ".comparison",
    "RunSummary": ".comparison",
    "summarize_run": ".comparison",
    "group_runs": ".comparison",
    "drop_copies": ".comparison",
    "run_identity": ".comparison",
    "run_failure": ".comparison",
    "Comparison": ".comparison",
    "Verdict": ".comparison",
    "compare": ".comparison",
    "event_samples": ".comparison",
    "render_comparison": ".comparison",
    "render_comparison_json": ".comparison",
    "render_comparison_markdown": ".comparison",
    "render_comparison_table": ".comparison",
}

__all__ = [
    "SpanBatch",
    "SpanRow",
    "TraceError",
    "rows_from_readable_spans",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'exporters' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
