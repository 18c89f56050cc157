"""A PyMarlin module ported to ppetrace: accumulation, clipping, a schedule and callbacks.

The module is written as a PyMarlin user writes it (only the import changes);
ppetrace's Trainer trains it, and :func:`pymarlin_reference` trains a copy
with a plain loop written to PyMarlin's semantics. Parameters, the callbacks'
arguments and the step estimate must match exactly. The rules, in PyMarlin
0.3.6 (github.com/microsoft/PyMarlin at 3d85176), are cited where the loop
applies them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

import ppetrace
from ppetrace import ModuleInterface, Stage  # was: from pymarlin.core.module_interface import ...

GA, EPOCHS, MAX_TRAIN, MAX_VAL, BATCH = 2, 2, 2, 2, 4


class Classifier(ModuleInterface):
    """A PyMarlin scenario: its own data, optimizer, linear decay schedule and callbacks."""

    def __init__(self, samples: int = 24) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
        )
        g = torch.Generator().manual_seed(11)
        self.train_ds = TensorDataset(
            torch.randn(samples, 6, generator=g), torch.randint(0, 3, (samples,), generator=g)
        )
        self.val_ds = {
            "a": TensorDataset(
                torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)
            ),
            "b": TensorDataset(
                torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
            ),
        }
        self.log: list[tuple[Any, ...]] = []

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int) -> Any:
        self.log.append(("estimate", estimated_global_steps_per_epoch, epochs))
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        total = estimated_global_steps_per_epoch * epochs
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / total))
        return [optimizer], [scheduler]

    def get_train_dataloader(self, sampler: type, batch_size: int) -> DataLoader[Any]:
        return DataLoader(self.train_ds, batch_size=batch_size, sampler=sampler(self.train_ds))

    def get_val_dataloaders(self, sampler: type, batch_size: int) -> dict[str, DataLoader[Any]]:
        return {
            k: DataLoader(ds, batch_size=batch_size, sampler=sampler(ds))
            for k, ds in self.val_ds.items()
        }

    def train_step(self, global_step: int, batch: Any, device: Any) -> Any:
        x, y = (t.to(device) for t in batch)
        logits = self.net(x)
        self.log.append(("train_step", global_step))
        return F.cross_entropy(logits, y), logits

    def val_step(self, global_step: int, batch: Any, device: Any) -> Any:
        x, y = (t.to(device) for t in batch)
        logits = self.net(x)
        return F.cross_entropy(logits, y), logits

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        self.log.append(("begin_epoch", global_step, epoch))

    def on_end_backward(self, global_step: int, loss_tensor: torch.Tensor) -> None:
        self.log.append(("end_backward", global_step, loss_tensor.item()))

    def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
        self.log.append(("end_train_step", global_step, *(tuple(o.shape) for o in outputs)))

    def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str = "default") -> None:
        self.log.append(
            ("end_val", global_step, key, outputs[0].mean().item(), tuple(outputs[1].shape))
        )

    def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
        self.log.append(("end_train_epoch", global_step, *(tuple(o.shape) for o in outputs)))

    def on_end_train(self, global_step: int) -> None:
        self.log.append(("end_train", global_step))


def _collate(steps: list[Any]) -> list[torch.Tensor]:
    # pymarlin/core/trainer_backend.py:155-187 (OutputCollector): detach, cpu, cat on dim 0
    return [
        torch.cat([o.detach().reshape(1) if o.dim() == 0 else o.detach() for o in col])
        for col in zip(*steps, strict=True)
    ]


def pymarlin_reference(module: Classifier, *, max_train: int | None, max_val: int | None) -> int:
    """PyMarlin's Trainer + SingleProcess backend as a plain loop; returns the global steps."""
    device = torch.device("cpu")
    # trainer.py:412-431: len(loader) // (world_size * GA) + 1, capped by max_train_steps
    steps_per_epoch = len(module.get_train_dataloader(SequentialSampler, BATCH)) // (1 * GA) + 1
    if max_train:
        steps_per_epoch = min(steps_per_epoch, max_train)
    (optimizer,), (scheduler,) = module.get_optimizers_schedulers(steps_per_epoch, EPOCHS)
    completed = batches = 0
    for epoch in range(EPOCHS):  # trainer.py:148-163
        module.on_begin_train_epoch(completed, epoch)
        module.train()
        epoch_outs: list[Any] = []
        step_outs: list[Any] = []
        steps_this_epoch = 0
        for batch in module.get_train_dataloader(torch.utils.data.RandomSampler, BATCH):
            if max_train and steps_this_epoch >= max_train:  # trainer_backend.py:227-232
                break
            # trainer_backend.py:256-268: global_step = completed + 1; loss / GA;
            # on_end_backward(completed, loss / GA)
            outputs = module.forward(
                stage=Stage.TRAIN, batch=batch, device=device, global_step=completed + 1
            )
            loss = outputs[0] / GA
            loss.backward()
            module.on_end_backward(completed, loss)
            epoch_outs.append(outputs)
            step_outs.append(outputs)
            batches += 1
            if batches % GA == 0:  # trainer_backend.py:248-250: steps on full groups only
                collated = _collate(step_outs)
                step_outs = []
                # trainer_backend.py:282-297 and 318-325: clip (1.0), step, zero_grad, schedule
                torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                completed += 1
                steps_this_epoch += 1
                module.on_end_train_step(completed, *collated)
        module.eval()  # trainer.py:181-197: each named loader, global_step = completed
        for key, loader in module.get_val_dataloaders(SequentialSampler, BATCH).items():
            outs = []
            for i, batch in enumerate(loader):
                if max_val and i >= max_val:  # trainer_backend.py:302-306
                    break
                with torch.no_grad():
                    outs.append(
                        module.forward(
                            stage=Stage.VAL, batch=batch, device=device, global_step=completed
                        )
                    )
            module.on_end_val_epoch(completed, *_collate(outs), key=key)
        module.on_end_train_epoch(completed, *_collate(epoch_outs))
    module.on_end_train(completed)  # trainer.py:169
    return completed


def ported_run(module: Classifier, *, max_train: int | None, max_val: int | None) -> int:
    trainer = ppetrace.Trainer(
        max_epochs=EPOCHS,
        grad_accumulation=GA,
        clip_grad_norm=1.0,  # pymarlin/core/trainer.py:54-55: clip_grads=True, max_grad_norm=1.0
        max_train_steps_per_epoch=max_train,
        max_val_steps_per_epoch=max_val,
        progress=False,
    )
    trainer.fit(module, batch_size=BATCH, val_batch_size=BATCH)
    return trainer.global_step


def pair(samples: int = 24) -> tuple[Classifier, Classifier]:
    torch.manual_seed(0)
    ours = Classifier(samples)
    theirs = Classifier(samples)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _params(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    return (p.detach() for p in module.parameters())


@pytest.mark.parametrize(("max_train", "max_val"), [(None, None), (MAX_TRAIN, MAX_VAL)])
def test_the_ported_module_trains_and_calls_back_exactly_as_on_pymarlin(
    max_train: int | None, max_val: int | None
) -> None:
    ours, theirs = pair()
    torch.manual_seed(1)
    steps = ported_run(ours, max_train=max_train, max_val=max_val)
    torch.manual_seed(1)
    assert pymarlin_reference(theirs, max_train=max_train, max_val=max_val) == steps
    assert steps == EPOCHS * (max_train or 3)
    for got, want in zip(_params(ours), _params(theirs), strict=True):
        assert torch.equal(got, want)
    assert ours.log == theirs.log
    # the counters the issue names, spelled out: [1, 1, 2, 2, ...] and the estimate
    assert [e[1] for e in ours.log if e[0] == "train_step"][:4] == [1, 1, 2, 2]
    assert ours.log[0] == ("estimate", min(24 // BATCH // GA + 1, max_train or 99), EPOCHS)


def test_a_partial_last_group_steps_on_ppetrace_and_carries_over_on_pymarlin() -> None:
    """A deliberate difference (README, "Porting"): 5 batches with accumulation 2 step
    3 times per epoch on ppetrace (the last group alone, as Lightning does); PyMarlin carries
    the odd batch into the next epoch's first group."""
    ours, theirs = pair(samples=20)
    torch.manual_seed(1)
    assert ported_run(ours, max_train=None, max_val=None) == 3 * EPOCHS
    torch.manual_seed(1)
    assert pymarlin_reference(theirs, max_train=None, max_val=None) == 5 * EPOCHS // GA
