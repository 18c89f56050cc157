"""The ways ``bench_trainer`` trains: its workloads, the three module kinds, hand loops,
the Trainer and the peers.

Every variant trains the workload's model (the same initial weights) on the
same ``DataLoader``; :meth:`_Variant.run` returns the wall and CPU ns of one
training run. ``bench_trainer`` (its module docstring says what each variant
is) times them in interleaved rounds.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ppetrace
from ppetrace import tracing

__all__ = [
    "CLASSES",
    "LR",
    "PEERS",
    "WORKLOADS",
    "Workload",
    "coverage",
    "peer_available",
]

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


def coverage(path: str | os.PathLike[str], name: str) -> float | None:
    """The share of the time of the ``name`` spans in a trace file that their direct
    children cover, all such spans together (``1 - self time / duration``); None when
    the file has none."""
    from exporters import read_chrome_trace

    frame = read_chrome_trace(path)
    rows = frame[frame["name"] == name]
    total = float(rows["dur_ns"].sum())
    if not total:
        return None
    return 1.0 - float(rows["self_ns"].sum()) / total


# -- the module kinds ---------------------------------------------------------------------


class _InterfaceModule(ppetrace.ModuleInterface):
    """A PyMarlin-style module: the workload's model, its loader and optimizer."""

    def __init__(self, model: nn.Module, loader: DataLoader[Any]) -> None:
        super().__init__()
        self.model = model
        self.loader = loader
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)

    def get_optimizers_schedulers(
        self, estimated_global_steps_per_epoch: int, epochs: int
    ) -> tuple[list[torch.optim.Optimizer], list[Any]]:
        return [self.opt], []

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> DataLoader[Any]:
        return self.loader

    def get_val_dataloaders(self, sampler: Any, batch_size: int) -> None:
        return None

    def train_step(self, global_step: int, batch: Any, device: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def val_step(self, global_step: int, batch: Any, device: Any) -> Any:
        return self.model(batch[0])


class _Network(ppetrace.AbstractPyTorchNetwork):
    """A delira-style network around the workload's model (the default closure)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


_LOSSES = {"ce": F.cross_entropy}


# -- the variants ---------------------------------------------------------------------


class _Variant:
    """One way to train: ``run()`` trains once over the loader and returns
    ``(wall ns, CPU ns)`` taken."""

    kind = "plain"

    def __init__(self, workload: Workload, loader: DataLoader[Any], tmp: Path) -> None:
        self.workload = workload
        self.loader = loader
        self.tmp = tmp
        self.model = workload.model()

    def run(self) -> tuple[int, int]:
        t0, c0 = time.perf_counter_ns(), time.process_time_ns()
        self.train()
        return time.perf_counter_ns() - t0, time.process_time_ns() - c0

    def train(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the variant holds (files, global state)."""


class _TracingOff(_Variant):
    """With ``off``, tracing is disabled (``configure(enabled=False)``) around the timed
    run, outside its timed region."""

    off = False

    def run(self) -> tuple[int, int]:
        if self.off:
            ppetrace.configure(enabled=False)
        try:
            return super().run()
        finally:
            if self.off:
                ppetrace.configure()


class _Hand(_Variant):
    def __init__(self, workload: Workload, loader: DataLoader[Any], tmp: Path) -> None:
        super().__init__(workload, loader, tmp)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def train(self) -> None:
        model, opt, loader = self.model, self.opt, self.loader
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


class _HandSpans(_TracingOff, _Hand):
    """The hand loop opening, by hand, the spans that the Trainer records for each step:
    the same names, nesting and empty hook spans (README, "Hook order"), under
    ``trainer.run`` and ``trainer.epoch``, with one ``FrozenAttributes`` per step built as
    the Trainer builds it. ``off``: tracing disabled (what the ``with`` statements and the
    mapping cost alone); ``nofile``: recorded, no exporter; else also streamed into a
    Chrome trace file, as ``trace_path`` does. Against ``hand`` it prices the spans; the
    Trainer against it prices the Trainer's loop beyond its spans."""

    nofile = False

    def train(self) -> None:
        from exporters.chrome import ChromeTraceExporter

        exporter = None
        if not self.off and not self.nofile:  # what trace_path costs the Trainer, here too
            exporter = ChromeTraceExporter(self.tmp / f"{type(self).__name__}.json")
            tracing.add_exporter(exporter)
        try:
            with ppetrace.trace("trainer.run"), ppetrace.trace("trainer.epoch"):
                self._epoch()
        finally:
            if exporter is not None:
                tracing.remove_exporter(exporter)

    def _epoch(self) -> None:
        model, opt, trace = self.model, self.opt, ppetrace.trace
        fetch, step, pre, convert, train, backward, optimizer, post = (
            trace(name)
            for name in (
                "trainer.fetch_batch",
                "trainer.step",
                "runtime.train_pre_step",
                "runtime.convert_batch",
                "module.train_step",
                "trainer.backward",
                "trainer.optimizer_step",
                "runtime.train_post_step",
            )
        )
        template = {
            "ppetrace.epoch": 0,
            "ppetrace.step": 0,
            "ppetrace.batch_idx": 0,
            "ppetrace.stage": "train",
            "ppetrace.device": "cpu",
            "ppetrace.runtime": "PyTorchRuntime",
            "ppetrace.batch_size": self.workload.batch_size,
        }
        model.train()
        with trace("trainer.loader_start"):
            it = iter(self.loader)
        for i in range(len(self.loader)):  # as the Trainer: no fetch past a loader's len()
            step_attrs = template.copy()
            step_attrs["ppetrace.step"] = i
            step_attrs["ppetrace.batch_idx"] = i
            attrs = tracing.FrozenAttributes(step_attrs)
            with fetch.again(attrs):
                batch = next(it)
            with step.again(attrs):
                pre.mark(attrs)
                with convert.again(attrs):
                    x, y = batch
                with train.again(attrs):
                    loss = F.cross_entropy(model(x), y)
                with backward.again(attrs):
                    loss.backward()
                with optimizer.again(attrs):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                post.mark(attrs)
        with trace("trainer.loader_end"):
            del it


class _HandSpansNoFile(_HandSpans):
    nofile = True


class _HandSpansOff(_HandSpans):
    off = True


class _HandInterface(_Variant):
    """A hand loop over a ModuleInterface, calling it as PyMarlin's trainer does."""

    kind = "interface"

    def __init__(self, workload: Workload, loader: DataLoader[Any], tmp: Path) -> None:
        super().__init__(workload, loader, tmp)
        self.module = _InterfaceModule(self.model, loader)

    def train(self) -> None:
        module, opt, train = self.module, self.module.opt, ppetrace.Stage.TRAIN
        module.train()
        for step, batch in enumerate(self.loader):
            loss = module(train, step + 1, batch, "cpu")
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


class _HandNetwork(_Variant):
    """A hand loop over a delira network: ``prepare_batch`` then ``closure``, as delira's."""

    kind = "network"

    def __init__(self, workload: Workload, loader: DataLoader[Any], tmp: Path) -> None:
        super().__init__(workload, loader, tmp)
        self.net = _Network(self.model)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=LR)

    def train(self) -> None:
        net, optimizers, device = self.net, {"default": self.opt}, "cpu"
        net.train()
        for batch_nr, batch in enumerate(self.loader):
            data = net.prepare_batch(batch, device, device)
            net.closure(
                net,
                data,
                optimizers=optimizers,
                losses=_LOSSES,
                metrics={},
                fold=0,
                batch_nr=batch_nr,
            )


class _Ppetrace(_TracingOff, _Variant):
    """``ppetrace.Trainer`` on the plain module; ``trace_path`` unless ``nofile``, tracing
    disabled when ``off``."""

    nofile = False
    #: ``Trainer(trace_detail=...)``: the default, or summarised steps (``_PpetraceSummarised``)
    detail: Any = "auto"

    def __init__(self, workload: Workload, loader: DataLoader[Any], tmp: Path) -> None:
        super().__init__(workload, loader, tmp)
        self.setup()
        self.trace_path: Path | None = (
            None if self.nofile or self.off else tmp / f"{type(self).__name__}-{workload.name}.json"
        )
        self.report_ns: list[int] = []
        self.steps_in_report = 0

    def setup(self) -> None:
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def fit(self, trainer: ppetrace.Trainer) -> None:
        trainer.fit(self.model, self.loader, optimizer=self.opt, loss_fn=F.cross_entropy)

    def train(self) -> None:
        trainer = ppetrace.Trainer(
            device="cpu",
            max_epochs=1,
            val_every_n_epochs=None,
            progress=False,
            trace_path=self.trace_path,
            trace_detail=self.detail,
        )
        self.fit(trainer)

    def build_report(self) -> int:
        """Build the step report from the last trace; returns ns taken (outside ``run``)."""
        from exporters import read_chrome_trace, step_report

        assert self.trace_path is not None
        t0 = time.perf_counter_ns()
        report = step_report(read_chrome_trace(self.trace_path), warmup_steps=1)
        ns = time.perf_counter_ns() - t0
        self.steps_in_report = int(report.total_steps)
        self.report_ns.append(ns)
        return ns

    def coverage(self) -> dict[str, float | None]:
        """Coverage of ``trainer.epoch`` and ``trainer.run`` in the last trace."""
        assert self.trace_path is not None
        return {span: coverage(self.trace_path, f"trainer.{span}") for span in ("epoch", "run")}


class _PpetraceNoFile(_Ppetrace):
    """The Trainer with tracing on but no exporter: the loop plus recording the spans."""

    nofile = True


class _PpetraceSummarised(_Ppetrace):
    """The traced Trainer with 999 steps in 1,000 summarised (issue 19's aggregates, in
    windows from the start): against ``ppetrace``, the cost of the aggregates."""

    detail = ppetrace.Schedule(wait=999, warmup=0, active=1, repeat=0)


class _PpetraceOff(_Ppetrace):
    """The Trainer with tracing disabled (``configure(enabled=False)``): the loop alone."""

    off = True


class _PpetraceInterface(_Ppetrace):
    kind = "interface"

    def setup(self) -> None:
        self.module = _InterfaceModule(self.model, self.loader)

    def fit(self, trainer: ppetrace.Trainer) -> None:
        trainer.fit(self.module)


class _PpetraceInterfaceOff(_PpetraceInterface):
    off = True


class _PpetraceNetwork(_Ppetrace):
    kind = "network"

    def setup(self) -> None:
        self.net = _Network(self.model)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=LR)

    def fit(self, trainer: ppetrace.Trainer) -> None:
        trainer.fit(self.net, self.loader, optimizer={"default": self.opt}, loss_fn=_LOSSES)


class _PpetraceNetworkOff(_PpetraceNetwork):
    off = True


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

    def train(self) -> None:
        import pytorch_pfn_extras as ppe

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

    def train(self) -> None:
        lightning = self.lightning
        threads = torch.get_num_threads()
        sink = io.StringIO()  # the simple profiler prints its summary at the end of fit
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink):
            warnings.simplefilter("ignore")
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
        if torch.get_num_threads() != threads:  # keep "same threads for all" true
            torch.set_num_threads(threads)


#: every variant by name
CLASSES: dict[str, type[_Variant]] = {
    "hand": _Hand,
    "hand_spans": _HandSpans,
    "hand_spans_nofile": _HandSpansNoFile,
    "hand_spans_off": _HandSpansOff,
    "ppetrace": _Ppetrace,
    "ppetrace_nofile": _PpetraceNoFile,
    "ppetrace_summarised": _PpetraceSummarised,
    "ppetrace_off": _PpetraceOff,
    "hand_interface": _HandInterface,
    "ppetrace_interface": _PpetraceInterface,
    "ppetrace_interface_off": _PpetraceInterfaceOff,
    "hand_network": _HandNetwork,
    "ppetrace_network": _PpetraceNetwork,
    "ppetrace_network_off": _PpetraceNetworkOff,
    "ppe": _Ppe,
    "ppe_profile": _PpeProfile,
    "lightning": _Lightning,
}
