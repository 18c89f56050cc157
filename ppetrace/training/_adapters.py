"""Adapters: the three kinds of module, seen by the training loop through one interface.

- :class:`InterfaceAdapter` for a :class:`~ppetrace.ModuleInterface`, which
  supplies its loaders, optimizers and schedulers;
- :class:`NetworkAdapter` for an :class:`~ppetrace.AbstractPyTorchNetwork`,
  whose ``closure`` runs the step with losses and optimizers given as dicts;
- :class:`PlainAdapter` for a plain ``nn.Module`` with an optimizer, a loss
  function and loaders of ``(inputs, targets)`` batches.

A step returns ``(loss, outputs, raw)``: the loss to back-propagate (``None``
when the step already did, as a network's closure does), the outputs as a
tuple for callbacks, and the raw return value for the runtime's
``train_post_step``/``eval_post_step``. Each adapter also names its
optimizers (``Trainer.optimizers``, as ppe's trainer exposes them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import RandomSampler, SequentialSampler

from ..interfaces.module_interface import CallbackInterface, ModuleInterface, Stage
from ..interfaces.network import _ACTIVE_MOVE, _ACTIVE_SCALING, AbstractPyTorchNetwork
from ..runtime._base import BaseRuntime
from ..runtime._pytorch import PyTorchRuntime
from ..tracing._recorder import trace
from ._collate import as_outputs

__all__ = ["Adapter", "InterfaceAdapter", "NetworkAdapter", "PlainAdapter", "make_adapter"]

Loaders = dict[str, Iterable[Any]]
_NO_SCOPE: contextlib.nullcontext[None] = contextlib.nullcontext()


def len_or_none(loader: Any) -> int | None:
    """``len(loader)``, or None for a loader without one."""
    try:
        return len(loader)
    except TypeError:
        return None


def named_loaders(loaders: Any, what: str) -> Loaders:
    """``None`` -> ``{}``, one loader -> ``{"default": loader}``, a dict -> a copy."""
    if loaders is None:
        return {}
    if isinstance(loaders, Mapping):
        out: Loaders = {}
        for name, loader in loaders.items():
            if not isinstance(loader, Iterable):
                raise TypeError(
                    f"Expected an iterable loader for {what} {name!r}, but received "
                    f"{type(loader).__name__}."
                )
            out[str(name)] = loader
        return out
    if isinstance(loaders, Iterable):
        return {"default": loaders}
    raise TypeError(
        f"Expected a loader or a dict of named loaders for {what}, but received "
        f"{type(loaders).__name__}."
    )


class Adapter:
    """What the loop needs from a module, whatever its kind."""

    #: the step already ran backward (a network's closure), so the loop must not
    backward_in_step = False
    #: the optimizers step inside the step (a network's closure with several optimizers)
    steps_in_closure = False
    #: the sampler classes a ModuleInterface builds its loaders with (PyMarlin's
    #: ``get_*_dataloader(sampler, batch_size)``); distributed training replaces them
    train_sampler: type = RandomSampler
    eval_sampler: type = SequentialSampler

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        train_loader: Iterable[Any] | None = None,
        val_loaders: Any = None,
        test_loaders: Any = None,
        batch_size: int = 32,
        val_batch_size: int | None = None,
    ) -> None:
        self.module = module
        #: what the training step calls: the module, or its DistributedDataParallel wrapper
        self.forward_module: torch.nn.Module = module
        #: a DistributedDataParallel wrapper the user passed to fit(), else None
        self.ddp: torch.nn.Module | None = None
        self.name = type(module).__name__
        self._train_loader = train_loader
        self._val_loaders = val_loaders
        self._test_loaders = test_loaders
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size if val_batch_size is not None else batch_size

    @property
    def loss_source(self) -> str:
        """What produced the loss, for error messages."""
        return f"{self.name}.train_step"

    @property
    def callback(self) -> CallbackInterface | None:
        """The module itself when it is a callback (it then gets every hook first)."""
        return self.module if isinstance(self.module, CallbackInterface) else None

    # -- data ----------------------------------------------------------------------

    def train_loader(self) -> Iterable[Any]:
        """The training loader for the next epoch."""
        if self._train_loader is None:
            raise ValueError(
                f"Expected a train_loader to fit {self.name}, but received None. Pass "
                "train_loader=DataLoader(...) to fit()."
            )
        return self._train_loader

    def val_loaders(self) -> Loaders:
        """The named validation loaders (possibly none)."""
        return named_loaders(self._val_loaders, "val_loaders")

    def test_loaders(self) -> Loaders:
        """The named test loaders (possibly none)."""
        return named_loaders(self._test_loaders, "loaders")

    # -- optimization ------------------------------------------------------------------

    def optimizers_schedulers(
        self, steps_per_epoch: int, epochs: int
    ) -> tuple[list[torch.optim.Optimizer], list[Any]]:
        raise NotImplementedError  # pragma: no cover - every adapter implements it

    def named_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        """``optimizers`` by name: ``{"main": opt}`` for one (as ppe), ``"0"``, ``"1"``, ...
        for several."""
        if len(optimizers) == 1:
            return {"main": optimizers[0]}
        return {str(i): opt for i, opt in enumerate(optimizers)}

    # -- steps -------------------------------------------------------------------------

    def active(self, scaling: Any) -> contextlib.AbstractContextManager[Any]:
        """What the steps of a fit (``scaling``: its loss scaling) or of an evaluation
        (``None``) need set around them; nothing here (see :class:`NetworkAdapter`)."""
        return _NO_SCOPE

    def train_step(
        self, global_step: int, batch: Any, device: Any, attrs: Mapping[str, Any]
    ) -> Any:
        """One training step: ``(loss or None, outputs tuple, raw outputs)``."""
        raise NotImplementedError  # pragma: no cover

    def eval_step(
        self, stage: Stage, global_step: int, batch: Any, device: Any, attrs: Mapping[str, Any]
    ) -> tuple[tuple[Any, ...], Any]:
        """One validation or test step: ``(outputs tuple, raw outputs)``."""
        raise NotImplementedError  # pragma: no cover

    # -- state -------------------------------------------------------------------------

    def get_state(self) -> Any:
        """The module's checkpoint state."""
        return self.module.state_dict()

    def update_state(self, state: Any) -> None:
        """Restore :meth:`get_state`."""
        self.module.load_state_dict(state)


def _plain_pair(batch: Any, name: str) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    kind = f"a sequence of length {len(batch)}" if isinstance(batch, (tuple, list)) else None
    raise TypeError(
        f"Expected each batch for the plain module {name} to be a pair (inputs, targets), but "
        f"received {kind or type(batch).__name__}. Yield (inputs, targets) from the loader, or "
        "use a ppetrace.ModuleInterface for other batch layouts."
    )


class PlainAdapter(Adapter):
    """A plain ``nn.Module``: ``loss = loss_fn(module(inputs), targets)``.

    Its outputs are ``(loss, preds)``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        optimizer: Any = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        schedulers: Iterable[Any] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(module, **kwargs)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.schedulers = list(schedulers)

    @property
    def loss_source(self) -> str:
        return f"loss_fn(preds, targets) for {self.name}"

    def optimizers_schedulers(
        self, steps_per_epoch: int, epochs: int
    ) -> tuple[list[torch.optim.Optimizer], list[Any]]:
        opt = self.optimizer
        if opt is None:
            raise ValueError(
                f"Expected an optimizer to fit the plain module {self.name}, but received None. "
                "Pass optimizer=torch.optim.SGD(model.parameters(), lr=0.1) to fit()."
            )
        if self.loss_fn is None:
            raise ValueError(
                f"Expected a loss_fn to fit the plain module {self.name}, but received None. "
                "Pass loss_fn=torch.nn.functional.cross_entropy (or any callable(preds, "
                "targets) -> scalar tensor) to fit()."
            )
        opts = list(opt) if isinstance(opt, (list, tuple)) else [opt]
        return opts, self.schedulers

    def train_step(
        self, global_step: int, batch: Any, device: Any, attrs: Mapping[str, Any]
    ) -> Any:
        inputs, targets = _plain_pair(batch, self.name)
        preds = self.forward_module(inputs)
        loss = self.loss_fn(preds, targets)  # type: ignore[misc]
        outs = (loss, preds)
        return loss, outs, outs

    def eval_step(
        self, stage: Stage, global_step: int, batch: Any, device: Any, attrs: Mapping[str, Any]
    ) -> tuple[tuple[Any, ...], Any]:
        if isinstance(batch, torch.Tensor):
            outs: tuple[Any, ...] = (self.module(batch),)
            return outs, outs
        inputs, targets = _plain_pair(batch, self.name)
        preds = self.module(inputs)
        outs = (preds,) if self.loss_fn is None else (self.loss_fn(preds, targets), preds)
        return outs, outs


class InterfaceAdapter(Adapter):
    """A :class:`ModuleInterface`: steps through ``module(stage, global_step, batch, device)``."""

    module: ModuleInterface

    def train_loader(self) -> Iterable[Any]:
        if self._train_loader is not None:
            return self._train_loader
        loader = self.module.get_train_dataloader(self.train_sampler, self.batch_size)
        if loader is None:
            raise ValueError(
                f"Expected {self.name}.get_train_dataloader to return a loader, but it returned "
                "None. Return a DataLoader over the training set."
            )
        return loader

    def val_loaders(self) -> Loaders:
        if self._val_loaders is not None:
            return named_loaders(self._val_loaders, "val_loaders")
        return named_loaders(
            self.module.get_val_dataloaders(self.eval_sampler, self.val_batch_size),
            f"{self.name}.get_val_dataloaders()",
        )

    def test_loaders(self) -> Loaders:
        if self._test_loaders is not None:
            return named_loaders(self._test_loaders, "loaders")
        return named_loaders(
            self.module.get_test_dataloaders(self.eval_sampler, self.val_batch_size),
            f"{self.name}.get_test_dataloaders()",
        )

    def optimizers_schedulers(
        self, steps_per_epoch: int, epochs: int
    ) -> tuple[list[torch.optim.Optimizer], list[Any]]:
        result = self.module.get_optimizers_schedulers(steps_per_epoch, epochs)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise TypeError(
                f"Expected {self.name}.get_optimizers_schedulers to return (optimizers, "
                f"schedulers), but it returned {type(result).__name__}. Return e.g. "
                "([optimizer], [])."
            )
        opts, scheds = result
        opts = [opts] if isinstance(opts, torch.optim.Optimizer) else list(opts or ())
        scheds = (
            [] if scheds is None else list(scheds) if isinstance(scheds, Iterable) else [scheds]
        )
        if not opts:
            raise ValueError(
                f"Expected at least one optimizer from {self.name}.get_optimizers_schedulers, "
                "but it returned none."
            )
        return opts, scheds

    def train_step(
        self, global_step: int, batch: Any, device: Any, attrs: Mapping[str, Any]
    ) -> Any:
        # PyMarlin passes the step this batch contributes to: completed + 1
        # (pymarlin/core/trainer_backend.py, SingleProcess._forward_backward)
        raw = self.forward_module(Stage.TRAIN, global_step + 1, batch, device)
        if isinstance(raw, torch.Tensor):
            return raw, (raw,), raw
        outs = as_outputs(raw)
        return (outs[0] if outs else raw), outs, raw

    def eval_step(
        self, stage: Stage, global_step: int, batch: Any, device: Any, attrs: Mapping[str, Any]
    ) -> tuple[tuple[Any, ...], Any]:
        raw = self.module(stage, global_step, batch, device)
        return as_outputs(raw), raw

    def get_state(self) -> Any:
        return self.module.get_state()

    def update_state(self, state: Any) -> None:
        self.module.update_state(state)


class _DeferredOptimizer:
    """An optimizer as seen by a network's ``closure``: ``step``/``zero_grad`` are the Trainer's.

    Everything else (``param_groups``, ``state``, ...) is the real optimizer's.
    """

    __slots__ = ("optimizer",)

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self, closure: Any = None) -> None:
        """Deferred: the Trainer steps at the accumulation boundary."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Deferred: the Trainer zeroes the gradients after stepping."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class _ScaledOptimizer:
    """An optimizer stepped inside a closure through the Trainer's ``GradScaler``.

    ``step()`` is ``scaler.step(optimizer)``; everything else is the real optimizer's.
    """

    __slots__ = ("optimizer", "scaler")

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        self.optimizer = optimizer
        self.scaler = scaler

    def step(self, closure: Any = None) -> Any:
        """``scaler.step(optimizer)``: unscale, skip on inf/NaN gradients, else step."""
        if closure is not None:
            raise ValueError(
                "Expected optimizer.step() without a closure under AMP with a GradScaler, but "
                "received one. torch's GradScaler.step does not take closures."
            )
        return self.scaler.step(self.optimizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class NetworkAdapter(Adapter):
    """An :class:`AbstractPyTorchNetwork`: ``prepare_batch`` then ``closure`` each step.

    ``optimizers`` and ``losses`` are dicts (one object becomes ``{"default": obj}``).
    The outputs for callbacks are the closure's predictions. With one
    optimizer the closure's ``step``/``zero_grad`` are deferred to the
    Trainer; with several they run in place (see :mod:`ppetrace.interfaces.network`).
    """

    backward_in_step = True
    module: AbstractPyTorchNetwork

    def __init__(
        self,
        module: AbstractPyTorchNetwork,
        *,
        optimizer: Any = None,
        loss_fn: Any = None,
        metrics: Mapping[str, Callable[..., Any]] | None = None,
        schedulers: Iterable[Any] = (),
        fold: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(module, **kwargs)
        self.optimizers = self._as_dict(optimizer)
        self.losses = self._as_dict(loss_fn)
        self.metrics = dict(metrics or {})
        self.schedulers = list(schedulers)
        self.fold = fold
        self.steps_in_closure = len(self.optimizers) > 1
        self._closure_optimizers: dict[str, Any] = self._wrap(None)
        #: set by the Trainer: loss -> context manager yielding the loss to backward
        self.scaling: Callable[[torch.Tensor], contextlib.AbstractContextManager[Any]] | None = None
        #: set by :meth:`use_runtime`: (tensor, device) -> tensor, the runtime's move
        self.move: Callable[[torch.Tensor, Any], torch.Tensor] | None = None

    @staticmethod
    def _as_dict(value: Any) -> dict[str, Any]:
        if value is None:
            return {}
        if isinstance(value, Mapping):
            return dict(value)
        return {"default": value}

    def _wrap(self, scaler: torch.amp.GradScaler | None) -> dict[str, Any]:
        if not self.steps_in_closure:
            return {k: _DeferredOptimizer(v) for k, v in self.optimizers.items()}
        if scaler is None:
            return dict(self.optimizers)
        return {k: _ScaledOptimizer(v, scaler) for k, v in self.optimizers.items()}

    def bind(
        self,
        scaling: Callable[[torch.Tensor], contextlib.AbstractContextManager[Any]],
        scaler: torch.amp.GradScaler | None,
    ) -> None:
        """Attach a fit's loss scaling and GradScaler."""
        self.scaling = scaling
        self._closure_optimizers = self._wrap(scaler)

    def use_runtime(self, runtime: BaseRuntime) -> None:
        """Move ``prepare_batch``'s tensors with ``runtime.move_tensor`` when they go to its
        device (a CPU tensor bound for a ``PyTorchRuntime``'s CPU is not moved at all)."""
        spec = runtime.device_spec
        move_tensor = runtime.move_tensor
        stays = (
            isinstance(runtime, PyTorchRuntime)
            and runtime.device_type == "cpu"
            and type(runtime).move_tensor is PyTorchRuntime.move_tensor
        )

        def move(tensor: torch.Tensor, device: Any) -> torch.Tensor:
            if device is spec or device == spec:
                if stays and tensor.is_cpu:
                    return tensor
                return move_tensor(tensor)
            return tensor.to(device)

        self.move = move

    @contextlib.contextmanager
    def active(self, scaling: Any) -> Iterator[None]:
        """Around the steps of a fit or an evaluation: ``scale_loss`` uses ``scaling`` (the
        fit's ``network_backward``; ``None`` yields the loss unchanged) and
        ``prepare_batch`` moves tensors through the runtime (:meth:`use_runtime`)."""
        move = _ACTIVE_MOVE.set(self.move)
        scale = _ACTIVE_SCALING.set(scaling)
        try:
            yield
        finally:
            _ACTIVE_SCALING.reset(scale)
            _ACTIVE_MOVE.reset(move)

    def optimizers_schedulers(
        self, steps_per_epoch: int, epochs: int
    ) -> tuple[list[torch.optim.Optimizer], list[Any]]:
        if not self.optimizers:
            raise ValueError(
                f"Expected optimizers to fit the network {self.name}, but received None. Pass "
                "optimizer={'default': torch.optim.Adam(net.parameters())} to fit()."
            )
        if not self.losses:
            raise ValueError(
                f"Expected losses to fit the network {self.name}, but received None. Pass "
                "loss_fn={'ce': torch.nn.CrossEntropyLoss()} to fit()."
            )
        return list(self.optimizers.values()), self.schedulers

    def named_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        return dict(self.optimizers)

    def train_step(
        self, global_step: int, batch: Any, device: Any, attrs: Mapping[str, Any]
    ) -> Any:
        # inside active(): prepare_batch moves through the runtime, scale_loss is the
        # Trainer's (set once per fit, not per step)
        net = self.module
        with trace("network.prepare_batch", attrs):
            data = net.prepare_batch(batch, device, device)
        with trace("network.closure", attrs):
            # as delira's trainer calls it (delira/training/base_trainer.py, _train_single_epoch)
            # under DDP the closure gets the wrapper, whose forward all-reduces gradients
            model: Any = self.forward_module
            raw = net.closure(
                model,
                data,
                optimizers=self._closure_optimizers,
                losses=self.losses,
                metrics=self.metrics,
                fold=self.fold,
                batch_nr=attrs["ppetrace.batch_idx"],
            )
        return None, as_outputs(raw[2]), raw

    def eval_step(
        self, stage: Stage, global_step: int, batch: Any, device: Any, attrs: Mapping[str, Any]
    ) -> tuple[tuple[Any, ...], Any]:
        net = self.module
        with trace("network.prepare_batch", attrs):
            data = net.prepare_batch(batch, device, device)
        with trace("network.closure", attrs):
            raw = net.closure(
                net,
                data,
                optimizers={},
                losses=self.losses,
                metrics=self.metrics,
                fold=self.fold,
                batch_nr=attrs["ppetrace.batch_idx"],
            )
        return as_outputs(raw[2]), raw


def make_adapter(module: Any, **kwargs: Any) -> Adapter:
    """The adapter for ``module``'s kind; keyword arguments that do not apply are rejected.

    A ``DistributedDataParallel`` wrapper is seen through: the adapter is the wrapped
    module's, and the training step calls the wrapper (``adapter.ddp``).
    """
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        adapter = make_adapter(module.module, **kwargs)
        adapter.ddp = adapter.forward_module = module
        return adapter
    if isinstance(module, ModuleInterface):
        for key in ("optimizer", "loss_fn", "metrics"):
            if kwargs.pop(key, None) is not None:
                raise ValueError(
                    f"Expected no {key} for the ModuleInterface {type(module).__name__}: it "
                    f"supplies its own, but received one. Return optimizers from "
                    "get_optimizers_schedulers() and compute the loss in train_step()."
                )
        schedulers = kwargs.pop("schedulers", ())
        if schedulers:
            raise ValueError(
                f"Expected no schedulers for the ModuleInterface {type(module).__name__}, but "
                "received some. Return them from get_optimizers_schedulers()."
            )
        _no_fold(module, kwargs)
        return InterfaceAdapter(module, **kwargs)
    if isinstance(module, AbstractPyTorchNetwork):
        return NetworkAdapter(module, **kwargs)
    if isinstance(module, torch.nn.Module):
        if kwargs.pop("metrics", None) is not None:
            raise ValueError(
                f"Expected no metrics for the plain module {type(module).__name__}, but received "
                "some. Compute metrics in a callback, or use an AbstractPyTorchNetwork."
            )
        _no_fold(module, kwargs)
        return PlainAdapter(module, **kwargs)
    raise TypeError(
        "Expected a ppetrace.ModuleInterface, a ppetrace.AbstractPyTorchNetwork or a "
        f"torch.nn.Module, but received {type(module).__name__}."
    )


def _no_fold(module: Any, kwargs: dict[str, Any]) -> None:
    fold = kwargs.pop("fold", 0)
    if fold:
        raise ValueError(
            f"Expected fold only for an AbstractPyTorchNetwork (its closure receives it), but "
            f"received fold={fold!r} for {type(module).__name__}. Leave fold at 0."
        )
