"""compare: runs are the samples, a noise floor, a gate, a minimum effect, named
environments; on synthetic runs with known answers."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from exporters import (
    DEFAULT_NOISE_FLOOR,
    Comparison,
    RunSummary,
    TraceError,
    Verdict,
    compare,
    event_samples,
    spans_to_frame,
    summarize_run,
)
from exporters._compare_result import COLUMNS
from exporters._compare_stats import log_median_se, run_level_test
from exporters.comparison import holm

RunBuilder = Any  # the builder from conftest.py's run_builder fixture
STEP = "trainer.step"


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
            rb.span(STEP, t, t + d, 0, {"ppetrace.step": i})
            t += d + 100
    if extra is not None:
        rb.span(extra, 10**9, 10**9 + 5_000)
    return spans_to_frame(rb.batch())


def _run(
    rng: np.random.Generator,
    *,
    median: float = 1_000_000.0,
    offset_sd: float = 0.0,
    shift: float = 0.0,
    step_sd: float = 0.05,
    steps: int = 100,
    **events: float,
) -> RunSummary:
    """One synthetic run: a log-normal run offset, then log-normal per-step noise around
    ``median * (1 + shift)``; every keyword adds an event with that median (same noise)."""
    offset = rng.normal(0.0, offset_sd) if offset_sd else 0.0
    center = math.log(median) + math.log1p(shift) + offset
    samples = {STEP: np.exp(center + rng.normal(0.0, step_sd, steps))}
    for name, value in events.items():
        samples[name.replace("__", ".")] = np.exp(math.log(value) + rng.normal(0.0, step_sd, steps))
    return RunSummary.from_samples(samples)


def _row(result: Comparison, event: str = STEP) -> pd.Series:
    return result.events.set_index("event").loc[event]


# -- samples and summaries ------------------------------------------------------------


def test_samples_are_per_step_totals_and_single_spans_outside_steps(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rb = run_builder()
    for i in range(3):
        s = rb.span(STEP, i * 10_000, i * 10_000 + 9_000, 0, {"ppetrace.step": i})
        rb.span("hook", i * 10_000 + 100, i * 10_000 + 200, s)  # twice per step
        rb.span("hook", i * 10_000 + 300, i * 10_000 + 500 + i, s)
    rb.span("hook", 50_000, 50_007)  # outside any step
    rb.span("hook", 60_000, 60_011)
    samples = event_samples(spans_to_frame(rb.batch()), warmup_steps=1)
    assert sorted(samples["hook"]) == [7, 11, 301, 302]  # steps 1 and 2: 100 + 200 + i
    assert sorted(samples[STEP]) == [9_000, 9_000]


def test_each_counted_step_also_gives_its_wall_time_as_step_wall(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rb = run_builder()
    rb.training([9_000] * 4, fetch_ns=1_000, gap_ns=500)
    samples = event_samples(spans_to_frame(rb.batch()), warmup_steps=1)
    # the gap before the fetch, the fetch and the step: the step report's wall time
    assert samples["step.wall"].tolist() == [10_500] * 3
    assert samples[STEP].tolist() == [9_000] * 3


def test_a_slower_loader_fails_the_default_gate_through_step_wall(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rng = np.random.default_rng(7)
    steps = [int(v) for v in 100_000 * (1 + 0.02 * rng.standard_normal(60))]
    runs = []
    for fetch in (10_000, 40_000):  # the data wait grows, the steps do not
        rb = run_builder()
        rb.training(steps, fetch_ns=fetch, gap_ns=2_000)
        runs.append(spans_to_frame(rb.batch()))
    result = compare(runs[0], runs[1])
    assert sorted(result.gate) == ["step.wall", "trainer.step"]
    assert result.regressions == ["step.wall"]
    assert _row(result, STEP)["verdict"] == Verdict.UNCHANGED


def test_validation_spans_are_no_training_samples(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rb = run_builder()
    for i in range(3):
        s = rb.span(STEP, i * 10_000, i * 10_000 + 9_000, 0, {"ppetrace.step": i})
        rb.span("module.forward", i * 10_000 + 100, i * 10_000 + 300, s)
    val = rb.span("trainer.validation", 40_000, 48_000)  # the Trainer's validation
    rb.span("module.forward", 41_000, 41_050, val)
    rb.span("runtime.convert_batch", 42_000, 42_010, val)
    fwd = rb.span("module.forward", 50_000, 50_070, 0, {"ppetrace.stage": "val"})  # instrument()
    rb.span("module.inner", 50_010, 50_020, fwd)
    rb.span("module.forward", 52_000, 52_080, 0, {"ppetrace.stage": "test"})
    rb.span("runtime.convert_batch", 60_000, 60_013, 0, {"ppetrace.stage": "train"})
    samples = event_samples(spans_to_frame(rb.batch()), warmup_steps=1)
    assert sorted(samples["module.forward"]) == [200, 200]  # steps 1 and 2 only
    assert sorted(samples["runtime.convert_batch"]) == [13]
    assert "module.inner" not in samples and "trainer.validation" not in samples


def test_a_run_summary_holds_each_events_median_and_its_error(
    run_builder: Callable[..., RunBuilder],
) -> None:
    frame = _frame(run_builder, [1_000, 2_000, 3_000, 4_000, 5_000, 6_000])
    summary = summarize_run(frame, warmup_steps=1, source="run.json")
    step = summary.events[STEP]
    assert (step.n, step.median_ns) == (5, 4_000)  # the first step is warmup
    assert step.log_se == pytest.approx(log_median_se(np.log([2e3, 3e3, 4e3, 5e3, 6e3])))
    assert summary.source == "run.json" and summary.environment is None
    frame.attrs["metadata"] = {"environment": {"torch_threads": 1}}
    assert summarize_run(frame).environment == {"torch_threads": 1}


def test_the_median_error_follows_the_order_statistic_interval() -> None:
    # McKean-Schrader: c = round((n + 1) / 2 - 1.96 * sqrt(n / 4)); (x[n-c] - x[c-1]) / 3.92
    x = np.arange(1.0, 101.0)  # n = 100: c = round(50.5 - 9.8) = 41
    assert log_median_se(x) == pytest.approx((x[59] - x[40]) / (2 * stats.norm.ppf(0.975)))
    assert log_median_se(np.array([5.0])) == 0.0
    with pytest.raises(ValueError, match=r"for the event 'trainer\.step', but received 1 val"):
        RunSummary.from_samples({STEP: [1.0, float("nan")]})
    with pytest.raises(ValueError, match=r"^Expected a non-empty 1-D sequence .* shape \(0,\)"):
        RunSummary.from_samples({STEP: []})


# -- the run-level test ------------------------------------------------------------


def test_one_run_per_side_is_judged_against_the_floor_with_the_normal_distribution() -> None:
    base, cand = np.log([1_000.0]), np.log([1_100.0])
    se = np.array([0.01])
    test = run_level_test(base, se, cand, se, noise_floor=0.03, confidence=0.95)
    sd = math.sqrt(2 * (0.03**2 + 0.01**2))
    z = math.log(1.1) / sd
    assert test.source == "floor" and math.isinf(test.df)
    assert test.change == pytest.approx(0.1)
    assert test.p_value == pytest.approx(2 * stats.norm.sf(z))
    assert test.ci_low == pytest.approx(math.expm1(math.log(1.1) - 1.959964 * sd), rel=1e-5)
    assert test.noise == pytest.approx(math.sqrt(0.03**2 + 0.01**2))


def test_runs_that_scatter_more_than_the_floor_use_students_t() -> None:
    base = np.log([100.0, 104.0, 97.0, 101.0])
    cand = np.log([108.0, 103.0, 111.0])
    zero = np.zeros(4)
    test = run_level_test(base, zero, cand, zero[:3], noise_floor=0.001, confidence=0.95)
    expected = stats.ttest_ind(cand, base, equal_var=True)
    assert test.source == "runs" and test.df == 5
    assert test.p_value == pytest.approx(expected.pvalue)
    assert test.change == pytest.approx(math.expm1(cand.mean() - base.mean()))
    # the same runs under a larger floor are judged against the floor
    floor = run_level_test(base, zero, cand, zero[:3], noise_floor=0.2, confidence=0.95)
    assert floor.source == "floor" and floor.p_value > expected.pvalue


def test_holm_adjustment_matches_the_step_down_procedure() -> None:
    p = np.array([0.01, 0.04, 0.03, 0.005])
    # sorted: 0.005*4=0.02, 0.01*3=0.03, 0.03*2=0.06, 0.04*1=0.04 -> monotone 0.06
    assert np.allclose(holm(p), [0.03, 0.06, 0.06, 0.02])
    assert np.allclose(holm(np.array([0.9, 0.8])), [1.0, 1.0])
    assert holm(np.array([])).size == 0


# -- known answers: no offset, a run offset alone, a true shift ------------------------


def test_identical_runs_are_unchanged() -> None:
    rng = np.random.default_rng(1)
    result = compare(_run(rng), _run(rng))
    row = _row(result)
    assert row["verdict"] == Verdict.UNCHANGED and not result.has_regression
    assert abs(row["change"]) < 0.02 and row["ci_low"] < 0 < row["ci_high"]


def test_a_run_offset_alone_is_not_a_regression_though_steps_differ_significantly() -> None:
    # two runs of the same code, the second 5% slower as a whole (CPU clock, layout):
    # its 1,000 steps differ "significantly", but one run per side cannot tell that
    # from the run-to-run noise, which the floor describes
    rng = np.random.default_rng(2)
    base = np.exp(math.log(1e6) + rng.normal(0, 0.01, 1000))
    cand = np.exp(math.log(1.05e6) + rng.normal(0, 0.01, 1000))
    assert stats.mannwhitneyu(cand, base).pvalue < 1e-100  # what a per-step test says
    result = compare(RunSummary.from_samples({STEP: base}), RunSummary.from_samples({STEP: cand}))
    row = _row(result)
    assert row["verdict"] == Verdict.UNCHANGED and not result.has_regression
    assert row["change"] == pytest.approx(0.05, abs=0.005)
    assert row["noise_source"] == "floor" and row["p_value"] > 0.05


def test_a_true_shift_is_a_regression_and_a_speedup_an_improvement() -> None:
    rng = np.random.default_rng(3)
    base = _run(rng, offset_sd=0.01)
    # 40%: one run per side against the 5% floor resolves about 15% at alpha 0.01
    slower = compare(base, _run(rng, offset_sd=0.01, shift=0.40))
    row = _row(slower)
    assert row["verdict"] == Verdict.REGRESSION and slower.has_regression
    assert slower.regressions == [STEP] and row["p_holm"] < 0.01
    assert row["ci_low"] > 0.1 and row["ci_low"] < row["change"] < row["ci_high"]
    faster = compare(base, _run(rng, offset_sd=0.01, shift=-0.40))
    assert _row(faster)["verdict"] == Verdict.IMPROVEMENT and faster.improvements == [STEP]
    assert not faster.has_regression


def test_several_runs_per_side_detect_a_shift_that_one_run_cannot() -> None:
    rng = np.random.default_rng(4)
    base = [_run(rng, offset_sd=0.005) for _ in range(6)]
    cand = [_run(rng, offset_sd=0.005, shift=0.06) for _ in range(6)]
    one = compare(base[0], cand[0])
    assert _row(one)["verdict"] == Verdict.UNCHANGED  # 6% < what the 5% floor resolves
    many = compare(base, cand, noise_floor=0.005)
    row = _row(many)
    assert (row["base_runs"], row["cand_runs"]) == (6, 6)
    assert row["verdict"] == Verdict.REGRESSION and many.has_regression
    assert row["change"] == pytest.approx(0.06, abs=0.01)


def test_runs_noisier_than_the_floor_are_judged_by_their_own_scatter() -> None:
    # five runs per side with 8% run offsets: the runs' scatter, not the 1% floor,
    # decides, so a 6% difference of the means is not a verdict
    rng = np.random.default_rng(5)
    base = [_run(rng, offset_sd=0.08) for _ in range(5)]
    cand = [_run(rng, offset_sd=0.08) for _ in range(5)]
    row = _row(compare(base, cand, noise_floor=0.01))
    assert row["noise_source"] == "runs" and row["noise"] > 0.03
    assert row["verdict"] == Verdict.UNCHANGED


def test_a_sub_microsecond_hook_is_below_noise_and_never_gates() -> None:
    # +43% on a 230 ns hook, highly significant, with the hook gated too
    rng = np.random.default_rng(6)
    base = _run(rng, runtime__train_pre_step=230.0)
    cand = _run(rng, runtime__train_pre_step=330.0)
    result = compare(base, cand, gate="all", noise_floor=0.01)
    hook = _row(result, "runtime.train_pre_step")
    assert hook["p_holm"] < 1e-6 and hook["change"] == pytest.approx(0.43, abs=0.03)
    assert hook["verdict"] == Verdict.BELOW_NOISE
    assert not result.has_regression
    # the minimum effect is 1% of the base step (10 µs here), at least 1 µs
    assert result.min_effect_abs_ns == pytest.approx(0.01 * _row(result)["base_median_ns"])
    # with no step to refer to, the absolute floor is the minimum effect
    alone = compare(
        RunSummary.from_samples({"hook": np.full(50, 230.0)}),
        RunSummary.from_samples({"hook": np.full(50, 330.0)}),
        gate="all",
        noise_floor=0.01,
    )
    assert alone.min_effect_abs_ns == 1_000 and alone.step_median_ns is None
    assert _row(alone, "hook")["verdict"] == Verdict.BELOW_NOISE
    loose = compare(
        RunSummary.from_samples({"hook": np.full(50, 230.0)}),
        RunSummary.from_samples({"hook": np.full(50, 330.0)}),
        gate="all",
        noise_floor=0.01,
        min_effect_ns=50,
    )
    assert loose.has_regression and loose.regressions == ["hook"]


def test_a_significant_change_within_the_threshold_is_unchanged() -> None:
    rng = np.random.default_rng(7)
    base = [_run(rng, step_sd=0.01) for _ in range(8)]
    cand = [_run(rng, step_sd=0.01, shift=0.02) for _ in range(8)]
    strict = compare(base, cand, noise_floor=0.001)
    row = _row(strict)
    assert row["p_holm"] < 1e-4  # clearly significant ...
    assert row["verdict"] == Verdict.UNCHANGED  # ... but 2%, within the 3% threshold
    loose = compare(base, cand, noise_floor=0.001, threshold=0.01)
    assert _row(loose)["verdict"] == Verdict.REGRESSION


def test_a_large_change_the_runs_cannot_tell_from_noise_is_inconclusive_not_unchanged() -> None:
    """Five noisy runs a side, the candidate 40% slower: not significant at alpha 0.01,
    so it fails nothing, but the tables say inconclusive (not unchanged, which read as a
    confirmed no-change), the headline says so, and a note gives the smallest change such
    runs can find (a trial saw +46%, CI +6% ... +102%, called unchanged under a green
    mark)."""
    from exporters import render_comparison_markdown, render_comparison_table
    from exporters._compare_stats import detectable_change

    rng = np.random.default_rng(3)
    base = [_run(rng, offset_sd=0.25) for _ in range(5)]
    cand = [_run(rng, offset_sd=0.25, shift=0.4) for _ in range(5)]
    result = compare(base, cand)
    row = _row(result)
    assert row["verdict"] == Verdict.UNCHANGED and row["p_holm"] >= 0.01  # the test's own
    assert row["change"] > 0.03 and not result.has_regression and result.decided
    assert result.inconclusive == [STEP]
    text = render_comparison_table(result)
    assert text.startswith("ppetrace compare: no gated regression, 1 gated event inconclusive")
    assert f"  {STEP}: inconclusive:" in text and "cannot tell it from noise" in text
    (table_row,) = [line for line in text.splitlines() if line.startswith(f"{STEP} ")]
    assert table_row.split()[-3] == "inconclusive"
    assert render_comparison_markdown(result).startswith("### ppetrace compare: ⚠️ no gated")
    (note,) = [n for n in result.notes if n.startswith(f"{STEP}: the runs' own scatter")]
    smallest = detectable_change(row["noise"], 5, 5, alpha=0.01)
    assert f"only from about +{smallest * 100:.1f}%" in note and smallest > 0.4
    # a noise floor of 0: the note without the ratio to it (it divided by zero)
    zero = compare(base, cand, noise_floor=0.0)
    assert any("the runs' own scatter is" in n and "floor" not in n for n in zero.notes)
    # the same runs without scatter beyond the floor: no such note, and a clear verdict
    quiet = compare([_run(rng) for _ in range(5)], [_run(rng, shift=0.4) for _ in range(5)])
    assert quiet.regressions == [STEP] and not quiet.notes and not quiet.inconclusive

    # no change, noisy runs: "not significant" (its interval reaches past the threshold),
    # not "unchanged", which needs the interval within ±threshold
    def runs(medians: list[float]) -> list[RunSummary]:
        return [RunSummary.from_samples({STEP: np.full(50, m)}) for m in medians]

    scattered = [1.0e6, 1.3e6, 0.8e6, 1.2e6, 0.9e6]
    noisy = compare(runs(scattered), runs(scattered[::-1]))
    assert _row(noisy)["change"] == pytest.approx(0.0, abs=1e-12)
    assert f"  {STEP}: not significant:" in render_comparison_table(noisy)
    tight = compare(runs([1.0e6] * 8), runs([1.0e6] * 8), noise_floor=0.001)
    text = render_comparison_table(tight)
    assert f"  {STEP}: unchanged:" in text and "the interval lies within ±3.0%" in text


def test_detectable_change_has_the_power_it_claims() -> None:
    """At the change detectable_change gives, the run-level test finds it about 80% of the
    time (simulated: 2,000 pairs of 5 runs a side, scatter 10%, alpha 0.01)."""
    from exporters._compare_stats import detectable_change

    rng = np.random.default_rng(0)
    sd, runs, alpha = 0.10, 5, 0.01
    change = detectable_change(sd, runs, runs, alpha=alpha)
    found = 0
    for _ in range(2_000):
        b = rng.normal(0.0, sd, runs)
        c = rng.normal(math.log1p(change), sd, runs)
        zero = np.zeros(runs)
        test = run_level_test(b, zero, c, zero, noise_floor=0.0, confidence=0.95)
        found += test.p_value < alpha
    assert 0.76 <= found / 2_000 <= 0.84


def test_runs_of_very_different_lengths_are_noted() -> None:
    rng = np.random.default_rng(5)
    base = summarize_run(_frame_like(rng, 150))
    cand = summarize_run(_frame_like(rng, 20))
    result = compare(base, cand)
    assert any(n.startswith("the runs differ in length: 150 trainer.step") for n in result.notes)
    assert not any("differ in length" in n for n in compare(base, base).notes)


def _frame_like(rng: np.random.Generator, steps: int) -> pd.DataFrame:
    """A run of ``steps`` trainer.step spans of about 1 ms."""
    from exporters import SpanBatch, SpanRow

    rows, t = [], 0
    for i in range(steps):
        d = int(rng.normal(1_000_000, 20_000))
        rows.append(SpanRow(STEP, 10 + i, 0, 1, t, t + d, 1, {"ppetrace.step": i}))
        t += d + 1_000
    return spans_to_frame(SpanBatch(rows))


# -- the gate ---------------------------------------------------------------------------


def test_only_gated_events_fail_and_holm_runs_over_the_gated_family() -> None:
    rng = np.random.default_rng(8)
    base = _run(rng, module__train_step=500_000.0, trainer__backward=300_000.0)
    cand = _run(rng, module__train_step=800_000.0, trainer__backward=300_000.0)
    default = compare(base, cand)
    assert default.gate == [STEP] and not default.has_regression
    info = _row(default, "module.train_step")
    assert info["verdict"] == Verdict.REGRESSION and not info["gated"]  # shown, not gating
    assert default.regressions == []
    assert default.records[0]["event"] == STEP  # gated events first
    gated = compare(base, cand, gate=[STEP, "module.train_step"])
    assert gated.regressions == ["module.train_step"] and gated.has_regression
    rows = gated.events.set_index("event")
    p = rows.loc[[STEP, "module.train_step"], "p_value"].to_numpy()
    assert np.allclose(rows.loc[[STEP, "module.train_step"], "p_holm"], holm(p))
    everything = compare(base, cand, gate="all")
    assert set(everything.gate) == {STEP, "module.train_step", "trainer.backward"}


def test_a_missing_gated_event_is_an_error_and_a_missing_default_a_note() -> None:
    rng = np.random.default_rng(9)
    base, cand = _run(rng), _run(rng)
    with pytest.raises(TraceError, match=r"Expected the gated events to be in both .* but nope"):
        compare(base, cand, gate=["nope"])
    with pytest.raises(ValueError, match="Expected at least one event name to gate"):
        compare(base, cand, gate=[])
    hooks = RunSummary.from_samples({"user.work": np.full(10, 1_000.0)})
    result = compare(hooks, hooks)
    assert result.gate == [] and not result.has_regression
    assert "nothing is gated" in result.notes[0]


def test_too_few_samples_is_insufficient_data_and_said_for_a_gated_event() -> None:
    few = RunSummary.from_samples({STEP: [1_000.0] * 4})
    slow = RunSummary.from_samples({STEP: [5_000.0] * 4})
    result = compare(few, slow, min_samples=5)
    row = _row(result)
    assert row["verdict"] == Verdict.INSUFFICIENT and (row["base_runs"], row["cand_runs"]) == (0, 0)
    assert np.isnan(row["p_value"]) and np.isnan(row["ci_low"])
    assert row["change"] == pytest.approx(4.0)  # still shown
    assert not result.has_regression
    assert "trainer.step has fewer than 5 samples" in result.notes[0]
    assert _row(compare(few, slow, min_samples=4))["verdict"] == Verdict.REGRESSION


# -- frames, environments, errors ------------------------------------------------------


def test_frames_and_lists_of_frames_are_runs(run_builder: Callable[..., RunBuilder]) -> None:
    rng = np.random.default_rng(10)
    frames = [_frame(run_builder, rng.lognormal(np.log(1e6), 0.02, 21)) for _ in range(3)]
    result = compare(frames, frames[0])
    row = _row(result)
    assert (row["base_runs"], row["cand_runs"], row["base_n"]) == (3, 1, 60)
    assert (result.base_runs, result.cand_runs) == (3, 1)
    assert tuple(result.events.columns) == COLUMNS


def test_environments_that_differ_are_named_field_by_field() -> None:
    rng = np.random.default_rng(11)
    env = {"python": "3.11.7", "torch": "2.13.0", "cpu_model": "EPYC", "torch_threads": 1}
    base = RunSummary(_run(rng).events, env)
    cand = RunSummary(_run(rng).events, {**env, "torch_threads": 2, "torch": "2.14.0"})
    result = compare(base, cand)
    assert result.environment_warnings == [
        "environment differs: torch: base 2.13.0, candidate 2.14.0",
        "environment differs: torch_threads: base 1, candidate 2",
    ]
    assert compare(base, RunSummary(cand.events, env)).environment_warnings == []
    mixed = compare([base, RunSummary(base.events, {**env, "cpu_model": "Xeon"})], base)
    assert mixed.environment_warnings == [
        "environment differs: cpu_model: base EPYC / Xeon, candidate EPYC"
    ]
    assert compare(base, RunSummary(cand.events)).environment_recorded
    nowhere = compare(RunSummary(base.events), RunSummary(cand.events))
    assert nowhere.environment_warnings == [] and not nowhere.environment_recorded
    unknown = compare(base, RunSummary(cand.events))
    assert unknown.environment_warnings == [
        "environment unknown: 1 candidate run has no environment record (a trace written by "
        "an older ppetrace or another program), so it cannot be checked"
    ]


def test_runs_of_different_world_sizes_are_named_as_an_environment_difference(
    run_builder: Callable[..., RunBuilder],
) -> None:
    env = {"python": "3.11.7", "torch_threads": 1}

    def run(ranks: int) -> pd.DataFrame:
        parts = []
        for rank in range(ranks):
            rb = run_builder(pid=100 + rank, rank=rank)
            rb.training([10_000 + 7 * i for i in range(8)])
            parts.append(spans_to_frame(rb.batch()))
        frame = pd.concat(parts, ignore_index=True)
        frame.attrs["metadata"] = {"environment": env}
        return frame

    two, one = run(2), run(1)
    assert summarize_run(two).environment == {**env, "ranks": 2}
    assert summarize_run(one).environment == env  # one process: nothing added
    assert compare(two, one).environment_warnings == [
        "environment differs: ranks: base 2, candidate 1"
    ]
    assert compare(two, run(2)).environment_warnings == []


def test_events_in_one_run_only_are_added_or_removed(
    run_builder: Callable[..., RunBuilder],
) -> None:
    base = _frame(run_builder, [1_000] * 8, extra="user.old")
    cand = _frame(run_builder, [1_000] * 8, extra="user.new")
    result = compare(base, cand)
    assert result.added == ["user.new"] and result.removed == ["user.old"]
    assert "user.new" not in set(result.events["event"])


def test_runs_with_no_event_in_common_are_refused(
    run_builder: Callable[..., RunBuilder],
) -> None:
    a = _frame(run_builder, [], extra="user.a", backward=False)
    b = _frame(run_builder, [], extra="user.b", backward=False)
    with pytest.raises(TraceError, match="Expected the two runs to have at least one event in co"):
        compare(a, b)
    # a test stage's trace has spans, but none of them is a training sample
    rb = run_builder()
    rb.span("[Strategy]SingleDeviceStrategy.test_step", 0, 1_000, 0, {"ppetrace.stage": "test"})
    tested = spans_to_frame(rb.batch())
    fit = _frame(run_builder, [1_000] * 4)
    with pytest.raises(TraceError, match=r"the candidate has no training events \(validation"):
        compare(fit, tested)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"threshold": -0.1},
            r"^Expected a non-negative fraction for threshold \(0\.03 is 3%\), but received "
            r"-0\.1\. Pass a finite number such as threshold=0\.03\.$",
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
            {"noise_floor": 3},
            r"^Expected a fraction between 0 and 1 for noise_floor \(0\.025 is 2\.5%\), but "
            r"received 3\. Pass the run-to-run CV of the median step time, such as "
            r"noise_floor=0\.03\.$",
        ),
        (
            {"min_effect": -0.01},
            r"^Expected a fraction between 0 and 1 for min_effect \(0\.01 is 1% of the median "
            r"step\), but received -0\.01\.$",
        ),
        (
            {"min_effect_ns": float("inf")},
            r"^Expected a non-negative number of nanoseconds for min_effect_ns, but received "
            r"inf\. Pass a duration such as min_effect_ns=1000 \(1 µs\)\.$",
        ),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    run = RunSummary.from_samples({STEP: [1_000.0] * 6})
    with pytest.raises(ValueError, match=message):
        compare(run, run, **kwargs)


def test_non_runs_are_refused(run_builder: Callable[..., RunBuilder]) -> None:
    frame = _frame(run_builder, [1_000] * 3)
    with pytest.raises(TypeError, match=r"Expected a span frame for candidate run 2 .* but rec"):
        compare(frame, [frame, [1, 2]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"Expected a span frame for base .* received int"):
        compare(3, frame)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Expected at least one base run, but received an emp"):
        compare([], frame)


def test_the_default_floor_is_the_documented_one() -> None:
    rng = np.random.default_rng(12)
    result = compare(_run(rng), _run(rng))
    assert result.noise_floor == DEFAULT_NOISE_FLOOR
    assert 0.005 <= DEFAULT_NOISE_FLOOR <= 0.05
