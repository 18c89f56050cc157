"""The optimization policy of a run: accumulation, clipping, AMP loss scaling, schedulers.

:class:`Optimization` owns the optimizers, the schedulers and the
``GradScaler`` of one ``fit``. The Trainer asks it to run a backward pass
(dividing the loss by the size of the accumulation group and scaling it for
AMP) and, at each accumulation boundary, to step: unscale, clip by norm,
step every optimizer, update the scaler, zero the gradients and step the
per-step schedulers. Per-epoch schedulers step in :meth:`Optimization.end_epoch`.

When the optimizers step inside a delira closure (several optimizers, a
GAN), the boundary only updates the ``GradScaler`` and steps the schedulers.
:func:`estimated_global_steps_per_epoch` is PyMarlin's step estimate.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "Optimization",
    "SchedulerInterval",
    "check_positive_int",
    "estimated_global_steps_per_epoch",
    "world_size",
]


class SchedulerInterval(enum.Enum):
    """When schedulers step: after every optimizer step, or at the end of each epoch."""

    STEP = "step"
    EPOCH = "epoch"


def check_positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a positive int (or ``None`` when allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"Expected {what} for {name}, but received {value!r}.")


def check_clip(value: Any) -> float | None:
    """Validate ``clip_grad_norm``: ``None`` or a finite number > 0."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"Expected a positive finite number or None for clip_grad_norm, but received "
            f"{value!r}. Pass e.g. clip_grad_norm=1.0, or None to disable clipping."
        )
    return float(value)


def world_size() -> int:
    """The number of processes training together: torch.distributed's world size when it
    is initialized, else 1."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def estimated_global_steps_per_epoch(
    batches: int | None,
    grad_accumulation: int,
    *,
    world_size: int = 1,
    max_train_steps_per_epoch: int | None = None,
) -> int:
    """PyMarlin's estimate of the optimizer steps in one epoch, for ``get_optimizers_schedulers``.

    ``batches // (world_size * grad_accumulation) + 1`` (PyMarlin,
    ``core/trainer.py``, ``estimated_global_steps_per_epoch``), capped by
    ``max_train_steps_per_epoch``. ``batches`` is the training loader's
    length; a loader without one gives the cap, or 1.
    """
    if batches is None:
        return max_train_steps_per_epoch or 1
    steps = batches // (world_size * grad_accumulation) + 1
    if max_train_steps_per_epoch:
        steps = min(steps, max_train_steps_per_epoch)
    return steps


class Optimization:
    """Optimizers, schedulers and the GradScaler of a run, and how they step.

    Args:
        optimizers: the optimizers; all of them step at each boundary.
        schedulers: LR schedulers (anything with ``step()``); they step after
            every optimizer step or at each epoch end, per ``interval``.
        clip_grad_norm: clip the total gradient norm of every optimized
            parameter to this value before stepping (``None``: no clipping).
        scaler: a ``torch.amp.GradScaler`` for float16 AMP, or ``None``.
        interval: when the schedulers step.
        steps_in_closure: the optimizers step inside a network's closure; then
            :meth:`step` only updates the scaler and steps the schedulers.
    """

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any] = (),
        *,
        clip_grad_norm: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
        interval: SchedulerInterval = SchedulerInterval.STEP,
        steps_in_closure: bool = False,
    ) -> None:
        self.optimizers = list(optimizers)
        self.steps_in_closure = steps_in_closure
        self.schedulers = list(schedulers)
        self.clip_grad_norm = clip_grad_norm
        self.scaler = scaler
        self.interval = interval
        self._step_schedulers = self.schedulers if interval is SchedulerInterval.STEP else []
        self._params: list[torch.Tensor] = []
        seen: set[int] = set()
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in seen:
                        seen.add(id(p))
                        self._params.append(p)
        #: whether gradients were accumulated since the last step
        self.pending = False

    def backward(self, loss: torch.Tensor, divisor: int = 1) -> torch.Tensor:
        """Back-propagate ``loss / divisor``, scaled by the GradScaler when there is one.

        Returns ``loss / divisor`` (what ``on_end_backward`` receives).
        """
        if divisor != 1:
            loss = loss / divisor
        scaler = self.scaler
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        self.pending = True
        return loss

    def scaled(self, loss: torch.Tensor, divisor: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss / divisor, that scaled by the GradScaler)``: the caller back-propagates the
        second."""
        if divisor != 1:
            loss = loss / divisor
        scaler = self.scaler
        self.pending = True
        return loss, (loss if scaler is None else scaler.scale(loss))

    def step(self) -> None:
        """Unscale, clip, step every optimizer, update the scaler, zero grads, step schedulers.

        With ``steps_in_closure``, only the scaler update and the schedulers.
        """
        scaler = self.scaler
        if self.steps_in_closure:
            if scaler is not None:
                scaler.update()
        elif scaler is None:
            if self.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self._params, self.clip_grad_norm)
            for opt in self.optimizers:
                opt.step()
        else:
            if self.clip_grad_norm is not None:
                for opt in self.optimizers:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(self._params, self.clip_grad_norm)
            for opt in self.optimizers:
                scaler.step(opt)
            scaler.update()
        if not self.steps_in_closure:
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
        for sched in self._step_schedulers:
            sched.step()
        self.pending = False

    def stepper(self) -> Callable[[], None]:
        """:meth:`step`, or an equivalent with fewer tests for the common case of one
        optimizer without clipping, GradScaler or per-step schedulers (the loop calls it
        once per optimizer step)."""
        if (
            len(self.optimizers) != 1
            or self.steps_in_closure
            or self.scaler is not None
            or self.clip_grad_norm is not None
            or self._step_schedulers
        ):
            return self.step
        opt = self.optimizers[0]
        step, zero_grad = opt.step, opt.zero_grad

        def step_one() -> None:
            step()
            zero_grad(set_to_none=True)
            self.pending = False

        return step_one

    def zero_grad(self) -> None:
        """Clear every optimized parameter's gradient."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.pending = False

    def end_epoch(self) -> None:
        """Step the per-epoch schedulers."""
        if self.interval is SchedulerInterval.EPOCH:
            for sched in self.schedulers:
                sched.step()

    # -- checkpoint state ------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The optimizers', schedulers' and scaler's state dicts."""
        return {
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "schedulers": [s.state_dict() for s in self.schedulers if hasattr(s, "state_dict")],
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the counts of optimizers and schedulers must match."""
        opts = list(state["optimizers"])
        scheds = list(state["schedulers"])
        with_state = [s for s in self.schedulers if hasattr(s, "load_state_dict")]
        if len(opts) != len(self.optimizers) or len(scheds) != len(with_state):
            raise ValueError(
                f"Expected {len(opts)} optimizer(s) and {len(scheds)} scheduler(s) as in the "
                f"checkpoint, but this run has {len(self.optimizers)} and {len(with_state)}. "
                "Resume with the same optimizers and schedulers."
            )
        for opt, opt_state in zip(self.optimizers, opts, strict=True):
            opt.load_state_dict(opt_state)
        for sched, sched_state in zip(with_state, scheds, strict=True):
            sched.load_state_dict(sched_state)
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])


def as_list(value: Any, what: str) -> list[Any]:
    """``None`` -> ``[]``, one object -> ``[obj]``, a mapping -> its values, an iterable -> list."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, torch.optim.Optimizer) or hasattr(value, "step"):
        return [value]
    if isinstance(value, Iterable):
        return list(value)
    raise TypeError(f"Expected {what} or an iterable of them, but received {type(value).__name__}.")
