"""A traced ``ppetrace.Trainer`` end to end, against a hand-written loop and against peers.

Run: ``python benchmarks/bench_trainer.py [--steps-tiny N] [--steps-mlp N] [--rounds R]
[--json PATH]`` (``python -m benchmarks.run`` runs it with the whole suite).

Two workloads (DESIGN.md, Budgets): *tiny* (Linear 16->4, batch 8) and *mlp*
(784-256-10, batch 64), cross-entropy loss, plain SGD, CPU, one torch thread.
Every variant trains the same architecture (the same initial weights) on the
same ``DataLoader`` object for the same number of steps:

- ``hand``: the reference, a hand-written loop (forward, loss, backward,
  ``opt.step()``, ``opt.zero_grad(set_to_none=True)``);
- ``ppetrace``: ``ppetrace.Trainer(trace_path=...)``, every hook a span, the
  spans streamed into a Chrome trace file. The timed region is building the
  Trainer plus ``fit`` (which closes the trace file). Building the step
  report from the file afterwards (``step_report(read_chrome_trace(path))``)
  is **not** in the timed region: it is timed on its own and shown beside;
- ``ppetrace_nofile`` and ``ppetrace_off``: the same Trainer with tracing on
  but no exporter, and with tracing disabled: they split the traced run's
  cost into the loop itself, recording the spans, and writing the trace;
- ``ppe``: pytorch-pfn-extras ``ppe.engine.create_trainer(...).run(loader)``;
- ``ppe_profile``: the same with its profiling on (``enable_profile=True,
  enable_trace=True``, which wraps each iteration, data fetch and train step
  in ``ppe.profiler.record``, plus the ``TimelineTrace`` extension that writes
  its Chrome trace);
- ``lightning``: ``lightning.Trainer(profiler="simple")`` with logger,
  checkpointing, progress bar and model summary off.

For the peers, too, the timed region is building their trainer plus the run.
A peer that is not installed is reported as "not installed".

Each variant runs once untimed (warm-up), then ``rounds`` interleaved rounds,
the order rotating every round so that machine noise hits all alike. The
gated figure for a variant is the median over rounds of its paired ratio to
the hand loop of the same round; the ratio of the fastest runs is reported too.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ppetrace

__all__ = [
    "BUDGETS",
    "PEERS",
    "VARIANTS",
    "TrainerResult",
    "Workload",
    "WORKLOADS",
    "main",
    "measure",
    "peer_available",
    "profile_traced",
    "sampled_self_times",
]

#: traced Trainer / hand loop, per workload (DESIGN.md, Budgets)
BUDGETS: dict[str, float] = {"tiny": 1.10, "mlp": 1.02}
#: every variant, the reference first
VARIANTS: tuple[str, ...] = (
    "hand",
    "ppetrace",
    "ppetrace_nofile",
    "ppetrace_off",
    "ppe",
    "ppe_profile",
    "lightning",
)
#: variant -> the module it needs (absent: "not installed")
PEERS: dict[str, str] = {
    "ppe": "pytorch_pfn_extras",
    "ppe_profile": "pytorch_pfn_extras",
    "lightning": "lightning",
}
LR = 0.01


@dataclass(frozen=True)
class Workload:
    """A model shape and batch size; ``hidden`` ``None`` means one Linear layer."""

    name: str
    in_features: int
    hidden: int | None
    classes: int
    batch_size: int

    def model(self) -> nn.Module:
        """A freshly initialized model (seeded: every call gives the same weights)."""
        torch.manual_seed(0)
        if self.hidden is None:
            return nn.Linear(self.in_features, self.classes)
        return nn.Sequential(
            nn.Linear(self.in_features, self.hidden),
            nn.ReLU(),
            nn.Linear(self.hidden, self.classes),
        )

    def loader(self, steps: int) -> DataLoader[Any]:
        """A loader of exactly ``steps`` batches of synthetic ``(inputs, labels)``."""
        gen = torch.Generator().manual_seed(1)
        n = steps * self.batch_size
        x = torch.randn(n, self.in_features, generator=gen)
        y = torch.randint(0, self.classes, (n,), generator=gen)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False)


WORKLOADS: dict[str, Workload] = {
    "tiny": Workload("tiny", 16, None, 4, 8),
    "mlp": Workload("mlp", 784, 256, 10, 64),
}


def peer_available(variant: str) -> bool:
    """Whether the package that ``variant`` needs can be imported (``True`` for ours)."""
    module = PEERS.get(variant)
    if module is None:
        return True
    try:
        __import__(module)
    except ImportError:
        return False
    return True


# -- the variants ---------------------------------------------------------------------


class _Variant:
    """One way to train: ``run()`` trains once over the loader and returns ns taken."""

    def __init__(self, workload: Workload, loader: DataLoader[Any], tmp: Path) -> None:
        self.workload = workload
        self.loader = loader
        self.tmp = tmp
        self.model = workload.model()

    def run(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the variant holds (files, global state)."""


class _Hand(_Variant):
    def __init__(self, workload: Workload, loader: DataLoader[Any], tmp: Path) -> None:
        super().__init__(workload, loader, tmp)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def run(self) -> int:
        model, opt, loader = self.model, self.opt, self.loader
        t0 = time.perf_counter_ns()
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter_ns() - t0


class _Ppetrace(_Variant):
    def __init__(self, workload: Workload, loader: DataLoader[Any], tmp: Path) -> None:
        super().__init__(workload, loader, tmp)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.trace_path = tmp / f"ppetrace-{workload.name}.json"
        self.report_ns: list[int] = []
        self.steps_in_report = 0

    def run(self) -> int:
        t0 = time.perf_counter_ns()
        trainer = ppetrace.Trainer(
            device="cpu",
            max_epochs=1,
            val_every_n_epochs=None,
            progress=False,
            trace_path=self.trace_path,
        )
        trainer.fit(self.model, self.loader, optimizer=self.opt, loss_fn=F.cross_entropy)
        return time.perf_counter_ns() - t0

    def build_report(self) -> int:
        """Build the step report from the last trace; returns ns taken (outside ``run``)."""
        from exporters import read_chrome_trace, step_report

        t0 = time.perf_counter_ns()
        report = step_report(read_chrome_trace(self.trace_path), warmup_steps=1)
        ns = time.perf_counter_ns() - t0
        self.steps_in_report = int(report.total_steps)
        self.report_ns.append(ns)
        return ns


class _PpetraceNoFile(_Variant):
    """The Trainer with tracing on but no exporter: the loop plus recording the spans."""

    def __init__(self, workload: Workload, loader: DataLoader[Any], tmp: Path) -> None:
        super().__init__(workload, loader, tmp)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def run(self) -> int:
        t0 = time.perf_counter_ns()
        trainer = ppetrace.Trainer(
            device="cpu", max_epochs=1, val_every_n_epochs=None, progress=False
        )
        trainer.fit(self.model, self.loader, optimizer=self.opt, loss_fn=F.cross_entropy)
        return time.perf_counter_ns() - t0


class _PpetraceOff(_PpetraceNoFile):
    """The Trainer with tracing disabled (``configure(enabled=False)``): the loop alone."""

    def run(self) -> int:
        ppetrace.configure(enabled=False)
        try:
            return super().run()
        finally:
            ppetrace.configure()


class _LossModel(nn.Module):
    """``forward(x, y) -> loss``: ppe's default logic back-propagates a scalar output."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x), y)


class _Ppe(_Variant):
    profile = False

    def __init__(self, workload: Workload, loader: DataLoader[Any], tmp: Path) -> None:
        super().__init__(workload, loader, tmp)
        import pytorch_pfn_extras as ppe

        self.loss_model = ppe.to(_LossModel(self.model), "cpu")
        self.opt = torch.optim.SGD(self.loss_model.parameters(), lr=LR)
        self.out_dir = tmp / f"ppe-{workload.name}-{'profile' if self.profile else 'plain'}"

    def run(self) -> int:
        import pytorch_pfn_extras as ppe

        t0 = time.perf_counter_ns()
        if self.profile:
            trainer = ppe.engine.create_trainer(
                self.loss_model,
                self.opt,
                max_epochs=1,
                device="cpu",
                out_dir=str(self.out_dir),
                extensions=[ppe.training.extensions.TimelineTrace()],
                enable_profile=True,
                enable_trace=True,
            )
        else:
            trainer = ppe.engine.create_trainer(
                self.loss_model, self.opt, max_epochs=1, device="cpu", out_dir=str(self.out_dir)
            )
        trainer.run(self.loader)
        return time.perf_counter_ns() - t0


class _PpeProfile(_Ppe):
    profile = True


class _Lightning(_Variant):
    def __init__(self, workload: Workload, loader: DataLoader[Any], tmp: Path) -> None:
        super().__init__(workload, loader, tmp)
        import lightning

        for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
            logging.getLogger(name).setLevel(logging.ERROR)
        model = self.model

        class LitModel(lightning.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                x, y = batch
                return F.cross_entropy(self.model(x), y)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=LR)

        self.lightning = lightning
        self.lit = LitModel()
        self.out_dir = tmp / f"lightning-{workload.name}"

    def run(self) -> int:
        lightning = self.lightning
        threads = torch.get_num_threads()
        sink = io.StringIO()  # the simple profiler prints its summary at the end of fit
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink):
            warnings.simplefilter("ignore")
            t0 = time.perf_counter_ns()
            trainer = lightning.Trainer(
                max_epochs=1,
                accelerator="cpu",
                devices=1,
                profiler="simple",
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                default_root_dir=str(self.out_dir),
            )
            trainer.fit(self.lit, train_dataloaders=self.loader)
            ns = time.perf_counter_ns() - t0
        if torch.get_num_threads() != threads:  # keep "same threads for all" true
            torch.set_num_threads(threads)
        return ns


_CLASSES: dict[str, type[_Variant]] = {
    "hand": _Hand,
    "ppetrace": _Ppetrace,
    "ppetrace_nofile": _PpetraceNoFile,
    "ppetrace_off": _PpetraceOff,
    "ppe": _Ppe,
    "ppe_profile": _PpeProfile,
    "lightning": _Lightning,
}


# -- measuring ----------------------------------------------------------------------


@dataclass
class TrainerResult:
    """The timings of one workload: ns per run, per variant, in round order."""

    workload: str
    steps: int
    rounds: int
    threads: int
    times_ns: dict[str, list[int]] = field(default_factory=dict)
    #: variants that could not run, with the reason ("not installed")
    missing: dict[str, str] = field(default_factory=dict)
    #: ns to build the step report from each round's trace (outside the timed region)
    report_ns: list[int] = field(default_factory=list)
    #: trainer.step rows that the report found (a sanity check of the trace)
    report_steps: int = 0

    def best_ns(self, variant: str) -> int:
        """The fastest run of ``variant``."""
        return min(self.times_ns[variant])

    def paired_ratio(self, variant: str, reference: str = "hand") -> float:
        """Median over rounds of ``variant`` / ``reference`` of the same round."""
        pairs = zip(self.times_ns[variant], self.times_ns[reference], strict=True)
        return statistics.median(v / r for v, r in pairs)

    def paired_ci(
        self, variant: str, reference: str = "hand", *, level: float = 0.95, resamples: int = 2000
    ) -> tuple[float, float]:
        """A bootstrap confidence interval of :meth:`paired_ratio` (seeded, so repeatable).

        On a shared machine the runs of one variant spread by tens of percent;
        the interval says whether a ratio differs from its budget beyond that noise.
        """
        import numpy as np

        pairs = zip(self.times_ns[variant], self.times_ns[reference], strict=True)
        ratios = np.array([v / r for v, r in pairs], dtype=float)
        rng = np.random.default_rng(0)
        picks = rng.integers(0, len(ratios), size=(resamples, len(ratios)))
        medians = np.median(ratios[picks], axis=1)
        tail = (1.0 - level) / 2 * 100
        lo, hi = np.percentile(medians, [tail, 100 - tail])
        return float(lo), float(hi)

    def best_ratio(self, variant: str, reference: str = "hand") -> float:
        """Fastest run of ``variant`` / fastest run of ``reference``."""
        return self.best_ns(variant) / self.best_ns(reference)

    def us_per_step(self, variant: str) -> float:
        """µs per training step of the fastest run of ``variant``."""
        return self.best_ns(variant) / self.steps / 1e3

    def median_us_per_step(self, variant: str) -> float:
        """µs per training step of the median run of ``variant``."""
        return statistics.median(self.times_ns[variant]) / self.steps / 1e3

    def to_json(self) -> dict[str, Any]:
        """Everything, plus the derived ratios, as JSON-ready data."""
        ran = [v for v in VARIANTS if v in self.times_ns]
        return {
            "workload": self.workload,
            "steps": self.steps,
            "rounds": self.rounds,
            "threads": self.threads,
            "times_ns": self.times_ns,
            "missing": self.missing,
            "us_per_step_best": {v: self.us_per_step(v) for v in ran},
            "us_per_step_median": {v: self.median_us_per_step(v) for v in ran},
            "ratio_paired_median": {v: self.paired_ratio(v) for v in ran},
            "ratio_paired_ci95": {v: self.paired_ci(v) for v in ran},
            "ratio_best": {v: self.best_ratio(v) for v in ran},
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

    A peer variant whose package is missing is recorded in
    ``TrainerResult.missing`` as ``"not installed"`` and not timed.
    """
    if isinstance(workload, str):
        if workload not in WORKLOADS:
            raise ValueError(
                f"Unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}."
            )
        workload = WORKLOADS[workload]
    unknown = [v for v in variants if v not in _CLASSES]
    if unknown:
        raise ValueError(f"Unknown variant {unknown[0]!r}; expected some of {', '.join(VARIANTS)}.")
    if "hand" not in variants:
        raise ValueError(
            f"Expected 'hand' among the variants (it is the reference), but received "
            f"{list(variants)}."
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
            runners[name] = _CLASSES[name](workload, loader, tmp)
            stack.callback(runners[name].close)
        for name, runner in runners.items():  # warm-up: imports, allocator, first calls
            say(f"{workload.name}: warm-up {name}")
            runner.run()
        order = list(runners)
        result.times_ns = {name: [] for name in order}
        traced = runners.get("ppetrace")
        for r in range(rounds):
            shift = r % len(order)
            for name in order[shift:] + order[:shift]:
                gc.collect()
                result.times_ns[name].append(runners[name].run())
                if name == "ppetrace" and isinstance(traced, _Ppetrace):
                    result.report_ns.append(traced.build_report())
                    result.report_steps = traced.steps_in_report
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


def render_results(results: Sequence[TrainerResult]) -> str:
    """A plain-text table: µs/step and both ratios per variant, per workload."""
    lines = []
    for res in results:
        lines.append(
            f"{res.workload}: {res.steps} steps per run, {res.rounds} interleaved rounds, "
            f"{res.threads} torch thread(s)"
        )
        for variant in VARIANTS:
            if variant in res.missing:
                lines.append(f"  {variant:<16} {res.missing[variant]}")
            elif variant in res.times_ns:
                lines.append(
                    f"  {variant:<16} {res.us_per_step(variant):9.1f} µs/step   "
                    f"{res.paired_ratio(variant):6.3f}x paired median   "
                    f"{res.best_ratio(variant):6.3f}x best"
                )
        if res.report_ns:
            lines.append(
                f"  step report from the trace (not in the timed region): "
                f"{min(res.report_ns) / 1e6:.1f} ms best"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-tiny", type=int, default=500, help="steps per run, tiny")
    parser.add_argument("--steps-mlp", type=int, default=200, help="steps per run, MLP")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
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
        ratio = res.paired_ratio("ppetrace")
        ok = ratio <= BUDGETS[res.workload]
        failed |= not ok
        print(
            f"traced Trainer / hand loop, {res.workload}: {ratio:.3f}x, budget <= "
            f"{BUDGETS[res.workload]:.2f}x: {'PASS' if ok else 'FAIL'}"
        )
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
