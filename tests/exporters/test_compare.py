"""compare: per-step samples, Mann-Whitney U with Holm correction, bootstrap CIs, verdicts."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pytest

from exporters import (
    Comparison,
    TraceError,
    Verdict,
    compare,
    event_samples,
    render_comparison,
    render_comparison_json,
    render_comparison_markdown,
    render_comparison_table,
    spans_to_frame,
)
from exporters.comparison import holm

RunBuilder = Any  # the builder from conftest.py's run_builder fixture


def _frame(
    run_builder: Callable[..., RunBuilder],
    step_ns: Sequence[float],
    *,
    extra: str | None = None,
    backward: bool = True,
) -> pd.DataFrame:
    rb = run_builder()
    durations = [int(d) for d in step_ns]
    if backward:
        rb.training(durations)
    else:
        t = 0
        for i, d in enumerate(durations):
            rb.span("trainer.step", t, t + d, 0, {"ppetrace.step": i})
            t += d + 100
    if extra is not None:
        rb.span(extra, 10**9, 10**9 + 5_000)
    return spans_to_frame(rb.batch())


def _noisy(rng: np.random.Generator, n: int, median: float, sigma: float = 0.1) -> np.ndarray:
    return rng.lognormal(np.log(median), sigma, n)


def test_samples_are_per_step_totals_and_single_spans_outside_steps(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rb = run_builder()
    for i in range(3):
        s = rb.span("trainer.step", i * 10_000, i * 10_000 + 9_000, 0, {"ppetrace.step": i})
        rb.span("hook", i * 10_000 + 100, i * 10_000 + 200, s)  # twice per step
        rb.span("hook", i * 10_000 + 300, i * 10_000 + 500 + i, s)
    rb.span("hook", 50_000, 50_007)  # outside any step
    rb.span("hook", 60_000, 60_011)
    samples = event_samples(spans_to_frame(rb.batch()), warmup_steps=1)
    assert sorted(samples["hook"]) == [7, 11, 301, 302]  # steps 1 and 2: 100 + 200 + i
    assert sorted(samples["trainer.step"]) == [9_000, 9_000]


def test_a_20_percent_slowdown_is_a_regression(run_builder: Callable[..., RunBuilder]) -> None:
    rng = np.random.default_rng(7)
    base = _frame(run_builder, _noisy(rng, 31, 1_000_000))
    cand = _frame(run_builder, _noisy(rng, 31, 1_200_000))
    result = compare(base, cand)
    row = result.events.set_index("event").loc["trainer.step"]
    assert row["verdict"] == Verdict.REGRESSION
    assert row["base_n"] == 30 and row["cand_n"] == 30  # one warmup step left out
    assert row["change"] == pytest.approx(0.2, abs=0.08)
    assert row["ci_low"] > 0.05 and row["ci_low"] < row["change"] < row["ci_high"]
    assert row["p_holm"] < 0.01
    assert result.has_regression and "trainer.step" in result.regressions
    assert result.events.loc[0, "verdict"] == Verdict.REGRESSION  # regressions first


def test_a_20_percent_speedup_is_an_improvement(run_builder: Callable[..., RunBuilder]) -> None:
    rng = np.random.default_rng(8)
    base = _frame(run_builder, _noisy(rng, 31, 1_000_000))
    cand = _frame(run_builder, _noisy(rng, 31, 800_000))
    result = compare(base, cand)
    assert result.events.set_index("event").loc["trainer.step", "verdict"] == "improvement"
    assert not result.has_regression and result.improvements


def test_a_significant_change_below_the_threshold_is_unchanged(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rng = np.random.default_rng(9)
    base = _frame(run_builder, _noisy(rng, 301, 1_000_000, 0.01), backward=False)
    cand = _frame(run_builder, _noisy(rng, 301, 1_030_000, 0.01), backward=False)
    strict = compare(base, cand, threshold=0.05)
    row = strict.events.iloc[0]
    assert row["p_holm"] < 1e-6  # clearly significant ...
    assert row["verdict"] == Verdict.UNCHANGED  # ... but only 3%, below 5%
    loose = compare(base, cand, threshold=0.02)
    assert loose.events.iloc[0]["verdict"] == Verdict.REGRESSION


def test_same_distribution_pairs_are_flagged_at_most_about_alpha(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rng = np.random.default_rng(2024)
    p_values = []
    flagged = 0
    for _ in range(200):
        base = _frame(run_builder, _noisy(rng, 21, 1_000_000, 0.2), backward=False)
        cand = _frame(run_builder, _noisy(rng, 21, 1_000_000, 0.2), backward=False)
        result = compare(base, cand, threshold=0.0, alpha=0.01, n_bootstrap=100)
        row = result.events.iloc[0]
        p_values.append(row["p_value"])
        flagged += row["verdict"] != Verdict.UNCHANGED
    assert flagged / 200 <= 0.03
    # not trivially silent: the p-values spread over [0, 1] as they should under the null
    p = np.array(p_values)
    assert 0.35 <= float(np.mean(p < 0.5)) <= 0.65
    assert 0.02 <= float(np.mean(p < 0.1)) <= 0.2


def test_too_few_samples_is_insufficient_data(run_builder: Callable[..., RunBuilder]) -> None:
    base = _frame(run_builder, [1_000, 1_000, 1_000, 1_000])
    cand = _frame(run_builder, [5_000, 5_000, 5_000, 5_000])
    result = compare(base, cand, min_samples=5)
    row = result.events.set_index("event").loc["trainer.step"]
    assert row["verdict"] == Verdict.INSUFFICIENT
    assert np.isnan(row["p_value"]) and np.isnan(row["ci_low"])
    assert row["change"] == pytest.approx(4.0)  # still shown
    assert not result.has_regression
    # with 3 samples each the test runs, but cannot be significant at alpha 0.01
    few = compare(base, cand, min_samples=3).events.set_index("event").loc["trainer.step"]
    assert 0.01 < few["p_value"] < 0.2 and few["verdict"] == Verdict.UNCHANGED


def test_events_in_one_run_only_are_added_or_removed(
    run_builder: Callable[..., RunBuilder],
) -> None:
    base = _frame(run_builder, [1_000] * 8, extra="user.old")
    cand = _frame(run_builder, [1_000] * 8, extra="user.new")
    result = compare(base, cand)
    assert result.added == ["user.new"] and result.removed == ["user.old"]
    assert "user.new" not in set(result.events["event"])
    md = render_comparison_markdown(result)
    assert "**Added** (only in the candidate): `user.new`" in md
    assert "**Removed** (only in the base): `user.old`" in md


def test_runs_with_no_event_in_common_are_refused(
    run_builder: Callable[..., RunBuilder],
) -> None:
    a = _frame(run_builder, [], extra="user.a", backward=False)
    b = _frame(run_builder, [], extra="user.b", backward=False)
    with pytest.raises(TraceError, match="Expected the two runs to have at least one event in co"):
        compare(a, b)


def test_holm_adjustment_matches_the_step_down_procedure() -> None:
    p = np.array([0.01, 0.04, 0.03, 0.005])
    # sorted: 0.005*4=0.02, 0.01*3=0.03, 0.03*2=0.06, 0.04*1=0.04 -> monotone 0.06
    assert np.allclose(holm(p), [0.03, 0.06, 0.06, 0.02])
    assert np.allclose(holm(np.array([0.9, 0.8])), [1.0, 1.0])
    assert holm(np.array([])).size == 0


def test_results_are_reproducible_with_a_seed(run_builder: Callable[..., RunBuilder]) -> None:
    rng = np.random.default_rng(3)
    base = _frame(run_builder, _noisy(rng, 21, 1_000_000))
    cand = _frame(run_builder, _noisy(rng, 21, 1_100_000))
    one, two = compare(base, cand, seed=5), compare(base, cand, seed=5)
    pd.testing.assert_frame_equal(one.events, two.events)
    other = compare(base, cand, seed=6)
    assert not np.allclose(one.events["ci_low"], other.events["ci_low"])


def _comparison(run_builder: Callable[..., RunBuilder]) -> Comparison:
    rng = np.random.default_rng(11)
    base = _frame(run_builder, _noisy(rng, 21, 1_000_000), extra="user.gone")
    cand = _frame(run_builder, _noisy(rng, 21, 1_500_000))
    return compare(base, cand)


def test_renderers_show_every_event_and_the_verdicts(
    run_builder: Callable[..., RunBuilder],
) -> None:
    result = _comparison(run_builder)
    md = render_comparison_markdown(result)
    assert md.startswith("### ppetrace compare: ❌ 2 significant regressions")
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(result.events)
    assert all(r.count("|") == rows[0].count("|") for r in rows)
    assert "❌ regression" in md and "threshold 5.0%" in md
    table = render_comparison_table(result)
    assert "2 regressions" in table and "trainer.step" in table
    assert "removed (only in the base): user.gone" in table
    doc = json.loads(render_comparison_json(result))
    assert doc["has_regression"] is True and doc["removed"] == ["user.gone"]
    assert {e["event"] for e in doc["events"]} == set(result.events["event"])
    assert render_comparison(result, "md") == md


def test_no_regression_headline(run_builder: Callable[..., RunBuilder]) -> None:
    base = _frame(run_builder, [1_000] * 8)
    md = render_comparison_markdown(compare(base, base))
    assert md.startswith("### ppetrace compare: ✅ no significant regression")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"threshold": -0.1},
            r"^Expected a non-negative fraction for threshold \(0\.05 is 5%\), but received "
            r"-0\.1\. Pass a finite number such as threshold=0\.05\.$",
        ),
        (
            {"alpha": 1.5},
            r"^Expected alpha between 0 and 1 \(exclusive\), but received 1\.5\. Pass a "
            r"significance level such as alpha=0\.01\.$",
        ),
        (
            {"min_samples": 1},
            r"^Expected an int >= 2 for min_samples, but received 1\. Pass the fewest samples "
            r"per run for a verdict, such as min_samples=5\.$",
        ),
        (
            {"confidence": 95},
            r"^Expected confidence between 0 and 1 \(exclusive\), but received 95\. Pass a "
            r"float level such as confidence=0\.95 \(not 95\)\.$",
        ),
        (
            {"n_bootstrap": 10},
            r"^Expected an int >= 100 for n_bootstrap, but received 10\. Pass the number of "
            r"bootstrap resamples, such as n_bootstrap=2000\.$",
        ),
    ],
)
def test_bad_arguments_are_refused(
    run_builder: Callable[..., RunBuilder], kwargs: dict[str, Any], message: str
) -> None:
    frame = _frame(run_builder, [1_000] * 3)
    with pytest.raises(ValueError, match=message):
        compare(frame, frame, **kwargs)


def test_non_frames_and_unknown_formats_are_refused(
    run_builder: Callable[..., RunBuilder],
) -> None:
    frame = _frame(run_builder, [1_000] * 3)
    with pytest.raises(TypeError, match="Expected a span frame for candidate"):
        compare(frame, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unknown comparison format 'csv'; expected one of"):
        render_comparison(compare(frame, frame), "csv")
