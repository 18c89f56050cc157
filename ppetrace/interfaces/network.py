"""The delira network API: :class:`AbstractPyTorchNetwork`, :class:`DataParallelPyTorchNetwork`
and :func:`scale_loss`.

A network trains through its static ``closure``: forward, losses, backward
inside :func:`scale_loss`, optimizer step. Under :class:`ppetrace.Trainer`,
which calls ``closure(model, data_dict, optimizers=..., losses=...,
metrics=..., fold=..., batch_nr=...)`` as delira's trainer does:

- ``prepare_batch`` and ``closure`` run inside ``network.prepare_batch`` and
  ``network.closure`` spans (both nested in ``module.train_step``);
  ``prepare_batch``'s moves go through the Trainer's runtime
  (``move_tensor``), so a custom device type works;
- the backward pass written inside ``with scale_loss(loss, ...) as scaled:``
  is the ``trainer.backward`` span; the loss is divided by the size of the
  accumulation group and scaled by the Trainer's active ``GradScaler``;
- with **one** optimizer, ``optimizer.step()`` and ``optimizer.zero_grad()``
  called inside ``closure`` are deferred to the Trainer, which steps at each
  accumulation boundary (after clipping, through the ``GradScaler``) in the
  ``trainer.optimizer_step`` span;
- with **several** optimizers (a GAN), the closure's ``step()`` and
  ``zero_grad()`` calls run in place, in the closure's order, as in delira:
  the generator sees the discriminator's updated weights. Each ``step()``
  goes through the ``GradScaler`` when AMP uses one (one scaler for all
  optimizers, updated once per training step, as torch documents for
  several optimizers); the Trainer does not zero the gradients. Gradient
  accumulation above 1 and ``clip_grad_norm`` cannot apply to steps taken
  inside the closure, so ``fit`` rejects them with ``ValueError``.

Outside a Trainer, :func:`scale_loss` yields the loss unchanged.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

import torch

__all__ = ["AbstractPyTorchNetwork", "DataParallelPyTorchNetwork", "scale_loss"]

# The Trainer's loss scaling for the network being trained: a callable that
# takes the loss and returns a context manager yielding the loss to backward.
_ACTIVE_SCALING: ContextVar[Callable[[torch.Tensor], contextlib.AbstractContextManager[Any]] | None]
_ACTIVE_SCALING = ContextVar("ppetrace_active_scaling", default=None)
# The Trainer's runtime move for the network being trained: (tensor, device) -> tensor.
_ACTIVE_MOVE: ContextVar[Callable[[torch.Tensor, Any], torch.Tensor] | None]
_ACTIVE_MOVE = ContextVar("ppetrace_active_move", default=None)


def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    **kwargs: Any,
) -> contextlib.AbstractContextManager[torch.Tensor]:
    """A context manager yielding the loss to call ``backward()`` on: scaled when a
    GradScaler is active.

    Inside a :class:`ppetrace.Trainer` fit the yielded loss is divided by
    the accumulation group size and scaled by the Trainer's
    ``torch.amp.GradScaler`` (when AMP uses one); the block is traced as
    ``trainer.backward`` and ``on_end_backward`` callbacks run when it exits.
    Anywhere else the loss is yielded unchanged. ``optimizers``, ``loss_id``,
    ``model``, ``delay_unscale`` and ``kwargs`` are accepted for delira
    compatibility and unused: the Trainer unscales before clipping and stepping.
    """
    active = _ACTIVE_SCALING.get()
    if active is None:
        return _Unscaled(loss)
    return active(loss)


class _Unscaled:
    """``scale_loss`` outside a Trainer: yields the loss itself."""

    __slots__ = ("loss",)

    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss

    def __enter__(self) -> torch.Tensor:
        return self.loss

    def __exit__(self, *exc_info: object) -> None:
        return None


def _to_tensor(value: Any) -> Any:
    """A tensor for arrays and numbers (floating point as ``torch.float``); others unchanged."""
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            return value
    if value.is_floating_point() and value.dtype is not torch.float32:
        value = value.to(torch.float32)  # delira: .to(torch.float)
    return value


def _move(value: torch.Tensor, device: Any) -> torch.Tensor:
    move = _ACTIVE_MOVE.get()
    if move is None:
        return value.to(device)
    return move(value, device)


class AbstractPyTorchNetwork(torch.nn.Module, ABC):
    """Base class of delira-style networks: ``forward`` plus a static training ``closure``.

    Keyword arguments given to ``__init__`` are recorded and returned by
    :attr:`init_kwargs`. Subclasses implement :meth:`forward`; they may
    override :meth:`closure` and :meth:`prepare_batch`, which are static.
    ``forward`` may return a tensor or, as delira's networks do, a dict of
    predictions with the main one under ``"pred"``.
    """

    #: The init kwargs; the class attribute is delira's (each instance gets its own dict).
    _init_kwargs: dict[str, Any] = {}  # noqa: RUF012 - delira's class attribute

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._init_kwargs = dict(kwargs)

    @abstractmethod
    def forward(self, *inputs: Any) -> Any:
        """Forward the inputs through the network (defines its behaviour)."""

    @property
    def init_kwargs(self) -> dict[str, Any]:
        """The keyword arguments the network was built with."""
        return dict(self._init_kwargs)

    @staticmethod
    def closure(
        model: AbstractPyTorchNetwork,
        data_dict: dict[str, Any],
        optimizers: Mapping[str, Any],
        losses: Mapping[str, Callable[..., torch.Tensor]] = {},
        metrics: Mapping[str, Callable[..., Any]] = {},
        fold: int = 0,
        **kwargs: Any,
    ) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """One step: forward ``data_dict["data"]``, losses and metrics of the prediction
        against ``data_dict["label"]``, then (when ``optimizers`` is not empty) backward
        inside :func:`scale_loss` and a step of ``optimizers["default"]``.

        As in delira, the prediction is ``preds["pred"]`` when ``forward``
        returns a dict (else the output itself). Returns ``(metric_values,
        loss_values, predictions)``: dicts keyed like ``metrics`` and
        ``losses`` (with empty ``optimizers``, validation, the keys get delira's
        ``"val_"`` prefix; the values are detached tensors, where delira calls
        ``.item()``, so no device sync happens here), and the predictions:
        the dict of detached outputs for a dict ``forward``, else a list
        holding the detached output. With empty ``optimizers`` nothing is
        back-propagated. ``kwargs`` takes what the Trainer adds (``batch_nr``).

        Raises ``AssertionError`` when ``optimizers`` is given without losses
        or without a ``"default"`` optimizer.
        """
        if optimizers:
            assert losses, "Expected at least one loss to back-propagate, but losses is empty."
            assert "default" in optimizers, (
                "Expected an optimizer named 'default' in optimizers, but received "
                f"{', '.join(map(repr, optimizers))}."
            )
        label = data_dict.get("label")
        with torch.enable_grad() if optimizers else torch.no_grad():
            preds = model(data_dict["data"])
            pred = preds["pred"] if isinstance(preds, Mapping) else preds
            loss_vals: dict[str, Any] = {}
            total: torch.Tensor | None = None
            for key, loss_fn in losses.items():
                value = loss_fn(pred, label)
                loss_vals[key] = value.detach()
                total = value if total is None else total + value
        with torch.no_grad():
            metric_vals = {key: _detach(fn(pred, label)) for key, fn in metrics.items()}
        if optimizers and total is not None:
            optimizer = optimizers["default"]
            optimizer.zero_grad()
            with scale_loss(total, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
        elif not optimizers:
            loss_vals = {f"val_{key}": value for key, value in loss_vals.items()}
            metric_vals = {f"val_{key}": value for key, value in metric_vals.items()}
        if isinstance(preds, Mapping):
            return metric_vals, loss_vals, {key: _detach(v) for key, v in preds.items()}
        return metric_vals, loss_vals, [_detach(preds)]

    @staticmethod
    def prepare_batch(
        batch: Any, input_device: torch.device | str, output_device: torch.device | str
    ) -> dict[str, Any]:
        """Return the batch as a dict of tensors, ``"data"`` on ``input_device`` and the rest
        on ``output_device``.

        ``batch`` is a dict (NumPy arrays, tensors and numbers become tensors)
        or a ``(data, label)`` pair. As delira's ``.to(torch.float)``,
        floating-point values become ``torch.float32`` (float64 NumPy data
        trains a float32 network); integer and bool values keep their dtype
        (delira makes them float32 too), so class labels stay ``int64`` for
        cross-entropy. Under the Trainer the moves go through its runtime.
        """
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            batch = {"data": batch[0], "label": batch[1]}
        if not isinstance(batch, Mapping):
            raise TypeError(
                "Expected a dict batch (with a 'data' key) or a (data, label) pair for "
                f"prepare_batch, but received {type(batch).__name__}. Yield dicts from the "
                "loader or override prepare_batch."
            )
        out: dict[str, Any] = {}
        for key, value in batch.items():
            value = _to_tensor(value)
            if isinstance(value, torch.Tensor):
                value = _move(value, input_device if key == "data" else output_device)
            out[key] = value
        return out


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


class DataParallelPyTorchNetwork(AbstractPyTorchNetwork, torch.nn.DataParallel):
    """Wraps an :class:`AbstractPyTorchNetwork` in ``torch.nn.DataParallel``.

    Batches are split across ``device_ids``; with a single device, or on a
    machine without CUDA, the wrapped network simply runs as is. ``closure``,
    ``prepare_batch`` and ``init_kwargs`` are those of the wrapped network.
    """

    def __init__(
        self,
        module: AbstractPyTorchNetwork,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
    ) -> None:
        if not isinstance(module, AbstractPyTorchNetwork):
            raise TypeError(
                "Expected an AbstractPyTorchNetwork to wrap, but received "
                f"{type(module).__name__}. Subclass ppetrace.AbstractPyTorchNetwork."
            )
        torch.nn.DataParallel.__init__(self, module, device_ids, output_device, dim)
        self._init_kwargs = {}

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Scatter the inputs over the devices, run the replicas and gather the outputs."""
        return torch.nn.DataParallel.forward(self, *inputs, **kwargs)

    @property
    def closure(self) -> Callable[..., Any]:  # type: ignore[override]
        """The wrapped network's ``closure``."""
        return self.module.closure

    @property
    def prepare_batch(self) -> Callable[..., Any]:  # type: ignore[override]
        """The wrapped network's ``prepare_batch``."""
        return self.module.prepare_batch

    @property
    def init_kwargs(self) -> dict[str, Any]:
        """The wrapped network's ``init_kwargs``."""
        return self.module.init_kwargs
