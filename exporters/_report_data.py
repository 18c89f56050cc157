"""The step report's data: :class:`StepReport` and :class:`Throughput` (built by
:func:`exporters.step_report`, rendered by :mod:`exporters._report_render`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ._parts import PART_COLUMNS, PART_NAMES
from ._stragglers import RankReport

__all__ = ["BETWEEN_STEPS", "DETAIL_COUNT", "VALIDATION", "Detail", "StepReport", "Throughput"]

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
_STEP_PARTS = (("wall", "wall_ns"), *zip(PART_NAMES, PART_COLUMNS, strict=True))
#: The events-table row for the step time that no span inside a step covers.
BETWEEN_STEPS = "(between steps)"
#: The spans reported apart from training steps (with everything below them).
VALIDATION = "trainer.validation"
#: The events-table column, present when some steps are summarised, with the number of
#: spans in steps with full detail: the ones the percentiles and the maximum are over.
DETAIL_COUNT = "detail_count"


def _empty_events() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=float) for c in _EVENT_COLUMNS}).astype(
        {"event": object}
    )


@dataclass(frozen=True)
class Throughput:
    """Training throughput over the counted (non-warmup) steps.

    Rates are per process (steps over the summed step wall time). Over the
    processes that ran at the same time, samples/s add up (data-parallel ranks
    add their samples) and steps/s is their mean (the ranks take each step
    together: the run's step rate is a rank's); processes whose steps did not
    overlap in time (runs one after another, merged into one trace) are one
    stream, whose times add.
    ``samples``/``samples_per_s`` are ``None`` unless every counted step has
    a batch size (``ppetrace.batch_size``). ``processes``: the processes with
    counted steps; ``concurrent``: the most of them that ran at the same time.
    """

    steps: int
    wall_ns: int
    steps_per_s: float
    samples: int | None
    samples_per_s: float | None
    processes: int
    concurrent: int = 1


@dataclass(frozen=True)
class Detail:
    """Which steps of a long run had full detail (every span written) and which were
    summarised (their hook-level spans written as per-event aggregates).

    ``steps``: ``trainer.step`` spans found (warmup included); ``detailed`` and
    ``summarised``: how many of them had full detail or were summarised;
    ``unknown``: summarised steps whose aggregates cannot be read (their names
    list is in a part that was not read: read the run from its first part);
    ``ranges``: the detailed steps as ``(pid, first, last)`` runs of consecutive
    ``step_index`` values (inclusive), in order; ``spans_summarised``: the spans
    that the aggregates of the counted (non-warmup) steps stand for; ``policy``:
    the trace's ``otherData["ppetrace.detail"]`` (``policy``, ``max_trace_bytes``,
    ``schedule``) when it records one.
    """

    steps: int
    detailed: int
    summarised: int
    unknown: int
    ranges: tuple[tuple[int, int, int], ...]
    spans_summarised: int = 0
    policy: dict[str, Any] | None = field(default=None, hash=False)

    def describe(self, *, limit: int = 6) -> str:
        """One line: ``Full detail: 331 of 1,000 steps (step_index 0-329, 999)...``."""
        pids = list(dict.fromkeys(r[0] for r in self.ranges))
        spans = []
        for pid in pids:
            text = _compact([(a, b) for p, a, b in self.ranges if p == pid], limit)
            spans.append(text if len(pids) == 1 else f"pid {pid}: {text}")
        where = f" (step_index {'; '.join(spans)})" if spans else ""
        n = self.spans_summarised
        line = (
            f"Full detail: {self.detailed:,} of {self.steps:,} steps{where}; "
            f"{self.summarised:,} summarised (per-event aggregates of {n:,} "
            f"span{'s' if n != 1 else ''} in the steps past the warmup)."
        )
        policy = self.policy or {}
        if policy.get("policy") in ("auto", "schedule"):
            line += f" trace_detail={policy['policy']}"
            if isinstance(policy.get("max_trace_bytes"), int):
                line += f", max_trace_bytes={policy['max_trace_bytes']:,}"
            line += "."
        if self.unknown:
            line += (
                f" {self.unknown:,} summarised step{'s' if self.unknown != 1 else ''} "
                "cannot be read (names list not found: read the run from its first part); "
                "their hook time is unknown and counts as trainer.step self time."
            )
        return line


def _compact(ranges: list[tuple[int, int]], limit: int) -> str:
    """Ranges of step indices as short text: ``0-329, 999-9,999 every 1,000``: a run of
    three or more single steps at a fixed stride is one item; at most ``limit`` items."""
    items: list[str] = []
    i = 0
    while i < len(ranges):
        a, b = ranges[i]
        j = i
        if a == b and i + 2 < len(ranges):
            stride = ranges[i + 1][0] - a
            while (
                j + 1 < len(ranges)
                and ranges[j + 1][0] == ranges[j + 1][1]
                and ranges[j + 1][0] - ranges[j][0] == stride
            ):
                j += 1
        if j - i >= 2:
            items.append(f"{a:,}-{ranges[j][0]:,} every {stride:,}")
            i = j + 1
            continue
        items.append(f"{a:,}" if a == b else f"{a:,}-{b:,}")
        i += 1
    if len(items) > limit:
        items = [*items[: limit - 1], f"... {len(items) - limit:,} more ...", items[-1]]
    return ", ".join(items)


@dataclass
class StepReport:
    """A step report: plain data, rendered by the ``render_*`` functions.

    - ``events``: one row per event name outside validation, columns ``event,
      count, total_ns, mean_ns, p50_ns, p90_ns, p99_ns, max_ns, self_ns,
      share``. ``total_ns`` and the statistics are *inclusive* (a span with
      its children); ``self_ns`` is without the children on its thread.
      ``share`` is the self time inside the counted steps, on the step's
      thread, over the steps' wall time: it adds up to 1 over the events
      inside steps and the ``(between steps)`` row (loop time no span inside a
      step covers); NaN for events never inside a step. Plus
      ``device_total_ns`` and ``device_mean_ns`` when spans carry device time.
      Sorted by total time.
    - ``validation``: the same table for ``trainer.validation`` spans, spans of
      stage ``val``, ``test`` or ``predict`` (``Trainer.validate``/``test``, a standalone
      ``Evaluator`` and a ``LightningProfiler`` stage other than ``fit`` have no
      ``trainer.validation``) and every span below them
      (reported apart from the training steps), ``share`` being self time over
      the summed time of the outermost of them.
    - ``steps``: one row per counted step: ``step_index`` (per process),
      ``pid, rank, epoch, step, batch_idx, batch_size, start_ns, end_ns,
      wall_ns``, the parts ``data_wait_ns, forward_ns, backward_ns,
      optimizer_ns, other_ns`` (adding up to ``wall_ns``; see
      :data:`exporters.STEP_PARTS`), ``compute_ns`` (the ``trainer.step``
      span less the fetches inside it), ``between_ns`` (wall time outside
      the step and its fetch) and ``device_ns``.
    - ``throughput``: a :class:`Throughput`.
    - ``warmup_steps``: the requested warmup; ``excluded_steps``: how many
      steps it removed; ``profiled_steps``: how many other steps were left out
      because a profiler's window held them (``profilers``: which profilers
      recorded windows); ``failed_steps``: how many more were left out for ending
      with ERROR status (cut off by an exception); ``total_steps``: steps found;
      ``spans``: spans counted.
    - ``tables``: extra named tables: those stored in the trace file (the
      Pyinstrument profiler stores ``top_functions``) and any that other code
      adds; the renderers print them last.
    - ``ranks``: for steps of two ranks or more, a :class:`RankReport` (per-rank
      step times, which rank arrived last at each step's gradient sync, and the
      straggler verdict); ``None`` otherwise.
    - ``environment``: what the run ran on (the trace's
      ``otherData.environment``: ``device``, ``torch_threads``, ``cpu_count``,
      ...); empty when the trace does not say.
    - ``detail``: for a long run whose trace summarised some steps, a
      :class:`Detail` (which steps had full detail); ``None`` when every step
      had. Then ``events`` covers every step: ``count``, ``total_ns``,
      ``mean_ns`` (total over count), ``self_ns`` and ``share`` add the
      summarised steps' aggregates to the spans; ``p50_ns``, ``p90_ns``,
      ``p99_ns`` and ``max_ns`` are over the spans of detailed steps only,
      which the extra column ``detail_count`` counts (NaN for an event seen
      only in aggregates). ``steps`` covers every step too (its parts from the
      aggregates, see :mod:`exporters._parts`), with the extra bool column
      ``full_detail``.
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
    validation: pd.DataFrame = field(default_factory=lambda: _empty_events())
    environment: dict[str, Any] = field(default_factory=dict)
    detail: Detail | None = None
    profiled_steps: int = 0
    #: steps with ERROR status (cut off by an exception), left out like the warmup
    failed_steps: int = 0
    profilers: tuple[str, ...] = ()
    #: how the run failed (:func:`exporters.run_failure`: a fit that raised, an ERROR
    #: step, a cut-off trace, ...), or ``None``; the renderers say it first
    failure: str | None = None

    @property
    def step_summary(self) -> pd.DataFrame:
        """Mean, p50, p90 and max of the wall time and of each part per step (data
        wait, forward, backward, optimizer, other), with each part's share of the
        total wall time (the parts' shares add up to 1)."""
        rows = []
        steps = self.steps
        # steps whose parts are unknown (unreadable aggregates) count in the wall row only
        known = steps if not len(steps) else steps.loc[steps["other_ns"].notna().to_numpy()]
        for label, col in _STEP_PARTS:
            chosen = steps if col == "wall_ns" else known
            wall_total = float(chosen["wall_ns"].sum()) if len(chosen) else 0.0
            values = chosen[col].astype(float) if len(chosen) else pd.Series(dtype=float)
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

    @property
    def threads_hint(self) -> str | None:
        """A one-line hint when steps are bimodal (wall p90/p50 > 3: a slow minority, or
        p50/p10 > 3: a fast minority) while torch runs more than one thread and at least
        as many threads as the CPUs this process may use; ``None`` otherwise (or when the
        trace does not record them)."""
        threads = self.environment.get("torch_threads")
        cpus = self.environment.get("cpu_count")
        if not isinstance(threads, int) or not isinstance(cpus, int) or not len(self.steps):
            return None
        wall = self.steps["wall_ns"].astype(float)
        p10, p50, p90 = (float(wall.quantile(q)) for q in (0.1, 0.5, 0.9))
        if not (p10 > 0 and max(p90 / p50, p50 / p10) > 3 and threads > 1 and threads >= cpus):
            return None
        return (
            f"Hint: step times are bimodal (p90/p50 = {p90 / p50:.1f}, p50/p10 = "
            f"{p50 / p10:.1f}) and torch runs {threads} threads on {cpus} available "
            f"CPU{'s' if cpus != 1 else ''}; if other processes share them, try "
            "torch.set_num_threads(1) or OMP_NUM_THREADS=1."
        )
