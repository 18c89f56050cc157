"""Step reports: where each training step's time goes.

:func:`step_report` turns a frame (:mod:`exporters.frame`) into a
:class:`StepReport`, which is plain data (DataFrames and numbers). Rendering
is separate: :func:`render_table` (terminal), :func:`render_markdown`,
:func:`render_csv` and :func:`render_json`, or :func:`render` by format name.

How steps are found and timed (wall time, data wait, compute) is described
in :mod:`exporters._steps`, and how a step splits into data wait, forward,
backward, optimizer and other in :mod:`exporters._parts`: one ``trainer.step`` span is one
step, and its data wait is its ``trainer.fetch_batch``, counted once whether
that is a sibling just before the step or a span inside it. Spans recorded
after the fact (``ppetrace.instrument()``'s steps) get their children by
time on the thread, for the step assignment and for self times. The first
``warmup_steps`` steps of each process, and every span inside them, are left
out of all tables. A trace of several ranks (a merged torchrun trace) also
gets a per-rank table and a straggler verdict (:mod:`exporters._stragglers`).

A long run's trace may keep full detail for some steps only and summarise
the others (their hook-level spans as per-event aggregates on the
``trainer.step`` row, :mod:`exporters._aggregates`). The report still covers
every step: the per-event count, total, mean, self time and share add the
aggregates to the spans, and the per-step table (wall time and parts) has a
row for every step; the per-call percentiles and maximum can only come from
the spans of detailed steps (column ``detail_count``), and
:attr:`StepReport.detail` says which steps had full detail.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ._aggregates import Aggregates, parse_aggregates
from ._failure import run_failure
from ._pandas import series
from ._parts import PART_COLUMNS, PART_NAMES, STEP_PARTS
from ._report_data import (
    _EVENT_COLUMNS,
    BETWEEN_STEPS,
    DETAIL_COUNT,
    VALIDATION,
    Detail,
    StepReport,
    Throughput,
)
from ._report_data import _empty_events as _empty_events
from ._report_render import (
    REPORT_FORMATS,
    render,
    render_csv,
    render_json,
    render_markdown,
    render_table,
    short_path,
)
from ._steps import (
    NOT_TRAINING_STAGES,
    assign_steps,
    event_labels,
    left_out_steps,
    name_codes,
)
from ._stragglers import DEFAULT_STRAGGLER_MARGIN, RankReport, rank_report
from .frame import _inherit

__all__ = [
    "BETWEEN_STEPS",
    "DETAIL_COUNT",
    "PART_COLUMNS",
    "PART_NAMES",
    "REPORT_FORMATS",
    "STEP_PARTS",
    "VALIDATION",
    "Detail",
    "RankReport",
    "StepReport",
    "Throughput",
    "render",
    "render_csv",
    "render_json",
    "render_markdown",
    "render_table",
    "short_path",
    "step_report",
]


def step_report(
    frame: pd.DataFrame,
    *,
    warmup_steps: int = 1,
    straggler_margin: float = DEFAULT_STRAGGLER_MARGIN,
) -> StepReport:
    """Summarise a frame of spans per event and per step (see :class:`StepReport`).

    The first ``warmup_steps`` ``trainer.step`` spans of each process, with
    their data wait and all spans inside them, are excluded, and so are the
    steps inside a scheduled profiler's window (``profiled_steps``: sampling or
    operator recording slows them; their spans stay in the trace). A frame with the
    steps of several ranks also gets ``ranks``; a rank is named a straggler
    when it arrives last at more than half of the steps by more than
    ``straggler_margin`` of the step (see :mod:`exporters._stragglers`).
    Summarised steps of a long run count like the others (the module doc).
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
    coded = name_codes(frame)
    aggregates = parse_aggregates(frame, coded)
    assignment = assign_steps(frame, warmup_steps, aggregates, coded)
    steps = assignment.steps
    n = len(frame)
    warm = np.zeros(n, dtype=bool)
    warmup, profiled, failed = left_out_steps(steps)
    left_out = warmup | profiled | failed
    warm[steps.index[left_out].to_numpy()] = True
    step_row = assignment.step_row
    in_step = step_row >= 0
    excluded = in_step & warm[np.where(in_step, step_row, 0)]
    kept_steps = steps.loc[~left_out]
    wall_total = float(kept_steps["wall_ns"].sum())
    own_self = assignment.self_ns
    self_all = frame["self_ns"].to_numpy(np.int64) if own_self is None else own_self
    on_thread = assignment.on_thread
    assert on_thread is not None and assignment.ppos is not None
    val_root, val_share = _validation_rows(frame, assignment.ppos)
    in_val = val_root >= 0
    train = ~excluded & ~in_val
    # the columns the tables read, as arrays: no copy of a million-row frame's rows
    dur = frame["dur_ns"].to_numpy(np.int64)
    device = _device_times(frame)
    assert assignment.names is not None
    codes, uniques = event_labels(frame, assignment.names)

    def table(rows: np.ndarray, in_step: np.ndarray, total: float) -> pd.DataFrame:
        """The event table of the rows where ``rows`` is true."""
        picked = None if device is None else device[rows]
        coded = (codes[rows], uniques)
        return _event_table(dur[rows], picked, in_step[rows], total, self_all[rows], coded)

    events = table(train, on_thread, wall_total)
    detail = None
    if len(aggregates.summarised):
        kept = np.zeros(n, dtype=bool)
        kept[kept_steps.index.to_numpy()] = True
        counted = aggregates.only(kept)
        events = _with_aggregates(events, counted, wall_total)
        detail = _detail(steps, aggregates, int(counted.count.sum()), frame.attrs.get("metadata"))
        kept_steps = kept_steps.assign(
            full_detail=~np.isin(kept_steps.index.to_numpy(), aggregates.summarised)
        )
    between = kept_steps["between_ns"].to_numpy(np.int64)
    if len(between) and wall_total > 0 and between.sum() > 0:
        events = _with_between_row(events, between, wall_total)
    val_total = float(dur[val_root[val_root == np.arange(n)]].sum())
    validation = table(in_val, val_share, val_total)
    return StepReport(
        events=events,
        steps=kept_steps.drop(columns=["warmup", "profiled", "failed"]).reset_index(drop=True),
        throughput=_throughput(kept_steps, steps),
        warmup_steps=warmup_steps,
        excluded_steps=int(warmup.sum()),
        profiled_steps=int(profiled.sum()),
        failed_steps=int(failed.sum()),
        profilers=_profilers(frame),
        total_steps=len(steps),
        spans=int(train.sum() + in_val.sum()),
        tables=_stored_tables(frame),
        ranks=rank_report(frame, assignment, kept_steps, margin=float(straggler_margin)),
        validation=validation,
        environment=_environment(frame),
        detail=detail,
        failure=run_failure(frame),
    )


def _profilers(frame: pd.DataFrame) -> tuple[str, ...]:
    """The names of the profilers whose windows the trace records, in first-seen order."""
    windows = frame.attrs.get("profile_windows")
    names = [w.get("profiler") for w in windows if isinstance(w, dict)] if windows else []
    return tuple(dict.fromkeys(str(name) for name in names if name))


def _detail(steps: pd.DataFrame, aggregates: Aggregates, spans: int, metadata: Any) -> Detail:
    """Which of ``steps`` (all, warmup included, per process in start order) had full
    detail, as a :class:`Detail` (with the policy recorded in ``metadata``, the trace's
    ``otherData``, if any)."""
    policy = metadata.get("ppetrace.detail") if isinstance(metadata, dict) else None
    summarised = np.isin(steps.index.to_numpy(), aggregates.summarised)
    full = ~summarised
    pid = steps["pid"].to_numpy(np.int64)
    index = steps["step_index"].to_numpy(np.int64)
    # runs of consecutive detailed steps of one process
    p, i = pid[full], index[full]
    new = np.ones(len(p), dtype=bool)
    new[1:] = (p[1:] != p[:-1]) | (i[1:] != i[:-1] + 1)
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(p)).astype(np.int64) - 1 if len(p) else first
    return Detail(
        steps=len(steps),
        detailed=int(full.sum()),
        summarised=int(summarised.sum()),
        unknown=len(aggregates.unknown),
        ranges=tuple((int(p[a]), int(i[a]), int(i[b])) for a, b in zip(first, last, strict=True)),
        spans_summarised=spans,
        policy=dict(policy) if isinstance(policy, dict) else None,
    )


def _with_aggregates(
    events: pd.DataFrame, aggregates: Aggregates, wall_total: float
) -> pd.DataFrame:
    """``events`` (from the spans) with the aggregates of the counted summarised steps
    added: count, total, self and share cover every step, the mean is total over count;
    the percentiles and max stay those of the spans, counted in ``detail_count``."""
    out = events.copy()
    out.insert(2, DETAIL_COUNT, out["count"].astype(np.int64))
    if not len(aggregates):
        return out
    table = pd.DataFrame(
        {
            "event": aggregates.event,
            "count": aggregates.count,
            "total_ns": aggregates.total_ns,
            "self_ns": aggregates.self_ns,
        }
    )
    sums = table.groupby("event", sort=False).sum()
    names = aggregates.names[sums.index.to_numpy(dtype=np.int64)]
    where = {name: i for i, name in enumerate(out["event"].tolist())}
    at = np.array([where.get(name, -1) for name in names], dtype=np.int64)
    count = out["count"].to_numpy(np.int64).copy()
    total = out["total_ns"].to_numpy(np.int64).copy()
    self_ns = out["self_ns"].to_numpy(np.int64).copy()
    share = out["share"].to_numpy(float).copy()
    old = at >= 0
    add_count, add_total, add_self = (sums[c].to_numpy(np.int64) for c in sums.columns)
    count[at[old]] += add_count[old]
    total[at[old]] += add_total[old]
    self_ns[at[old]] += add_self[old]
    if wall_total > 0:  # aggregated spans are inside their step, on its thread
        share[at[old]] = np.nan_to_num(share[at[old]]) + add_self[old] / wall_total
    out["count"], out["total_ns"], out["self_ns"], out["share"] = count, total, self_ns, share
    new = ~old
    if new.any():
        rows = pd.DataFrame({c: np.full(int(new.sum()), np.nan) for c in out.columns})
        rows["event"] = series(names[new])
        rows[DETAIL_COUNT] = 0
        rows["count"], rows["total_ns"], rows["self_ns"] = (
            add_count[new],
            add_total[new],
            add_self[new],
        )
        rows["share"] = add_self[new] / wall_total if wall_total > 0 else np.nan
        out = pd.concat([out, rows], ignore_index=True)
    out["mean_ns"] = out["total_ns"].to_numpy(float) / out["count"].to_numpy(float)
    for col in (DETAIL_COUNT, "count", "total_ns", "self_ns"):
        out[col] = out[col].astype(np.int64)
    totals = out["total_ns"].to_numpy()
    labels = out["event"].tolist()
    order = sorted(range(len(out)), key=lambda i: (-totals[i], labels[i]))
    return out.iloc[order].reset_index(drop=True)


def _environment(frame: pd.DataFrame) -> dict[str, Any]:
    """The trace's ``otherData.environment`` (``frame.attrs["metadata"]``), or ``{}``."""
    meta = frame.attrs.get("metadata")
    env = meta.get("environment") if isinstance(meta, dict) else None
    return dict(env) if isinstance(env, dict) else {}


def _validation_rows(frame: pd.DataFrame, ppos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the row of its outermost validation ancestor-or-self (-1 if none), and
    whether the row runs on that span's thread (its share counts). Validation is a
    ``trainer.validation`` span or a span whose ``stage`` is ``val`` or ``test`` (the
    evaluator's of ``Trainer.validate``/``test`` or a standalone ``Evaluator``), as in
    ``compare``."""
    n = len(frame)
    names = frame["name"].to_numpy(dtype=object)
    marked = names == VALIDATION
    if "stage" in frame.columns:
        marked |= frame["stage"].isin(NOT_TRAINING_STAGES).to_numpy(dtype=bool)
    val_rows = np.flatnonzero(marked)
    if not len(val_rows):
        return np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=bool)
    # the outermost: a validation row below another one takes that one's root
    mark = np.full(n, np.nan)
    mark[val_rows] = val_rows
    up = np.where(ppos >= 0, ppos, 0)
    above = np.where(ppos >= 0, _inherit(mark, ppos)[up], np.nan)
    roots = val_rows[np.isnan(above[val_rows])]
    mark = np.full(n, np.nan)
    mark[roots] = roots
    filled = _inherit(mark, ppos)
    root = np.where(np.isnan(filled), -1, filled).astype(np.int64)
    at = np.where(root >= 0, root, 0)
    pid = frame["pid"].to_numpy(np.int64)
    tid = frame["tid"].to_numpy(np.int64)
    return root, (root >= 0) & (pid[at] == pid) & (tid[at] == tid)


def _with_between_row(events: pd.DataFrame, between: np.ndarray, wall_total: float) -> pd.DataFrame:
    """``events`` with the ``(between steps)`` row: per counted step, the wall time
    outside its spans (so that ``share`` adds up to 1 over the steps)."""
    gap = between.astype(float)
    row: dict[str, Any] = {c: np.nan for c in events.columns}
    row.update(
        event=BETWEEN_STEPS,
        count=len(gap),
        total_ns=gap.sum(),
        mean_ns=gap.mean(),
        p50_ns=np.quantile(gap, 0.5),
        p90_ns=np.quantile(gap, 0.9),
        p99_ns=np.quantile(gap, 0.99),
        max_ns=gap.max(),
        self_ns=gap.sum(),
        share=gap.sum() / wall_total,
    )
    row.update(count=len(gap), total_ns=int(between.sum()), self_ns=int(between.sum()))
    if DETAIL_COUNT in row:  # its statistics are over every step
        row[DETAIL_COUNT] = len(gap)
    row.update(max_ns=int(between.max()))
    out = pd.concat([events, pd.DataFrame([row], columns=events.columns)], ignore_index=True)
    for col, dtype in events.dtypes.items():  # whole numbers stay whole
        if dtype.kind in "iu" and out[col].notna().all():
            out[col] = out[col].astype(dtype)
    totals = out["total_ns"].to_numpy(dtype=float)
    labels = out["event"].tolist()
    order = sorted(range(len(out)), key=lambda i: (-totals[i], labels[i]))
    return out.iloc[order].reset_index(drop=True)


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


def _device_times(frame: pd.DataFrame) -> np.ndarray | None:
    """The frame's device time per span (float ns, NaN where unknown), or None when it
    has none at all."""
    if "device_dur_ns" not in frame.columns:
        return None
    dev = pd.to_numeric(frame["device_dur_ns"], errors="coerce").to_numpy(dtype=float)
    return dev if np.isfinite(dev).any() else None


def _event_table(
    dur: np.ndarray,
    device: np.ndarray | None,
    in_step: np.ndarray,
    wall_total: float,
    self_ns: np.ndarray,
    coded: tuple[np.ndarray, np.ndarray],
) -> pd.DataFrame:
    """Per event: inclusive statistics, self time, and ``share``: the self time of the
    rows in ``in_step`` over ``wall_total`` (NaN for an event with no such row).
    The rows' durations, device times (:func:`_device_times`) and names as (codes,
    uniques): grouped by integer codes, any name works, whatever pandas' string storage."""
    if not len(dur):
        return _empty_events()
    codes, names = coded
    step_self = np.where(in_step, self_ns, 0)
    grouped = _sums_by_code(codes, len(names), dur, self_ns, step_self, in_step)
    if grouped is None:
        grouped = _sums_by_pandas(codes, dur, self_ns, step_self, in_step)
    out, step_sum, any_in_step = grouped
    by_code = pd.Series(dur).groupby(codes, sort=False)
    q = by_code.quantile([0.5, 0.9, 0.99]).unstack()
    out["p50_ns"] = q[0.5]
    out["p90_ns"] = q[0.9]
    out["p99_ns"] = q[0.99]
    if wall_total > 0:
        out["share"] = (step_sum / wall_total).where(any_in_step)
    else:
        out["share"] = np.nan
    columns = list(_EVENT_COLUMNS)
    if device is not None and np.isfinite(device).any():
        dg = pd.Series(device).groupby(codes, sort=False)
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


_Grouped = tuple[pd.DataFrame, pd.Series, pd.Series]
_EXACT = float(2**52)  # float64 sums of whole numbers below this are exact


def _sums_by_code(
    codes: np.ndarray,
    k: int,
    dur: np.ndarray,
    self_ns: np.ndarray,
    step_self: np.ndarray,
    in_step: np.ndarray,
) -> _Grouped | None:
    """Per event code: count, total, mean, max and self time (the table's first
    columns), the self time in steps and whether any row is in a step, by counting
    sorts of the codes (``np.bincount``) rather than a frame of the rows and pandas'
    groupby (:func:`_sums_by_pandas`, the same figures). None where a sum could be
    inexact in float64 (its absolute values add up to 2**52 or more) or a code is
    negative (a missing name): the caller then groups with pandas."""
    if not len(codes) or int(codes.min()) < 0:
        return None
    weights = (dur, self_ns, step_self)
    if any(float(np.abs(w).sum(dtype=np.float64)) >= _EXACT for w in weights):
        return None
    count = np.bincount(codes, minlength=k)
    at = np.flatnonzero(count)  # the codes of the events present

    def total(w: np.ndarray) -> np.ndarray:
        return np.rint(np.bincount(codes, weights=w, minlength=k)[at]).astype(np.int64)

    longest = np.full(k, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(longest, codes, dur)
    totals, n = total(dur), count[at]
    out = pd.DataFrame(
        {
            "count": n,
            "total_ns": totals,
            "mean_ns": totals / n,
            "max_ns": longest[at],
            "self_ns": total(self_ns),
        },
        index=at,
    )
    inside = np.bincount(codes, weights=in_step.astype(np.float64), minlength=k)[at] > 0
    return out, pd.Series(total(step_self), index=at), pd.Series(inside, index=at)


def _sums_by_pandas(
    codes: np.ndarray,
    dur: np.ndarray,
    self_ns: np.ndarray,
    step_self: np.ndarray,
    in_step: np.ndarray,
) -> _Grouped:
    """:func:`_sums_by_code` by pandas' groupby, for any sizes and codes."""
    data = pd.DataFrame(
        {
            "event": codes,
            "dur": dur,
            "self": self_ns,
            "in_step": step_self,
            "inside": in_step.astype(np.int8),
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
    return out, g["in_step"].sum(), g["inside"].max() > 0


def _throughput(steps: pd.DataFrame, every_step: pd.DataFrame) -> Throughput:
    """Steps and samples per second of the counted ``steps``: per process over its summed
    step wall time; over the processes that ran at the same time (the ranks of one run)
    samples/s add up and steps/s is their mean (data-parallel ranks take each step
    together); processes that did not run at the same time (sequential runs merged into
    one trace) are joined one after another (their times add, their rates do not).
    Whether two processes ran at the same time is read from all their steps
    (``every_step``, the warmup too)."""
    if not len(steps):
        return Throughput(0, 0, 0.0, None, None, 0)
    sizes = steps["batch_size"]
    known = bool(sizes.notna().all())
    per = steps.groupby("pid", sort=False).agg(
        n=("wall_ns", "size"), wall=("wall_ns", "sum"), samples=("batch_size", "sum")
    )
    span = every_step.groupby("pid", sort=False).agg(
        first=("start_ns", "min"), last=("end_ns", "max")
    )
    per = per.join(span).sort_values("first", kind="stable")
    # processes that overlap in time form a group; groups follow one another
    ends = per["last"].to_numpy(np.int64)
    starts = per["first"].to_numpy(np.int64)
    new_group = np.ones(len(per), dtype=bool)
    new_group[1:] = starts[1:] >= np.maximum.accumulate(ends)[:-1]
    group = np.cumsum(new_group)
    steps_time = samples_time = 0.0  # each group's time at its summed rate, added up
    n_steps = n_samples = 0.0
    for g in np.unique(group):
        part = per.loc[group == g]
        wall_s = part["wall"].to_numpy(float) / 1e9
        ok = wall_s > 0
        if not ok.any():
            continue
        # the ranks of a data-parallel run take their steps together: the run's step rate
        # is a rank's (their mean), while their samples add up
        rate = float((part["n"].to_numpy(float)[ok] / wall_s[ok]).mean())
        count = float(part["n"].to_numpy(float)[ok].mean())
        steps_time += count / rate
        n_steps += count
        if known:
            sample_rate = float((part["samples"].to_numpy(float)[ok] / wall_s[ok]).sum())
            count_s = float(part["samples"].to_numpy(float)[ok].sum())
            if sample_rate > 0:
                samples_time += count_s / sample_rate
                n_samples += count_s
    return Throughput(
        steps=len(steps),
        wall_ns=int(steps["wall_ns"].sum()),
        steps_per_s=n_steps / steps_time if steps_time > 0 else 0.0,
        samples=int(sizes.sum()) if known else None,
        samples_per_s=(n_samples / samples_time if samples_time > 0 else 0.0) if known else None,
        processes=int(steps["pid"].nunique()),
        concurrent=int(np.bincount(group).max()),
    )
