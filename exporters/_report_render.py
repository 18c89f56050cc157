"""Renderers of a :class:`exporters.StepReport`: terminal table, Markdown, CSV, JSON."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from typing import Any

import pandas as pd

from ._render import fmt_count, fmt_ns, fmt_pct, json_records, json_value, markdown, text_table
from ._report_data import DETAIL_COUNT, StepReport, Throughput
from ._stragglers import RankReport

__all__ = [
    "REPORT_FORMATS",
    "render",
    "render_csv",
    "render_json",
    "render_markdown",
    "render_table",
    "short_path",
]


# -- rendering ---------------------------------------------------------------------


def processes_note(t: Throughput) -> str:
    """How the throughput of several processes was counted (``""`` for one process)."""
    if t.processes < 2:
        return ""
    if t.concurrent == t.processes:
        return f" ({t.processes} processes at once: steps/s of one, samples/s of all)"
    if t.concurrent > 1:
        return (
            f" ({t.processes} processes, at most {t.concurrent} at a time: steps/s of one, "
            "samples/s of all)"
        )
    return f" ({t.processes} processes, one after another)"


def _headline(report: StepReport) -> list[str]:
    w = report.excluded_steps
    n, spans = report.throughput.steps, report.spans
    lines = [
        f"{fmt_count(n)} step{'s' if n != 1 else ''} "
        f"({w} warmup step{'s' if w != 1 else ''} excluded; warmup_steps={report.warmup_steps}), "
        f"{fmt_count(spans)} span{'s' if spans != 1 else ''}"
    ]
    if report.failure:  # first: the figures below cover the steps before the failure
        lines.insert(
            0, f"Not a clean run: {report.failure}. The figures cover its steps up to then."
        )
    t = report.throughput
    if t.steps:
        tp = f"Throughput: {t.steps_per_s:,.1f} steps/s"
        if t.samples_per_s is not None:
            tp += f", {t.samples_per_s:,.1f} samples/s"
        lines.append(tp + processes_note(t))
    elif report.total_steps:
        n = report.total_steps
        steps = "The only step is" if n == 1 else f"All {n} steps are"
        lines.append(f"{steps} warmup: no per-step table or throughput (lower warmup_steps).")
    else:
        lines.append("No trainer.step spans: no per-step table or throughput.")
    if report.profiled_steps:
        k, by = report.profiled_steps, ", ".join(report.profilers) or "a profiler"
        lines.append(
            f"{fmt_count(k)} profiled step{'s' if k != 1 else ''} excluded (inside the "
            f"windows of {by}, whose profiling slows steps down; their spans stay in the "
            "trace)."
        )
    if report.failed_steps:
        k = report.failed_steps
        lines.append(
            f"{fmt_count(k)} failed step{'s' if k != 1 else ''} excluded (ERROR status: cut "
            "off by an exception; its spans stay in the trace)."
        )
    if report.detail is not None:
        lines.append(report.detail.describe())
    env = report.environment
    if env:
        ran = [f"Device: {env.get('device') or '–'}"]
        if env.get("torch_threads") is not None:
            ran.append(f"torch threads: {env['torch_threads']}")
        if env.get("cpu_count") is not None:
            ran.append(f"CPUs available: {env['cpu_count']}")
        lines.append(", ".join(ran))
    return lines


def _tail_lines(report: StepReport, *, wrap: bool = True) -> list[str]:
    """The lines under the per-step table: how the parts are made, and the hint."""
    lines = [
        "Parts are self times by event: data wait = trainer.fetch_batch; forward = "
        "module.train_step,",
        "module.forward, network.closure, runtime.execute; backward = trainer.backward; "
        "optimizer = trainer.optimizer_step.",
    ]
    if not wrap:
        lines = [" ".join(lines)]
    hint = report.threads_hint
    return [*lines, hint] if hint else lines


def _events_note(report: StepReport, *, wrap: bool = False) -> list[str]:
    """For a report with summarised steps, what the events table's columns cover."""
    if report.detail is None:
        return []
    lines = [
        "count, inclusive, mean, self and share cover every step (spans plus the summarised "
        "steps' aggregates);",
        "p50, p90, p99 and max are per call, over the spans of the steps with full detail "
        "only (counted in 'in detail').",
    ]
    return lines if wrap else [" ".join(lines)]


def _summary_rows(report: StepReport) -> list[list[str]]:
    return [
        [
            str(r["part"]),
            fmt_ns(r["mean_ns"]),
            fmt_ns(r["p50_ns"]),
            fmt_ns(r["p90_ns"]),
            fmt_ns(r["max_ns"]),
            fmt_pct(r["share"]),
        ]
        for _, r in report.step_summary.iterrows()
    ]


_SUMMARY_HEADER = ["per step", "mean", "p50", "p90", "max", "share"]


def _event_rows(events: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    header = ["event", "count", "inclusive", "mean", "p50", "p90", "p99", "max", "self", "share"]
    detail = DETAIL_COUNT in events.columns
    if detail:
        header.insert(2, "in detail")
    device = "device_total_ns" in events.columns
    if device:
        header += ["device", "device mean"]
    rows = []
    for r in events.itertuples(index=False):
        row = [
            str(r.event),
            fmt_count(r.count),
            *([fmt_count(getattr(r, DETAIL_COUNT))] if detail else []),
            fmt_ns(r.total_ns),
            fmt_ns(r.mean_ns),
            fmt_ns(r.p50_ns),
            fmt_ns(r.p90_ns),
            fmt_ns(r.p99_ns),
            fmt_ns(r.max_ns),
            fmt_ns(r.self_ns),
            fmt_pct(r.share),
        ]
        if device:
            row += [fmt_ns(r.device_total_ns), fmt_ns(r.device_mean_ns)]
        rows.append(row)
    return header, rows


def _generic_rows(table: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    header = [str(c) for c in table.columns]
    rows = []
    for rec in table.itertuples(index=False, name=None):
        row = []
        for col, value in zip(header, rec, strict=True):
            if col == "file" and isinstance(value, str):
                row.append(short_path(value))
            elif col.endswith("_ns"):
                row.append(fmt_ns(value))
            elif col == "share" or col.endswith("_share"):
                row.append(fmt_pct(value))
            else:
                row.append("–" if json_value(value) is None else str(value))
        rows.append(row)
    return header, rows


def _rank_rows(ranks: RankReport) -> tuple[list[str], list[list[str]]]:
    header = ["rank", "steps", "mean", "p90", "data wait", "compute", "slowest", "lead"]
    rows = [
        [
            str(r.rank),
            fmt_count(r.steps),
            fmt_ns(r.mean_ns),
            fmt_ns(r.p90_ns),
            fmt_ns(r.data_wait_mean_ns),
            fmt_ns(r.compute_mean_ns),
            f"{r.slowest} ({fmt_pct(r.slowest_share)})",
            fmt_ns(r.lead_mean_ns),
        ]
        for r in ranks.table.itertuples(index=False)
    ]
    return header, rows


def _rank_lines(ranks: RankReport) -> list[str]:
    spread = ranks.steps["spread_ns"] if len(ranks.steps) else pd.Series(dtype=float)
    lines = [
        f"Per rank: {len(ranks.table)} ranks, {ranks.matched_steps} steps matched; slowest = "
        f"last to reach {ranks.sync_event}, lead = its arrival after the others' median"
    ]
    if len(spread):
        lines.append(
            f"Spread per step (last - first arrival): median {fmt_ns(spread.median())}, "
            f"p90 {fmt_ns(spread.quantile(0.9))}, max {fmt_ns(spread.max())}"
        )
    return lines


def _top(report: StepReport, top: int | None) -> pd.DataFrame:
    return _top_of(report.events, top)


def _top_of(events: pd.DataFrame, top: int | None) -> pd.DataFrame:
    if top is None:
        return events
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"Expected a positive int for top, but received {top!r}.")
    return events.head(top)


_PACKAGE_ROOTS = re.compile(r".*[/\\](?:site-packages|dist-packages|lib[/\\]python\d[\d.]*)[/\\]")


def short_path(path: str) -> str:
    """A source file as the path inside its package: ``.../site-packages/torch/nn/x.py``
    -> ``torch/nn/x.py`` (also ``dist-packages`` and the standard library); any other
    absolute path keeps its last three parts after ``…/``."""
    short = _PACKAGE_ROOTS.sub("", path, count=1)
    if short != path:
        return short
    parts = re.split(r"[/\\]", path)
    if len(parts) > 4 and (path.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", path)):
        return "…/" + "/".join(parts[-3:])
    return path


#: the heading of the table of validation, test and predict time (``StepReport.validation``)
_EVALUATION = "Validation and test events"
_NO_TRAINING = "No training events: the run did not train (its evaluation events follow)."
#: the first table's heading when the trace has no training step (an inference script)
_OUTSIDE = "Events outside any training step (the run did not train)"


def _events_heading(report: StepReport) -> str:
    if report.total_steps:
        return "Training events (share: self time inside steps over step time)"
    return _OUTSIDE


def render_table(report: StepReport, *, top: int | None = None) -> str:
    """The report as aligned plain text for a terminal; ``top`` keeps the K largest events."""
    events = _top(report, top)
    parts = ["ppetrace step report", *_headline(report), ""]
    if report.throughput.steps:
        parts += [text_table(_SUMMARY_HEADER, _summary_rows(report)), *_tail_lines(report), ""]
    if report.ranks is not None:
        h, r = _rank_rows(report.ranks)
        parts += [*_rank_lines(report.ranks), text_table(h, r), report.ranks.verdict, ""]
    if len(report.events) or not len(report.validation):
        header, rows = _event_rows(events)
        parts += [_events_heading(report)]
        parts.append(text_table(header, rows))
        parts += _events_note(report, wrap=True)
        if top is not None and len(report.events) > len(events):
            parts.append(f"({_more(len(report.events) - len(events))} not shown)")
    else:
        parts.append(_NO_TRAINING)
    if len(report.validation):
        h, r = _event_rows(_top_of(report.validation, top))
        parts += ["", f"{_EVALUATION} (share: self time over their time)"]
        parts.append(text_table(h, r))
    for name, table in report.tables.items():
        h, r = _generic_rows(table)
        parts += ["", name, text_table(h, r)]
    return "\n".join(parts) + "\n"


def render_markdown(report: StepReport, *, top: int | None = None) -> str:
    """The report as GitHub-flavoured Markdown."""
    events = _top(report, top)
    parts = ["### ppetrace step report", ""]
    parts += [f"- {line}" for line in _headline(report)]
    parts.append("")
    if report.throughput.steps:
        parts += [markdown(_SUMMARY_HEADER, _summary_rows(report)), ""]
        parts_line, *hint = _tail_lines(report, wrap=False)
        parts += [f"_{parts_line}_", *(f"**{line}**" for line in hint)]
        parts.append("")
    if report.ranks is not None:
        h, r = _rank_rows(report.ranks)
        parts += [f"- {line}" for line in _rank_lines(report.ranks)]
        parts += ["", markdown(h, r), "", f"**{report.ranks.verdict}**", ""]
    if len(report.events) or not len(report.validation):
        header, rows = _event_rows(events)
        title = "Training events" if report.total_steps else _OUTSIDE
        parts += [f"#### {title}", "", markdown(header, rows)]
        parts += [f"\n_{line}_" for line in _events_note(report)]
        if top is not None and len(report.events) > len(events):
            parts += ["", f"_{_more(len(report.events) - len(events))} not shown._"]
    else:
        parts.append(f"_{_NO_TRAINING}_")
    if len(report.validation):
        h, r = _event_rows(_top_of(report.validation, top))
        parts += ["", f"#### {_EVALUATION}", "", markdown(h, r)]
    for name, table in report.tables.items():
        h, r = _generic_rows(table)
        parts += ["", f"#### {name}", "", markdown(h, r)]
    return "\n".join(parts) + "\n"


def render_csv(report: StepReport, *, top: int | None = None, table: str = "events") -> str:
    """One table as CSV with raw numbers (ns): ``events`` (default), ``validation``,
    ``steps``, ``summary``, ``ranks`` and ``rank_steps`` (multi-rank traces) or the name of an
    extra table."""
    tables = {
        "events": _top(report, top),
        "validation": report.validation,
        "steps": report.steps,
        "summary": report.step_summary,
    }
    if report.ranks is not None:
        tables["ranks"] = report.ranks.table
        tables["rank_steps"] = report.ranks.steps
    tables.update(report.tables)
    frame = tables.get(table)
    if frame is None:
        raise ValueError(f"Expected one of the tables {', '.join(tables)}, but received {table!r}.")
    buf = io.StringIO()
    frame.to_csv(buf, index=False, lineterminator="\n")
    return buf.getvalue()


def render_json(report: StepReport, *, top: int | None = None) -> str:
    """The whole report as a JSON document (times in ns, NaN as ``null``)."""
    t = report.throughput
    doc = {
        "warmup_steps": report.warmup_steps,
        "excluded_steps": report.excluded_steps,
        "profiled_steps": report.profiled_steps,
        "failed_steps": report.failed_steps,
        "failure": report.failure,
        "profilers": list(report.profilers),
        "total_steps": report.total_steps,
        "spans": report.spans,
        "throughput": {
            "steps": t.steps,
            "wall_ns": t.wall_ns,
            "steps_per_s": json_value(t.steps_per_s),
            "samples": t.samples,
            "samples_per_s": json_value(t.samples_per_s),
            "processes": t.processes,
            "concurrent": t.concurrent,
        },
        "environment": {k: json_value(v) for k, v in report.environment.items()},
        **({"detail": _detail_json(report)} if report.detail is not None else {}),
        "threads_hint": report.threads_hint,
        "step_summary": json_records(report.step_summary),
        "events": json_records(_top(report, top)),
        "validation": json_records(_top_of(report.validation, top)),
        "steps": json_records(report.steps),
        "tables": {name: json_records(tab) for name, tab in report.tables.items()},
    }
    ranks = report.ranks
    if ranks is not None:
        doc["ranks"] = {
            "straggler": ranks.straggler,
            "margin": ranks.margin,
            "matched_steps": ranks.matched_steps,
            "sync_event": ranks.sync_event,
            "verdict": ranks.verdict,
            "table": json_records(ranks.table),
            "steps": json_records(ranks.steps),
        }
    return json.dumps(doc, indent=2) + "\n"


def _detail_json(report: StepReport) -> dict[str, Any]:
    d = report.detail
    assert d is not None
    return {
        "steps": d.steps,
        "detailed": d.detailed,
        "summarised": d.summarised,
        "unknown": d.unknown,
        "ranges": [{"pid": p, "first": a, "last": b} for p, a, b in d.ranges],
        "spans_summarised": d.spans_summarised,
        "policy": d.policy,
        "note": _events_note(report)[0],
    }


#: Report renderers by format name (the CLI's ``--format``).
REPORT_FORMATS: dict[str, Callable[..., str]] = {
    "table": render_table,
    "md": render_markdown,
    "csv": render_csv,
    "json": render_json,
}


def render(report: StepReport, fmt: str = "table", *, top: int | None = None) -> str:
    """Render ``report`` in the format ``fmt``: one of ``table``, ``md``, ``csv``, ``json``."""
    renderer = REPORT_FORMATS.get(fmt)
    if renderer is None:
        raise ValueError(
            f"Unknown report format {fmt!r}; expected one of {', '.join(REPORT_FORMATS)}."
        )
    return renderer(report, top=top)


def _more(n: int) -> str:
    """``"1 more event"``, ``"3 more events"``."""
    return f"{n} more event{'s' if n != 1 else ''}"
