"""A traced ``ppetrace.Trainer`` end to end, against hand-written loops and against peers.

Run: ``python benchmarks/bench_trainer.py [--steps-tiny N] [--steps-mlp N] [--rounds R]
[--json PATH]`` (``python -m benchmarks.run`` runs it with the whole suite).

Two workloads (DESIGN.md, Budgets): *tiny* (Linear 16->4, batch 8) and *mlp*
(784-256-10, batch 64), cross-entropy loss, plain SGD, CPU, one torch thread.
Every variant trains the same architecture (the same initial weights) on the
same ``DataLoader`` object for the same number of steps, in one of the three
module kinds the Trainer takes, each against a hand-written loop of its own
kind doing the same math:

- plain ``nn.Module``: ``hand`` (forward, loss, backward, ``opt.step()``,
  ``opt.zero_grad(set_to_none=True)``); ``ppetrace``
  (``ppetrace.Trainer(trace_path=...)``: every hook a span, streamed into a
  Chrome trace file), ``ppetrace_nofile`` (tracing on, no exporter) and
  ``ppetrace_off`` (tracing disabled: the loop alone); ``hand_spans``,
  ``hand_spans_nofile`` and ``hand_spans_off``: the hand loop opening the
  Trainer's 8 spans per step by hand, with the same names, nesting and
  attribute mapping (file, no exporter, tracing disabled). Their paired
  differences (:data:`PARTS`, :func:`cost_parts`) split the traced Trainer's time
  above the hand loop: the span blocks themselves, recording, writing, and
  the Trainer's own loop beyond its spans;
- PyMarlin ``ModuleInterface``: ``hand_interface`` (``module(Stage.TRAIN,
  step + 1, batch, device)`` as PyMarlin calls it, then the same backward and
  step), ``ppetrace_interface`` and ``ppetrace_interface_off``;
- delira ``AbstractPyTorchNetwork``: ``hand_network`` (``prepare_batch`` and
  ``closure`` with the real optimizer, as a delira loop calls them),
  ``ppetrace_network`` and ``ppetrace_network_off``;
- peers on the plain module: ``ppe`` (pytorch-pfn-extras
  ``ppe.engine.create_trainer(...).run(loader)``), ``ppe_profile`` (the same with
  ``enable_profile=True, enable_trace=True`` and the ``TimelineTrace``
  extension writing its Chrome trace) and ``lightning``
  (``lightning.Trainer(profiler="simple")``, logger, checkpointing, progress
  bar and model summary off). A peer that is not installed is reported as
  "not installed".

The timed region of a Trainer is building it plus ``fit`` (which closes the
trace file). Building the step report from the traced run's file
(``step_report(read_chrome_trace(path))``) is **not** in it: it is timed on
its own and shown beside. Each traced run's file also gives the *coverage*
of ``trainer.epoch`` and ``trainer.run``: the share of each span's time that
its direct children cover (1 - self time / duration), the time no span
accounts for.

Each variant runs once untimed (warm-up), then ``rounds`` interleaved rounds,
the order rotating every round so that machine noise hits all alike. Each run
is timed twice: wall time (``perf_counter_ns``) and CPU time of the whole
process (``process_time_ns``, all threads: the trace writer's too), which a
busy machine disturbs less. A variant's figures are paired with its own
kind's hand loop in the same round: the ratio (median over rounds, with a
bootstrap 95% interval) and the loop's own cost in µs per step above the hand
loop (median of the per-round differences, with its interval).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import ppetrace

try:
    from benchmarks.trainer_variants import (
        CLASSES,
        PEERS,
        WORKLOADS,
        Workload,
        _Hand,
        _Ppetrace,
        _Variant,
        coverage,
        peer_available,
    )
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from trainer_variants import (  # type: ignore[no-redef]
        CLASSES,
        PEERS,
        WORKLOADS,
        Workload,
        _Hand,
        _Ppetrace,
        _Variant,
        coverage,
        peer_available,
    )

__all__ = [
    "BUDGETS",
    "BUDGETS_OFF",
    "CI_BUDGETS",
    "COVERAGE_BUDGET",
    "KINDS",
    "PARTS",
    "PEERS",
    "REFERENCE",
    "TRACED",
    "VARIANTS",
    "WORKLOADS",
    "TrainerResult",
    "Workload",
    "cost_parts",
    "coverage",
    "main",
    "measure",
    "peer_available",
    "profile_traced",
    "sampled_self_times",
]

#: traced Trainer / its hand loop, per workload, for every module kind (DESIGN.md, Budgets)
BUDGETS: dict[str, float] = {"tiny": 1.10, "mlp": 1.02}
#: the upper bound of the 95% interval of that ratio, where the budget asks for one
CI_BUDGETS: dict[str, float] = {"mlp": 1.05}
#: the Trainer with tracing disabled / its hand loop, per workload
BUDGETS_OFF: dict[str, float] = {"tiny": 1.05}
#: the share of trainer.epoch and trainer.run that their direct children cover
COVERAGE_BUDGET = 0.99
#: the module kinds the Trainer takes
KINDS: tuple[str, ...] = ("plain", "interface", "network")
#: every variant: hand loops first, then the Trainer per kind, then the peers
VARIANTS: tuple[str, ...] = (
    "hand",
    "ppetrace",
    "ppetrace_nofile",
    "ppetrace_off",
    "hand_spans",
    "hand_spans_nofile",
    "hand_spans_off",
    "hand_interface",
    "ppetrace_interface",
    "ppetrace_interface_off",
    "hand_network",
    "ppetrace_network",
    "ppetrace_network_off",
    "ppe",
    "ppe_profile",
    "lightning",
)
#: each variant's reference: the hand loop of its module kind (the peers: the plain one)
REFERENCE: dict[str, str] = {
    v: ("hand_interface" if "interface" in v else "hand_network" if "network" in v else "hand")
    for v in CLASSES
}
#: where the traced Trainer's time above the hand loop goes (plain module kind): ``(id,
#: part, variant, reference)``, each part the per-step difference of ``variant`` and
#: ``reference`` in the same round. The first three split what the Trainer's spans cost
#: in a loop that does nothing else, the fourth measures it whole; the fifth is the
#: Trainer's own loop beyond them.
PARTS: tuple[tuple[str, str, str, str], ...] = (
    (
        "with_floor",
        "the step's 8 span blocks and its mapping, tracing disabled",
        "hand_spans_off",
        "hand",
    ),
    ("recording", "recording those 8 spans (no exporter)", "hand_spans_nofile", "hand_spans_off"),
    ("writing", "writing them into a Chrome trace file", "hand_spans", "hand_spans_nofile"),
    ("spans", "the 8 spans alone: blocks, recording and writing", "hand_spans", "hand"),
    (
        "loop",
        "the Trainer's loop beyond its spans, tracing disabled",
        "ppetrace_off",
        "hand_spans_off",
    ),
    ("tracing", "tracing in the Trainer: recording and writing", "ppetrace", "ppetrace_off"),
    ("all", "the traced Trainer, all in", "ppetrace", "hand"),
)
#: the variants that write a trace file (their coverage is measured), by kind
TRACED: dict[str, str] = {
    "plain": "ppetrace",
    "interface": "ppetrace_interface",
    "network": "ppetrace_network",
}


# -- measuring ----------------------------------------------------------------------


def _bootstrap_median(values: Sequence[float], level: float, resamples: int) -> tuple[float, float]:
    """A seeded (repeatable) bootstrap interval of the median of ``values``."""
    import numpy as np

    data = np.asarray(values, dtype=float)
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(data), size=(resamples, len(data)))
    medians = np.median(data[picks], axis=1)
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(medians, [tail, 100 - tail])
    return float(lo), float(hi)


@dataclass
class TrainerResult:
    """The timings of one workload: ns per run, per variant, in round order.

    ``times_ns`` is wall time and ``cpu_ns`` the process's CPU time of the same
    runs; every figure takes ``clock="wall"`` or ``"cpu"``. A variant is paired
    with its :data:`REFERENCE` (its kind's hand loop) unless ``reference`` is given.
    """

    workload: str
    steps: int
    rounds: int
    threads: int
    times_ns: dict[str, list[int]] = field(default_factory=dict)
    cpu_ns: dict[str, list[int]] = field(default_factory=dict)
    #: variants that could not run, with the reason ("not installed")
    missing: dict[str, str] = field(default_factory=dict)
    #: ns to build the step report from each round's trace (outside the timed region)
    report_ns: list[int] = field(default_factory=list)
    #: trainer.step rows that the report found (a sanity check of the trace)
    report_steps: int = 0
    #: per traced variant, ``{"epoch": [...], "run": [...]}``: coverage in each round
    coverage: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def _times(self, variant: str, clock: str) -> list[int]:
        if clock not in ("wall", "cpu"):
            raise ValueError(f"Expected clock 'wall' or 'cpu', but received {clock!r}.")
        return (self.times_ns if clock == "wall" else self.cpu_ns)[variant]

    def _reference(self, variant: str, reference: str | None) -> str:
        return reference if reference is not None else REFERENCE.get(variant, "hand")

    def ratios(
        self, variant: str, reference: str | None = None, *, clock: str = "wall"
    ) -> list[float]:
        """``variant`` / its reference, round by round."""
        ref = self._reference(variant, reference)
        pairs = zip(self._times(variant, clock), self._times(ref, clock), strict=True)
        return [v / r for v, r in pairs]

    def best_ns(self, variant: str, *, clock: str = "wall") -> int:
        """The fastest run of ``variant``."""
        return min(self._times(variant, clock))

    def paired_ratio(
        self, variant: str, reference: str | None = None, *, clock: str = "wall"
    ) -> float:
        """Median over rounds of ``variant`` / reference of the same round."""
        return statistics.median(self.ratios(variant, reference, clock=clock))

    def paired_ci(
        self,
        variant: str,
        reference: str | None = None,
        *,
        clock: str = "wall",
        level: float = 0.95,
        resamples: int = 2000,
    ) -> tuple[float, float]:
        """A bootstrap confidence interval of :meth:`paired_ratio` (seeded, so repeatable).

        On a shared machine the runs of one variant spread by tens of percent;
        the interval says whether a ratio differs from its budget beyond that noise.
        """
        return _bootstrap_median(self.ratios(variant, reference, clock=clock), level, resamples)

    def overheads_us(
        self, variant: str, reference: str | None = None, *, clock: str = "wall"
    ) -> list[float]:
        """µs per step that ``variant`` takes above its reference, round by round."""
        ref = self._reference(variant, reference)
        pairs = zip(self._times(variant, clock), self._times(ref, clock), strict=True)
        return [(v - r) / self.steps / 1e3 for v, r in pairs]

    def overhead_us(
        self, variant: str, reference: str | None = None, *, clock: str = "wall"
    ) -> float:
        """Median over rounds of the µs per step above the reference of the same round."""
        return statistics.median(self.overheads_us(variant, reference, clock=clock))

    def overhead_ci(
        self,
        variant: str,
        reference: str | None = None,
        *,
        clock: str = "wall",
        level: float = 0.95,
        resamples: int = 2000,
    ) -> tuple[float, float]:
        """A bootstrap confidence interval of :meth:`overhead_us`."""
        values = self.overheads_us(variant, reference, clock=clock)
        return _bootstrap_median(values, level, resamples)

    def best_ratio(
        self, variant: str, reference: str | None = None, *, clock: str = "wall"
    ) -> float:
        """Fastest run of ``variant`` / fastest run of its reference."""
        ref = self._reference(variant, reference)
        return self.best_ns(variant, clock=clock) / self.best_ns(ref, clock=clock)

    def us_per_step(self, variant: str, *, clock: str = "wall") -> float:
        """µs per training step of the fastest run of ``variant``."""
        return self.best_ns(variant, clock=clock) / self.steps / 1e3

    def median_us_per_step(self, variant: str, *, clock: str = "wall") -> float:
        """µs per training step of the median run of ``variant``."""
        return statistics.median(self._times(variant, clock)) / self.steps / 1e3

    def min_coverage(self, span: str, variants: Sequence[str] | None = None) -> float | None:
        """The lowest coverage of ``trainer.<span>`` over the traced variants and rounds."""
        chosen = self.coverage if variants is None else {v: self.coverage[v] for v in variants}
        values = [c for per in chosen.values() for c in per.get(span, [])]
        return min(values) if values else None

    def to_json(self) -> dict[str, Any]:
        """Everything, plus the derived figures, as JSON-ready data."""
        ran = [v for v in VARIANTS if v in self.times_ns]
        timed = [v for v in ran if REFERENCE[v] in self.times_ns]
        derived: dict[str, Any] = {}
        for clock in ("wall", "cpu"):
            if clock == "cpu" and not self.cpu_ns:
                continue
            derived[clock] = {
                "us_per_step_best": {v: self.us_per_step(v, clock=clock) for v in ran},
                "us_per_step_median": {v: self.median_us_per_step(v, clock=clock) for v in ran},
                "ratio_paired_median": {v: self.paired_ratio(v, clock=clock) for v in timed},
                "ratio_paired_ci95": {v: self.paired_ci(v, clock=clock) for v in timed},
                "ratio_best": {v: self.best_ratio(v, clock=clock) for v in timed},
                "overhead_us_per_step": {v: self.overhead_us(v, clock=clock) for v in timed},
                "overhead_us_per_step_ci95": {v: self.overhead_ci(v, clock=clock) for v in timed},
            }
        return {
            "workload": self.workload,
            "steps": self.steps,
            "rounds": self.rounds,
            "threads": self.threads,
            "times_ns": self.times_ns,
            "cpu_ns": self.cpu_ns,
            "missing": self.missing,
            "reference": {v: REFERENCE[v] for v in ran},
            **derived.get("wall", {}),
            "cpu": derived.get("cpu", {}),
            "coverage": self.coverage,
            "report_ns": self.report_ns,
            "report_steps": self.report_steps,
        }


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Freeze the objects that exist now for the garbage collector, for the block.

    The benchmarks call ``gc.collect()`` before each timed run; with torch,
    pandas and the peers loaded, that (and any automatic full collection inside
    a timed region) walks hundreds of thousands of objects, a quarter of a
    second here. Frozen, the collector sees only the benchmark's own objects,
    alike for every variant. Nested use keeps the outer freeze.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure(
    workload: Workload | str,
    *,
    steps: int,
    rounds: int,
    variants: Sequence[str] = VARIANTS,
    threads: int = 1,
    tmp_dir: str | os.PathLike[str] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> TrainerResult:
    """Time every variant on ``workload``: one warm-up each, then interleaved rounds.

    Each variant's reference (its kind's hand loop, :data:`REFERENCE`) must be
    among ``variants``. A peer variant whose package is missing is recorded in
    ``TrainerResult.missing`` as ``"not installed"`` and not timed.
    """
    if isinstance(workload, str):
        if workload not in WORKLOADS:
            raise ValueError(
                f"Unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}."
            )
        workload = WORKLOADS[workload]
    unknown = [v for v in variants if v not in CLASSES]
    if unknown:
        raise ValueError(f"Unknown variant {unknown[0]!r}; expected some of {', '.join(VARIANTS)}.")
    if "hand" not in variants:
        raise ValueError(
            f"Expected 'hand' among the variants (it is the reference), but received "
            f"{list(variants)}."
        )
    lacking = sorted({REFERENCE[v] for v in variants} - set(variants))
    if lacking:
        raise ValueError(
            f"Expected the reference {lacking[0]!r} among the variants (the hand loop of the "
            f"same module kind), but received {list(variants)}."
        )
    for name, value in (("steps", steps), ("rounds", rounds), ("threads", threads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Expected a positive int for {name}, but received {value!r}.")
    result = TrainerResult(workload.name, steps, rounds, threads)
    say = on_progress or (lambda _msg: None)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=tmp_dir)))
        stack.enter_context(_threads(threads))
        stack.enter_context(gc_frozen())
        ppetrace.configure()  # no processor: spans reach only the Trainer's Chrome trace
        loader = workload.loader(steps)
        runners: dict[str, _Variant] = {}
        for name in variants:
            if not peer_available(name):
                result.missing[name] = "not installed"
                continue
            runners[name] = CLASSES[name](workload, loader, tmp)
            stack.callback(runners[name].close)
        for name, runner in runners.items():  # warm-up: imports, allocator, first calls
            say(f"{workload.name}: warm-up {name}")
            runner.run()
        order = list(runners)
        result.times_ns = {name: [] for name in order}
        result.cpu_ns = {name: [] for name in order}
        for r in range(rounds):
            shift = r % len(order)
            for name in order[shift:] + order[:shift]:
                gc.collect()
                runner = runners[name]
                wall, cpu = runner.run()
                result.times_ns[name].append(wall)
                result.cpu_ns[name].append(cpu)
                if isinstance(runner, _Ppetrace) and runner.trace_path is not None:
                    per = result.coverage.setdefault(name, {"epoch": [], "run": []})
                    for span, value in runner.coverage().items():
                        if value is not None:
                            per[span].append(value)
                    if name == "ppetrace":
                        result.report_ns.append(runner.build_report())
                        result.report_steps = runner.steps_in_report
            say(f"{workload.name}: round {r + 1}/{rounds}")
    ppetrace.configure()
    return result


# -- where the time goes ----------------------------------------------------------------


def sampled_self_times(
    fn: Callable[[], Any], interval_s: float
) -> dict[tuple[str, str, int], float]:
    """Seconds of self time per ``(function, file, line)`` of ``fn()`` under pyinstrument."""
    from pyinstrument import Profiler

    profiler = Profiler(interval=interval_s)
    profiler.start()
    try:
        fn()
    finally:
        profiler.stop()
    session = profiler.last_session
    totals: dict[tuple[str, str, int], float] = {}
    stack = [session.root_frame()] if session is not None else []
    while stack:
        frame = stack.pop()
        if frame is None:
            continue
        stack.extend(frame.children)
        if frame.is_synthetic:  # "[self]" leaves: already in their parent's self time
            continue
        key = (frame.function or "?", frame.file_path_short or "?", frame.line_no or 0)
        totals[key] = totals.get(key, 0.0) + float(frame.total_self_time)
    return totals


def profile_traced(
    workload: Workload | str,
    *,
    steps: int,
    top: int = 12,
    interval_s: float = 0.0001,
    threads: int = 1,
) -> dict[str, Any]:
    """Where the traced Trainer spends time that the hand loop does not.

    Runs the hand loop and the traced Trainer once each under pyinstrument
    (after a warm-up). Returns ``functions``: the ``top`` functions of
    ppetrace's own code (``ppetrace/``, ``exporters/``, ``opentelemetry/``)
    by self time per step (``function``, ``file``, ``line``,
    ``us_per_step``), which the hand loop does not run at all; and per-step
    totals: ``library_us_per_step`` (that code together),
    ``traced_us_per_step`` and ``hand_us_per_step`` (all sampled time) and
    ``other_delta_us_per_step`` (the rest of the difference: torch and the
    DataLoader running slower or faster, or sampling noise). Sampling slows
    Python code, so read the figures as a ranking.
    """
    if isinstance(workload, str):
        workload = WORKLOADS[workload]
    with tempfile.TemporaryDirectory() as tmp, _threads(threads), gc_frozen():
        ppetrace.configure()
        loader = workload.loader(steps)
        hand = _Hand(workload, loader, Path(tmp))
        traced = _Ppetrace(workload, loader, Path(tmp))
        hand.run()  # warm-up
        traced.run()
        hand_s = sampled_self_times(hand.run, interval_s)
        traced_s = sampled_self_times(traced.run, interval_s)
    ppetrace.configure()

    def per_step(seconds: float) -> float:
        return round(seconds / steps * 1e6, 3)

    library = {k: v for k, v in traced_s.items() if k[1].startswith(_LIBRARY_PREFIXES)}
    functions = [
        {"function": f, "file": file, "line": line, "us_per_step": per_step(t)}
        for (f, file, line), t in sorted(library.items(), key=lambda kv: kv[1], reverse=True)
    ]
    lib_total = sum(library.values())
    traced_total = sum(traced_s.values())
    hand_total = sum(hand_s.values())
    return {
        "steps": steps,
        "interval_s": interval_s,
        "functions": functions[:top],
        "library_us_per_step": per_step(lib_total),
        "traced_us_per_step": per_step(traced_total),
        "hand_us_per_step": per_step(hand_total),
        "other_delta_us_per_step": per_step(traced_total - hand_total - lib_total),
    }


_LIBRARY_PREFIXES = ("ppetrace/", "exporters/", "opentelemetry/")


# -- command line -------------------------------------------------------------------------


def cost_parts(
    res: TrainerResult, *, clock: str = "cpu"
) -> list[tuple[str, str, float, float, float]]:
    """:data:`PARTS` measured: ``(id, part, µs per step, 95% CI low, high)`` for each part
    whose two variants ran, from the per-round differences (CPU time by default: the
    spans' exporter works on threads of its own, and CPU time is the less noisy clock)."""
    out = []
    ran = res.cpu_ns if clock == "cpu" else res.times_ns
    for part_id, part, variant, reference in PARTS:
        if variant in ran and reference in ran:
            lo, hi = res.overhead_ci(variant, reference, clock=clock)
            out.append((part_id, part, res.overhead_us(variant, reference, clock=clock), lo, hi))
    return out


def render_results(results: Sequence[TrainerResult]) -> str:
    """A plain-text table per workload: per variant µs/step, the paired ratio to its kind's
    hand loop with its interval, and µs/step above that hand loop, in wall and CPU time;
    then the coverage of trainer.epoch and trainer.run."""
    lines = []
    for res in results:
        lines.append(
            f"{res.workload}: {res.steps} steps per run, {res.rounds} interleaved rounds, "
            f"{res.threads} torch thread(s); ratios and µs/step above the hand loop of the "
            "same module kind, median of paired rounds [95% CI]"
        )
        for variant in VARIANTS:
            if variant in res.missing:
                lines.append(f"  {variant:<24} {res.missing[variant]}")
                continue
            if variant not in res.times_ns:
                continue
            line = f"  {variant:<24} {res.median_us_per_step(variant):9.1f} µs/step"
            if variant != REFERENCE[variant]:
                parts = []
                for clock in ("wall", "cpu"):
                    lo, hi = res.paired_ci(variant, clock=clock)
                    olo, ohi = res.overhead_ci(variant, clock=clock)
                    parts.append(
                        f"{clock} {res.paired_ratio(variant, clock=clock):.3f}x [{lo:.3f}-{hi:.3f}]"
                        f" {res.overhead_us(variant, clock=clock):+.1f} µs [{olo:+.1f},{ohi:+.1f}]"
                    )
                line += "   " + "   ".join(parts)
            lines.append(line)
        for variant, per in res.coverage.items():
            shown = ", ".join(
                f"trainer.{span} {min(values):.2%} (median {statistics.median(values):.2%})"
                for span, values in per.items()
                if values
            )
            lines.append(f"  coverage by direct children, {variant}: {shown} (lowest round)")
        found = cost_parts(res)
        if found:
            lines.append("  where the traced Trainer's time above the hand loop goes (CPU time):")
        for _part_id, part, us, lo, hi in found:
            lines.append(f"    {part:<58} {us:+6.1f} µs/step [{lo:+.1f},{hi:+.1f}]")
        if res.report_ns:
            lines.append(
                f"  step report from the trace (not in the timed region): "
                f"{min(res.report_ns) / 1e6:.1f} ms best"
            )
    return "\n".join(lines)


def budget_lines(res: TrainerResult) -> list[tuple[str, bool]]:
    """Each budget of one workload as ``(line, passed)``."""
    out = []
    for kind, variant in TRACED.items():
        if variant not in res.times_ns:
            continue
        ratio = res.paired_ratio(variant)
        ok = ratio <= BUDGETS[res.workload]
        text = f"traced Trainer ({kind}) / hand loop, {res.workload}: {ratio:.3f}x"
        text += f" (budget <= {BUDGETS[res.workload]:.2f}x"
        if res.workload in CI_BUDGETS:
            hi = res.paired_ci(variant)[1]
            ok = ok and hi <= CI_BUDGETS[res.workload]
            text += f", 95% CI upper {hi:.3f}x <= {CI_BUDGETS[res.workload]:.2f}x"
        out.append((text + ")", ok))
        off = variant + "_off" if variant != "ppetrace" else "ppetrace_off"
        if res.workload in BUDGETS_OFF and off in res.times_ns:
            ratio = res.paired_ratio(off)
            out.append(
                (
                    f"Trainer ({kind}), tracing disabled / hand loop, {res.workload}: "
                    f"{ratio:.3f}x (budget <= {BUDGETS_OFF[res.workload]:.2f}x)",
                    ratio <= BUDGETS_OFF[res.workload],
                )
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-tiny", type=int, default=500, help="steps per run, tiny")
    parser.add_argument("--steps-mlp", type=int, default=200, help="steps per run, MLP")
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for all")
    parser.add_argument("--json", dest="json_path", help="also write the results here")
    args = parser.parse_args(argv)
    results = [
        measure("tiny", steps=args.steps_tiny, rounds=args.rounds, threads=args.threads),
        measure("mlp", steps=args.steps_mlp, rounds=args.rounds, threads=args.threads),
    ]
    print(render_results(results))
    failed = False
    for res in results:
        for text, ok in budget_lines(res):
            failed |= not ok
            print(f"{text}: {'PASS' if ok else 'FAIL'}")
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(
                {
                    "results": [r.to_json() for r in results],
                    "python": sys.version.split()[0],
                    "torch": torch.__version__,
                    "machine": platform.machine(),
                },
                indent=2,
            )
            + "\n"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
