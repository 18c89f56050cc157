"""``ppetrace.instrument()``, ``LightningProfiler`` and ``ppetrace run`` against the same code
without them, and the truth of their spans.

Run: ``python benchmarks/bench_instrument.py [--quick] [--json PATH]`` (``python -m
benchmarks.run`` runs it as its "instrument" section). Every figure is measured in
this one run, the compared variants interleaved (the order rotating each round):

- *instrument*: a hand-written loop (forward, cross-entropy, backward, ``opt.step()``,
  ``opt.zero_grad(set_to_none=True)`` over a ``DataLoader``) bare, and the same loop
  under ``instrument(trace_path=...)``, the timed region being ``instrument()``, the
  loop and ``close()`` (which writes the trace). Workloads of ``bench_trainer``: tiny
  (Linear 16->4, batch 8) and mlp (784-256-10, batch 64), one torch thread. The gated
  figure is the median over rounds of the paired ratio; a bootstrap 95% interval of
  it is printed beside. Budgets: mlp <= 1.05x, tiny <= 1.15x. Five more variants
  split that cost (info rows ``instrument.<workload>.<variant>``): ``nofile`` is
  ``instrument()`` without a trace file (the rest is writing it); ``spans`` opens
  the same spans by hand in the same loop (``ppetrace.trace`` blocks), ``rows``
  records them after the fact by hand (clock reads around each call, then rows, as
  ``instrument()`` records its spans), both written into a Chrome trace: ppetrace's
  two ways of recording a span, without any inference of steps. ``hooks`` hooks the
  places ``instrument()`` hooks with wrappers that only call through: what hooking
  costs before any span. ``hooks_rows`` is ``rows`` under those hooks: hooking and
  recording together, the part of instrument()'s cost that its Python hooks and rows
  take before it infers any step.
- *lightning*: ``lightning.Trainer`` fits of the mlp workload with ``profiler=None``,
  ``profiler="simple"`` and ``LightningProfiler(trace_path)``; budgets:
  LightningProfiler / simple <= 1.00x and LightningProfiler / none <= 1.10x. Info:
  ``LightningProfiler()`` without a trace file against simple (the rest is writing it).
- *start-up*: ``ppetrace run --no-report s.py`` against ``python s.py`` for a script
  that imports torch and trains three steps, each a fresh process; budget: the median
  paired difference <= 0.5 s. The report ``ppetrace run`` prints by default is timed
  apart (info).
- *truth*: a loop with busy-waits in forward (2 ms), in a custom autograd backward
  (3 ms) and in the dataset (4 ms per batch). Each ``module.forward``,
  ``trainer.backward`` and ``trainer.fetch_batch`` span must hold its wait and match
  the call around it as the loop measures it (``next(it)``, ``model(x)``,
  ``loss.backward()``) within max(1%, 20 µs) of the wait (median over the steps);
  ``trainer.step`` spans with their data wait must cover >= 99% of the loop's wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file: `benchmarks` is a folder of the repository
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import ppetrace  # noqa: E402
from benchmarks.bench_trainer import (  # noqa: E402
    WORKLOADS,
    TrainerResult,
    Workload,
    _threads,
    gc_frozen,
    peer_available,
)

__all__ = [
    "BUDGETS",
    "SIZES",
    "measure_instrument",
    "measure_lightning",
    "measure_startup",
    "measure_truth",
    "main",
    "rows",
]

#: instrument() / bare loop, per workload; LightningProfiler against simple and none;
#: start-up in seconds; truth as a fraction and a floor; tiling as a fraction
BUDGETS: dict[str, float] = {
    "instrument.mlp": 1.05,
    "instrument.tiny": 1.15,
    "lightning.simple": 1.00,
    "lightning.none": 1.10,
    "startup_s": 0.5,
    "truth_fraction": 0.01,
    "truth_floor_ns": 20_000,
    "tiling": 0.99,
}
#: sizes, under the keys that ``benchmarks.run.SIZES`` holds them (``startup_rounds`` 0:
#: one run each and no warm-up: a smoke run)
SIZES: dict[str, dict[str, int]] = {
    "full": {
        "instrument_tiny_steps": 500,
        "instrument_mlp_steps": 200,
        "instrument_rounds": 15,
        "instrument_lightning_steps": 200,
        "instrument_lightning_rounds": 11,
        "instrument_startup_rounds": 9,
        "instrument_truth_steps": 60,
    },
    "quick": {
        "instrument_tiny_steps": 16,
        "instrument_mlp_steps": 8,
        "instrument_rounds": 2,
        "instrument_lightning_steps": 8,
        "instrument_lightning_rounds": 1,
        "instrument_startup_rounds": 0,
        "instrument_truth_steps": 4,
    },
}
LR = 0.01


def _ci(ratios: Sequence[float], resamples: int = 2000) -> tuple[float, float]:
    """Bootstrap 95% interval of the median (seeded)."""
    import numpy as np

    values = np.asarray(ratios, dtype=float)
    picks = np.random.default_rng(0).integers(0, len(values), size=(resamples, len(values)))
    lo, hi = np.percentile(np.median(values[picks], axis=1), [2.5, 97.5])
    return float(lo), float(hi)


def _interleaved(
    runners: dict[str, Callable[[], int]],
    rounds: int,
    say: Callable[[str], None],
    what: str,
    *,
    warmup: bool = True,
) -> dict[str, list[int]]:
    """One warm-up run each, then ``rounds`` rounds in rotating order; ns per run."""
    if warmup:
        for run in runners.values():
            run()
    order = list(runners)
    times: dict[str, list[int]] = {name: [] for name in order}
    for r in range(rounds):
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            gc.collect()
            times[name].append(runners[name]())
        say(f"{what}: round {r + 1}/{rounds}")
    return times


# -- instrument() on a hand-written loop ----------------------------------------------------


def _hand_loop(model: nn.Module, opt: torch.optim.Optimizer, loader: DataLoader[Any]) -> None:
    model.train()
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _spans_loop(model: nn.Module, opt: torch.optim.Optimizer, loader: DataLoader[Any]) -> None:
    """:func:`_hand_loop` opening by hand the spans that ``instrument()`` records for each
    step, with their names, nesting and one ``FrozenAttributes`` per step, through
    ``ppetrace.trace`` blocks."""
    trace, frozen = ppetrace.trace, ppetrace.tracing.FrozenAttributes
    fetch, step, forward, backward, optimizer = (
        trace(name)
        for name in (
            "trainer.fetch_batch",
            "trainer.step",
            "module.forward",
            "trainer.backward",
            "trainer.optimizer_step",
        )
    )
    name = type(model).__name__
    model.train()
    it, i = iter(loader), 0
    while True:
        attrs = frozen({"ppetrace.step": i, "ppetrace.stage": "train", "ppetrace.module": name})
        with fetch.again(attrs):
            batch = next(it, None)
        if batch is None:
            break
        x, y = batch
        with step.again(attrs):
            with forward.again(attrs):
                out = model(x)
            loss = F.cross_entropy(out, y)
            with backward.again(attrs):
                loss.backward()
            with optimizer.again(attrs):
                opt.step()
                opt.zero_grad(set_to_none=True)
        i += 1


def _rows_loop(model: nn.Module, opt: torch.optim.Optimizer, loader: DataLoader[Any]) -> None:
    """:func:`_spans_loop`'s spans recorded after the fact instead, as ``instrument()``
    records its fetch, forward and backward: two clock reads right around each call, and
    the rows appended afterwards (``RowBuffer.record``: no ``with`` block, no
    OpenTelemetry context), the step's last, with the id its children name as parent."""
    from ppetrace.integrations._record import RowBuffer, current_parent, next_ids

    frozen, ns = ppetrace.tracing.FrozenAttributes, time.perf_counter_ns
    rows = RowBuffer()
    record, ids, parent = rows.record, next_ids(), current_parent()
    name = type(model).__name__
    model.train()
    it, i = iter(loader), 0
    try:
        while True:
            attrs = frozen({"ppetrace.step": i, "ppetrace.stage": "train", "ppetrace.module": name})
            t0 = ns()
            batch = next(it, None)
            t1 = ns()
            record("trainer.fetch_batch", t0, t1, parent, attrs)
            if batch is None:
                break
            x, y = batch
            f0 = ns()
            out = model(x)
            f1 = ns()
            loss = F.cross_entropy(out, y)
            b0 = ns()
            loss.backward()
            b1 = ns()
            o0 = ns()
            opt.step()
            opt.zero_grad(set_to_none=True)
            o1 = ns()
            step_id = next(ids)
            inside = (parent[0], step_id)
            record("module.forward", f0, f1, inside, attrs)
            record("trainer.backward", b0, b1, inside, attrs)
            record("trainer.optimizer_step", o0, o1, inside, attrs)
            record("trainer.step", t1, o1, parent, attrs, step_id)
            i += 1
    finally:
        rows.close()


@contextlib.contextmanager
def _pass_through_hooks() -> Any:
    """The places ``instrument()`` hooks, hooked with wrappers that only call through
    (``Module.__call__``, the DataLoader iterator's ``__next__``,
    ``torch.autograd.backward``) and torch's global optimizer step hooks doing nothing:
    what hooking a loop without changing its code costs before any span is recorded."""
    import torch.utils.data.dataloader as dl
    from torch.optim import optimizer as optim

    def through(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return wrapper

    def nothing(*_args: Any) -> None:
        return None

    points = [
        (torch.nn.Module, "__call__"),
        (dl._BaseDataLoaderIter, "__next__"),
        (torch.autograd, "backward"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name in points]
    handles = [
        optim.register_optimizer_step_pre_hook(nothing),
        optim.register_optimizer_step_post_hook(nothing),
    ]
    try:
        for owner, name, fn in saved:
            setattr(owner, name, through(fn))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        for handle in handles:
            handle.remove()


def measure_instrument(
    workload: Workload | str, *, steps: int, rounds: int, say: Callable[[str], None] = print
) -> TrainerResult:
    """``hand`` (the bare loop), ``instrument`` (the loop under instrument(), trace
    written), ``nofile`` (the same without a trace file: what writing it costs),
    ``spans`` and ``rows`` (the loop recording the same spans by hand, through
    ``ppetrace.trace`` blocks or after the fact, into a Chrome trace file:
    :func:`_spans_loop`, :func:`_rows_loop`), ``hooks`` (the bare loop under
    :func:`_pass_through_hooks`: what hooking alone costs) and ``hooks_rows`` (``rows``
    under those hooks: hooking and recording the spans together, without inferring any
    step), interleaved; a :class:`bench_trainer.TrainerResult`."""
    wl = WORKLOADS[workload] if isinstance(workload, str) else workload
    result = TrainerResult(wl.name, steps, rounds, 1)
    with tempfile.TemporaryDirectory() as tmp, _threads(1), gc_frozen():
        ppetrace.configure()
        loader = wl.loader(steps)
        kinds = ("hand", "instrument", "nofile", "spans", "rows", "hooks", "hooks_rows")
        models = {k: wl.model() for k in kinds}
        opts = {k: torch.optim.SGD(m.parameters(), lr=LR) for k, m in models.items()}
        path = Path(tmp) / "instrument.json"

        def hand() -> int:
            t0 = time.perf_counter_ns()
            _hand_loop(models["hand"], opts["hand"], loader)
            return time.perf_counter_ns() - t0

        def traced() -> int:
            t0 = time.perf_counter_ns()
            with ppetrace.instrument(trace_path=path):
                _hand_loop(models["instrument"], opts["instrument"], loader)
            return time.perf_counter_ns() - t0

        def unwritten() -> int:
            t0 = time.perf_counter_ns()
            with ppetrace.instrument():
                _hand_loop(models["nofile"], opts["nofile"], loader)
            return time.perf_counter_ns() - t0

        def written(
            kind: str, loop: Callable[..., None], hooked: bool = False
        ) -> Callable[[], int]:
            def run() -> int:
                from exporters.chrome import ChromeTraceExporter

                t0 = time.perf_counter_ns()
                exporter = ChromeTraceExporter(Path(tmp) / f"{kind}.json")
                ppetrace.tracing.add_exporter(exporter)
                try:
                    with _pass_through_hooks() if hooked else contextlib.nullcontext():
                        loop(models[kind], opts[kind], loader)
                finally:
                    ppetrace.tracing.remove_exporter(exporter)
                return time.perf_counter_ns() - t0

            return run

        def hooked() -> int:
            t0 = time.perf_counter_ns()
            with _pass_through_hooks():
                _hand_loop(models["hooks"], opts["hooks"], loader)
            return time.perf_counter_ns() - t0

        result.times_ns = _interleaved(
            {
                "hand": hand,
                "instrument": traced,
                "nofile": unwritten,
                "spans": written("spans", _spans_loop),
                "rows": written("rows", _rows_loop),
                "hooks": hooked,
                "hooks_rows": written("hooks_rows", _rows_loop, hooked=True),
            },
            rounds,
            say,
            f"instrument {wl.name}",
        )
        from exporters import read_chrome_trace, step_report

        result.report_steps = step_report(read_chrome_trace(path), warmup_steps=0).total_steps
    ppetrace.configure()
    return result


# -- LightningProfiler ------------------------------------------------------------------------


def measure_lightning(
    workload: Workload | str, *, steps: int, rounds: int, say: Callable[[str], None] = print
) -> dict[str, list[int]] | None:
    """ns per fit with ``profiler=None``, ``"simple"``, ``LightningProfiler(trace_path)``
    (``ppetrace``) and ``LightningProfiler()`` without a trace file (``ppetrace_nofile``:
    the spans recorded, nothing written); None when Lightning is not installed."""
    if not peer_available("lightning"):
        return None
    import lightning

    from ppetrace.integrations.lightning import LightningProfiler

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    wl = WORKLOADS[workload] if isinstance(workload, str) else workload

    class Lit(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = wl.model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    with tempfile.TemporaryDirectory() as tmp, _threads(1), gc_frozen():
        ppetrace.configure()
        loader = wl.loader(steps)
        lits = {k: Lit() for k in ("none", "simple", "ppetrace", "ppetrace_nofile")}

        def fit(kind: str) -> Callable[[], int]:
            def run() -> int:
                threads = torch.get_num_threads()
                profiler: Any = {"none": None, "simple": "simple"}.get(kind)
                sink = io.StringIO()
                with warnings.catch_warnings(), contextlib.redirect_stdout(sink):
                    warnings.simplefilter("ignore")
                    t0 = time.perf_counter_ns()
                    if kind == "ppetrace":
                        profiler = LightningProfiler(Path(tmp) / "lightning.json")
                    elif kind == "ppetrace_nofile":
                        profiler = LightningProfiler()
                    trainer = lightning.Trainer(
                        max_epochs=1,
                        accelerator="cpu",
                        devices=1,
                        profiler=profiler,
                        logger=False,
                        enable_checkpointing=False,
                        enable_progress_bar=False,
                        enable_model_summary=False,
                        num_sanity_val_steps=0,
                        default_root_dir=tmp,
                    )
                    trainer.fit(lits[kind], train_dataloaders=loader)
                    ns = time.perf_counter_ns() - t0
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
                return ns

            return run

        # a smoke run (one round) skips the warm-up fits
        runners = {k: fit(k) for k in lits}
        times = _interleaved(runners, rounds, say, f"lightning {wl.name}", warmup=rounds > 1)
    ppetrace.configure()
    return times


# -- ppetrace run start-up ---------------------------------------------------------------------

_STARTUP_SCRIPT = """
import torch
from torch import nn
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def _ppetrace_command() -> list[str]:
    exe = Path(sys.executable).with_name("ppetrace")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ppetrace"]


def measure_startup(*, rounds: int, say: Callable[[str], None] = print) -> dict[str, list[int]]:
    """Wall ns of fresh processes: ``python s.py``, ``ppetrace run --no-report s.py`` and
    ``ppetrace run s.py`` (with the report), interleaved after a warm-up (which fills the
    file cache); ``<name>_cpu``: the CPU ns (user + system) of the same runs, which a
    shared machine disturbs less than the wall time. ``rounds=0``: one run each, no
    warm-up (a smoke run)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "s.py"
        script.write_text(textwrap.dedent(_STARTUP_SCRIPT))
        trace = Path(tmp) / "s.json"
        commands = {
            "python": [sys.executable, str(script)],
            "run": [*_ppetrace_command(), "run", "--no-report", "--trace", str(trace), str(script)],
            "run_report": [*_ppetrace_command(), "run", "--trace", str(trace), str(script)],
        }

        cpu: dict[str, list[int]] = {k: [] for k in commands}

        def timed(name: str, argv: list[str]) -> Callable[[], int]:
            def run() -> int:
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                t0 = time.perf_counter_ns()
                subprocess.run(argv, check=True, capture_output=True, cwd=tmp)
                wall = time.perf_counter_ns() - t0
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                used = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
                cpu[name].append(round(used * 1e9))
                return wall

            return run

        runners = {k: timed(k, v) for k, v in commands.items()}
        times = _interleaved(runners, max(rounds, 1), say, "start-up", warmup=rounds > 0)
        n = max(rounds, 1)
        times.update({f"{k}_cpu": v[-n:] for k, v in cpu.items()})  # after the warm-up
        return times


# -- truth ----------------------------------------------------------------------------------------

WAITS_NS = {"module.forward": 2_000_000, "trainer.backward": 3_000_000}
WAITS_NS["trainer.fetch_batch"] = 4_000_000
#: how long each wrapped block really took, measured inside it (the machine may preempt
#: a process after its busy-wait; the span must match the block, whatever it took)
INSIDE: dict[str, list[int]] = {}


def _busy(what: str) -> None:
    t0 = time.perf_counter_ns()
    end = t0 + WAITS_NS[what]
    while time.perf_counter_ns() < end:
        pass
    INSIDE[what].append(time.perf_counter_ns() - t0)


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _busy("trainer.backward")
        return grad


class _SlowNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _busy("module.forward")
        return _SlowBackward.apply(x * self.w)


class _SlowBatches(Dataset[Any]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        _busy("trainer.fetch_batch")
        return torch.ones(2, 2)


def run_truth_loop(path: Path, *, steps: int) -> tuple[dict[str, list[int]], int]:
    """A hand loop over ``steps`` slow batches under ``instrument(trace_path=path)``:
    per event, the wall ns of each call around a busy-wait as the loop timed it, and the
    loop's wall ns. ``INSIDE`` holds what each wait measured inside itself. The test of
    instrument()'s timing (tests/ppetrace/integrations) runs it too."""
    for key in WAITS_NS:
        INSIDE[key] = []
    calls: dict[str, list[int]] = {key: [] for key in WAITS_NS}
    model = _SlowNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(_SlowBatches(steps), batch_size=None)
    clock = time.perf_counter_ns
    with _threads(1), ppetrace.instrument(trace_path=path):
        t0 = clock()
        it = iter(data)
        while True:
            t = clock()
            x = next(it, None)
            if x is None:
                break
            calls["trainer.fetch_batch"].append(clock() - t)
            t = clock()
            out = model(x)
            calls["module.forward"].append(clock() - t)
            loss = out.sum()
            t = clock()
            loss.backward()
            calls["trainer.backward"].append(clock() - t)
            opt.step()
            opt.zero_grad()
        loop_ns = clock() - t0
    return calls, loop_ns


def measure_truth(*, steps: int) -> dict[str, Any]:
    """Spans of instrument() against the busy-waits they wrap and the calls around them."""
    from exporters import read_chrome_trace, step_report

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "truth.json"
        calls, loop_ns = run_truth_loop(path, steps=steps)
        frame = read_chrome_trace(path)
    out: dict[str, Any] = {"steps": steps, "loop_ns": loop_ns, "spans": {}}
    for name, wait in WAITS_NS.items():
        inside, outside = INSIDE[name], calls[name]
        spans = frame.loc[frame["name"] == name].sort_values("start_ns")["dur_ns"]
        spans = [int(s) for s in spans[: len(outside)]]  # not the loader's last, empty fetch
        gaps = [o - s for o, s in zip(outside, spans, strict=True)]
        bound = max(BUDGETS["truth_fraction"] * wait, BUDGETS["truth_floor_ns"])
        out["spans"][name] = {
            "wait_ns": wait,
            "count": len(spans),
            "holds_wait": all(s >= i >= wait for s, i in zip(spans, inside, strict=True)),
            "call_minus_span_median_ns": statistics.median(gaps),
            "call_minus_span_max_ns": max(gaps),
            "span_minus_wait_median_ns": statistics.median(
                s - i for s, i in zip(spans, inside, strict=True)
            ),
            "bound_ns": bound,
        }
    steps_table = step_report(frame, warmup_steps=0).steps
    covered = int((steps_table["compute_ns"] + steps_table["data_wait_ns"]).sum())
    out["tiling"] = covered / loop_ns
    out["steps_only"] = int(steps_table["compute_ns"].sum()) / loop_ns
    return out


# -- rows for benchmarks.run ---------------------------------------------------------------------


def _paired(times: dict[str, list[int]], variant: str, reference: str) -> list[float]:
    return [v / r for v, r in zip(times[variant], times[reference], strict=True)]


def _beside_row(res: TrainerResult, name: str, variant: str, what: str, said: str) -> Any:
    """The info row ``instrument.<name>.<variant>``: ``variant`` against the bare loop, as
    ``benchmarks.run`` shows a Trainer variant against its hand loop, then ``said``."""
    from benchmarks.run import _timed_row

    row = _timed_row(res, f"instrument.{name}.{variant}", what, variant, None, None)
    row.note += f"; {said}"
    return row


def _above(res: TrainerResult, variant: str) -> str:
    """instrument()'s paired cost above ``variant``, with its interval."""
    lo, hi = res.overhead_ci("instrument", variant)
    return (
        f"{res.overhead_us('instrument', variant):+,.1f} µs/step (95% CI {lo:+,.1f} to {hi:+,.1f})"
    )


def rows(size: dict[str, int], details: dict[str, Any]) -> list[Any]:
    """The section's rows for ``benchmarks.run`` (``size`` holds the keys of :data:`SIZES`)."""
    from benchmarks.run import FAIL, INFO, MISSING, PASS, Row, _say

    own = {k[len("instrument_") :]: v for k, v in size.items() if k.startswith("instrument_")}
    out: list[Row] = []

    def gate(ok: bool) -> str:
        return PASS if ok else FAIL

    for name in ("tiny", "mlp"):
        res = measure_instrument(name, steps=own[f"{name}_steps"], rounds=own["rounds"], say=_say)
        details[f"instrument_{name}"] = {"times_ns": res.times_ns, "steps": res.steps}
        ratio = res.paired_ratio("instrument")
        lo, hi = res.paired_ci("instrument")
        budget = BUDGETS[f"instrument.{name}"]
        wl = WORKLOADS[name]
        label = "Linear 16->4, batch 8" if wl.hidden is None else "MLP 784-256-10, batch 64"
        out.append(
            Row(
                id=f"instrument.{name}",
                what=f"instrument() on a hand loop, {name} ({label}), trace written",
                measured=f"{res.median_us_per_step('instrument'):,.1f} µs/step",
                reference=f"{res.median_us_per_step('hand'):,.1f} µs/step (bare loop)",
                ratio=ratio,
                budget=f"<= {budget:.2f}x",
                status=gate(ratio <= budget),
                value=res.median_us_per_step("instrument"),
                reference_value=res.median_us_per_step("hand"),
                unit="µs/step",
                note=(
                    f"median of {res.rounds} paired rounds of {res.steps} steps, 95% CI "
                    f"{lo:.3f}-{hi:.3f}x; fastest runs {res.best_ratio('instrument'):.3f}x; "
                    f"{res.report_steps} steps in the trace's report"
                ),
            )
        )

        beside = (
            (
                "nofile",
                f"instrument() on the same loop without a trace file, {name}",
                "the spans recorded and nothing written; writing the trace (the exporter "
                "made, the spans encoded and written, the file closed) takes "
                f"{_above(res, 'nofile')} above it",
            ),
            (
                "spans",
                f"the same spans opened by hand with ppetrace.trace, {name}, trace written",
                "recording and writing the step's spans through trace blocks; instrument() "
                f"takes {_above(res, 'spans')} above it: its global hooks and step inference",
            ),
            (
                "rows",
                f"the same spans recorded after the fact by hand (rows), {name}, trace written",
                "clock reads around each call and RowBuffer rows, as instrument() records "
                f"its spans; instrument() takes {_above(res, 'rows')} above it",
            ),
            (
                "hooks",
                f"the places instrument() hooks, hooked to call through only, {name}",
                "Module.__call__, the DataLoader iterator's __next__ and "
                "torch.autograd.backward wrapped to call through, and torch's global "
                "optimizer step hooks doing nothing",
            ),
            (
                "hooks_rows",
                f"the rows loop under the call-through hooks, {name}, trace written",
                "hooking instrument()'s places and recording its spans after the fact, with "
                "no step inferred: what ppetrace's Python hooks and rows cost together; "
                f"instrument() takes {_above(res, 'hooks_rows')} above it",
            ),
        )
        out.extend(_beside_row(res, name, *spec) for spec in beside)
    times = measure_lightning(
        "mlp", steps=own["lightning_steps"], rounds=own["lightning_rounds"], say=_say
    )
    for ref, what in (("simple", 'profiler="simple"'), ("none", "no profiler")):
        row_id = f"instrument.lightning_{ref}"
        label = f"LightningProfiler / Lightning {what} (mlp)"
        if times is None:
            out.append(Row(id=row_id, what=label, status=MISSING, note="lightning"))
            continue
        details["lightning_profiler"] = times
        ratios = _paired(times, "ppetrace", ref)
        ratio = statistics.median(ratios)
        lo, hi = _ci(ratios)
        budget = BUDGETS[f"lightning.{ref}"]
        steps = own["lightning_steps"]
        out.append(
            Row(
                id=row_id,
                what=label,
                measured=f"{statistics.median(times['ppetrace']) / steps / 1e3:,.1f} µs/step",
                reference=f"{statistics.median(times[ref]) / steps / 1e3:,.1f} µs/step ({ref})",
                ratio=ratio,
                budget=f"<= {budget:.2f}x",
                status=gate(ratio <= budget),
                unit="µs/step",
                note=(
                    f"median of {len(ratios)} paired rounds of one fit of {steps} steps "
                    f"(setup included), 95% CI {lo:.3f}-{hi:.3f}x"
                ),
            )
        )
    label = 'LightningProfiler() without a trace file / Lightning profiler="simple" (mlp)'
    if times is None:
        out.append(
            Row(id="instrument.lightning_nofile", what=label, status=MISSING, note="lightning")
        )
    else:
        ratios = _paired(times, "ppetrace_nofile", "simple")
        lo, hi = _ci(ratios)
        steps = own["lightning_steps"]
        mine = statistics.median(times["ppetrace_nofile"]) / steps / 1e3
        simple = statistics.median(times["simple"]) / steps / 1e3
        out.append(
            Row(
                id="instrument.lightning_nofile",
                what=label,
                measured=f"{mine:,.1f} µs/step",
                reference=f"{simple:,.1f} µs/step (simple)",
                ratio=statistics.median(ratios),
                status=INFO,
                unit="µs/step",
                note=(
                    f"median of {len(ratios)} paired rounds, 95% CI {lo:.3f}-{hi:.3f}x: the "
                    "same spans recorded, no trace written; the difference to "
                    "instrument.lightning_simple is writing the trace"
                ),
            )
        )
    start = measure_startup(rounds=own["startup_rounds"], say=_say)
    details["startup_ns"] = start
    diffs = [(r - p) / 1e9 for r, p in zip(start["run"], start["python"], strict=True)]
    extra = statistics.median(diffs)
    cpu_extra = statistics.median(
        (r - p) / 1e9 for r, p in zip(start["run_cpu"], start["python_cpu"], strict=True)
    )
    lo, hi = _ci(diffs)
    out.append(
        Row(
            id="instrument.startup",
            what="ppetrace run --no-report s.py, on top of python s.py",
            measured=f"+{extra:.3f} s",
            reference=f"{statistics.median(start['python']) / 1e9:.2f} s (python s.py)",
            budget=f"<= {BUDGETS['startup_s']:.1f} s",
            status=gate(extra <= BUDGETS["startup_s"]),
            value=extra,
            unit="s",
            note=(
                f"median of {len(diffs)} paired fresh processes, 95% CI +{lo:.3f}-+{hi:.3f} s; "
                f"CPU time (user + system) +{cpu_extra:.3f} s"
            ),
        )
    )
    report = statistics.median(
        (r - p) / 1e9 for r, p in zip(start["run_report"], start["run"], strict=True)
    )
    out.append(
        Row(
            id="instrument.startup_report",
            what="ppetrace run: the step report it prints at the end",
            measured=f"+{report:.3f} s",
            reference="ppetrace run --no-report",
            status=INFO,
            value=report,
            unit="s",
        )
    )
    truth = measure_truth(steps=own["truth_steps"])
    details["truth"] = truth
    for name, spans in truth["spans"].items():
        ok = spans["holds_wait"] and abs(spans["call_minus_span_median_ns"]) <= spans["bound_ns"]
        out.append(
            Row(
                id=f"instrument.truth.{name}",
                what=f"truth: {name} span / the call around a {spans['wait_ns'] // 10**6} ms wait",
                measured=f"{spans['call_minus_span_median_ns'] / 1e3:,.1f} µs",
                reference=f"{spans['bound_ns'] / 1e3:,.0f} µs (max(1%, 20 µs))",
                budget=f"<= {spans['bound_ns'] / 1e3:,.0f} µs",
                status=gate(ok),
                value=spans["call_minus_span_median_ns"],
                unit="ns",
                note=(
                    f"median over {spans['count']} steps of (call as the loop timed it) - "
                    f"(span); max {spans['call_minus_span_max_ns'] / 1e3:,.1f} µs; every span "
                    f"holds its wait: {spans['holds_wait']}; span - wait (the call's own work: "
                    f"DataLoader, autograd): {spans['span_minus_wait_median_ns'] / 1e3:,.1f} µs"
                ),
            )
        )
    out.append(
        Row(
            id="instrument.tiling",
            what="truth: trainer.step spans + their data wait / the loop's wall time",
            measured=f"{truth['tiling'] * 100:.2f}%",
            budget=f">= {BUDGETS['tiling'] * 100:.0f}%",
            status=gate(truth["tiling"] >= BUDGETS["tiling"]),
            value=truth["tiling"],
            note=f"the step spans alone: {truth['steps_only'] * 100:.2f}% (the rest is data wait)",
        )
    )
    return out


#: the row ids :func:`rows` yields
ROW_IDS = (
    "instrument.tiny",
    "instrument.tiny.nofile",
    "instrument.tiny.spans",
    "instrument.tiny.rows",
    "instrument.tiny.hooks",
    "instrument.tiny.hooks_rows",
    "instrument.mlp",
    "instrument.mlp.nofile",
    "instrument.mlp.spans",
    "instrument.mlp.rows",
    "instrument.mlp.hooks",
    "instrument.mlp.hooks_rows",
    "instrument.lightning_simple",
    "instrument.lightning_none",
    "instrument.lightning_nofile",
    "instrument.startup",
    "instrument.startup_report",
    *(f"instrument.truth.{name}" for name in WAITS_NS),
    "instrument.tiling",
)
#: the rows with a budget
BUDGETED = tuple(
    r
    for r in ROW_IDS
    if r not in ("instrument.startup_report", "instrument.lightning_nofile")
    and not r.endswith((".nofile", ".spans", ".rows", ".hooks", ".hooks_rows"))
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--json", dest="json_path", help="also write the rows and raw times here")
    args = parser.parse_args(argv)
    from dataclasses import asdict

    from benchmarks.run import PASS, render_table

    details: dict[str, Any] = {}
    found = rows(SIZES["quick" if args.quick else "full"], details)
    print(render_table(found))
    for row in found:
        if row.note:
            print(f"  {row.id}: {row.note}")
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps({"rows": [asdict(r) for r in found], "details": details}, default=str)
        )
    return 0 if all(r.status in (PASS, "info", "not installed") for r in found) else 1


if __name__ == "__main__":
    sys.exit(main())
