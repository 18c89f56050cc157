"""What ported PyMarlin and ppe code relies on: counters, step caps, what runtime hooks see,
and hooks for every placed part of a module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ppetrace
from ppetrace import BaseRuntime, runtime_registry
from ppetrace.training import _optim, _setup


def dataset(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


class Marlin(ppetrace.ModuleInterface):
    """Records the counters PyMarlin hands over."""

    def __init__(self, train: int = 24, val: int = 12, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 3)
        self.lr = lr
        self.train_ds, self.val_ds = dataset(train), dataset(val, 1)
        self.log: list[tuple[Any, ...]] = []

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int) -> Any:
        self.log.append(("estimate", estimated_global_steps_per_epoch))
        return [torch.optim.SGD(self.parameters(), lr=self.lr)], []

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> Any:
        return DataLoader(self.train_ds, batch_size=batch_size)

    def get_val_dataloaders(self, sampler: Any, batch_size: int) -> Any:
        return DataLoader(self.val_ds, batch_size=batch_size)

    def train_step(self, global_step: int, batch: Any, device: Any) -> Any:
        self.log.append(("train_step", global_step))
        return F.cross_entropy(self.lin(batch[0]), batch[1])

    def val_step(self, global_step: int, batch: Any, device: Any) -> Any:
        self.log.append(("val_step", global_step))
        return self.lin(batch[0])

    def on_end_backward(self, global_step: int, loss_tensor: torch.Tensor) -> None:
        self.log.append(("end_backward", global_step, loss_tensor))


def test_train_step_gets_completed_plus_one_and_on_end_backward_the_divided_loss() -> None:
    module = Marlin(train=20, lr=0.0)  # 5 batches of 4, accumulation 2: groups of 2, 2, 1
    weights = [p.detach().clone() for p in module.lin.parameters()]
    ppetrace.Trainer(grad_accumulation=2, val_every_n_epochs=None, progress=False).fit(
        module, batch_size=4
    )
    assert [e[1] for e in module.log if e[0] == "train_step"] == [1, 1, 2, 2, 3]
    backward = [e for e in module.log if e[0] == "end_backward"]
    assert [e[1] for e in backward] == [0, 0, 1, 1, 2]  # completed steps, as PyMarlin
    batches = DataLoader(dataset(20), batch_size=4)
    for (_, _, loss), divisor, (x, y) in zip(backward, [2, 2, 2, 2, 1], batches, strict=True):
        assert loss.requires_grad  # not detached
        expected = F.cross_entropy(F.linear(x, *weights), y) / divisor  # PyMarlin: loss / GA
        assert torch.equal(loss.detach(), expected)


def test_the_step_estimate_is_pymarlins_with_the_world_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    est = _optim.estimated_global_steps_per_epoch
    assert est(6, 2) == 4 and est(7, 2) == 4 and est(6, 2, world_size=2) == 2
    assert est(6, 2, max_train_steps_per_epoch=3) == 3 and est(None, 2) == 1
    assert est(None, 2, max_train_steps_per_epoch=5) == 5
    for world, expected in ((1, 24 // 4 // 2 + 1), (2, 24 // 4 // 4 + 1)):
        monkeypatch.setattr(_setup, "world_size", lambda world=world: world)
        module = Marlin()
        ppetrace.Trainer(grad_accumulation=2, val_every_n_epochs=None, progress=False).fit(
            module, batch_size=4
        )
        assert module.log[0] == ("estimate", expected)


def test_world_size_is_torch_distributed_when_initialized(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _optim.world_size() == 1
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 4)
    assert _optim.world_size() == 4


def test_max_train_and_val_steps_per_epoch_cap_each_epoch() -> None:
    module = Marlin(train=40, val=12)  # 10 train batches, 3 val batches of 4
    trainer = ppetrace.Trainer(
        max_epochs=2,
        grad_accumulation=2,
        max_train_steps_per_epoch=2,
        max_val_steps_per_epoch=2,
        progress=False,
    )
    trainer.fit(module, batch_size=4, val_batch_size=4)
    steps = [e[1] for e in module.log if e[0] == "train_step"]
    assert steps == [1, 1, 2, 2, 3, 3, 4, 4] and trainer.global_step == 4
    assert trainer.epoch == 2 and trainer.batches_seen == 8
    assert [e[1] for e in module.log if e[0] == "val_step"] == [2, 2, 4, 4]
    assert module.log[0] == ("estimate", 2)  # min(10 // 2 + 1, 2)
    module.log.clear()
    trainer.validate(module, batch_size=4)
    assert len([e for e in module.log if e[0] == "val_step"]) == 2
    full = ppetrace.Evaluator(module, batch_size=4, max_batches=None).run()
    assert full["default"][0].shape == (12, 3)


@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_bad_step_caps_are_named(value: Any) -> None:
    for name in ("max_train_steps_per_epoch", "max_val_steps_per_epoch"):
        with pytest.raises(ValueError, match=rf"^Expected a positive int or None for {name}"):
            ppetrace.Trainer(**{name: value})


# -- what runtime hooks see ------------------------------------------------------------

SEEN: list[tuple[Any, ...]] = []


class Watching(BaseRuntime):
    """Records what ppe's hooks read from the trainer, and the batch objects."""

    def initialize_module(self, module: Any, loader_or_batch: Any, optimizer: Any = None) -> None:
        SEEN.append(("init", module, optimizer))

    def train_pre_step(self, trainer: Any, module: Any, batch_idx: int, batch: Any) -> None:
        SEEN.append(("pre", trainer.iteration, trainer.epoch, batch_idx, id(batch)))
        SEEN.append(("attrs", trainer.models, trainer.optimizers))

    def convert_batch(self, args: Any) -> Any:
        return [t.clone() for t in args]  # a new object: post_step must not get it

    def train_post_step(
        self, trainer: Any, module: Any, batch_idx: int, batch: Any, outs: Any
    ) -> None:
        SEEN.append(("post", trainer.iteration, batch_idx, id(batch)))

    def eval_pre_step(self, evaluator: Any, module: Any, batch_idx: int, batch: Any) -> None:
        SEEN.append(("eval_pre", id(batch), set(evaluator.models)))

    def eval_post_step(
        self, evaluator: Any, module: Any, batch_idx: int, batch: Any, outs: Any
    ) -> None:
        SEEN.append(("eval_post", id(batch)))

    def train_epoch_begin(self, module: Any) -> None:
        SEEN.append(("epoch_begin", module))


@pytest.fixture
def watching() -> Iterator[None]:
    SEEN.clear()
    runtime_registry.register("watching", Watching)
    yield
    runtime_registry.unregister("watching")
    SEEN.clear()


def test_hooks_see_ppes_trainer_attributes_and_the_pre_steps_batch(watching: None) -> None:
    net = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    batches = [tuple(t) for t in DataLoader(dataset(8), batch_size=4)]
    val = [tuple(t) for t in DataLoader(dataset(4, 1), batch_size=4)]
    ppetrace.Trainer(device="watching", max_epochs=2, progress=False).fit(
        net, batches, val, optimizer=opt, loss_fn=F.cross_entropy
    )
    pre = [e for e in SEEN if e[0] == "pre"]
    post = [e for e in SEEN if e[0] == "post"]
    assert [e[1:4] for e in pre] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    # ppe counts the iteration after the post-step (pytorch_pfn_extras/training/manager.py:659)
    assert [e[1:3] for e in post] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert [e[4] for e in pre] == [e[3] for e in post] == [id(b) for b in batches] * 2
    models, optimizers = next(e[1:] for e in SEEN if e[0] == "attrs")
    assert models == {"main": net} and optimizers == {"main": opt}
    evals = [e for e in SEEN if e[0].startswith("eval")]
    assert [e[1] for e in evals] == [id(val[0])] * 4 and evals[0][2] == {"main"}
    assert SEEN[0] == ("init", net, opt)


class Parts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(6, 4)
        self.head = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def test_every_placed_part_gets_its_own_runtimes_hooks_as_ppe(watching: None) -> None:
    model = Parts()
    encoder_rt = ppetrace.runtime_of(ppetrace.to(model.encoder, "watching"))
    head_rt = ppetrace.runtime_of(ppetrace.to(model.head, "watching:1"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = ppetrace.Trainer(device="cpu", val_every_n_epochs=None, progress=False)
    trainer.fit(
        model,
        [tuple(t) for t in DataLoader(dataset(4), batch_size=4)],
        optimizer=opt,
        loss_fn=F.cross_entropy,
    )
    assert [e[1:] for e in SEEN if e[0] == "init"] == [(model.encoder, opt), (model.head, opt)]
    assert [e[1] for e in SEEN if e[0] == "epoch_begin"] == [model.encoder, model.head]
    assert len([e for e in SEEN if e[0] == "pre"]) == 2  # one batch, two parts
    # the user's placements are kept: nothing was re-tagged with the Trainer's runtime
    assert ppetrace.runtime_of(model.encoder) is encoder_rt
    assert ppetrace.runtime_of(model.head[1]) is head_rt
    assert "_ppe_runtime" not in model.__dict__
    assert trainer.models == {"main": model}


def test_a_module_placed_whole_gets_the_hooks_once(watching: None) -> None:
    model = ppetrace.to(Parts(), "watching")
    ppetrace.Trainer(device="watching", val_every_n_epochs=None, progress=False).fit(
        model,
        [tuple(t) for t in DataLoader(dataset(4), batch_size=4)],
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=F.cross_entropy,
    )
    assert [e[1] for e in SEEN if e[0] == "init"] == [model]
