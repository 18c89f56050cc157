"""The result of :func:`exporters.compare`: :class:`Comparison` and :class:`Verdict`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import pandas as pd

from ._defaults import (
    DEFAULT_ALPHA,
    DEFAULT_GATE,
    DEFAULT_MIN_EFFECT,
    DEFAULT_MIN_EFFECT_NS,
    DEFAULT_NOISE_FLOOR,
    DEFAULT_THRESHOLD,
)
from ._pandas import records_frame

__all__ = [
    "COLUMNS",
    "DEFAULT_ALPHA",
    "DEFAULT_GATE",
    "DEFAULT_MIN_EFFECT",
    "DEFAULT_MIN_EFFECT_NS",
    "DEFAULT_NOISE_FLOOR",
    "DEFAULT_THRESHOLD",
    "Comparison",
    "Verdict",
    "is_inconclusive",
    "within",
]


class Verdict:
    """The verdict strings of a comparison."""

    REGRESSION = "regression"
    IMPROVEMENT = "improvement"
    BELOW_NOISE = "below noise"
    UNCHANGED = "unchanged"
    INSUFFICIENT = "insufficient data"


def within(record: Mapping[str, Any], threshold: float) -> bool:
    """Whether a row's confidence interval lies within ±``threshold``: only then does an
    ``unchanged`` verdict read as unchanged (else: not significant)."""
    return -threshold <= float(record["ci_low"]) and float(record["ci_high"]) <= threshold


def is_inconclusive(record: Mapping[str, Any], *, alpha: float, threshold: float) -> bool:
    """Whether a row ``unchanged`` by its verdict has a change beyond ``threshold`` that is
    not significant at ``alpha``: shown as ``inconclusive``."""
    return (
        record["verdict"] == Verdict.UNCHANGED
        and not float(record["p_holm"]) < alpha
        and abs(float(record["change"])) > threshold
    )


_ORDER = {
    Verdict.REGRESSION: 0,
    Verdict.IMPROVEMENT: 1,
    Verdict.BELOW_NOISE: 2,
    Verdict.UNCHANGED: 3,
    Verdict.INSUFFICIENT: 4,
}

COLUMNS = (
    "event",
    "gated",
    "base_runs",
    "cand_runs",
    "base_n",
    "cand_n",
    "base_median_ns",
    "cand_median_ns",
    "change",
    "ci_low",
    "ci_high",
    "noise",
    "noise_source",
    "p_value",
    "p_holm",
    "verdict",
)


@dataclass
class Comparison:
    """The result of :func:`compare`.

    ``records`` has one dict per event found on both sides, gated events first,
    and :attr:`events` is the same table as a DataFrame (built on first use):
    ``event, gated, base_runs, cand_runs`` (runs with enough samples),
    ``base_n, cand_n`` (their samples), ``base_median_ns, cand_median_ns`` (the
    geometric mean of the runs' medians: with one run, its median), ``change``
    with ``ci_low``/``ci_high``, ``noise`` (the run-to-run standard deviation
    used, about a CV) and ``noise_source`` (``floor`` or ``runs``),
    ``p_value``, ``p_holm`` and ``verdict``. The settings used are kept, with
    ``min_effect_abs_ns`` (the minimum effect in ns) and ``step_median_ns``
    (the base's ``trainer.step``, its reference).
    """

    records: list[dict[str, Any]]
    added: list[str]
    removed: list[str]
    threshold: float
    alpha: float
    min_samples: int
    confidence: float
    noise_floor: float = DEFAULT_NOISE_FLOOR
    gate: list[str] = field(default_factory=lambda: list(DEFAULT_GATE))
    min_effect: float = DEFAULT_MIN_EFFECT
    min_effect_ns: float = DEFAULT_MIN_EFFECT_NS
    min_effect_abs_ns: float = DEFAULT_MIN_EFFECT_NS
    step_median_ns: float | None = None
    base_runs: int = 1
    cand_runs: int = 1
    environment_warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: whether any run had an environment record (``otherData.environment``)
    environment_recorded: bool = False
    #: the runs that failed (a fit that raised, an ERROR step, a cut-off trace), by side:
    #: ``{"base": ["<file>: <how>", ...], "candidate": [...]}``, sides without one left out
    failed_runs: dict[str, list[str]] = field(default_factory=dict)
    #: ``trainer.step`` samples in ns per run, ``{"base": [...], "candidate": [...]}``
    #: (runs that have them), for :func:`exporters.render_comparison_html`
    step_samples: dict[str, list[Any]] = field(default_factory=dict, repr=False)

    @cached_property
    def events(self) -> pd.DataFrame:
        """The comparison table, one row per event, columns :data:`COLUMNS`."""
        if not self.records:
            return pd.DataFrame({c: [] for c in COLUMNS})
        return records_frame(self.records)

    def _with(self, verdict: str | None) -> list[str]:
        """The gated events (with ``verdict``, unless None), in table order."""
        return [
            str(r["event"])
            for r in self.records
            if r["gated"] and (verdict is None or r["verdict"] == verdict)
        ]

    @property
    def gated(self) -> list[str]:
        """The gated events found on both sides."""
        return self._with(None)

    @property
    def regressions(self) -> list[str]:
        """Gated events that regressed (significant, beyond the threshold and the minimum
        effect)."""
        return self._with(Verdict.REGRESSION)

    @property
    def improvements(self) -> list[str]:
        """Gated events that improved."""
        return self._with(Verdict.IMPROVEMENT)

    @property
    def inconclusive(self) -> list[str]:
        """Gated events whose change is beyond the threshold but not significant: the runs
        cannot tell it from noise (no verdict against the code, none for it either)."""
        return [
            str(r["event"])
            for r in self.records
            if r["gated"] and is_inconclusive(r, alpha=self.alpha, threshold=self.threshold)
        ]

    @property
    def decided(self) -> bool:
        """Whether a gated event got a verdict (else the comparison cannot fail: no gated
        event in both runs, or too few steps for each)."""
        return any(r["gated"] and r["verdict"] != Verdict.INSUFFICIENT for r in self.records)

    @property
    def runs_failed(self) -> bool:
        """Whether a run of either side failed (:attr:`failed_runs`): its steps do not
        stand for the code's speed, so the CLI exits with 2 unless told to accept it."""
        return bool(self.failed_runs)

    @property
    def has_regression(self) -> bool:
        """Whether a gated event regressed (the CLI then exits with 1)."""
        return bool(self.regressions)
