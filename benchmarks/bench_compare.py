"""Calibration of ``ppetrace compare``: no false alarms on identical runs, and the
slowdowns it must catch.

Real runs. A small traced training (``ppetrace.Trainer`` on a 784-256-10 MLP,
batch 64, one torch thread, generated data) runs as a fresh process ``--runs``
times unchanged (A) and as many times with a busy-wait in ``forward`` of 5% and
of 10% of the median step (B5, B10; the median comes from one calibration run
that is not used otherwise). The runs are interleaved, A B5 B10, A B5 B10, ...
(the order rotates each round), so a drift of the machine hits every variant
alike. Then, with ``compare``'s default settings (``--warmup`` steps left out):

- A/A, one run per side: every pair of A runs (false alarms = exit code 1);
- A/B10 and A/B5, one run per side: every A x B pair (detection);
- 5 runs per side: random 5-of-N subsets of A against B5 (detection) and of
  two disjoint A halves (false alarms);
- N runs against N runs: A/B5, A/B10, and A/A between the two halves;
- the measured run-to-run CV of the median step, with a 95% interval;
- the curve: false alarms and detection at each noise floor in ``--floors``.

Synthetic runs. Runs with known offsets (log-normal, SD = the default noise
floor, the case where the floor is exactly right) and per-step noise, reduced
with :meth:`exporters.RunSummary.from_samples`: ``--pairs`` A/A pairs and as
many 10% pairs one run per side, and 5-run-per-side trials at 5%. It also
shows what the old per-step Mann-Whitney test flagged on the same A/A pairs.
``tests/exporters/test_compare_calibration.py`` runs this variant in the suite.

Speed. ``python -m ppetrace compare`` of two 100,000-span traces, 3 times.

Budgets (issue 10): A/A real one run per side 0 false alarms; A/A synthetic
<= 1%; 10% one run per side detected >= 80%; 5% five runs per side detected
>= 80%; compare of two 100k-span traces <= 3 s. It prints every figure and
exits with 1 when a budget is missed.

Run::

    python benchmarks/bench_compare.py             # 10 runs per variant, ~4-6 min
    python benchmarks/bench_compare.py --quick     # 6 runs of 120 steps, ~2 min
    python benchmarks/bench_compare.py --synthetic-only   # seconds
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]

BUDGET_AA_REAL = 0  # false alarms, all pairs
BUDGET_AA_SYNTHETIC = 0.01
BUDGET_DETECT_10_ONE = 0.80
BUDGET_DETECT_5_FIVE = 0.80
BUDGET_COMPARE_S = 3.0
DEFAULT_FLOORS = (0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.10, 0.15, 0.2, 0.3)
WARMUP = 20

# -- the training that is measured (a child process) --------------------------------


def child(out: str, steps: int, spin_ns: int, threads: int) -> int:
    """One run: a traced MLP training with a busy-wait of ``spin_ns`` in forward."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import ppetrace

    torch.set_num_threads(threads)
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if spin_ns:
                end = time.perf_counter_ns() + spin_ns
                while time.perf_counter_ns() < end:
                    pass
            return self.body(x)

    n = steps * 64
    data = TensorDataset(torch.randn(n, 784), torch.randint(0, 10, (n,)))
    model = Net()
    trainer = ppetrace.Trainer(
        device="cpu", max_epochs=1, val_every_n_epochs=None, progress=False, trace_path=out
    )
    trainer.fit(
        model,
        DataLoader(data, batch_size=64),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        loss_fn=nn.functional.cross_entropy,
    )
    return 0


def _run_child(out: Path, steps: int, spin_ns: int, threads: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(out)]
    cmd += ["--steps", str(steps), "--spin-ns", str(spin_ns), "--threads", str(threads)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)


# -- statistics helpers ---------------------------------------------------------------


def _rate_ci(k: int, n: int) -> tuple[float, float]:
    """The exact (Clopper-Pearson) 95% interval of a rate k/n."""
    if n == 0:
        return (math.nan, math.nan)
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return (float(ci.low), float(ci.high))


def _rate(k: int, n: int) -> dict[str, Any]:
    low, high = _rate_ci(k, n)
    return {"k": k, "n": n, "rate": k / n if n else math.nan, "ci95": [low, high]}


def _show_rate(r: dict[str, Any]) -> str:
    return (
        f"{r['k']}/{r['n']} = {r['rate'] * 100:.1f}% "
        f"(95% CI {r['ci95'][0] * 100:.1f}-{r['ci95'][1] * 100:.1f}%)"
    )


def cv_with_interval(medians: Sequence[float]) -> dict[str, float]:
    """The run-to-run CV (SD of log medians) with a 95% chi-square interval."""
    logs = np.log(np.asarray(medians, dtype=float))
    n = len(logs)
    s = float(np.std(logs, ddof=1))
    df = n - 1
    low = s * math.sqrt(df / float(stats.chi2.ppf(0.975, df)))
    high = s * math.sqrt(df / float(stats.chi2.ppf(0.025, df)))
    return {"cv": s, "low": low, "high": high, "runs": n}


Pick = tuple[tuple[int, ...], tuple[int, ...]]


def _subset_pairs(n_a: int, n_b: int, k: int, trials: int, rng: np.random.Generator) -> list[Pick]:
    """Up to ``trials`` distinct pairs (k-subset of range(n_a), k-subset of range(n_b)):
    all of them when there are fewer."""
    total = math.comb(n_a, k) * math.comb(n_b, k)
    if total <= trials:
        return list(
            itertools.product(
                itertools.combinations(range(n_a), k), itertools.combinations(range(n_b), k)
            )
        )
    seen: set[Pick] = set()
    while len(seen) < trials:
        sa = tuple(sorted(rng.choice(n_a, size=k, replace=False).tolist()))
        sb = tuple(sorted(rng.choice(n_b, size=k, replace=False).tolist()))
        seen.add((sa, sb))
    return sorted(seen)


# -- the real-run variant -------------------------------------------------------------


def _flags(base: Sequence[Any], cand: Sequence[Any], floor: float | None) -> bool:
    import exporters

    kwargs: dict[str, Any] = {} if floor is None else {"noise_floor": floor}
    return exporters.compare(list(base), list(cand), **kwargs).has_regression


def analyse_real(
    runs: dict[str, list[Any]],
    *,
    per_side: int = 5,
    trials: int = 200,
    floors: Sequence[float] = DEFAULT_FLOORS,
    seed: int = 0,
) -> dict[str, Any]:
    """Rates from RunSummaries of the variants ``A``, ``B5`` and ``B10``."""
    a, b5, b10 = runs["A"], runs["B5"], runs["B10"]
    rng = np.random.default_rng(seed)
    k = min(per_side, len(a), len(b5))
    five_b = _subset_pairs(len(a), len(b5), k, trials, rng)
    half = len(a) // 2
    aa_five = []
    if half >= 2:
        for _ in range(min(trials, 50)):
            perm = rng.permutation(len(a))
            aa_five.append((tuple(perm[:half]), tuple(perm[half : 2 * half])))

    def at(floor: float | None) -> dict[str, Any]:
        aa = [_flags([a[i]], [a[j]], floor) for i, j in itertools.combinations(range(len(a)), 2)]
        d10 = [_flags([x], [y], floor) for x in a for y in b10]
        d5 = [_flags([x], [y], floor) for x in a for y in b5]
        f5 = [_flags([a[i] for i in sa], [b5[j] for j in sb], floor) for sa, sb in five_b]
        aa5 = [_flags([a[i] for i in sa], [a[j] for j in sb], floor) for sa, sb in aa_five]
        return {
            "aa_one": _rate(sum(aa), len(aa)),
            "detect10_one": _rate(sum(d10), len(d10)),
            "detect5_one": _rate(sum(d5), len(d5)),
            "detect5_five": _rate(sum(f5), len(f5)),
            "aa_half": _rate(sum(aa5), len(aa5)),
        }

    out: dict[str, Any] = {"default": at(None), "per_side": k}
    out["all_vs_all"] = {
        "A/B5": _flags(a, b5, None),
        "A/B10": _flags(a, b10, None),
        "A/A halves": _flags(a[:half], a[half : 2 * half], None) if half else None,
    }
    out["curve"] = {f"{f:.3f}": at(f) for f in floors}
    quiet = [f for f, r in out["curve"].items() if r["aa_one"]["k"] == 0]
    out["smallest_silent_floor"] = float(quiet[0]) if quiet else None
    return out


def record_runs(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Run the training ``args.runs`` times per variant, interleaved, into ``work``;
    return (and write to ``work/runs.json``) the manifest that :func:`real_runs` reads."""
    import exporters

    t0 = time.perf_counter()
    calib = work / "calibration.json"
    _run_child(calib, args.steps, 0, args.threads)
    step = exporters.summarize_run(
        exporters.read_chrome_trace(calib), warmup_steps=args.warmup
    ).events["trainer.step"]
    spins = {"A": 0, "B5": round(0.05 * step.median_ns), "B10": round(0.10 * step.median_ns)}
    print(
        f"calibration run: median step {step.median_ns / 1e6:.3f} ms; busy-wait "
        f"B5 {spins['B5'] / 1e3:.1f} µs, B10 {spins['B10'] / 1e3:.1f} µs",
        flush=True,
    )
    names = list(spins)
    paths: dict[str, list[str]] = {v: [] for v in names}
    for i in range(args.runs):
        order = names[i % 3 :] + names[: i % 3]
        for variant in order:
            out = work / f"{variant}-{i:02d}.json"
            _run_child(out, args.steps, spins[variant], args.threads)
            paths[variant].append(out.name)
        print(f"  round {i + 1}/{args.runs} ({' '.join(order)}) done", flush=True)
    manifest = {
        "spins": spins,
        "steps": args.steps,
        "runs": args.runs,
        "paths": paths,
        "run_seconds": time.perf_counter() - t0,
    }
    (work / "runs.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def real_runs(args: argparse.Namespace, work: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Analyse the runs that ``manifest`` lists in ``work`` (see the module doc)."""
    import exporters

    spins = manifest["spins"]
    summaries = {
        v: [
            exporters.summarize_run(
                exporters.read_chrome_trace(work / name), warmup_steps=args.warmup
            )
            for name in names
        ]
        for v, names in manifest["paths"].items()
    }
    medians = {v: [s.events["trainer.step"].median_ns for s in ss] for v, ss in summaries.items()}
    a_med = float(np.median(medians["A"]))
    t1 = time.perf_counter()
    result = analyse_real(summaries, trials=args.trials, floors=args.floors)
    result.update(
        runs=manifest["runs"],
        steps=manifest["steps"],
        warmup=args.warmup,
        spin_ns=spins,
        step_medians_ns=medians,
        cv=cv_with_interval(medians["A"]),
        within_run_log_se=float(
            np.median([s.events["trainer.step"].log_se for s in summaries["A"]])
        ),
        realized={v: float(np.median(medians[v]) / a_med - 1.0) for v in ("B5", "B10")},
        spin_share={v: spins[v] / a_med for v in ("B5", "B10")},
        environment=summaries["A"][0].environment,
        seconds={"runs": manifest["run_seconds"], "analysis": time.perf_counter() - t1},
    )
    return result


# -- the synthetic variant -------------------------------------------------------------


def synthetic(
    *,
    pairs: int = 1000,
    detect_pairs: int | None = None,
    trials: int = 300,
    per_side: int = 5,
    run_sd: float | None = None,
    step_sd: float = 0.10,
    steps: int = 180,
    hook_run_sd: float = 0.20,
    shift_one: float = 0.10,
    shift_five: float = 0.05,
    old_pairs: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Rates on synthetic runs with known offsets (see the module doc): ``pairs`` A/A
    pairs one run per side, ``detect_pairs`` (default ``pairs``) pairs with a
    ``shift_one`` slowdown, ``trials`` trials of ``per_side`` runs per side with a
    ``shift_five`` slowdown and as many A/A trials. Run offsets have the SD
    ``run_sd`` (default: the default noise floor), steps ``step_sd``; a 230 ns hook
    has run offsets of ``hook_run_sd``. The first ``old_pairs`` (default: all) A/A
    pairs are also judged by the old per-step Mann-Whitney test."""
    import exporters

    floor = exporters.DEFAULT_NOISE_FLOOR if run_sd is None else run_sd
    rng = np.random.default_rng(seed)
    step_ns, hook_ns = 1_000_000.0, 230.0

    def samples(shift: float) -> tuple[np.ndarray, Any]:
        offset = rng.normal(0.0, floor)
        step = np.exp(np.log(step_ns) + math.log1p(shift) + offset + rng.normal(0, step_sd, steps))
        hook = np.exp(np.log(hook_ns) + rng.normal(0, hook_run_sd) + rng.normal(0, 0.3, steps))
        summary = exporters.RunSummary.from_samples({"trainer.step": step, "runtime.hook": hook})
        return step, summary

    aa = old_aa = n_old = hook_flagged = 0
    for _ in range(pairs):
        xs, x = samples(0.0)
        ys, y = samples(0.0)
        result = exporters.compare(x, y)
        aa += result.has_regression
        verdicts = {r["event"]: r["verdict"] for r in result.records}
        hook_flagged += verdicts["runtime.hook"] in ("regression", "improvement")
        if n_old < (pairs if old_pairs is None else old_pairs):  # the old per-step test
            n_old += 1
            p_old = float(stats.mannwhitneyu(ys, xs, alternative="two-sided").pvalue)
            old_aa += p_old < 0.01 and abs(np.median(ys) / np.median(xs) - 1) > 0.05
    n_detect = pairs if detect_pairs is None else detect_pairs
    d_one = sum(
        exporters.compare(samples(0.0)[1], samples(shift_one)[1]).has_regression
        for _ in range(n_detect)
    )
    d_five = aa_five = 0
    for _ in range(trials):
        base = [samples(0.0)[1] for _ in range(per_side)]
        cand = [samples(shift_five)[1] for _ in range(per_side)]
        same = [samples(0.0)[1] for _ in range(per_side)]
        d_five += exporters.compare(base, cand).has_regression
        aa_five += exporters.compare(base, same).has_regression
    return {
        "run_sd": floor,
        "step_sd": step_sd,
        "steps": steps,
        "shift_one": shift_one,
        "shift_five": shift_five,
        "per_side": per_side,
        "aa_one": _rate(aa, pairs),
        "detect_one": _rate(d_one, n_detect),
        "detect_five": _rate(d_five, trials),
        "aa_five": _rate(aa_five, trials),
        "old_method_aa_one": _rate(old_aa, n_old),
        "hook_verdicts_aa_one": _rate(hook_flagged, pairs),
    }


# -- speed ---------------------------------------------------------------------------


def time_compare(work: Path, spans: int = 100_000, repeat: int = 3) -> dict[str, Any]:
    """Seconds of ``python -m ppetrace compare`` on two ``spans``-span traces."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_export import make_batches
    from exporters import ChromeTraceExporter

    paths = []
    for name in ("base", "cand"):
        path = work / f"{name}-{spans}.json"
        writer = ChromeTraceExporter(path)
        for batch in make_batches(spans):
            writer.export_batch(batch)
        writer.shutdown()
        paths.append(path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "ppetrace", "compare", *map(str, paths)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        times.append(time.perf_counter() - t0)
        if done.returncode not in (0, 1):
            raise RuntimeError(f"ppetrace compare failed: {done.stderr.strip()}")
    from benchmarks.bench_export import DESIGN_JSON_DUMPS_US, reference_json_dumps_us

    speed = DESIGN_JSON_DUMPS_US / reference_json_dumps_us(make_batches(20_000))
    median = float(np.median(times))
    return {
        "spans": spans,
        "seconds": times,
        "median_s": median,
        "machine_speed": speed,
        "median_s_at_design_speed": median * speed,
    }


# -- the report ----------------------------------------------------------------------


def _budgets(res: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    rows = []
    real = res.get("real")
    if real is not None:
        d = real["default"]
        rows.append(
            (
                "A/A real, one run per side, all pairs",
                f"{d['aa_one']['k']} false alarms in {d['aa_one']['n']} pairs",
                "0",
                d["aa_one"]["k"] <= BUDGET_AA_REAL,
            )
        )
        rows.append(
            (
                "10% slowdown, one run per side",
                _show_rate(d["detect10_one"]),
                ">= 80%",
                d["detect10_one"]["rate"] >= BUDGET_DETECT_10_ONE,
            )
        )
        rows.append(
            (
                f"5% slowdown, {real['per_side']} runs per side",
                _show_rate(d["detect5_five"]),
                ">= 80%",
                d["detect5_five"]["rate"] >= BUDGET_DETECT_5_FIVE,
            )
        )
    syn = res.get("synthetic")
    if syn is not None:
        rows.append(
            (
                "A/A synthetic with run offsets, one run per side",
                _show_rate(syn["aa_one"]),
                "<= 1%",
                syn["aa_one"]["rate"] <= BUDGET_AA_SYNTHETIC,
            )
        )
    speed = res.get("speed")
    if speed is not None:
        rows.append(
            (
                f"ppetrace compare, two {speed['spans']:,}-span traces",
                f"median {speed['median_s']:.2f} s of "
                + ", ".join(f"{t:.2f}" for t in speed["seconds"])
                + f" (machine speed x{speed['machine_speed']:.2f} of DESIGN.md's: "
                f"{speed['median_s_at_design_speed']:.2f} s there)",
                "<= 3 s",
                speed["median_s"] <= BUDGET_COMPARE_S,
            )
        )
    return rows


def _print_real(real: dict[str, Any]) -> None:
    cv = real["cv"]
    print(
        f"\nreal runs: {real['runs']} per variant, {real['steps']} steps, warmup "
        f"{real['warmup']}; run time {real['seconds']['runs']:.0f} s, analysis "
        f"{real['seconds']['analysis']:.1f} s"
    )
    print(
        f"  run-to-run CV of the median step (A): {cv['cv'] * 100:.2f}% "
        f"(95% CI {cv['low'] * 100:.2f}-{cv['high'] * 100:.2f}%, {cv['runs']} runs); "
        f"within-run SE of the median {real['within_run_log_se'] * 100:.2f}%"
    )
    a = np.asarray(real["step_medians_ns"]["A"]) / 1e6
    print(f"  A medians (ms): {' '.join(f'{x:.3f}' for x in a)}")
    for v in ("B5", "B10"):
        print(
            f"  {v}: busy-wait {real['spin_share'][v] * 100:.1f}% of A's median step, "
            f"realized slowdown of the median {real['realized'][v] * 100:+.1f}%"
        )
    d = real["default"]
    print("  default settings:")
    for key, label in (
        ("aa_one", "A/A one run per side (false alarms)"),
        ("detect10_one", "A/B10 one run per side (detected)"),
        ("detect5_one", "A/B5 one run per side (detected)"),
        ("detect5_five", f"A/B5 {real['per_side']} runs per side (detected)"),
        ("aa_half", "A/A half vs half (false alarms)"),
    ):
        print(f"    {label:45s} {_show_rate(d[key])}")
    print(f"    all runs vs all runs: {real['all_vs_all']}")
    silent = real["smallest_silent_floor"]
    if silent is None:
        print("  no floor of the curve gives 0 A/A false alarms")
    else:
        r = real["curve"][f"{silent:.3f}"]
        print(
            f"  smallest floor with 0 A/A false alarms: {silent * 100:.1f}%; there, 10% one "
            f"run per side is detected in {r['detect10_one']['rate'] * 100:.0f}% and 5% with "
            f"{real['per_side']} runs per side in {r['detect5_five']['rate'] * 100:.0f}%"
        )
    print("  the curve (one run per side unless noted):")
    print(
        f"    {'floor':>6}  {'A/A false alarms':>18}  {'10% detected':>14}  "
        f"{'5% detected':>12}  {'5% x5 detected':>15}"
    )
    for floor, r in real["curve"].items():
        print(
            f"    {float(floor) * 100:5.1f}%  {r['aa_one']['k']:>7}/{r['aa_one']['n']:<10}"
            f"  {r['detect10_one']['rate'] * 100:13.1f}%  {r['detect5_one']['rate'] * 100:11.1f}%"
            f"  {r['detect5_five']['rate'] * 100:14.1f}%"
        )


def _print_synthetic(syn: dict[str, Any]) -> None:
    print(
        f"\nsynthetic runs: run offsets SD {syn['run_sd'] * 100:.1f}% (the default floor), "
        f"per-step SD {syn['step_sd'] * 100:.0f}%, {syn['steps']} steps; "
        f"{syn['seconds']:.1f} s"
    )
    for key, label in (
        ("aa_one", "A/A one run per side (false alarms)"),
        ("detect_one", f"{syn['shift_one']:.0%} one run per side (detected)"),
        ("detect_five", f"{syn['shift_five']:.0%} {syn['per_side']} runs per side (detected)"),
        ("aa_five", f"A/A {syn['per_side']} runs per side (false alarms)"),
        ("hook_verdicts_aa_one", "A/A: a 230 ns hook flagged (informational)"),
        ("old_method_aa_one", "A/A: per-step Mann-Whitney, >5% (old method)"),
    ):
        print(f"  {label:48s} {_show_rate(syn[key])}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the calibration; print every figure; return 1 when a budget is missed."""
    parser = argparse.ArgumentParser(
        description=(
            "Calibrate ppetrace compare: A/A false alarms and the detection of 5% and 10% "
            "slowdowns on real and synthetic runs, the run-to-run CV and a curve over noise "
            "floors, and the speed of compare on 100k-span traces. Bounded time: the real "
            "runs take about 3 x RUNS x (5 s of start-up + STEPS x the step time), about "
            "4-6 min with the defaults on a quiet 2-core machine, about 2 min with --quick; "
            "--synthetic-only takes seconds."
        )
    )
    parser.add_argument("--runs", type=int, default=10, help="runs per variant (default 10)")
    parser.add_argument("--steps", type=int, default=200, help="steps per run (default 200)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="steps left out (20)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--trials", type=int, default=200, help="5-run subsets (default 200)")
    parser.add_argument("--pairs", type=int, default=1000, help="synthetic pairs (default 1000)")
    parser.add_argument("--quick", action="store_true", help="6 runs of 120 steps, 500 pairs")
    parser.add_argument(
        "--floors",
        default=",".join(f"{f:g}" for f in DEFAULT_FLOORS),
        help="noise floors of the curve, fractions separated by commas",
    )
    parser.add_argument("--synthetic-only", action="store_true", help="skip the real runs")
    parser.add_argument("--real-only", action="store_true", help="skip the synthetic runs")
    parser.add_argument("--keep", metavar="DIR", help="keep the run traces in DIR")
    parser.add_argument(
        "--from",
        dest="source",
        metavar="DIR",
        help="analyse the runs kept in DIR (by --keep) instead of running again",
    )
    parser.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--spin-ns", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.steps, args.spin_ns, args.threads)
    if args.quick:
        args.runs, args.steps, args.pairs = 6, 120, 500
    if args.runs < 2 or args.steps <= args.warmup + 5:
        parser.error("expected --runs >= 2 and --steps > --warmup + 5")
    args.floors = [float(f) for f in args.floors.split(",")]

    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "command": "python benchmarks/bench_compare.py " + " ".join(argv or sys.argv[1:]),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_avg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
    }
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if not args.synthetic_only:
            if args.source:
                source = Path(args.source)
                manifest = json.loads((source / "runs.json").read_text())
            else:
                source, manifest = work, record_runs(args, work)
            res["real"] = real_runs(args, source, manifest)
            _print_real(res["real"])
        if not args.real_only:
            s0 = time.perf_counter()
            res["synthetic"] = synthetic(pairs=args.pairs)
            res["synthetic"]["seconds"] = time.perf_counter() - s0
            _print_synthetic(res["synthetic"])
        res["speed"] = time_compare(work)
    res["machine"]["load_avg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    res["seconds"] = time.perf_counter() - t0
    rows = _budgets(res)
    res["budgets"] = [{"what": w, "measured": m, "budget": b, "pass": ok} for w, m, b, ok in rows]
    print(
        f"\nbudgets (load average {res['machine']['load_avg_start']} at the start, "
        f"{res['machine']['load_avg_end']} at the end; {res['seconds']:.0f} s in all):"
    )
    for what, measured, budget, ok in rows:
        print(f"  {'PASS' if ok else 'FAIL'}  {what:50s} {measured}  (budget {budget})")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str) + "\n")
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
