"""The PyMarlin module interface: :class:`Stage`, :class:`CallbackInterface` and
:class:`ModuleInterface`.

A :class:`ModuleInterface` is a ``torch.nn.Module`` that also supplies its own
data loaders, optimizers and schedulers and the recipes of a training,
validation and test step; :class:`ppetrace.Trainer` drives it. It is also a
:class:`CallbackInterface`, so it receives every callback hook of the run.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["CallbackInterface", "ModuleInterface", "Stage"]


class Stage(enum.Enum):
    """Stages of a run: train, val, test.

    The values are PyMarlin's (``Stage(1) is Stage.TRAIN``); :attr:`label`
    (``"train"``, ``"val"``, ``"test"``) is the ``ppetrace.stage`` span
    attribute, and ``Stage("val")`` also looks a stage up by its label.
    """

    TRAIN = 1
    VAL = 2
    TEST = 3

    @property
    def label(self) -> str:
        """The stage's name in lower case: the ``ppetrace.stage`` span attribute."""
        return _LABELS[self]

    @classmethod
    def _missing_(cls, value: object) -> Stage | None:
        if isinstance(value, str):
            return _BY_LABEL.get(value.strip().lower())
        return None


_LABELS = {stage: stage.name.lower() for stage in Stage}
_BY_LABEL = {label: stage for stage, label in _LABELS.items()}


class CallbackInterface(ABC):  # noqa: B024 - every hook is an optional, documented no-op
    """Hooks called by :class:`ppetrace.Trainer` during training; all are no-ops here.

    Override only the hooks you need. The Trainer checks once, before the
    run, which hooks a callback overrides: a hook that is not overridden is
    never called and gets no span, and step outputs are collated (detached,
    copied to the CPU, concatenated on dim 0) only when some callback
    overrides a hook that receives them. Each call runs inside a
    ``callback.<hook>`` span.
    """

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:  # noqa: B027
        """Called at the start of each training epoch, before the first batch is fetched.

        ``global_step`` is the number of optimizer steps completed so far and
        ``epoch`` the zero-based epoch that begins.
        """

    def on_end_train_step(self, global_step: int, *train_step_collated_outputs: Any) -> None:  # noqa: B027
        """Called after each optimizer step, with ``global_step`` already incremented.

        ``train_step_collated_outputs`` holds one collated item per output of
        ``train_step``, over the batches of this accumulation group: if
        ``train_step`` returns ``loss, logits`` this is ``(losses, logits)``. A
        dict output (a delira network's predictions) is collated key by key.
        """

    def on_end_train_epoch(self, global_step: int, *train_step_collated_outputs: Any) -> None:  # noqa: B027
        """Called at the end of each training epoch with the epoch's collated step outputs.

        The outputs kept for this hook are bounded by the Trainer's
        ``max_collated_bytes``; beyond it the oldest steps are dropped.
        """

    def on_end_backward(self, global_step: int, loss_tensor: torch.Tensor) -> None:  # noqa: B027
        """Called after each backward pass with the loss that was back-propagated.

        As in PyMarlin, ``loss_tensor`` is the step's loss divided by the
        gradient accumulation (the size of the accumulation group; a partial
        last group divides by its own size), not detached, and not scaled by
        a ``GradScaler``; ``global_step`` is the number of optimizer steps
        completed.
        """

    def on_end_val_epoch(  # noqa: B027
        self, global_step: int, *val_step_collated_outputs: Any, key: str = "default"
    ) -> None:
        """Called once per named validation loader with that loader's collated outputs.

        ``key`` is the loader's name (``"default"`` for a single loader).
        """

    def on_end_train(self, global_step: int) -> None:  # noqa: B027
        """Called once when training finishes, after the runtime's ``train_cleanup``."""


class ModuleInterface(torch.nn.Module, CallbackInterface):
    """A ``torch.nn.Module`` with its data, optimizers and step recipes, as in PyMarlin.

    Subclasses implement :meth:`get_optimizers_schedulers`,
    :meth:`get_train_dataloader`, :meth:`get_val_dataloaders`,
    :meth:`train_step` and :meth:`val_step`; a subclass missing one of them
    cannot be instantiated (``TypeError``). :meth:`forward` is overridden to
    dispatch on the :class:`Stage`, and every :class:`CallbackInterface`
    hook may be overridden too.
    """

    @abstractmethod
    def get_optimizers_schedulers(
        self, estimated_global_steps_per_epoch: int, epochs: int
    ) -> tuple[Iterable[torch.optim.Optimizer], Iterable[Any]]:
        """Return ``(optimizers, schedulers)``; schedulers may be empty.

        ``estimated_global_steps_per_epoch`` is PyMarlin's estimate of the
        optimizer steps per epoch: ``len(train loader) // (world size *
        gradient accumulation) + 1``, capped by the Trainer's
        ``max_train_steps_per_epoch``; ``epochs`` is ``max_epochs``.
        """

    @abstractmethod
    def get_train_dataloader(
        self, sampler: type[torch.utils.data.Sampler[Any]], batch_size: int
    ) -> Iterable[Any]:
        """Return the training loader; called once per epoch.

        ``sampler`` is a sampler *class* (``RandomSampler``): build it on your
        dataset, e.g. ``DataLoader(ds, batch_size=batch_size, sampler=sampler(ds))``.
        """

    @abstractmethod
    def get_val_dataloaders(
        self, sampler: type[torch.utils.data.Sampler[Any]], batch_size: int
    ) -> Mapping[str, Iterable[Any]] | Iterable[Any] | None:
        """Return one validation loader, a dict of named loaders, or ``None`` for none.

        Called each time validation runs; ``sampler`` is ``SequentialSampler``.
        The names are passed to ``on_end_val_epoch`` as ``key``.
        """

    def get_test_dataloaders(
        self, sampler: type[torch.utils.data.Sampler[Any]], batch_size: int
    ) -> Mapping[str, Iterable[Any]] | Iterable[Any] | None:
        """Return the test loader(s) for :meth:`ppetrace.Trainer.test`; ``None`` by default."""
        return None

    def forward(
        self, stage: Stage, global_step: int, batch: Any, device: torch.device | str | int
    ) -> Any:
        """Dispatch to :meth:`train_step`, :meth:`val_step` or :meth:`test_step` by ``stage``.

        Raises ``AttributeError`` for anything that is not a :class:`Stage`.
        """
        if stage is Stage.TRAIN:
            return self.train_step(global_step, batch, device)
        if stage is Stage.VAL:
            return self.val_step(global_step, batch, device)
        if stage is Stage.TEST:
            return self.test_step(global_step, batch, device)
        raise AttributeError(
            f"Expected a ppetrace.Stage (TRAIN, VAL or TEST) for stage, but received {stage!r}."
        )

    @abstractmethod
    def train_step(
        self, global_step: int, batch: Any, device: torch.device | str | int
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run one training forward pass and return the loss, or a tuple whose first item is it.

        The loss must be a scalar tensor; the Trainer runs backward and the
        optimizer step. As in PyMarlin, ``global_step`` is the step this batch
        contributes to (optimizer steps completed + 1). The batch has already
        been moved by the runtime's ``convert_batch``. Other outputs (logits,
        ...) reach the callbacks.
        """

    @abstractmethod
    def val_step(self, global_step: int, batch: Any, device: torch.device | str | int) -> Any:
        """Run one validation step (under ``torch.no_grad``) and return tensors to collect."""

    def test_step(self, global_step: int, batch: Any, device: torch.device | str | int) -> Any:
        """Run one test step (under ``torch.no_grad``); defaults to :meth:`val_step`."""
        return self.val_step(global_step, batch, device)

    def get_state(self) -> dict[str, Any]:
        """Return what to checkpoint; the default is ``self.state_dict()``."""
        return self.state_dict()

    def update_state(self, state: Mapping[str, Any]) -> None:
        """Restore from the output of :meth:`get_state`; the default loads the state dict.

        An empty state is skipped, as in PyMarlin.
        """
        if state:
            self.load_state_dict(state)
