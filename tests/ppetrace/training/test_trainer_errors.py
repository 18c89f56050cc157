"""Bad input to the Trainer: a clear error, raised before any work is lost."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ppetrace
from ppetrace import PyTorchRuntime


def loader(n: int = 16) -> DataLoader[tuple[torch.Tensor, ...]]:
    ds = TensorDataset(torch.randn(n, 8), torch.randint(0, 4, (n,)))
    return DataLoader(ds, batch_size=8)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"grad_accumulation": 0},
            r"Expected a positive int for grad_accumulation, but received 0\.",
        ),
        ({"grad_accumulation": 1.5}, r"positive int for grad_accumulation, but received 1\.5\."),
        ({"clip_grad_norm": 0}, r"positive finite number or None for clip_grad_norm, but .* 0\."),
        ({"clip_grad_norm": -1.0}, r"for clip_grad_norm, but received -1\.0\."),
        ({"max_epochs": 0}, r"Expected a positive int for max_epochs, but received 0\."),
        ({"max_steps": 0}, r"positive int or None for max_steps, but received 0\."),
        ({"val_every_n_steps": -2}, r"for val_every_n_steps, but received -2\."),
        (
            {"checkpoint_every_n_steps": 5},
            r"Expected a checkpoint_dir with checkpoint_every_n_steps=5, but received "
            r"checkpoint_dir=None",
        ),
        ({"scheduler_interval": "batch"}, r"'step' or 'epoch' for scheduler_interval, .*'batch'"),
    ],
)
def test_bad_options_raise_value_error(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ppetrace.Trainer(**options)


def test_bad_device_and_callback_types_raise_type_error() -> None:
    with pytest.raises(TypeError, match=r"Expected a device string, .* but received int\."):
        ppetrace.Trainer(device=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Expected each callback .* but callback 1 is str\."):
        ppetrace.Trainer(callbacks=[ppetrace.CallbackInterface(), "x"])


def test_amp_needs_autocast_on_a_runtime_instance() -> None:
    trainer = ppetrace.Trainer(device=PyTorchRuntime("cpu", {}), amp=True, progress=False)
    net = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match=r"runtime with autocast enabled for amp=True"):
        trainer.fit(
            net,
            loader(),
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            loss_fn=F.cross_entropy,
        )


def test_empty_training_loader() -> None:
    net = torch.nn.Linear(8, 4)
    with pytest.raises(
        ValueError,
        match=r"Expected the training loader of Linear to yield at least one batch, but it "
        r"yielded none\. Check the dataset size, batch_size and drop_last\.",
    ):
        ppetrace.Trainer(progress=False).fit(
            net,
            loader(0),
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            loss_fn=F.cross_entropy,
        )


def test_empty_training_loader_without_len() -> None:
    net = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match=r"yielded none in epoch 0\."):
        ppetrace.Trainer(progress=False).fit(
            net,
            iter(list[Any]()),
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            loss_fn=F.cross_entropy,
        )


class Bad(ppetrace.ModuleInterface):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int) -> Any:
        return [torch.optim.SGD(self.parameters(), lr=0.1)], []

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> Any:
        return loader(24)

    def get_val_dataloaders(self, sampler: Any, batch_size: int) -> Any:
        return None

    def train_step(self, global_step: int, batch: Any, device: Any) -> Any:
        losses = F.cross_entropy(self.lin(batch[0]), batch[1], reduction="none")
        return (losses.mean() if global_step == 1 else losses), losses  # PyMarlin: from 1

    def val_step(self, global_step: int, batch: Any, device: Any) -> Any:
        return self.lin(batch[0])


def test_a_train_step_whose_loss_is_not_a_scalar_names_the_module_and_the_step() -> None:
    with pytest.raises(
        ValueError,
        match=r"Expected Bad\.train_step to return a scalar loss tensor \(or a tuple whose first "
        r"item is one\), but at global step 1 \(epoch 0, batch 1\) it returned a tensor of "
        r"shape \(8,\)\. Reduce the loss to a scalar",
    ):
        ppetrace.Trainer(progress=False).fit(Bad())


def test_a_loss_fn_returning_a_non_tensor_is_named() -> None:
    net = torch.nn.Linear(8, 4)
    with pytest.raises(
        ValueError, match=r"Expected loss_fn\(preds, targets\) for Linear .* returned a float\."
    ):
        ppetrace.Trainer(progress=False).fit(
            net,
            loader(),
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            loss_fn=lambda p, t: 0.5,
        )


def test_plain_module_needs_pairs_an_optimizer_and_a_loss() -> None:
    net = torch.nn.Linear(8, 4)
    trainer = ppetrace.Trainer(progress=False)
    with pytest.raises(ValueError, match=r"Expected an optimizer to fit the plain module Linear"):
        trainer.fit(net, loader(), loss_fn=F.cross_entropy)
    with pytest.raises(ValueError, match=r"Expected a loss_fn to fit the plain module Linear"):
        trainer.fit(net, loader(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"Expected a train_loader to fit Linear"):
        trainer.fit(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=F.mse_loss)
    triples = DataLoader(TensorDataset(torch.randn(4, 8), torch.randn(4), torch.randn(4)))
    with pytest.raises(
        TypeError,
        match=r"Expected each batch for the plain module Linear to be a pair \(inputs, targets\), "
        r"but received a sequence of length 3\.",
    ):
        trainer.fit(
            net, triples, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=F.mse_loss
        )


def test_module_interface_rejects_optimizers_given_to_fit() -> None:
    bad = Bad()
    with pytest.raises(ValueError, match=r"Expected no optimizer for the ModuleInterface Bad"):
        ppetrace.Trainer(progress=False).fit(
            bad, optimizer=torch.optim.SGD(bad.parameters(), lr=0.1)
        )


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"Expected a ppetrace\.ModuleInterface, .* received str"):
        ppetrace.Trainer(progress=False).fit("model")  # type: ignore[arg-type]


def test_unknown_device_lists_the_registered_types() -> None:
    net = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match=r"Unknown device type 'tpu'; registered: .*cpu"):
        ppetrace.Trainer(device="tpu", progress=False).fit(
            net,
            loader(),
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            loss_fn=F.cross_entropy,
        )
