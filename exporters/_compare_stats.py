"""The statistics of :func:`exporters.compare`: runs are the samples.

Steps of one run are not independent draws: every run has its own offset (CPU
frequency, memory layout, neighbours), so a test on the steps of two runs
finds the run-to-run difference "significant". Here each run contributes one
number per event, ``y = log(median of its per-step samples)``, and the change
is ``exp(mean(y_cand) - mean(y_base)) - 1`` (with one run per side: the ratio
of the two medians, minus 1).

The run-to-run standard deviation of ``y`` (about the coefficient of
variation of the run median) is the larger of:

- the **noise floor** ``f`` (a documented default measured on repeated real
  runs, or the user's), to which each run adds the sampling error of its own
  median (:func:`log_median_se`); then the test uses the normal distribution;
- the **scatter of the runs themselves** (the pooled standard deviation of
  ``y`` within each side), when there are at least three runs in all; then
  the test is Student's t with ``runs - 2`` degrees of freedom.

So one run per side is judged against the floor, a stored set of baseline
runs against its own scatter when that is larger, and a noisy machine cannot
make identical code look slower by being noisier than the floor assumed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# scipy.special, not scipy.stats: the same functions, and a third of the import time
# (0.5 s against 1.6 s on the development machine), which every `ppetrace compare` pays
from scipy import special

from ._defaults import DEFAULT_NOISE_FLOOR

__all__ = [
    "DEFAULT_NOISE_FLOOR",
    "RunLevelTest",
    "detectable_change",
    "holm",
    "log_median_se",
    "run_level_test",
]

_Z975 = float(-special.ndtri(0.025))


def log_median_se(log_samples: np.ndarray) -> float:
    """The standard error of the median of ``log_samples`` (McKean-Schrader: the
    distribution-free 95% order-statistic interval of the median, divided by 2 x 1.96).
    0 for fewer than 2 samples."""
    x = np.sort(np.asarray(log_samples, dtype=float))
    n = len(x)
    if n < 2:
        return 0.0
    c = round((n + 1) / 2 - _Z975 * math.sqrt(n / 4))
    c = min(max(c, 1), (n + 1) // 2)
    return float((x[n - c] - x[c - 1]) / (2 * _Z975))


@dataclass(frozen=True)
class RunLevelTest:
    """One event's test: ``change`` (a fraction) with its ``ci_low``/``ci_high``, the
    two-sided ``p_value``, the run-to-run standard deviation used (``noise``, about a
    CV), where it came from (``source``: ``"floor"`` or ``"runs"``) and the degrees of
    freedom (``inf`` for the normal distribution)."""

    change: float
    ci_low: float
    ci_high: float
    p_value: float
    noise: float
    source: str
    df: float


@lru_cache(maxsize=64)
def _quantile(confidence: float, df: float) -> float:
    """The two-sided ``confidence`` quantile: normal for ``df = inf``, else Student's t."""
    tail = (1.0 - confidence) / 2.0
    return float(-special.ndtri(tail)) if math.isinf(df) else float(-special.stdtrit(df, tail))


def run_level_test(
    base_logs: np.ndarray,
    base_se: np.ndarray,
    cand_logs: np.ndarray,
    cand_se: np.ndarray,
    *,
    noise_floor: float,
    confidence: float,
) -> RunLevelTest:
    """Test ``mean(cand_logs) - mean(base_logs)`` (log run medians; ``*_se`` are their
    within-run standard errors) as the module doc says."""
    b = np.asarray(base_logs, dtype=float)
    c = np.asarray(cand_logs, dtype=float)
    nb, nc = len(b), len(c)
    if nb == 0 or nc == 0:
        raise ValueError("Expected at least one run on each side for the test.")
    delta = float(c.mean() - b.mean())
    se_b = np.asarray(base_se, dtype=float)
    se_c = np.asarray(cand_se, dtype=float)
    # the floor: every run varies by f, plus the sampling error of its own median
    floor_var = (noise_floor**2 + float(np.mean(se_b**2))) / nb + (
        noise_floor**2 + float(np.mean(se_c**2))
    ) / nc
    floor_sd = math.sqrt(noise_floor**2 + float(np.mean(np.concatenate([se_b, se_c]) ** 2)))
    df = nb + nc - 2
    var, sd, dist_df, source = floor_var, floor_sd, math.inf, "floor"
    if df >= 1:
        ss = float(((b - b.mean()) ** 2).sum() + ((c - c.mean()) ** 2).sum())
        s = math.sqrt(ss / df)
        runs_var = s * s * (1 / nb + 1 / nc)
        if runs_var > floor_var:
            var, sd, dist_df, source = runs_var, s, float(df), "runs"
    se = math.sqrt(var)
    normal = math.isinf(dist_df)
    if se == 0:
        p = 1.0 if delta == 0 else 0.0
    elif normal:
        p = 2.0 * float(special.ndtr(-abs(delta) / se))
    else:
        p = 2.0 * float(special.stdtr(dist_df, -abs(delta) / se))
    q = _quantile(confidence, dist_df)
    return RunLevelTest(
        change=math.expm1(delta),
        ci_low=math.expm1(delta - q * se),
        ci_high=math.expm1(delta + q * se),
        p_value=min(p, 1.0),
        noise=sd,
        source=source,
        df=dist_df,
    )


def detectable_change(
    noise: float, base_runs: int, cand_runs: int, *, alpha: float, power: float = 0.8
) -> float:
    """The smallest relative change that the run-level test finds with probability
    ``power`` at two-sided level ``alpha`` (the first step of Holm's correction: pass
    alpha over the gated events), when runs scatter by ``noise`` (SD of the log run
    medians) and ``base_runs`` and ``cand_runs`` are compared (Student's t on their
    degrees of freedom; normal without any)."""
    se = noise * math.sqrt(1.0 / base_runs + 1.0 / cand_runs)
    df = base_runs + cand_runs - 2
    if df >= 1:
        needed = float(special.stdtrit(df, 1.0 - alpha / 2.0) + special.stdtrit(df, power))
    else:
        needed = float(special.ndtri(1.0 - alpha / 2.0) + special.ndtri(power))
    return math.expm1(needed * se)


def holm(p_values: np.ndarray) -> np.ndarray:
    """Holm's step-down adjustment of p-values (family-wise error rate)."""
    p = np.asarray(p_values, dtype=float)
    m = len(p)
    if m == 0:
        return p.copy()
    order = np.argsort(p, kind="stable")
    scaled = (m - np.arange(m)) * p[order]
    adjusted = np.minimum(np.maximum.accumulate(scaled), 1.0)
    out = np.empty(m)
    out[order] = adjusted
    return out
