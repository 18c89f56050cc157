"""The per-rank part of a step report: which rank holds the others up.

In: the counted steps of a report (:mod:`exporters._steps`, one row per
``trainer.step`` with its rank) and the frame they came from, with every
rank's times on one clock (a merged trace). Out: a :class:`RankReport`.

Method. In synchronous data-parallel training every rank waits for the
slowest one at each step's gradient all-reduce, which DDP runs inside the
backward pass, so the step *times* of all ranks come out nearly equal; what
differs is when each rank *arrives* there. A step's arrival on a rank is the
start of its first ``trainer.backward`` span (the end of its ``trainer.step``
where a step has none). Steps are matched across ranks by ``(epoch,
batch_idx)``, or by their order on each rank when those are missing. For
each matched step, the rank that arrives last is the slowest; its **lead**
is its arrival minus the median arrival of the other ranks, and the
**spread** is the last arrival minus the first. A rank is named a
**straggler** when it is the slowest in more than half of the matched steps,
each time with a lead above the margin: ``margin`` (default 5%) of that
step's median wall time over the ranks; and when that count is not chance:
noise alone makes each of R ranks the slowest at 1/R of the steps, so the
count must be beyond what a binomial(n, 1/R) gives with probability 1%
(for 2 ranks and 20 steps: 16 or more). Time spent inside the backward pass
(a rank whose backward itself is slow) is not attributed by this method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ._steps import StepAssignment

__all__ = ["DEFAULT_STRAGGLER_MARGIN", "RankReport", "rank_report"]

#: A straggler's lead must exceed this share of the step's median wall time.
DEFAULT_STRAGGLER_MARGIN = 0.05
#: ... and its count of slowest steps must have less than this chance under noise alone.
CHANCE = 0.01
SYNC_EVENT = "trainer.backward"
RANK_COLUMNS = [
    "rank",
    "steps",
    "mean_ns",
    "p90_ns",
    "data_wait_mean_ns",
    "compute_mean_ns",
    "slowest",
    "slowest_share",
    "lead_mean_ns",
]


@dataclass
class RankReport:
    """The per-rank tables of a multi-rank step report.

    - ``table``: one row per rank: ``rank, steps, mean_ns, p90_ns`` (step wall
      time), ``data_wait_mean_ns, compute_mean_ns``, ``slowest`` (matched steps
      at which it arrived last), ``slowest_share``, ``lead_mean_ns`` (its mean
      lead at those steps).
    - ``steps``: one row per matched step: ``epoch, batch_idx, step_index,
      slowest_rank, spread_ns, lead_ns, median_wall_ns, counts`` (whether the
      lead beat the margin).
    - ``straggler``: the rank named a straggler, or ``None``; ``margin``;
      ``matched_steps``; ``sync_event``: what the arrival was read from.
    """

    table: pd.DataFrame
    steps: pd.DataFrame
    straggler: int | None
    margin: float
    matched_steps: int
    sync_event: str

    @property
    def verdict(self) -> str:
        """One line: the straggler and why, or that there is none."""
        if not self.matched_steps:
            return "No step is found on every rank: no straggler analysis."
        if self.straggler is None:
            return (
                f"No straggler: no rank arrived last at {self.sync_event} in more than half "
                f"of the {self.matched_steps} matched steps by more than "
                f"{self.margin:.0%} of the step, more often than chance."
            )
        row = self.table.set_index("rank").loc[self.straggler]
        counted = int(self.steps["counts"].sum()) if len(self.steps) else 0
        mine = int((self.steps["counts"] & (self.steps["slowest_rank"] == self.straggler)).sum())
        return (
            f"Straggler: rank {self.straggler} arrived last at {self.sync_event} in {mine} of "
            f"{self.matched_steps} matched steps by more than {self.margin:.0%} of the step "
            f"(mean lead {row['lead_mean_ns'] / 1e6:.3g} ms; {counted} steps had a lead "
            "above the margin)."
        )


def _tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ binomial(n, p)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


def _arrivals(frame: pd.DataFrame, assignment: StepAssignment, rows: np.ndarray) -> np.ndarray:
    """Per step row: the start of its first ``trainer.backward``, else the step's end; in ns
    after the frame's first span (exact in float64, where epoch ns are not)."""
    steps = assignment.steps
    t0 = int(frame["start_ns"].min())
    arrival = (steps.loc[rows, "end_ns"].to_numpy(np.int64) - t0).astype(float)
    names = frame["name"].to_numpy(dtype=object)
    back = np.flatnonzero(names == SYNC_EVENT)
    if len(back):
        owner = assignment.step_row[back]
        ok = owner >= 0
        rel = frame["start_ns"].to_numpy(np.int64)[back][ok] - t0
        starts = pd.Series(rel).groupby(owner[ok]).min()
        first = starts.reindex(rows).to_numpy(dtype=float)
        arrival = np.where(np.isnan(first), arrival, first)
    return arrival


def rank_report(
    frame: pd.DataFrame,
    assignment: StepAssignment,
    counted: pd.DataFrame,
    *,
    margin: float = DEFAULT_STRAGGLER_MARGIN,
) -> RankReport | None:
    """The per-rank report of ``counted`` steps (indexed by frame row), or ``None`` when
    they come from fewer than two ranks."""
    ranks = pd.to_numeric(counted["rank"], errors="coerce")
    known = counted.loc[ranks.notna().to_numpy()]
    if known["rank"].nunique() < 2:
        return None
    steps = known.copy()
    steps["rank"] = steps["rank"].astype(np.int64)
    rows = steps.index.to_numpy()
    steps["arrival"] = _arrivals(frame, assignment, rows)
    has_keys = steps["epoch"].notna().all() and steps["batch_idx"].notna().all()
    if has_keys:
        steps["k0"] = steps["epoch"].astype(np.int64)
        steps["k1"] = steps["batch_idx"].astype(np.int64)
    else:
        steps["k0"] = 0
        steps["k1"] = steps.groupby("rank").cumcount()
    steps = steps.drop_duplicates(["rank", "k0", "k1"], keep="last")
    arrival = steps.pivot(index=["k0", "k1"], columns="rank", values="arrival")
    wall = steps.pivot(index=["k0", "k1"], columns="rank", values="wall_ns")
    full = arrival.notna().all(axis=1).to_numpy()
    arrival, wall = arrival.loc[full], wall.loc[full].astype(float)
    cols = np.asarray(arrival.columns, dtype=np.int64)
    a = arrival.to_numpy(dtype=float)
    per_step = pd.DataFrame(
        {
            "epoch": arrival.index.get_level_values(0) if has_keys else pd.NA,
            "batch_idx": arrival.index.get_level_values(1) if has_keys else pd.NA,
            "step_index": np.arange(len(a)),
        }
    )
    if len(a):
        last = np.argmax(a, axis=1)
        others = a.copy()
        others[np.arange(len(a)), last] = np.nan
        lead = a[np.arange(len(a)), last] - np.nanmedian(others, axis=1)
        median_wall = np.median(wall.to_numpy(), axis=1)
        per_step["slowest_rank"] = cols[last]
        per_step["spread_ns"] = (a.max(axis=1) - a.min(axis=1)).astype(np.int64)
        per_step["lead_ns"] = lead.astype(np.int64)
        per_step["median_wall_ns"] = median_wall.astype(np.int64)
        per_step["counts"] = lead > margin * median_wall
    else:
        for col in ("slowest_rank", "spread_ns", "lead_ns", "median_wall_ns"):
            per_step[col] = pd.Series(dtype=np.int64)
        per_step["counts"] = pd.Series(dtype=bool)
    table_rows = []
    matched = len(per_step)
    straggler = None
    for rank, part in steps.groupby("rank", sort=True):
        w = part["wall_ns"].astype(float)
        mine = per_step["slowest_rank"] == rank
        slowest = int(mine.sum())
        leads = per_step.loc[mine, "lead_ns"]
        table_rows.append(
            {
                "rank": int(rank),
                "steps": len(part),
                "mean_ns": w.mean(),
                "p90_ns": w.quantile(0.9),
                "data_wait_mean_ns": part["data_wait_ns"].astype(float).mean(),
                "compute_mean_ns": part["compute_ns"].astype(float).mean(),
                "slowest": slowest,
                "slowest_share": slowest / matched if matched else np.nan,
                "lead_mean_ns": leads.mean() if len(leads) else np.nan,
            }
        )
        k = int((mine & per_step["counts"]).sum())
        if matched and k * 2 > matched and _tail(k, matched, 1 / len(cols)) < CHANCE:
            straggler = int(rank)
    sync = SYNC_EVENT if (frame["name"] == SYNC_EVENT).any() else "the end of trainer.step"
    return RankReport(
        pd.DataFrame(table_rows, columns=RANK_COLUMNS),
        per_step,
        straggler,
        margin,
        matched,
        sync,
    )
