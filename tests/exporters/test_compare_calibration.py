"""The synthetic variant of ``benchmarks/bench_compare.py`` in the suite: 500 A/A pairs
of runs with known run offsets stay under 1% false alarms, where the old per-step test
cried wolf, and the gate still catches a real slowdown."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the repository, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_compare import synthetic  # noqa: E402


def test_500_aa_pairs_with_run_offsets_stay_under_one_percent_false_alarms() -> None:
    # run offsets with the SD of the default floor: the case where the floor is exactly
    # right, so about alpha / 2 = 0.5% of A/A pairs are expected to alarm
    res = synthetic(pairs=500, detect_pairs=100, trials=0, shift_one=0.35, old_pairs=200, seed=1)
    assert res["aa_one"]["n"] == 500
    assert res["aa_one"]["rate"] <= 0.01, res["aa_one"]
    # the same pairs under the old method (per-step Mann-Whitney, 5%) alarm often
    assert res["old_method_aa_one"]["rate"] >= 0.05, res["old_method_aa_one"]
    # a 230 ns hook whose runs differ by 20% never gets a verdict
    assert res["hook_verdicts_aa_one"]["k"] == 0
    # and the gate is not silent: a 35% slowdown one run per side is caught (about 4
    # floors of run-to-run noise)
    assert res["detect_one"]["rate"] >= 0.9, res["detect_one"]


def test_five_runs_per_side_catch_what_one_run_cannot() -> None:
    # quiet runs (0.5% offsets), judged against the default 5% floor: a 13% slowdown,
    # which one run per side catches about 1 time in 4, is caught with five runs per
    # side in nearly every trial, and identical sets of runs do not alarm
    res = synthetic(
        pairs=0, detect_pairs=0, trials=40, run_sd=0.005, step_sd=0.05, shift_five=0.13, seed=2
    )
    assert res["detect_five"]["rate"] >= 0.9, res["detect_five"]
    assert res["aa_five"]["k"] <= 1, res["aa_five"]
