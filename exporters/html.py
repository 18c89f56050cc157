"""HTML pages of a step report and of a comparison: charts you look at, offline.

:func:`render_html` and :func:`render_comparison_html` return one
self-contained HTML document: plotly.js (the ``plotly`` package, the
``ppetrace[html]`` extra) and the data inline, and a Content-Security-Policy
that lets the page make no request of any kind. Without plotly they raise an
:class:`ImportError` naming the extra.

The report page: the run summary (steps, warmup excluded, throughput, device,
torch threads), the step time of every step stacked by part (data wait,
forward, backward, optimizer, other; above :data:`MAX_STEP_POINTS` steps each
point is the mean of consecutive steps, and the page says so), a histogram of
step times with p50/p90/p99, self time per event as a share of step time
(adding up to 100%), the per-step and event tables, validation events,
device time when spans carry it, per-rank step times for several ranks, and
the trace's extra tables (``top_functions``). For a long run whose trace
summarised some steps, the run summary says which steps had full detail and
the events table what its columns cover (see :func:`exporters.step_report`).
The comparison page: per event,
the change with its confidence interval as error bars coloured by verdict,
and the base and candidate step-time distributions.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from ._compare_render import _headline, _rows, _runs, _settings, shown_verdict
from ._compare_result import Comparison, Verdict
from ._html import HTML_EXTRA_HINT, Page, plotly_js
from ._parts import PART_COLUMNS, PART_NAMES
from ._render import fmt_count, fmt_ns, fmt_pct
from ._report_data import StepReport
from ._report_render import (
    _event_rows,
    _events_note,
    _generic_rows,
    _rank_rows,
    _summary_rows,
    processes_note,
)

__all__ = ["HTML_EXTRA_HINT", "MAX_STEP_POINTS", "render_comparison_html", "render_html"]

#: Above this many steps, the step-time chart shows means of consecutive steps.
MAX_STEP_POINTS = 20_000
_TOP_EVENTS = 30
_SHARE_BARS = 20
_COLORS = {
    "data wait": "#8c8c8c",
    "forward": "#1f77b4",
    "backward": "#ff7f0e",
    "optimizer": "#2ca02c",
    "other": "#d62728",
}
_VERDICT_COLORS = {
    Verdict.REGRESSION: "#b00020",
    Verdict.IMPROVEMENT: "#1b7f3b",
    Verdict.BELOW_NOISE: "#9e9e9e",
    Verdict.UNCHANGED: "#1f77b4",
    # an unchanged verdict told apart (shown_verdict with the comparison)
    "inconclusive": "#c77c02",
    "within threshold": "#5b9bd5",
    "not significant": "#8fb8de",
    Verdict.INSUFFICIENT: "#cfcfcf",
    # an informational event's significant change (it fails nothing)
    "slower (not gated)": "#e08a00",
    "faster (not gated)": "#7cc48e",
}


_UNITS = (("s", 1e9), ("ms", 1e6), ("µs", 1e3), ("ns", 1.0))


def _unit(values_ns: Any) -> tuple[str, float]:
    """The time unit that suits ``values_ns`` (by their median) and its size in ns."""
    v = np.abs(np.asarray(values_ns, dtype=float))
    v = v[np.isfinite(v)]
    typical = float(np.median(v)) if len(v) else 0.0
    for unit, scale in _UNITS:
        if typical >= scale:
            return unit, scale
    return "ns", 1.0


def _check(value: Any, kind: type, what: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"Expected {what}, but received {type(value).__name__}.")


# -- the report page ---------------------------------------------------------------


def render_html(report: StepReport, *, title: str = "ppetrace step report") -> str:
    """The step report as one self-contained HTML page (see the module doc)."""
    _check(report, StepReport, "a StepReport from exporters.step_report")
    plotly_js()  # fail first, naming the extra, when plotly is missing
    page = Page(title)
    _summary(page, report)
    steps = report.steps
    if len(steps):
        _step_line(page, steps)
        page.heading("Per step")
        page.table(["part", "mean", "p50", "p90", "max", "share"], _summary_rows(report))
        _histogram(page, steps)
    _shares(page, report.events)
    page.heading("Events")
    page.paragraph(
        "inclusive: with the children; self: without them; share: self time inside "
        "steps over step time."
    )
    header, rows = _event_rows(report.events.head(_TOP_EVENTS))
    page.table(header, rows, table_id="events")
    for line in _events_note(report):
        page.paragraph(line, cls="note")
    if len(report.events) > _TOP_EVENTS:
        more = len(report.events) - _TOP_EVENTS
        page.paragraph(f"{more} more event{'s' if more != 1 else ''} not shown.")
    if len(report.validation):
        page.heading("Validation and test events (apart from training steps)")
        header, rows = _event_rows(report.validation.head(_TOP_EVENTS))
        page.table(header, rows)
    _device(page, report)
    _ranks(page, report)
    for name, table in report.tables.items():
        page.heading(name)
        header, rows = _generic_rows(table)
        page.table(header, rows)
    return page.html()


def _summary(page: Page, report: StepReport) -> None:
    t = report.throughput
    env = report.environment
    facts = [
        ("steps", f"{fmt_count(t.steps)} counted of {fmt_count(report.total_steps)}"),
        (
            "warmup excluded",
            f"{report.excluded_steps} step{'s' if report.excluded_steps != 1 else ''} "
            f"(warmup_steps={report.warmup_steps})",
        ),
        ("spans", fmt_count(report.spans)),
    ]
    if report.failed_steps:
        k = report.failed_steps
        facts.append(("failed excluded", f"{k} step{'s' if k != 1 else ''} (ERROR status)"))
    if report.profiled_steps:
        k = report.profiled_steps
        facts.append(
            (
                "profiled excluded",
                f"{k} step{'s' if k != 1 else ''} ({', '.join(report.profilers) or 'a profiler'})",
            )
        )
    if report.detail is not None:
        facts.append(("full detail", report.detail.describe()))
    if report.failure:
        facts.insert(
            0, ("not a clean run", f"{report.failure} (the figures cover its steps up to then)")
        )
    if t.steps:
        tp = f"{t.steps_per_s:,.1f} steps/s"
        if t.samples_per_s is not None:
            tp += f", {t.samples_per_s:,.1f} samples/s"
        facts.append(("throughput", tp + processes_note(t)))
    facts.append(("device", str(env.get("device") or "not recorded")))
    threads = env.get("torch_threads")
    facts.append(("torch threads", "not recorded" if threads is None else str(threads)))
    cpus = env.get("cpu_count")
    facts.append(("CPUs available", "not recorded" if cpus is None else str(cpus)))
    for key in ("torch", "python", "cpu_model"):
        if env.get(key):
            facts.append((key, str(env[key])))
    page.heading("Run")
    page.facts(facts)
    hint = report.threads_hint
    if hint:
        page.paragraph(hint, cls="hint")


def _first_process(steps: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The steps of one process (the lowest rank, else the first pid) and its name."""
    if steps["pid"].nunique() <= 1:
        return steps, ""
    ranks = pd.to_numeric(steps["rank"], errors="coerce")
    if ranks.notna().any():
        rank = ranks.min()
        return steps.loc[(ranks == rank).to_numpy()], f"rank {int(rank)}"
    pid = steps["pid"].iloc[0]
    return steps.loc[steps["pid"] == pid], f"pid {pid}"


def _step_line(page: Page, all_steps: pd.DataFrame) -> None:
    steps, who = _first_process(all_steps)
    steps = steps.sort_values("start_ns")
    n = len(steps)
    x = np.arange(1, n + 1, dtype=float)
    unit, scale = _unit(steps["wall_ns"])
    parts = {
        name: steps[col].to_numpy(dtype=float) / scale
        for name, col in zip(PART_NAMES, PART_COLUMNS, strict=True)
    }
    note = f"Every step of {who}" if who else "Every step"
    note += " (per-rank step times below)." if who else "."
    if n > MAX_STEP_POINTS:
        k = math.ceil(n / MAX_STEP_POINTS)
        cut = np.arange(0, n, k)
        counts = np.diff(np.append(cut, n)).astype(float)
        x = np.add.reduceat(x, cut) / counts
        parts = {name: np.add.reduceat(v, cut) / counts for name, v in parts.items()}
        note = (
            f"Downsampled: {fmt_count(n)} steps are more than {fmt_count(MAX_STEP_POINTS)}, so "
            f"each point is the mean of {k} consecutive steps ({fmt_count(len(cut))} points)."
        )
    data = [
        {
            "type": "scatter",
            "mode": "lines",
            "name": name,
            "x": x,
            "y": values,
            "stackgroup": "parts",
            "line": {"width": 0.5, "color": _COLORS[name]},
        }
        for name, values in parts.items()
    ]
    layout = {
        "title": {"text": "Step time over the run, by part"},
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"title": {"text": unit}, "rangemode": "tozero"},
        "hovermode": "x unified",
    }
    page.heading("Step time over the run")
    page.paragraph(note)
    page.chart("step-time", data, layout)


def _histogram(page: Page, steps: pd.DataFrame) -> None:
    unit, scale = _unit(steps["wall_ns"])
    wall = steps["wall_ns"].to_numpy(dtype=float) / scale
    counts, edges = np.histogram(wall, bins=min(80, max(10, int(np.sqrt(len(wall))))))
    centers = (edges[:-1] + edges[1:]) / 2
    marks = {f"p{q}": float(np.percentile(wall, q)) for q in (50, 90, 99)}
    shapes = [
        {
            "type": "line",
            "xref": "x",
            "yref": "paper",
            "x0": v,
            "x1": v,
            "y0": 0,
            "y1": 1,
            "line": {"dash": "dash", "color": "#444"},
        }
        for v in marks.values()
    ]
    annotations = [
        {
            "x": v,
            "y": y,
            "xref": "x",
            "yref": "paper",
            "text": f"{name} {fmt_ns(v * scale)}",
            "showarrow": False,
            "xanchor": "left",
            "yanchor": "top",
            "bgcolor": "rgba(255,255,255,0.8)",
        }
        for (name, v), y in zip(marks.items(), (1.0, 0.92, 0.84), strict=True)
    ]
    data = [
        {
            "type": "bar",
            "x": centers,
            "y": counts,
            "width": float(edges[1] - edges[0]) if len(edges) > 1 else None,
            "name": "steps",
            "marker": {"color": "#1f77b4"},
        }
    ]
    layout = {
        "title": {"text": "Step times (wall)"},
        "xaxis": {"title": {"text": unit}},
        "yaxis": {"title": {"text": "steps"}},
        "shapes": shapes,
        "annotations": annotations,
        "bargap": 0.02,
    }
    page.heading("Distribution of step times")
    page.chart("step-histogram", data, layout)


def _shares(page: Page, events: pd.DataFrame) -> None:
    shares = events.loc[events["share"].notna(), ["event", "share"]]
    if not len(shares):
        return
    shares = shares.sort_values("share", ascending=False)
    top = shares.head(_SHARE_BARS)
    names = [str(e) for e in top["event"]]
    values = list(top["share"].astype(float) * 100)
    rest = shares.iloc[_SHARE_BARS:]
    if len(rest):
        names.append(f"({len(rest)} other events)")
        values.append(float(rest["share"].sum()) * 100)
    total = float(shares["share"].sum()) * 100
    data = [
        {
            "type": "bar",
            "orientation": "h",
            "x": values[::-1],
            "y": names[::-1],
            "text": [f"{v:.1f}%" for v in values[::-1]],
            "textposition": "auto",
            "marker": {"color": "#1f77b4"},
        }
    ]
    layout = {
        "title": {"text": f"Self time per event, % of step time (total {total:.1f}%)"},
        "xaxis": {"title": {"text": "% of step time"}},
        "yaxis": {"automargin": True},
        "margin": {"l": 220, "t": 50, "r": 20, "b": 50},
    }
    page.heading("Where the time goes")
    page.chart("self-share", data, layout, height=max(300, 26 * len(names) + 100))


def _device(page: Page, report: StepReport) -> None:
    events = report.events
    if "device_total_ns" not in events.columns:
        return
    dev = events.loc[events["device_total_ns"].notna()]
    if not len(dev):
        return
    dev = dev.sort_values("device_total_ns", ascending=False).head(_SHARE_BARS)
    names = [str(e) for e in dev["event"]][::-1]
    unit, scale = _unit(dev["device_total_ns"])
    data = [
        {
            "type": "bar",
            "orientation": "h",
            "name": "device",
            "x": (dev["device_total_ns"].to_numpy(dtype=float) / scale)[::-1],
            "y": names,
            "marker": {"color": "#9467bd"},
        },
        {
            "type": "bar",
            "orientation": "h",
            "name": "host (inclusive)",
            "x": (dev["total_ns"].to_numpy(dtype=float) / scale)[::-1],
            "y": names,
            "marker": {"color": "#bdbdbd"},
        },
    ]
    layout = {
        "title": {"text": "Device time per event (CUDA events) beside host time"},
        "xaxis": {"title": {"text": f"{unit}, summed over the run"}},
        "yaxis": {"automargin": True},
        "barmode": "group",
        "margin": {"l": 220, "t": 50, "r": 20, "b": 50},
    }
    page.heading("Device time")
    page.chart("device-time", data, layout, height=max(300, 40 * len(names) + 100))


def _box(name: str, values: np.ndarray, color: str | None = None) -> dict[str, Any]:
    """A box of ``values`` from its quartiles and 1.5 IQR fences: the page's size
    does not grow with the number of values."""
    q1, med, q3 = np.percentile(values, [25, 50, 75])
    iqr = q3 - q1
    low = float(values[values >= q1 - 1.5 * iqr].min())
    high = float(values[values <= q3 + 1.5 * iqr].max())
    box: dict[str, Any] = {
        "type": "box",
        "name": name,
        "q1": [q1],
        "median": [med],
        "q3": [q3],
        "lowerfence": [low],
        "upperfence": [high],
        "mean": [float(values.mean())],
        "x": [name],
        "boxpoints": False,
    }
    if color:
        box["marker"] = {"color": color}
    return box


def _ranks(page: Page, report: StepReport) -> None:
    if report.ranks is None:
        return
    steps = report.steps
    ranks = pd.to_numeric(steps["rank"], errors="coerce")
    unit, scale = _unit(steps["wall_ns"])
    wall = steps["wall_ns"].to_numpy(dtype=float) / scale
    data = [
        _box(f"rank {int(r)}", wall[(ranks == r).to_numpy()])
        for r in sorted(ranks.dropna().unique())
    ]
    layout = {
        "title": {"text": "Step time per rank"},
        "yaxis": {"title": {"text": unit}, "rangemode": "tozero"},
        "showlegend": False,
    }
    page.heading("Ranks")
    page.paragraph(report.ranks.verdict)
    page.chart("rank-steps", data, layout)
    header, rows = _rank_rows(report.ranks)
    page.table(header, rows)


# -- the comparison page -----------------------------------------------------------


def render_comparison_html(comparison: Comparison, *, title: str = "ppetrace compare") -> str:
    """A comparison as one self-contained HTML page (see the module doc)."""
    _check(comparison, Comparison, "a Comparison from exporters.compare")
    plotly_js()
    page = Page(f"{title}: {_headline(comparison)}")
    page.paragraph(f"{_runs(comparison)}. {_settings(comparison)}")
    for warning in comparison.environment_warnings:
        page.paragraph(f"warning: {warning}", cls="hint")
    for note in comparison.notes:
        page.paragraph(f"note: {note}")
    _changes(page, comparison)
    _distributions(page, comparison)
    page.heading("Events")
    header, rows = _rows(comparison, marks=False)
    classes = [
        f"verdict-{str(r['verdict']).replace(' ', '-')}" if r["gated"] else "verdict-info"
        for r in comparison.records
    ]
    page.table(header, rows, row_classes=classes, table_id="comparison")
    if comparison.added:
        page.paragraph(f"added (only in the candidate): {', '.join(comparison.added)}")
    if comparison.removed:
        page.paragraph(f"removed (only in the base): {', '.join(comparison.removed)}")
    return page.html()


def _changes(page: Page, comparison: Comparison) -> None:
    records = comparison.records
    if not records:
        return
    data = []
    for verdict, color in _VERDICT_COLORS.items():
        chosen = [
            r for r in records if shown_verdict(r, marks=False, comparison=comparison) == verdict
        ]
        if not chosen:
            continue
        change = np.array([float(r["change"]) for r in chosen]) * 100
        low = np.array([float(r["ci_low"]) for r in chosen]) * 100
        high = np.array([float(r["ci_high"]) for r in chosen]) * 100
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": verdict,
                "x": change,
                "y": [("⚑ " if r["gated"] else "") + str(r["event"]) for r in chosen],
                "error_x": {
                    "type": "data",
                    "symmetric": False,
                    "array": high - change,
                    "arrayminus": change - low,
                    "color": color,
                },
                "marker": {"color": color, "size": 9},
            }
        )
    t = comparison.threshold * 100
    shapes = [
        {
            "type": "line",
            "xref": "x",
            "yref": "paper",
            "x0": v,
            "x1": v,
            "y0": 0,
            "y1": 1,
            "line": {"dash": "dot", "color": "#999"},
        }
        for v in (-t, t)
    ]
    level = f"{comparison.confidence * 100:.0f}%"
    layout = {
        "title": {"text": f"Change per event, candidate vs base ({level} CI; ⚑ gated)"},
        "xaxis": {"title": {"text": "change of the median, %"}, "zeroline": True},
        "yaxis": {"automargin": True, "autorange": "reversed", "type": "category"},
        "shapes": shapes,
        "margin": {"l": 240, "t": 50, "r": 20, "b": 50},
    }
    page.heading("Change per event")
    page.paragraph(
        f"Error bars: the {level} confidence interval; dotted lines: the threshold "
        f"±{fmt_pct(comparison.threshold)}. Colours: " + ", ".join(_VERDICT_COLORS) + "."
    )
    page.chart("changes", data, layout, height=max(320, 28 * len(records) + 120))


def _distributions(page: Page, comparison: Comparison) -> None:
    sides = comparison.step_samples
    base = [np.asarray(s, dtype=float) for s in sides.get("base", []) if len(s)]
    cand = [np.asarray(s, dtype=float) for s in sides.get("candidate", []) if len(s)]
    if not base or not cand:
        return
    unit, scale = _unit(np.concatenate(base))
    pooled = {"base": np.concatenate(base) / scale, "candidate": np.concatenate(cand) / scale}
    both = np.concatenate(list(pooled.values()))
    edges = np.histogram_bin_edges(both, bins=min(80, max(10, int(np.sqrt(len(both))))))
    colors = {"base": "#7f7f7f", "candidate": "#1f77b4"}
    data = []
    for side, values in pooled.items():
        counts, _ = np.histogram(values, bins=edges)
        data.append(
            {
                "type": "bar",
                "name": f"{side} ({fmt_count(len(values))} steps)",
                "x": (edges[:-1] + edges[1:]) / 2,
                "y": counts / max(len(values), 1),
                "width": float(edges[1] - edges[0]),
                "opacity": 0.6,
                "marker": {"color": colors[side]},
            }
        )
    layout = {
        "title": {"text": "trainer.step times: base against candidate"},
        "xaxis": {"title": {"text": unit}},
        "yaxis": {"title": {"text": "fraction of steps"}},
        "barmode": "overlay",
    }
    page.heading("Step-time distributions")
    page.chart("step-distributions", data, layout)
    boxes = [
        _box(f"{side} run {i + 1}", s / scale, colors[side])
        for side, runs in (("base", base), ("candidate", cand))
        for i, s in enumerate(runs)
    ]
    page.chart(
        "step-runs",
        boxes,
        {
            "title": {"text": "trainer.step per run"},
            "yaxis": {"title": {"text": unit}},
            "showlegend": False,
        },
        height=360,
    )
