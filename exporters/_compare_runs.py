"""One run, reduced to what :func:`exporters.compare` needs: per event, the median of
its per-step samples and that median's sampling error, plus the run's environment.

The samples of an event are *per step*: the event's total time inside each
counted (non-warmup) training step (a ``trainer.step``, its
``trainer.fetch_batch`` and everything under them; see :mod:`exporters._steps`).
A long run's summarised steps (:mod:`exporters._aggregates`) give their
samples from their aggregates' totals, so every event is compared over every
step, detailed or not; a summarised step whose aggregates cannot be read (its
names list is in a part that was not read) gives no sample of its hooks.
An event outside steps contributes one sample per span. One more "event",
:data:`STEP_WALL` (``step.wall``), is no span: its samples are the counted steps'
wall time as the step report gives it (the data wait, the step and the time
between steps; see :mod:`exporters._steps`), so a slower loader or a slower loop
around the steps shows in it, while ``trainer.step`` is the step's own span. Validation is left
out, as in the step report: ``trainer.validation`` spans with everything below
them, and spans whose ``stage`` (``ppetrace.stage``) is ``"val"`` or ``"test"``
with everything below them (``instrument()`` marks its ``no_grad`` forwards so).

Runs of several ranks: a merged trace is one run whose samples are every
rank's steps (over all ranks), or one rank's (``rank=R``). Separate rank files
of one run share its trace id (``otherData.trace_id``): :func:`group_runs`
joins them into one frame per run, so a folder of rank files counts as one run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ._aggregates import parse_aggregates
from ._compare_stats import log_median_se
from ._failure import run_failure
from ._report_data import VALIDATION
from ._steps import (
    NOT_TRAINING_STAGES,
    STEP,
    STEP_WALL,
    assign_steps,
    event_labels,
    left_out_steps,
    name_codes,
)
from .frame import _inherit

__all__ = [
    "EventStat",
    "RunSummary",
    "drop_copies",
    "event_samples",
    "group_runs",
    "run_failure",
    "run_identity",
    "summarize_run",
]


def event_samples(frame: pd.DataFrame, *, warmup_steps: int = 1) -> dict[str, np.ndarray]:
    """Per-event duration samples in ns: per counted step, the event's total time in
    that step (summarised steps: from their aggregates); for spans outside steps, one
    sample per span; validation, the warmup and the profiled steps left out."""
    return _samples(frame, warmup_steps)[0]


def _samples(frame: pd.DataFrame, warmup_steps: int) -> tuple[dict[str, np.ndarray], int]:
    """:func:`event_samples`, and how many steps (past the warmup) were left out for being
    inside a profiler's window."""
    n = len(frame)
    if n == 0:
        return {}, 0
    coded = name_codes(frame)
    aggregates = parse_aggregates(frame, coded)
    assignment = assign_steps(frame, warmup_steps, aggregates, coded)
    assert assignment.ppos is not None
    steps = assignment.steps
    warm = np.zeros(n, dtype=bool)
    # the warmup and the profiled steps (their profiling slowed them) are left out
    warmup, in_window, failed = left_out_steps(steps)
    profiled = int(in_window.sum())
    left_out = warmup | in_window | failed  # (a step cut off by an exception: no sample)
    warm[steps.index[left_out].to_numpy()] = True
    step_row = assignment.step_row
    in_step = step_row >= 0
    keep = ~(in_step & warm[np.where(in_step, step_row, 0)]) & ~_validation(frame, assignment.ppos)
    unit = np.where(in_step, step_row, -1 - np.arange(n))[keep]
    all_codes, uniques = event_labels(frame, coded)
    codes = all_codes[keep]  # (codes of names left out leave gaps: no sample has them)
    dur = frame["dur_ns"].to_numpy(np.int64)[keep]
    if len(aggregates):  # the summarised steps' totals, in the counted steps
        counted = aggregates.only(~warm)
        known = {name: i for i, name in enumerate(uniques)}
        extra = [name for name in counted.names if name not in known]
        known.update((name, len(uniques) + i) for i, name in enumerate(extra))
        uniques = np.concatenate([np.asarray(uniques, dtype=object), np.array(extra, dtype=object)])
        as_code = np.array([known[name] for name in counted.names], dtype=np.int64)
        unit = np.concatenate([unit, counted.step_row])
        codes = np.concatenate([codes, as_code[counted.event]])
        dur = np.concatenate([dur, counted.total_ns])
    wall = steps["wall_ns"].to_numpy(np.int64)[~left_out].astype(float)
    if not len(codes):
        return ({STEP_WALL: wall} if len(wall) else {}), profiled
    order = np.lexsort((unit, codes))
    c, u, d = codes[order], unit[order], dur[order]
    first = np.ones(len(c), dtype=bool)
    first[1:] = (c[1:] != c[:-1]) | (u[1:] != u[:-1])
    sums = np.add.reduceat(d, np.flatnonzero(first)).astype(float)
    events = c[first]
    cuts = np.flatnonzero(events[1:] != events[:-1]) + 1
    samples = {
        str(uniques[part_events[0]]): part
        for part_events, part in zip(np.split(events, cuts), np.split(sums, cuts), strict=True)
    }
    if len(wall):
        samples[STEP_WALL] = wall  # each counted step's wall time, as the step report's
    return samples, profiled


def _validation(frame: pd.DataFrame, ppos: np.ndarray) -> np.ndarray:
    """Whether each row is validation: a ``trainer.validation`` span, a span whose
    ``stage`` is ``"val"`` or ``"test"``, or a span below either."""
    mark = frame["name"].to_numpy(dtype=object) == VALIDATION
    if "stage" in frame.columns:
        mark |= frame["stage"].isin(NOT_TRAINING_STAGES).to_numpy(dtype=bool)
    if not mark.any():
        return mark
    return ~np.isnan(_inherit(np.where(mark, 1.0, np.nan), ppos))


@dataclass(frozen=True)
class EventStat:
    """One event in one run: ``n`` samples, their ``median_ns``, and ``log_se``, the
    standard error of ``log(median)`` estimated from the samples."""

    n: int
    median_ns: float
    log_se: float


@dataclass(frozen=True)
class RunSummary:
    """One run as :func:`exporters.compare` sees it: ``events`` (name ->
    :class:`EventStat`), the ``environment`` recorded in the trace's
    ``otherData`` (``None`` when it has none), ``source`` (its file, if any) and
    ``step_samples``: its ``trainer.step`` samples in ns, kept for the step-time
    distributions of :func:`exporters.render_comparison_html` (``None`` without);
    ``step_count``: its ``trainer.step`` spans, warmup included (``None`` when not
    known), so that a run whose steps are all warmup can be told apart;
    ``profiled_steps``: the steps left out for being inside a profiler's window."""

    events: Mapping[str, EventStat]
    environment: Mapping[str, Any] | None = None
    source: str | None = None
    step_samples: np.ndarray | None = field(default=None, compare=False, repr=False)
    #: ``trainer.step`` spans in the run, warmup included (``None``: not known).
    step_count: int | None = field(default=None, compare=False, repr=False)
    #: steps past the warmup left out for being inside a profiler's window
    profiled_steps: int = field(default=0, compare=False, repr=False)
    #: how the run failed (:func:`run_failure`), or ``None``: it ended without an error
    failure: str | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_samples(
        cls,
        samples: Mapping[str, Any],
        *,
        environment: Mapping[str, Any] | None = None,
        source: str | None = None,
    ) -> RunSummary:
        """A summary of one run from per-event duration samples in ns (one array-like per
        event, e.g. :func:`event_samples` of a frame, or timings from elsewhere)."""
        events = {}
        for name, values in samples.items():
            array = np.asarray(values, dtype=float)
            if array.ndim != 1 or not len(array) or not np.all(np.isfinite(array)):
                what = (
                    f"an array of shape {array.shape}"
                    if array.ndim != 1 or not len(array)
                    else f"{int((~np.isfinite(array)).sum())} values that are not finite"
                )
                raise ValueError(
                    f"Expected a non-empty 1-D sequence of finite durations in ns for the "
                    f"event {name!r}, but received {what}."
                )
            events[str(name)] = _stat(array)
        step = samples.get(STEP)
        return cls(
            events,
            None if environment is None else dict(environment),
            source,
            None if step is None else np.asarray(step, dtype=float),
        )


def _stat(samples: np.ndarray) -> EventStat:
    # log of at least 1 ns: a zero-length span (clock granularity) stays finite
    logs = np.log(np.maximum(samples, 1.0))
    return EventStat(len(samples), float(np.median(samples)), log_median_se(logs))


def summarize_run(
    frame: pd.DataFrame,
    *,
    warmup_steps: int = 1,
    source: str | None = None,
    rank: int | None = None,
) -> RunSummary:
    """Reduce one run's span frame to a :class:`RunSummary` (see the module doc).

    ``warmup_steps`` steps at the start of each process are left out. The
    environment comes from ``frame.attrs["metadata"]["environment"]``, which
    :func:`exporters.read_chrome_trace` fills from the file's ``otherData``, with
    ``ranks`` added for a run of several ranks (comparing runs of different world sizes
    is then named as an environment difference); ``source`` defaults to
    ``frame.attrs["path"]``. ``rank`` keeps one rank's spans (of a merged trace); by
    default every rank's steps are samples.
    """
    if not isinstance(frame, pd.DataFrame) or "dur_ns" not in frame.columns:
        raise TypeError(
            "Expected a span frame (from exporters.spans_to_frame or read_chrome_trace), "
            f"but received {type(frame).__name__}."
        )
    world = _world(frame)
    failure = run_failure(frame)  # of the whole run: another rank's failure is the run's
    if rank is not None:
        ranks = pd.to_numeric(frame["rank"], errors="coerce")
        mine = frame.loc[(ranks == rank).fillna(False).to_numpy(dtype=bool)]
        if not len(mine):
            found = sorted(int(r) for r in ranks.dropna().unique())
            raise ValueError(
                f"Expected spans of rank {rank} in "
                f"{frame.attrs.get('path') or 'the run'}, but it has "
                f"{'ranks ' + ', '.join(map(str, found)) if found else 'no rank'}. Pass one "
                "of those, or leave rank out to use every rank."
            )
        mine.attrs = dict(frame.attrs)
        frame = mine
    samples, profiled = _samples(frame, warmup_steps)
    metadata = frame.attrs.get("metadata")
    environment = metadata.get("environment") if isinstance(metadata, Mapping) else None
    if not isinstance(environment, Mapping):
        environment = None
    elif world > 1:  # a 2-rank run against a 1-rank one measures the ranks too
        environment = {**environment, "ranks": world}
    if source is None and frame.attrs.get("path") is not None:
        source = str(frame.attrs["path"])
    summary = RunSummary.from_samples(samples, environment=environment, source=source)
    steps = int((frame["name"].to_numpy(dtype=object) == STEP).sum())
    return dataclasses.replace(summary, step_count=steps, profiled_steps=profiled, failure=failure)


def _world(frame: pd.DataFrame) -> int:
    """How many ranks a run has: the distinct ranks of its spans, or the world size its
    file records, if larger; 1 for a single process."""
    found = 0
    if "rank" in frame.columns:
        found = int(pd.to_numeric(frame["rank"], errors="coerce").dropna().nunique())
    meta = frame.attrs.get("metadata")
    size = meta.get("world_size") if isinstance(meta, Mapping) else None
    if isinstance(size, int) and not isinstance(size, bool) and size > found:
        found = size
    return max(found, 1)


def _rank_of(frame: pd.DataFrame) -> int | None:
    meta = frame.attrs.get("metadata")
    rank = meta.get("rank") if isinstance(meta, Mapping) else None
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def run_identity(frame: pd.DataFrame) -> tuple[Any, ...] | None:
    """What makes a trace file one recording: its trace id, rank, host, process and start
    (``otherData``), with its span count and first and last times; None when its file
    records no trace id or start. Two files with one identity are copies of one run (a
    file copied, ``ppetrace repair``'s copy); two fits of one process, which share the
    trace id, start apart."""
    meta = frame.attrs.get("metadata")
    if not isinstance(meta, Mapping):
        return None
    trace_id, started = meta.get("trace_id"), meta.get("start_time_ns")
    if not (isinstance(trace_id, str) and trace_id) or not isinstance(started, int):
        return None
    n = len(frame)
    first = int(frame["start_ns"].min()) if n else None
    last = int(frame["end_ns"].max()) if n else None
    rest = [meta.get(k) for k in ("rank", "host", "pid")]
    rest = [_hashable(v) for v in rest]  # (a file may hold anything there)
    return (trace_id, *rest, started, n, first, last)


def drop_copies(
    frames: list[pd.DataFrame],
) -> tuple[list[pd.DataFrame], list[tuple[Any, Any]]]:
    """``frames`` with each recording once (:func:`run_identity`): a copy of a file given
    before is left out, and so is a rank file that a merged trace among ``frames`` holds
    (``otherData.merged_from``: the same trace id, rank, host, process and start), so one
    run never counts as several independent runs. Returns the frames kept and, per frame
    left out, its path and the path of the one that holds it."""
    held: dict[tuple[Any, ...], pd.DataFrame] = {}  # the inputs of the merged traces
    for frame in frames:
        meta = frame.attrs.get("metadata")
        merged = meta.get("merged_from") if isinstance(meta, Mapping) else None
        for source in merged if isinstance(merged, list) else ():
            other = source.get("otherData") if isinstance(source, Mapping) else None
            key = _origin_key(other)
            if key is not None:
                held.setdefault(key, frame)
    kept: list[pd.DataFrame] = []
    seen: dict[tuple[Any, ...], tuple[Any, pd.DataFrame]] = {}
    copies: list[tuple[Any, Any]] = []
    for frame in frames:
        meta = frame.attrs.get("metadata")
        origin = (
            _origin_key(meta) if isinstance(meta, Mapping) and "merged_from" not in meta else None
        )
        holder = None if origin is None else held.get(origin)
        if holder is not None:
            copies.append((frame.attrs.get("path"), holder.attrs.get("path")))
            if frame.attrs.get("truncated"):
                holder.attrs["truncated"] = True
            continue
        key = run_identity(frame)
        if key is not None and key in seen:
            copies.append((frame.attrs.get("path"), seen[key][0]))
            if frame.attrs.get("truncated"):  # a cut-off file and its repaired copy
                seen[key][1].attrs["truncated"] = True
            continue
        if key is not None:
            seen[key] = (frame.attrs.get("path"), frame)
        kept.append(frame)
    return kept, copies


def _origin_key(other: Any) -> tuple[Any, ...] | None:
    """What names one process's recording in its ``otherData``: trace id, rank, host,
    process and start (None without a trace id and a start)."""
    if not isinstance(other, Mapping):
        return None
    trace_id, started = other.get("trace_id"), other.get("start_time_ns")
    if not (isinstance(trace_id, str) and trace_id) or not isinstance(started, int):
        return None
    rest = [_hashable(other.get(k)) for k in ("rank", "host", "pid")]
    return (trace_id, *rest, started)


def _hashable(value: Any) -> Any:
    """A metadata value as a key: None, str and int as they are, anything else its repr
    (a file may hold a list there)."""
    return value if value is None or isinstance(value, (str, int)) else repr(value)


def group_runs(frames: list[pd.DataFrame]) -> list[pd.DataFrame]:
    """Join the rank files of one run into one frame each, in first-seen order: frames
    that share ``otherData.trace_id`` and ``otherData.run_id`` (one call: a job's calls
    share the trace id) and each have a different ``otherData.rank`` (what the ranks of a
    torchrun run write). Any other frame is a run of its own (files of one process, such
    as two fits, share a trace id and a rank). Pids that two joined frames share are
    moved apart."""
    groups: dict[object, list[pd.DataFrame]] = {}
    for i, frame in enumerate(frames):
        meta = frame.attrs.get("metadata")
        meta = meta if isinstance(meta, Mapping) else {}
        tid = meta.get("trace_id")
        key = (tid, _hashable(meta.get("run_id"))) if isinstance(tid, str) and tid else ("file", i)
        groups.setdefault(key, []).append(frame)
    out: list[pd.DataFrame] = []
    for members in groups.values():
        ranks = [_rank_of(f) for f in members]
        if len(members) == 1 or None in ranks or len(set(ranks)) != len(ranks):
            out.extend(members)
            continue
        parts: list[pd.DataFrame] = []
        used: set[int] = set()
        for frame in members:
            pids = set(frame["pid"].unique().tolist())
            if pids & used:
                shift = max(used | pids) + 1 - min(pids)
                frame = frame.assign(pid=frame["pid"] + shift)
                pids = {p + shift for p in pids}
            used |= pids
            parts.append(frame)
        joined = pd.concat(parts, ignore_index=True)
        joined.attrs = dict(members[0].attrs)
        cut = [str(f.attrs.get("path")) for f in members if f.attrs.get("truncated")]
        joined.attrs["truncated"] = bool(cut)
        if cut:
            joined.attrs["truncated_paths"] = cut
        paths = [str(f.attrs.get("path")) for f in members if f.attrs.get("path")]
        joined.attrs["path"] = " + ".join(paths) if paths else None
        out.append(joined)
    return out
