"""Compare a baseline run with a candidate, event by event, with statistics.

For each event the samples are *per step*: the total time of that event
inside each counted (non-warmup) training step (a ``trainer.step``, its
``trainer.fetch_batch`` and everything under them; see
:mod:`exporters._steps`). An event outside steps contributes one sample per
span. For each event present in both runs :func:`compare` gives:

- the base and candidate medians and the relative change
  ``median(candidate) / median(base) - 1``;
- a bootstrap confidence interval for that change (percentile method,
  ``n_bootstrap`` resamples from a generator seeded with ``seed``, so results
  are reproducible);
- a two-sided Mann-Whitney U p-value (``scipy.stats.mannwhitneyu``) and its
  Holm-corrected value across all tested events;
- a verdict: ``regression`` (significant, i.e. Holm p < ``alpha``, and the
  change is above ``+threshold``), ``improvement`` (significant and below
  ``-threshold``), ``unchanged``, or ``insufficient data`` when either run has
  fewer than ``min_samples`` samples of the event.

Events found in only one run are listed as ``added`` or ``removed``.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from ._errors import TraceError
from ._pandas import records_frame
from ._render import fmt_ns, fmt_pct, json_records, markdown, text_table
from ._steps import assign_steps

__all__ = [
    "COMPARE_FORMATS",
    "Comparison",
    "Verdict",
    "compare",
    "event_samples",
    "holm",
    "render_comparison",
    "render_comparison_json",
    "render_comparison_markdown",
    "render_comparison_table",
]


class Verdict:
    """The verdict strings of a comparison."""

    REGRESSION = "regression"
    IMPROVEMENT = "improvement"
    UNCHANGED = "unchanged"
    INSUFFICIENT = "insufficient data"


_ORDER = {
    Verdict.REGRESSION: 0,
    Verdict.IMPROVEMENT: 1,
    Verdict.UNCHANGED: 2,
    Verdict.INSUFFICIENT: 3,
}


@dataclass
class Comparison:
    """The result of :func:`compare`.

    ``events`` has one row per event present in both runs: ``event, base_n,
    cand_n, base_median_ns, cand_median_ns, change, ci_low, ci_high, p_value,
    p_holm, verdict``, regressions first. ``added``/``removed`` list the
    events only in the candidate/base.
    """

    events: pd.DataFrame
    added: list[str]
    removed: list[str]
    threshold: float
    alpha: float
    min_samples: int
    confidence: float

    def _with(self, verdict: str) -> list[str]:
        return [str(e) for e in self.events.loc[self.events["verdict"] == verdict, "event"]]

    @property
    def regressions(self) -> list[str]:
        """Events with a significant slowdown beyond the threshold."""
        return self._with(Verdict.REGRESSION)

    @property
    def improvements(self) -> list[str]:
        """Events with a significant speed-up beyond the threshold."""
        return self._with(Verdict.IMPROVEMENT)

    @property
    def has_regression(self) -> bool:
        """Whether any event regressed (the CLI then exits with 1)."""
        return bool((self.events["verdict"] == Verdict.REGRESSION).any())


def event_samples(frame: pd.DataFrame, *, warmup_steps: int = 1) -> dict[str, np.ndarray]:
    """Per-event duration samples in ns: per counted step, the event's total time in
    that step; for spans outside steps, one sample per span."""
    n = len(frame)
    if n == 0:
        return {}
    assignment = assign_steps(frame, warmup_steps)
    steps = assignment.steps
    warm = np.zeros(n, dtype=bool)
    warm[steps.index[steps["warmup"].to_numpy(dtype=bool)].to_numpy()] = True
    step_row = assignment.step_row
    in_step = step_row >= 0
    keep = ~(in_step & warm[np.where(in_step, step_row, 0)])
    unit = np.where(in_step, step_row, -1 - np.arange(n))[keep]
    codes, uniques = pd.factorize(frame["name"].to_numpy(dtype=object)[keep])
    dur = frame["dur_ns"].to_numpy(np.int64)[keep]
    if not len(codes):
        return {}
    order = np.lexsort((unit, codes))
    c, u, d = codes[order], unit[order], dur[order]
    first = np.ones(len(c), dtype=bool)
    first[1:] = (c[1:] != c[:-1]) | (u[1:] != u[:-1])
    sums = np.add.reduceat(d, np.flatnonzero(first)).astype(float)
    events = c[first]
    cuts = np.flatnonzero(events[1:] != events[:-1]) + 1
    return {
        str(uniques[part_events[0]]): part
        for part_events, part in zip(np.split(events, cuts), np.split(sums, cuts), strict=True)
    }


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


def _change(base_median: float, cand_median: float) -> float:
    if base_median == 0:
        return 0.0 if cand_median == 0 else float("inf")
    return cand_median / base_median - 1.0


def _bootstrap_ci(
    base: np.ndarray, cand: np.ndarray, *, n_boot: int, confidence: float, seed: int
) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    chunk = max(1, min(n_boot, 4_000_000 // max(len(base), len(cand), 1)))
    changes = []
    done = 0
    while done < n_boot:
        k = min(chunk, n_boot - done)
        mb = np.median(base[rng.integers(0, len(base), size=(k, len(base)))], axis=1)
        mc = np.median(cand[rng.integers(0, len(cand), size=(k, len(cand)))], axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            changes.append(np.where(mb > 0, mc / mb - 1.0, np.where(mc > 0, np.inf, 0.0)))
        done += k
    values = np.concatenate(changes)
    tail = (1.0 - confidence) / 2.0 * 100.0
    lo, hi = np.percentile(values, [tail, 100.0 - tail])
    return float(lo), float(hi)


def _check(
    threshold: float, alpha: float, min_samples: int, confidence: float, n_bootstrap: int
) -> None:
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not (0.0 <= threshold < float("inf"))
    ):
        raise ValueError(
            f"Expected a non-negative fraction for threshold (0.05 is 5%), but received "
            f"{threshold!r}. Pass a finite number such as threshold=0.05."
        )
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0.0 < alpha < 1.0):
        raise ValueError(
            f"Expected alpha between 0 and 1 (exclusive), but received {alpha!r}. Pass a "
            "significance level such as alpha=0.01."
        )
    if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 2:
        raise ValueError(
            f"Expected an int >= 2 for min_samples, but received {min_samples!r}. Pass the "
            "fewest samples per run for a verdict, such as min_samples=5."
        )
    if (
        isinstance(confidence, bool)
        or not isinstance(confidence, float)
        or not (0.0 < confidence < 1.0)
    ):
        raise ValueError(
            f"Expected confidence between 0 and 1 (exclusive), but received {confidence!r}. "
            "Pass a float level such as confidence=0.95 (not 95)."
        )
    if isinstance(n_bootstrap, bool) or not isinstance(n_bootstrap, int) or n_bootstrap < 100:
        raise ValueError(
            f"Expected an int >= 100 for n_bootstrap, but received {n_bootstrap!r}. Pass "
            "the number of bootstrap resamples, such as n_bootstrap=2000."
        )


def compare(
    base: pd.DataFrame,
    candidate: pd.DataFrame,
    *,
    threshold: float = 0.05,
    alpha: float = 0.01,
    min_samples: int = 5,
    warmup_steps: int = 1,
    confidence: float = 0.95,
    n_bootstrap: int = 2000,
    seed: int = 0,
) -> Comparison:
    """Compare two frames event by event (see the module doc for the statistics).

    ``threshold`` is the smallest relative change that counts (0.05 = 5%),
    ``alpha`` the significance level after Holm correction, ``min_samples``
    the fewest samples per run below which the verdict is ``insufficient
    data``, and ``warmup_steps`` the steps left out at the start of each
    process. Raises :class:`TraceError` when the runs have no event in common.
    """
    _check(threshold, alpha, min_samples, confidence, n_bootstrap)
    for label, frame in (("base", base), ("candidate", candidate)):
        if not isinstance(frame, pd.DataFrame) or "dur_ns" not in frame.columns:
            raise TypeError(
                f"Expected a span frame for {label} (from exporters.spans_to_frame or "
                f"read_chrome_trace), but received {type(frame).__name__}."
            )
    b_samples = event_samples(base, warmup_steps=warmup_steps)
    c_samples = event_samples(candidate, warmup_steps=warmup_steps)
    common = [e for e in b_samples if e in c_samples]
    added = sorted(e for e in c_samples if e not in b_samples)
    removed = sorted(e for e in b_samples if e not in c_samples)
    if not common:
        raise TraceError(
            "Expected the two runs to have at least one event in common, but the base has "
            f"{_names(b_samples)} and the candidate has {_names(c_samples)}."
        )
    rows = []
    for event in common:
        b, c = b_samples[event], c_samples[event]
        mb, mc = float(np.median(b)), float(np.median(c))
        row = {
            "event": event,
            "base_n": len(b),
            "cand_n": len(c),
            "base_median_ns": mb,
            "cand_median_ns": mc,
            "change": _change(mb, mc),
            "ci_low": np.nan,
            "ci_high": np.nan,
            "p_value": np.nan,
        }
        if min(len(b), len(c)) >= min_samples:
            if np.all(b == b[0]) and np.all(c == b[0]):
                p = 1.0
            else:
                p = float(stats.mannwhitneyu(c, b, alternative="two-sided").pvalue)
            row["p_value"] = 1.0 if np.isnan(p) else p
            key = zlib.crc32(event.encode("utf-8", "surrogatepass"))
            event_seed = (seed * 1_000_003 + key) % (2**63)
            row["ci_low"], row["ci_high"] = _bootstrap_ci(
                b, c, n_boot=n_bootstrap, confidence=confidence, seed=event_seed
            )
        rows.append(row)
    table = records_frame(rows)
    tested = table["p_value"].notna().to_numpy()
    p_holm = np.full(len(table), np.nan)
    p_holm[tested] = holm(table.loc[tested, "p_value"].to_numpy())
    table["p_holm"] = p_holm
    verdicts = []
    for change, p, ok in zip(table["change"], table["p_holm"], tested, strict=True):
        if not ok:
            verdicts.append(Verdict.INSUFFICIENT)
        elif p < alpha and change > threshold:
            verdicts.append(Verdict.REGRESSION)
        elif p < alpha and change < -threshold:
            verdicts.append(Verdict.IMPROVEMENT)
        else:
            verdicts.append(Verdict.UNCHANGED)
    table["verdict"] = verdicts
    size = np.nan_to_num(np.abs(table["change"].to_numpy(dtype=float)), nan=0.0)
    events = list(table["event"])
    # verdict, then the largest change, then the name; sorted in Python, since
    # pandas would store the names as strings first (see _pandas)
    order = sorted(range(len(table)), key=lambda i: (_ORDER[verdicts[i]], -size[i], events[i]))
    table = table.iloc[order]
    return Comparison(
        events=table.reset_index(drop=True),
        added=added,
        removed=removed,
        threshold=float(threshold),
        alpha=float(alpha),
        min_samples=min_samples,
        confidence=confidence,
    )


def _names(samples: dict[str, np.ndarray]) -> str:
    names = sorted(samples)
    if not names:
        return "no events"
    shown = ", ".join(names[:5])
    return f"{len(names)} events ({shown}{', ...' if len(names) > 5 else ''})"


# -- rendering ---------------------------------------------------------------------

_MARK = {
    Verdict.REGRESSION: "❌ regression",
    Verdict.IMPROVEMENT: "✅ improvement",
    Verdict.UNCHANGED: "unchanged",
    Verdict.INSUFFICIENT: "insufficient data",
}


def _p(value: float) -> str:
    if value != value:
        return "–"
    return f"{value:.2g}" if value >= 1e-4 else "<1e-4"


def _rows(comparison: Comparison, *, marks: bool) -> tuple[list[str], list[list[str]]]:
    level = f"{comparison.confidence * 100:.0f}% CI"
    header = ["event", "base", "candidate", "change", level, "p (Holm)", "verdict", "n"]
    rows = []
    records: list[dict[Any, Any]] = comparison.events.to_dict("records")
    for r in records:
        ci = (
            "–"
            if r["ci_low"] != r["ci_low"]
            else f"{fmt_pct(r['ci_low'], signed=True)} … {fmt_pct(r['ci_high'], signed=True)}"
        )
        rows.append(
            [
                str(r["event"]),
                fmt_ns(r["base_median_ns"]),
                fmt_ns(r["cand_median_ns"]),
                fmt_pct(r["change"], signed=True),
                ci,
                _p(float(r["p_holm"])),
                _MARK[str(r["verdict"])] if marks else str(r["verdict"]),
                f"{r['base_n']}/{r['cand_n']}",
            ]
        )
    return header, rows


def _summary(comparison: Comparison) -> str:
    counts = comparison.events["verdict"].value_counts()

    def count(v: str, word: str) -> str:
        k = int(counts.get(v, 0))
        return f"{k} {word}{'s' if k != 1 and not word.endswith('data') else ''}"

    return ", ".join(
        [
            count(Verdict.REGRESSION, "regression"),
            count(Verdict.IMPROVEMENT, "improvement"),
            f"{int(counts.get(Verdict.UNCHANGED, 0))} unchanged",
            f"{int(counts.get(Verdict.INSUFFICIENT, 0))} with insufficient data",
        ]
    )


def _settings(comparison: Comparison) -> str:
    return (
        f"medians of per-step samples; threshold {fmt_pct(comparison.threshold)}, "
        f"alpha {comparison.alpha:g} (Mann-Whitney U, Holm-corrected), "
        f"bootstrap {comparison.confidence * 100:.0f}% CI, "
        f"at least {comparison.min_samples} samples per run"
    )


def render_comparison_table(comparison: Comparison) -> str:
    """The comparison as aligned plain text for a terminal."""
    header, rows = _rows(comparison, marks=False)
    parts = [
        f"ppetrace compare: {_summary(comparison)}",
        _settings(comparison),
        "",
        text_table(header, rows, left=(0, 6)),
    ]
    if comparison.added:
        parts.append(f"\nadded (only in the candidate): {', '.join(comparison.added)}")
    if comparison.removed:
        parts.append(
            f"{'' if comparison.added else chr(10)}removed (only in the base): "
            f"{', '.join(comparison.removed)}"
        )
    return "\n".join(parts) + "\n"


def render_comparison_markdown(comparison: Comparison) -> str:
    """The comparison as Markdown, ready to post as a CI comment."""
    n_reg = len(comparison.regressions)
    title = (
        f"❌ {n_reg} significant regression{'s' if n_reg != 1 else ''}"
        if n_reg
        else "✅ no significant regression"
    )
    header, rows = _rows(comparison, marks=True)
    parts = [
        f"### ppetrace compare: {title}",
        "",
        f"{_summary(comparison)}.",
        "",
        f"<sub>{_settings(comparison)}</sub>",
        "",
        markdown(header, rows, left=(0, 6)),
    ]
    if comparison.added:
        parts += [
            "",
            "**Added** (only in the candidate): " + ", ".join(f"`{e}`" for e in comparison.added),
        ]
    if comparison.removed:
        parts += [
            "",
            "**Removed** (only in the base): " + ", ".join(f"`{e}`" for e in comparison.removed),
        ]
    return "\n".join(parts) + "\n"


def render_comparison_json(comparison: Comparison) -> str:
    """The comparison as a JSON document (medians in ns, changes as fractions)."""
    doc = {
        "threshold": comparison.threshold,
        "alpha": comparison.alpha,
        "min_samples": comparison.min_samples,
        "confidence": comparison.confidence,
        "has_regression": comparison.has_regression,
        "regressions": comparison.regressions,
        "improvements": comparison.improvements,
        "added": comparison.added,
        "removed": comparison.removed,
        "events": json_records(comparison.events),
    }
    return json.dumps(doc, indent=2) + "\n"


#: Comparison renderers by format name (the CLI's ``--format``).
COMPARE_FORMATS: dict[str, Callable[[Comparison], str]] = {
    "table": render_comparison_table,
    "md": render_comparison_markdown,
    "json": render_comparison_json,
}


def render_comparison(comparison: Comparison, fmt: str = "table") -> str:
    """Render ``comparison`` in the format ``fmt``: one of ``table``, ``md``, ``json``."""
    renderer = COMPARE_FORMATS.get(fmt)
    if renderer is None:
        raise ValueError(
            f"Unknown comparison format {fmt!r}; expected one of {', '.join(COMPARE_FORMATS)}."
        )
    return renderer(comparison)
