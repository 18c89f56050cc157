"""Compare baseline runs with candidate runs, event by event, and gate on what matters.

In: one run or several runs per side (span frames, or :class:`RunSummary`\\ s
from :func:`summarize_run`). Out: a :class:`Comparison`, one row per event
found on both sides, and a verdict that a CI job can exit on.

The method (the README's "How `compare` decides" has the measured figures):

- **Runs are the samples.** Each run gives, per event, the median of its
  per-step samples (:mod:`exporters._compare_runs`). The change is the ratio of
  the geometric means of the run medians, minus 1, and its confidence interval
  and two-sided p-value come from :func:`exporters._compare_stats.run_level_test`:
  the run-to-run noise is the larger of the ``noise_floor`` (plus each run's
  own sampling error; normal distribution) and, with three runs or more, the
  scatter of the runs themselves (Student's t).
- **Only a change that matters is a verdict.** ``regression`` or
  ``improvement`` needs all three: Holm-adjusted p below ``alpha``, a change
  beyond ``threshold``, and an absolute change of at least the minimum effect
  (``min_effect`` of the base's median ``trainer.step``, and never less than
  ``min_effect_ns``). A change that is significant and beyond the threshold
  but smaller than the minimum effect is ``below noise`` (a sub-microsecond
  hook, say); anything else is ``unchanged``; ``insufficient data`` when a
  side has no run with ``min_samples`` samples of the event.
- **A gate.** Only gated events decide :attr:`Comparison.has_regression` (the
  CLI's exit code). By default that is ``trainer.step`` alone; every other
  event is informational. The Holm correction runs over the gated events, and
  separately over the informational ones.
- **Environments are named.** :attr:`Comparison.environment_warnings` has a
  line per environment field (``otherData.environment``) that differs.
- **Failed runs are named.** A run whose fit raised, whose step ended with an
  error or whose trace is cut off (:func:`run_failure`) is listed in
  :attr:`Comparison.failed_runs` and the notes: its steps up to the failure are
  no measure of the code's speed, and ``ppetrace compare`` exits 2 on it.

Events found on one side only are listed as ``added`` or ``removed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from ._compare_env import environment_warnings
from ._compare_render import (
    COMPARE_FORMATS,
    render_comparison,
    render_comparison_json,
    render_comparison_markdown,
    render_comparison_table,
)
from ._compare_result import _ORDER, Comparison, Verdict
from ._compare_runs import (
    EventStat,
    RunSummary,
    drop_copies,
    event_samples,
    group_runs,
    run_failure,
    run_identity,
    summarize_run,
)
from ._compare_stats import detectable_change, holm, run_level_test
from ._defaults import (
    DEFAULT_ALPHA,
    DEFAULT_GATE,
    DEFAULT_MIN_EFFECT,
    DEFAULT_MIN_EFFECT_NS,
    DEFAULT_NOISE_FLOOR,
    DEFAULT_THRESHOLD,
)
from ._errors import TraceError
from ._render import fmt_pct
from ._steps import STEP

__all__ = [
    "COMPARE_FORMATS",
    "DEFAULT_ALPHA",
    "DEFAULT_GATE",
    "DEFAULT_MIN_EFFECT",
    "DEFAULT_MIN_EFFECT_NS",
    "DEFAULT_NOISE_FLOOR",
    "DEFAULT_THRESHOLD",
    "Comparison",
    "EventStat",
    "RunSummary",
    "Verdict",
    "compare",
    "drop_copies",
    "event_samples",
    "holm",
    "render_comparison",
    "render_comparison_json",
    "render_comparison_markdown",
    "render_comparison_table",
    "summarize_run",
    "group_runs",
    "run_failure",
    "run_identity",
]

Run = pd.DataFrame | RunSummary


def _is_fraction(value: object, *, low: float, high: float, closed: bool = True) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    v = float(value)
    return (low <= v <= high) if closed else (low < v < high)


def _check(
    threshold: float,
    alpha: float,
    min_samples: int,
    confidence: float,
    noise_floor: float,
    min_effect: float,
    min_effect_ns: float,
) -> None:
    if not _is_fraction(threshold, low=0.0, high=math.inf) or math.isinf(threshold):
        raise ValueError(
            f"Expected a non-negative fraction for threshold (0.03 is 3%), but received "
            f"{threshold!r}. Pass a finite number such as threshold=0.03."
        )
    if not _is_fraction(alpha, low=0.0, high=1.0, closed=False):
        raise ValueError(
            f"Expected alpha between 0 and 1 (exclusive), but received {alpha!r}. Pass a "
            "significance level such as alpha=0.01."
        )
    if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 2:
        raise ValueError(
            f"Expected an int >= 2 for min_samples, but received {min_samples!r}. Pass the "
            "fewest samples per run for a verdict, such as min_samples=5."
        )
    if not isinstance(confidence, float) or not _is_fraction(
        confidence, low=0.0, high=1.0, closed=False
    ):
        raise ValueError(
            f"Expected confidence between 0 and 1 (exclusive), but received {confidence!r}. "
            "Pass a float level such as confidence=0.95 (not 95)."
        )
    if not _is_fraction(noise_floor, low=0.0, high=1.0):
        raise ValueError(
            f"Expected a fraction between 0 and 1 for noise_floor (0.025 is 2.5%), but "
            f"received {noise_floor!r}. Pass the run-to-run CV of the median step time, "
            "such as noise_floor=0.03."
        )
    if not _is_fraction(min_effect, low=0.0, high=1.0):
        raise ValueError(
            f"Expected a fraction between 0 and 1 for min_effect (0.01 is 1% of the median "
            f"step), but received {min_effect!r}."
        )
    if not _is_fraction(min_effect_ns, low=0.0, high=math.inf) or math.isinf(min_effect_ns):
        raise ValueError(
            f"Expected a non-negative number of nanoseconds for min_effect_ns, but received "
            f"{min_effect_ns!r}. Pass a duration such as min_effect_ns=1000 (1 µs)."
        )


def _runs(
    side: Run | Sequence[Run], label: str, warmup_steps: int, rank: int | None = None
) -> list[RunSummary]:
    items: Sequence[object]
    if isinstance(side, (pd.DataFrame, RunSummary)):
        items = [side]
    elif isinstance(side, Sequence) and not isinstance(side, (str, bytes)):
        items = side
        if not items:
            raise ValueError(f"Expected at least one {label} run, but received an empty sequence.")
    else:
        items = [side]
    out = []
    for i, item in enumerate(items):
        if isinstance(item, RunSummary):
            out.append(item)
        elif isinstance(item, pd.DataFrame) and "dur_ns" in item.columns:
            out.append(summarize_run(item, warmup_steps=warmup_steps, rank=rank))
        else:
            which = label if len(items) == 1 else f"{label} run {i + 1}"
            raise TypeError(
                f"Expected a span frame for {which} (from exporters.spans_to_frame or "
                f"read_chrome_trace) or a RunSummary, but received {type(item).__name__}."
            )
    return out


def _failed(run: RunSummary, i: int, n: int) -> str:
    """``"<file>: <how it failed>"`` for a failed run (its number when it has no file)."""
    where = run.source or (f"run {i + 1}" if n > 1 else "the run")
    return f"{where}: {run.failure}"


def _names(names: set[str]) -> str:
    shown = sorted(names)
    if not shown:  # (a test or predict stage's trace has spans, but none is a sample)
        return "no training events (validation, test and predict spans are no samples)"
    head = ", ".join(shown[:5])
    noun = "event" if len(shown) == 1 else "events"
    return f"{len(shown)} {noun} ({head}{', ...' if len(shown) > 5 else ''})"


def _all_warmup(b_runs: list[RunSummary], c_runs: list[RunSummary]) -> str:
    """``"": the ... side's N steps are all warmup ..."`` for the sides whose
    ``trainer.step`` spans were all left out as warmup, or ``""``."""
    sides = []
    for label, runs in (("base", b_runs), ("candidate", c_runs)):
        counts = [r.step_count for r in runs if r.step_count and STEP not in r.events]
        if counts and all(STEP not in r.events for r in runs):
            n = sum(counts)
            steps = "the only step" if n == 1 else f"all {n} steps"
            sides.append(f"{steps} of the {label} {'is' if n == 1 else 'are'} warmup")
    if not sides:
        return ""
    return f" ({' and '.join(sides)}: lower the warmup, warmup_steps or --warmup)"


def _resolve_gate(
    gate: str | Sequence[str] | None, common: list[str], notes: list[str], warmup: str = ""
) -> list[str]:
    if gate is None:
        found = [e for e in DEFAULT_GATE if e in common]
        if not found:
            notes.append(  # (step.wall has samples exactly when trainer.step has)
                f"{DEFAULT_GATE[0]} is not in both runs{warmup}, so nothing is gated "
                "and this comparison cannot fail; choose events to gate (gate=[...] in "
                "Python, --gate on the command line)."
            )
        return found
    if isinstance(gate, str):
        if gate == "all":
            return list(common)
        gate = [gate]
    names = [str(g) for g in gate]
    if not names:
        raise ValueError("Expected at least one event name to gate (or 'all'), but received none.")
    missing = [g for g in names if g not in common]
    if missing:
        raise TraceError(
            f"Expected the gated events to be in both the base and the candidate runs, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not; the events "
            f"in both are {', '.join(sorted(common)[:12])}{', ...' if len(common) > 12 else ''}."
        )
    return list(dict.fromkeys(names))


def _center(stats: list[EventStat]) -> float:
    """The geometric mean of the runs' medians (the median itself for one run)."""
    if not stats:
        return math.nan
    return float(np.exp(np.mean(np.log(np.maximum([s.median_ns for s in stats], 1.0)))))


def _verdict(
    change: float, p_holm: float, delta_ns: float, *, alpha: float, threshold: float, floor: float
) -> str:
    if not (p_holm < alpha and abs(change) > threshold):
        return Verdict.UNCHANGED
    if abs(delta_ns) < floor:
        return Verdict.BELOW_NOISE
    return Verdict.REGRESSION if change > 0 else Verdict.IMPROVEMENT


def _resolution_notes(
    rows: list[dict[str, Any]], noise_floor: float, alpha: float, threshold: float
) -> list[str]:
    """A note for each gated event whose runs scatter far beyond the noise floor: the
    smallest change its comparison can find, so that a pass is read for what it is."""
    gated = [r for r in rows if r["gated"] and not math.isnan(float(r["p_value"]))]
    notes = []
    for r in gated:
        noise = float(r["noise"])
        if r["noise_source"] != "runs" or noise <= 2 * noise_floor:
            continue
        runs = int(r["base_runs"]), int(r["cand_runs"])
        smallest = detectable_change(noise, *runs, alpha=alpha / len(gated))
        if smallest <= threshold:  # it finds what the gate asks for: nothing to say
            continue
        times = ""
        if noise_floor > 0:
            times = f", {noise / noise_floor:.1f}x the noise floor ({fmt_pct(noise_floor)})"
        notes.append(
            f"{r['event']}: the runs' own scatter is {fmt_pct(noise)}{times}. With "
            f"{runs[0]} and {runs[1]} runs, a "
            f"change is found 80% of the time only from about {fmt_pct(smallest, signed=True)}"
            f" (the threshold is {fmt_pct(threshold)}); a pass says no more. Compare more "
            "runs per side, or on a quieter machine."
        )
    return notes


def compare(
    base: Run | Sequence[Run],
    candidate: Run | Sequence[Run],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    alpha: float = DEFAULT_ALPHA,
    noise_floor: float = DEFAULT_NOISE_FLOOR,
    gate: str | Sequence[str] | None = None,
    min_effect: float = DEFAULT_MIN_EFFECT,
    min_effect_ns: float = DEFAULT_MIN_EFFECT_NS,
    min_samples: int = 5,
    warmup_steps: int = 1,
    confidence: float = 0.95,
    rank: int | None = None,
) -> Comparison:
    """Compare the base run(s) with the candidate run(s) (see the module doc).

    ``base`` and ``candidate`` are each one run or a sequence of runs: span
    frames (``warmup_steps`` steps left out at the start of each process) or
    :class:`RunSummary`\\ s. ``threshold`` is the smallest relative change that
    counts (0.03 = 3%); ``alpha`` the significance level after Holm
    correction; ``noise_floor`` the run-to-run CV of a run's median assumed at
    least (default :data:`DEFAULT_NOISE_FLOOR`); ``gate`` the events that can
    fail the comparison (default ``trainer.step`` when present, ``"all"``, or
    names); ``min_effect`` (a fraction of the base's median step) and
    ``min_effect_ns`` the minimum absolute effect; ``min_samples`` the fewest
    samples a run needs to count for an event. ``rank`` compares one rank of
    multi-rank frames (merged torchrun traces); by default every rank's steps
    are samples of its run. Raises :class:`TraceError` when the sides have no
    event in common or a named gated event is missing.
    """
    _check(threshold, alpha, min_samples, confidence, noise_floor, min_effect, min_effect_ns)
    b_runs = _runs(base, "base", warmup_steps, rank)
    c_runs = _runs(candidate, "candidate", warmup_steps, rank)
    b_names = {e for r in b_runs for e in r.events}
    c_names = {e for r in c_runs for e in r.events}
    common = sorted(b_names & c_names)
    warmup = _all_warmup(b_runs, c_runs)
    if not common:
        raise TraceError(
            "Expected the two runs to have at least one event in common, but the base has "
            f"{_names(b_names)} and the candidate has {_names(c_names)}{warmup}."
        )
    notes: list[str] = []
    gated = set(_resolve_gate(gate, common, notes, warmup))
    profiled = [sum(r.profiled_steps for r in runs) for runs in (b_runs, c_runs)]
    if any(profiled):
        notes.append(
            f"{profiled[0]} profiled step{'s' if profiled[0] != 1 else ''} of the base and "
            f"{profiled[1]} of the candidate are no samples (inside a profiler's window, "
            "whose profiling slows steps down)."
        )

    def qualifying(runs: list[RunSummary], event: str) -> list[EventStat]:
        return [r.events[event] for r in runs if event in r.events]

    step_stats = [s for s in qualifying(b_runs, STEP) if s.n >= min_samples]
    step_median = _center(step_stats) if step_stats else None
    floor_ns = float(min_effect_ns)
    if step_median is not None and math.isfinite(step_median):
        floor_ns = max(floor_ns, min_effect * step_median)

    rows = []
    for event in common:
        b_all, c_all = qualifying(b_runs, event), qualifying(c_runs, event)
        b_ok = [s for s in b_all if s.n >= min_samples]
        c_ok = [s for s in c_all if s.n >= min_samples]
        mb, mc = _center(b_ok or b_all), _center(c_ok or c_all)
        row: dict[str, Any] = {
            "event": event,
            "gated": event in gated,
            "base_runs": len(b_ok),
            "cand_runs": len(c_ok),
            "base_n": sum(s.n for s in (b_ok or b_all)),
            "cand_n": sum(s.n for s in (c_ok or c_all)),
            "base_median_ns": mb,
            "cand_median_ns": mc,
            "change": (mc / mb - 1.0) if mb > 0 else math.nan,
            "ci_low": math.nan,
            "ci_high": math.nan,
            "noise": math.nan,
            "noise_source": "",
            "p_value": math.nan,
        }
        if b_ok and c_ok:
            test = run_level_test(
                np.log(np.maximum([s.median_ns for s in b_ok], 1.0)),
                np.array([s.log_se for s in b_ok]),
                np.log(np.maximum([s.median_ns for s in c_ok], 1.0)),
                np.array([s.log_se for s in c_ok]),
                noise_floor=float(noise_floor),
                confidence=confidence,
            )
            row.update(
                change=test.change,
                ci_low=test.ci_low,
                ci_high=test.ci_high,
                noise=test.noise,
                noise_source=test.source,
                p_value=test.p_value,
            )
        rows.append(row)
    tested = np.array([not math.isnan(float(r["p_value"])) for r in rows])
    is_gated = np.array([bool(r["gated"]) for r in rows])
    p_values = np.array([float(r["p_value"]) for r in rows])
    p_holm = np.full(len(rows), np.nan)
    for family in (is_gated, ~is_gated):
        chosen = tested & family
        p_holm[chosen] = holm(p_values[chosen])
    for row, p_adj, ok in zip(rows, p_holm, tested, strict=True):
        row["p_holm"] = float(p_adj)
        if not ok:
            row["verdict"] = Verdict.INSUFFICIENT
            continue
        b, c = float(row["base_median_ns"]), float(row["cand_median_ns"])
        row["verdict"] = _verdict(
            float(row["change"]),
            float(p_adj),
            c - b,
            alpha=alpha,
            threshold=threshold,
            floor=floor_ns,
        )
    notes += _resolution_notes(rows, noise_floor, alpha, threshold)
    failed_runs = {
        side: [_failed(r, i, len(runs)) for i, r in enumerate(runs) if r.failure]
        for side, runs in (("base", b_runs), ("candidate", c_runs))
    }
    for side, lines in failed_runs.items():
        if lines:
            n = len(lines)
            notes.append(
                f"{'a' if n == 1 else n} {side} run{'s' if n != 1 else ''} "
                f"failed: {'; '.join(lines)}. Steps up to a failure are no measure of the "
                "code's speed."
            )
    counts = [[r.step_count for r in runs if r.step_count] for runs in (b_runs, c_runs)]
    if all(counts):
        b_steps, c_steps = (float(np.median(c)) for c in counts)
        if max(b_steps, c_steps) > 2 * min(b_steps, c_steps):
            notes.append(
                f"the runs differ in length: {b_steps:g} trainer.step spans per base run, "
                f"{c_steps:g} per candidate run (median). A run cut short (a crash, an "
                "interrupted or truncated trace) or configured otherwise compares other "
                "steps (warmer or colder); check that both sides ran the same work."
            )
    silent = [str(r["event"]) for r, ok in zip(rows, tested, strict=True) if r["gated"] and not ok]
    if silent:
        notes.append(
            f"{', '.join(silent)} {'has' if len(silent) == 1 else 'have'} fewer than "
            f"{min_samples} samples in every run of a side: no verdict, so "
            f"{'it' if len(silent) == 1 else 'they'} cannot fail the comparison."
        )

    def key(r: dict[str, Any]) -> tuple[bool, int, float, str]:
        change = float(r["change"])
        size = 0.0 if math.isnan(change) else abs(change)
        return (not r["gated"], _ORDER[str(r["verdict"])], -size, str(r["event"]))

    # gated first, then verdict, the largest change, the name
    rows.sort(key=key)
    return Comparison(
        records=rows,  # each holds the COLUMNS, in order
        added=sorted(c_names - b_names),
        removed=sorted(b_names - c_names),
        threshold=float(threshold),
        alpha=float(alpha),
        min_samples=min_samples,
        confidence=confidence,
        noise_floor=float(noise_floor),
        gate=[e for e in common if e in gated],
        min_effect=float(min_effect),
        min_effect_ns=float(min_effect_ns),
        min_effect_abs_ns=floor_ns,
        step_median_ns=step_median,
        base_runs=len(b_runs),
        cand_runs=len(c_runs),
        environment_warnings=environment_warnings(
            [r.environment for r in b_runs], [r.environment for r in c_runs]
        ),
        notes=notes,
        environment_recorded=any(r.environment is not None for r in (*b_runs, *c_runs)),
        failed_runs={side: lines for side, lines in failed_runs.items() if lines},
        step_samples={
            side: [r.step_samples for r in runs if r.step_samples is not None]
            for side, runs in (("base", b_runs), ("candidate", c_runs))
        },
    )
