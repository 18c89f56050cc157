"""Setting up a Trainer call: its runtime, the module's placement, the optimization of a fit.

Each function takes the Trainer as ``self`` (as ``_session`` does). The
optimizers come from the adapter, given PyMarlin's step estimate
(:func:`~ppetrace.training._optim.estimated_global_steps_per_epoch`, with
the world size); a network whose closure steps several optimizers itself
rejects accumulation and clipping here, before anything runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch

from ..integrations._ranks import check_trace_path
from ..interfaces.module_interface import Stage
from ..runtime._base import BaseRuntime
from ..runtime._pytorch import PyTorchRuntime
from ..runtime._registry import make_runtime
from ._adapters import Adapter, NetworkAdapter, make_adapter
from ._distributed import Distributed
from ._evaluator import Evaluator, _callbacks_for
from ._optim import (
    Optimization,
    SchedulerInterval,
    estimated_global_steps_per_epoch,
    world_size,
)
from ._placement import place
from ._run import Run, TrainerView, len_or_none

__all__ = [
    "check_device",
    "check_trace_path",
    "empty_loader",
    "evaluator_for",
    "prepare_fit",
    "trainer_runtime",
]


class TrainerSettings(TrainerView, Protocol):
    """The Trainer as these functions see it: its settings, and what a call records."""

    device: str | torch.device | BaseRuntime
    runtime_options: dict[str, Any] | None
    amp: bool
    max_epochs: int
    grad_accumulation: int
    clip_grad_norm: float | None
    scheduler_interval: SchedulerInterval
    callbacks: list[object]
    max_collated_bytes: int
    max_train_steps_per_epoch: int | None
    max_val_steps_per_epoch: int | None
    on_nonfinite_loss: Any
    runtime: BaseRuntime | None
    use_distributed_sampler: bool
    gather_outputs: bool
    _dist: Distributed | None
    _models: dict[str, torch.nn.Module]
    _optimizers: dict[str, Any]

    def update_state(self, state: Mapping[str, Any]) -> None: ...


def prepare_fit(self: TrainerSettings, adapter: Adapter) -> tuple[Run, Iterable[Any], int | None]:
    """Runtime, module placement, first loader, optimization and callbacks of a fit."""
    check_trainable(adapter.module)
    runtime = trainer_runtime(self)
    self.runtime = runtime
    adapter.module, placements = place(adapter.module, runtime)
    dist = self._dist
    adapter.forward_module = adapter.module if adapter.ddp is None else adapter.ddp
    if dist is not None:
        if self.use_distributed_sampler:
            dist.shard(adapter)
        adapter.forward_module = dist.wrap(adapter, runtime)
    first_loader = adapter.train_loader()
    n = len_or_none(first_loader)
    if n == 0:
        raise empty_loader(adapter)
    estimate = estimated_global_steps_per_epoch(
        n if dist is None else dist.full_batches(adapter, first_loader),
        self.grad_accumulation,
        world_size=world_size(),
        max_train_steps_per_epoch=self.max_train_steps_per_epoch,
    )
    optimizers, schedulers = adapter.optimizers_schedulers(estimate, self.max_epochs)
    if adapter.steps_in_closure:
        _check_closure_steps(self, adapter, len(optimizers))
    optim = Optimization(
        optimizers,
        schedulers,
        clip_grad_norm=self.clip_grad_norm,
        scaler=runtime.grad_scaler,
        interval=self.scheduler_interval,
        steps_in_closure=adapter.steps_in_closure,
    )
    callbacks = _callbacks_for(adapter, self.callbacks)
    run = Run(
        self,
        adapter,
        runtime,
        optim,
        callbacks,
        self.max_collated_bytes,
        placements,
        self.on_nonfinite_loss,
    )
    run.evaluator.max_batches = self.max_val_steps_per_epoch
    if dist is not None and self.gather_outputs:
        run.evaluator.gather = dist.gather
    if isinstance(adapter, NetworkAdapter):
        adapter.bind(run.network_backward, runtime.grad_scaler)
    self._models = {"main": adapter.module}
    self._optimizers = adapter.named_optimizers(optimizers)
    self.update_state({"epoch": 0, "global_step": 0, "batch_in_epoch": 0, "batches_seen": 0})
    return run, first_loader, n


def check_trainable(module: torch.nn.Module) -> None:
    """``ValueError`` naming ``module`` when it has no parameter that requires a gradient."""
    params = list(module.parameters())
    if any(p.requires_grad for p in params):
        return
    what = (
        "no parameters at all"
        if not params
        else f"{len(params)} parameter tensor(s), none with requires_grad=True"
    )
    raise ValueError(
        f"Expected a module with trainable parameters to fit, but {type(module).__name__} has "
        f"{what}. Unfreeze the parameters to train (module.requires_grad_(True)), or use "
        "trainer.validate()/trainer.test() to only evaluate it."
    )


def check_device(device: str | torch.device | BaseRuntime) -> None:
    """A CUDA device that this torch cannot use raises ``RuntimeError`` with a sentence,
    instead of torch's ``AssertionError`` when the module moves."""
    if isinstance(device, BaseRuntime):
        if not isinstance(device, PyTorchRuntime):
            return  # a custom runtime moves things itself
        spec: Any = device.device_spec
    else:
        try:
            spec = torch.device(device)
        except (RuntimeError, ValueError, TypeError):
            return  # a custom device type: its registered runtime decides
    if not isinstance(spec, torch.device) or spec.type != "cuda":
        return
    shown = str(device.device_spec if isinstance(device, BaseRuntime) else device)
    if not torch.backends.cuda.is_built():
        raise RuntimeError(
            f"Expected a CUDA device for device={shown!r}, but this torch build has no CUDA "
            f"support (torch {torch.__version__}). Install a CUDA build of torch, or pass "
            "device='cpu'."
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"Expected a CUDA device for device={shown!r}, but torch finds none "
            "(torch.cuda.is_available() is False). Check the driver and CUDA_VISIBLE_DEVICES, "
            "or pass device='cpu'."
        )
    count = torch.cuda.device_count()
    if spec.index is not None and spec.index >= count:
        raise RuntimeError(
            f"Expected a CUDA device for device={shown!r}, but only {count} CUDA device(s) "
            f"are visible (cuda:0 to cuda:{count - 1}). Pass one of those."
        )


def _check_closure_steps(self: TrainerSettings, adapter: Adapter, count: int) -> None:
    for option, value, bad in (
        ("grad_accumulation", self.grad_accumulation, self.grad_accumulation > 1),
        ("clip_grad_norm", self.clip_grad_norm, self.clip_grad_norm is not None),
    ):
        if bad:
            raise ValueError(
                f"Expected {option} to be off for the network {adapter.name}, whose closure "
                f"steps its {count} optimizers itself (in place, in the closure's order, as "
                f"delira does), but received {option}={value!r}. Accumulate or clip inside "
                "the closure, or train with one optimizer."
            )


def trainer_runtime(self: TrainerSettings) -> BaseRuntime:
    """The runtime of a call: the ``device`` instance, or one built from the device string
    with ``runtime_options`` (and autocast plus a GradScaler for ``amp``)."""
    device = self.device if self._dist is None else self._dist.local_device(self.device)
    if isinstance(device, BaseRuntime):
        if self.runtime_options:
            raise ValueError(
                "Expected runtime_options only with a device string, but received a runtime "
                f"instance ({device!r}) too. Configure the instance when you build it."
            )
        if self.amp and not device.autocast_enabled:
            raise ValueError(
                f"Expected a runtime with autocast enabled for amp=True, but {device!r} has "
                "none. Build it with options={'autocast': True, 'grad_scaler': True}."
            )
        return device
    options = dict(self.runtime_options or {})
    if self.amp:
        options.setdefault("autocast", True)
        options.setdefault("grad_scaler", True)
    return make_runtime(device, options=options or None)


def evaluator_for(
    self: TrainerSettings,
    module: torch.nn.Module,
    stage: Stage,
    loaders: Any,
    loss_fn: Any,
    metrics: Any,
    batch_size: int,
) -> Evaluator:
    """The Evaluator of a ``validate`` or ``test`` call, sharing the Trainer's callbacks."""
    key = "val_loaders" if stage is Stage.VAL else "test_loaders"
    adapter = make_adapter(
        module, loss_fn=loss_fn, metrics=metrics, batch_size=batch_size, **{key: loaders}
    )
    runtime = trainer_runtime(self)
    self.runtime = runtime
    adapter.module, placements = place(adapter.module, runtime)
    self._models = {"main": adapter.module}
    callbacks = _callbacks_for(adapter, self.callbacks)
    evaluator = Evaluator._for_run(
        adapter, runtime, stage, callbacks, self.max_collated_bytes, placements
    )
    dist = self._dist
    if dist is not None:
        if self.use_distributed_sampler:
            dist.shard(adapter)
        if self.gather_outputs:
            evaluator.gather = dist.gather
    return evaluator


def empty_loader(adapter: Adapter, epoch: int | None = None) -> ValueError:
    """The error for a training loader that yielded no batch."""
    when = "" if epoch is None else f" in epoch {epoch}"
    return ValueError(
        f"Expected the training loader of {adapter.name} to yield at least one batch, but it "
        f"yielded none{when}. Check the dataset size, batch_size and drop_last."
    )
