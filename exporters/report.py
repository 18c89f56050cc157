"""Step reports: where each training step's time goes.

:func:`step_report` turns a frame (:mod:`exporters.frame`) into a
:class:`StepReport`, which is plain data (DataFrames and numbers). Rendering
is separate: :func:`render_table` (terminal), :func:`render_markdown`,
:func:`render_csv` and :func:`render_json`, or :func:`render` by format name.

How steps are found and timed (wall time, data wait, compute, other) is
described in :mod:`exporters._steps`: one ``trainer.step`` span is one
step, and its data wait is its ``trainer.fetch_batch``, counted once whether
that is a sibling just before the step or a span inside it. Spans recorded
after the fact (``ppetrace.instrument()``'s steps) get their children by
time on the thread, for the step assignment and for self times. The first
``warmup_steps`` steps of each process, and every span inside them, are left
out of all tables. A trace of several ranks (a merged torchrun trace) also
gets a per-rank table and a straggler verdict (:mod:`exporters._stragglers`).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ._pandas import series
from ._render import fmt_count, fmt_ns, fmt_pct, json_records, json_value, markdown, text_table
from ._steps import assign_steps
from ._stragglers import DEFAULT_STRAGGLER_MARGIN, RankReport, rank_report

__all__ = [
    "REPORT_FORMATS",
    "RankReport",
    "StepReport",
    "Throughput",
    "render",
    "render_csv",
    "render_json",
    "render_markdown",
    "render_table",
    "step_report",
]

_EVENT_COLUMNS = [
    "event",
    "count",
    "total_ns",
    "mean_ns",
    "p50_ns",
    "p90_ns",
    "p99_ns",
    "max_ns",
    "self_ns",
    "share",
]
_STEP_PARTS = (
    ("wall", "wall_ns"),
    ("data wait", "data_wait_ns"),
    ("compute", "compute_ns"),
    ("other", "other_ns"),
)


@dataclass(frozen=True)
class Throughput:
    """Training throughput over the counted (non-warmup) steps.

    Rates are per process (steps over the summed step wall time) and then
    added up over processes, so data-parallel ranks add their samples.
    ``samples``/``samples_per_s`` are ``None`` unless every counted step has
    a batch size (``ppetrace.batch_size``).
    """

    steps: int
    wall_ns: int
    steps_per_s: float
    samples: int | None
    samples_per_s: float | None
    processes: int


@dataclass
class StepReport:
    """A step report: plain data, rendered by the ``render_*`` functions.

    - ``events``: one row per event name, columns ``event, count, total_ns,
      mean_ns, p50_ns, p90_ns, p99_ns, max_ns, self_ns, share`` (share of the
      counted steps' wall time spent in that event inside steps; NaN for
      events never inside a step), plus ``device_total_ns`` and
      ``device_mean_ns`` when spans carry device time. Sorted by total time.
    - ``steps``: one row per counted step: ``step_index`` (per process),
      ``pid, rank, epoch, step, batch_idx, batch_size, start_ns, end_ns,
      wall_ns, data_wait_ns, compute_ns, other_ns, device_ns``.
    - ``throughput``: a :class:`Throughput`.
    - ``warmup_steps``: the requested warmup; ``excluded_steps``: how many
      steps it removed; ``total_steps``: steps found; ``spans``: spans counted.
    - ``tables``: extra named tables: those stored in the trace file (the
      Pyinstrument profiler stores ``top_functions``) and any that other code
      adds; the renderers print them last.
    - ``ranks``: for steps of two ranks or more, a :class:`RankReport` (per-rank
      step times, which rank arrived last at each step's gradient sync, and the
      straggler verdict); ``None`` otherwise.
    """

    events: pd.DataFrame
    steps: pd.DataFrame
    throughput: Throughput
    warmup_steps: int
    excluded_steps: int
    total_steps: int
    spans: int
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    ranks: RankReport | None = None

    @property
    def step_summary(self) -> pd.DataFrame:
        """Mean, p50, p90 and max of wall, data wait, compute and other per step,
        with each part's share of the total wall time."""
        rows = []
        wall_total = float(self.steps["wall_ns"].sum()) if len(self.steps) else 0.0
        for label, col in _STEP_PARTS:
            values = self.steps[col].astype(float) if len(self.steps) else pd.Series(dtype=float)
            rows.append(
                {
                    "part": label,
                    "mean_ns": values.mean() if len(values) else np.nan,
                    "p50_ns": values.quantile(0.5) if len(values) else np.nan,
                    "p90_ns": values.quantile(0.9) if len(values) else np.nan,
                    "max_ns": values.max() if len(values) else np.nan,
                    "share": values.sum() / wall_total if wall_total > 0 else np.nan,
                }
            )
        return pd.DataFrame(rows)


def step_report(
    frame: pd.DataFrame,
    *,
    warmup_steps: int = 1,
    straggler_margin: float = DEFAULT_STRAGGLER_MARGIN,
) -> StepReport:
    """Summarise a frame of spans per event and per step (see :class:`StepReport`).

    The first ``warmup_steps`` ``trainer.step`` spans of each process, with
    their data wait and all spans inside them, are excluded. A frame with the
    steps of several ranks also gets ``ranks``; a rank is named a straggler
    when it arrives last at more than half of the steps by more than
    ``straggler_margin`` of the step (see :mod:`exporters._stragglers`).
    """
    if (
        isinstance(straggler_margin, bool)
        or not isinstance(straggler_margin, (int, float))
        or not 0 <= straggler_margin < 10
    ):
        raise ValueError(
            "Expected a share of the step such as 0.05 for straggler_margin, but received "
            f"{straggler_margin!r}."
        )
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(
            f"Expected a non-negative int for warmup_steps, but received {warmup_steps!r}."
        )
    if not isinstance(frame, pd.DataFrame) or not {"name", "dur_ns", "self_ns"} <= set(
        frame.columns
    ):
        raise TypeError(
            "Expected a span frame from exporters.spans_to_frame or read_chrome_trace, but "
            f"received {type(frame).__name__}."
        )
    assignment = assign_steps(frame, warmup_steps)
    steps = assignment.steps
    n = len(frame)
    warm = np.zeros(n, dtype=bool)
    warm_rows = steps.index[steps["warmup"].to_numpy(dtype=bool)].to_numpy()
    warm[warm_rows] = True
    step_row = assignment.step_row
    in_step = step_row >= 0
    excluded = in_step & warm[np.where(in_step, step_row, 0)]
    counted = frame.loc[~excluded]
    counted_in_step = in_step[~excluded]
    kept_steps = steps.loc[~steps["warmup"].to_numpy(dtype=bool)]
    wall_total = float(kept_steps["wall_ns"].sum())
    own_self = assignment.self_ns
    self_ns = None if own_self is None else own_self[~excluded]
    events = _event_table(counted, counted_in_step, wall_total, self_ns)
    return StepReport(
        events=events,
        steps=kept_steps.drop(columns=["warmup"]).reset_index(drop=True),
        throughput=_throughput(kept_steps),
        warmup_steps=warmup_steps,
        excluded_steps=int(len(steps) - len(kept_steps)),
        total_steps=len(steps),
        spans=len(counted),
        tables=_stored_tables(frame),
        ranks=rank_report(frame, assignment, kept_steps, margin=float(straggler_margin)),
    )


def _stored_tables(frame: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Tables stored in the trace file (``frame.attrs["tables"]``, e.g. ``top_functions``)."""
    stored = frame.attrs.get("tables")
    if not isinstance(stored, dict):
        return {}
    out: dict[str, pd.DataFrame] = {}
    for name, table in stored.items():
        try:
            out[str(name)] = pd.DataFrame(table["rows"], columns=table["columns"])
        except (KeyError, TypeError, ValueError):
            continue  # a malformed table is left out, never fatal
    return out


def _event_table(
    frame: pd.DataFrame, in_step: np.ndarray, wall_total: float, self_ns: np.ndarray | None
) -> pd.DataFrame:
    if not len(frame):
        return pd.DataFrame({c: pd.Series(dtype=float) for c in _EVENT_COLUMNS}).astype(
            {"event": object}
        )
    dur = frame["dur_ns"].to_numpy(np.int64)
    # grouped by integer codes: any name works, whatever pandas' string storage
    codes, names = pd.factorize(frame["name"].to_numpy(dtype=object))
    data = pd.DataFrame(
        {
            "event": codes,
            "dur": dur,
            "self": frame["self_ns"].to_numpy(np.int64) if self_ns is None else self_ns,
            "in_step": np.where(in_step, dur, 0),
        }
    )
    g = data.groupby("event", sort=False)
    out = pd.DataFrame(
        {
            "count": g["dur"].size(),
            "total_ns": g["dur"].sum(),
            "mean_ns": g["dur"].mean(),
            "max_ns": g["dur"].max(),
            "self_ns": g["self"].sum(),
        }
    )
    q = g["dur"].quantile([0.5, 0.9, 0.99]).unstack()
    out["p50_ns"] = q[0.5]
    out["p90_ns"] = q[0.9]
    out["p99_ns"] = q[0.99]
    step_sum = g["in_step"].sum()
    any_in_step = g["in_step"].max() > 0
    if wall_total > 0:
        out["share"] = (step_sum / wall_total).where(any_in_step)
    else:
        out["share"] = np.nan
    device = frame["device_dur_ns"] if "device_dur_ns" in frame.columns else None
    columns = list(_EVENT_COLUMNS)
    if device is not None:
        dev = pd.to_numeric(device, errors="coerce").to_numpy(dtype=float)
        if np.isfinite(dev).any():
            dg = pd.Series(dev, index=data.index).groupby(data["event"], sort=False)
            out["device_total_ns"] = dg.sum(min_count=1)
            out["device_mean_ns"] = dg.mean()
            columns += ["device_total_ns", "device_mean_ns"]
    labels = np.asarray(names, dtype=object)[out.index.to_numpy(dtype=np.int64)]
    totals = out["total_ns"].to_numpy()
    # largest total first, then by name; sorted in Python, since pandas would
    # store the names as strings first (see _pandas)
    order = sorted(range(len(out)), key=lambda i: (-totals[i], labels[i]))
    out = out.iloc[order].reset_index(drop=True)
    out.insert(0, "event", series(labels[order]))
    return out[columns]


def _throughput(steps: pd.DataFrame) -> Throughput:
    if not len(steps):
        return Throughput(0, 0, 0.0, None, None, 0)
    steps_per_s = 0.0
    samples_per_s = 0.0
    for _, part in steps.groupby("pid", sort=False):
        wall_s = float(part["wall_ns"].sum()) / 1e9
        if wall_s > 0:
            steps_per_s += len(part) / wall_s
            samples_per_s += float(part["batch_size"].sum()) / wall_s
    sizes = steps["batch_size"]
    known = bool(sizes.notna().all())
    return Throughput(
        steps=len(steps),
        wall_ns=int(steps["wall_ns"].sum()),
        steps_per_s=steps_per_s,
        samples=int(sizes.sum()) if known else None,
        samples_per_s=samples_per_s if known else None,
        processes=int(steps["pid"].nunique()),
    )


# -- rendering ---------------------------------------------------------------------


def _headline(report: StepReport) -> list[str]:
    w = report.excluded_steps
    lines = [
        f"{fmt_count(report.throughput.steps)} steps "
        f"({w} warmup step{'s' if w != 1 else ''} excluded; warmup_steps={report.warmup_steps}), "
        f"{fmt_count(report.spans)} spans"
    ]
    t = report.throughput
    if t.steps:
        tp = f"Throughput: {t.steps_per_s:,.1f} steps/s"
        if t.samples_per_s is not None:
            tp += f", {t.samples_per_s:,.1f} samples/s"
        if t.processes > 1:
            tp += f" (sum over {t.processes} processes)"
        lines.append(tp)
    elif report.total_steps:
        lines.append(
            f"All {report.total_steps} steps are warmup: no per-step table or throughput "
            "(lower warmup_steps)."
        )
    else:
        lines.append("No trainer.step spans: no per-step table or throughput.")
    return lines


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
    header = ["event", "count", "total", "mean", "p50", "p90", "p99", "max", "self", "share"]
    device = "device_total_ns" in events.columns
    if device:
        header += ["device", "device mean"]
    rows = []
    for r in events.itertuples(index=False):
        row = [
            str(r.event),
            fmt_count(r.count),
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
            if col.endswith("_ns"):
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
    if top is None:
        return report.events
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"Expected a positive int for top, but received {top!r}.")
    return report.events.head(top)


def render_table(report: StepReport, *, top: int | None = None) -> str:
    """The report as aligned plain text for a terminal; ``top`` keeps the K largest events."""
    events = _top(report, top)
    parts = ["ppetrace step report", *_headline(report), ""]
    if report.throughput.steps:
        parts += [text_table(_SUMMARY_HEADER, _summary_rows(report)), ""]
    if report.ranks is not None:
        h, r = _rank_rows(report.ranks)
        parts += [*_rank_lines(report.ranks), text_table(h, r), report.ranks.verdict, ""]
    header, rows = _event_rows(events)
    parts.append(text_table(header, rows))
    if top is not None and len(report.events) > len(events):
        parts.append(f"({len(report.events) - len(events)} more events not shown)")
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
    if report.ranks is not None:
        h, r = _rank_rows(report.ranks)
        parts += [f"- {line}" for line in _rank_lines(report.ranks)]
        parts += ["", markdown(h, r), "", f"**{report.ranks.verdict}**", ""]
    header, rows = _event_rows(events)
    parts.append(markdown(header, rows))
    if top is not None and len(report.events) > len(events):
        parts += ["", f"_{len(report.events) - len(events)} more events not shown._"]
    for name, table in report.tables.items():
        h, r = _generic_rows(table)
        parts += ["", f"#### {name}", "", markdown(h, r)]
    return "\n".join(parts) + "\n"


def render_csv(report: StepReport, *, top: int | None = None, table: str = "events") -> str:
    """One table as CSV with raw numbers (ns): ``events`` (default), ``steps``,
    ``summary``, ``ranks`` and ``rank_steps`` (multi-rank traces) or the name of an
    extra table."""
    tables = {"events": _top(report, top), "steps": report.steps, "summary": report.step_summary}
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
        "total_steps": report.total_steps,
        "spans": report.spans,
        "throughput": {
            "steps": t.steps,
            "wall_ns": t.wall_ns,
            "steps_per_s": json_value(t.steps_per_s),
            "samples": t.samples,
            "samples_per_s": json_value(t.samples_per_s),
            "processes": t.processes,
        },
        "step_summary": json_records(report.step_summary),
        "events": json_records(_top(report, top)),
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
