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


def test_cuda_that_this_torch_cannot_use_is_a_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with pytest.raises(
        RuntimeError,
        match=r"Expected a CUDA device for device='cuda', but this torch build has no CUDA "
        r"support \(torch .*\)\. Install a CUDA build of torch, or pass device='cpu'\.",
    ):
        ppetrace.Trainer(device="cuda")
    with pytest.raises(RuntimeError, match=r"device='cuda:1', but this torch build has no CUDA"):
        ppetrace.Trainer(device=torch.device("cuda", 1))
    with pytest.raises(RuntimeError, match=r"device='cuda', but this torch build has no CUDA"):
        ppetrace.Trainer(device=PyTorchRuntime("cuda", {}))
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"but torch finds none \(torch.cuda.is_available\(\)"):
        ppetrace.Trainer(device="cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match=r"'cuda:3', but only 2 CUDA device\(s\) are visible"):
        ppetrace.Trainer(device="cuda:3")
    ppetrace.Trainer(device="cuda:1")  # a device that exists: accepted


def test_a_module_without_trainable_parameters_is_named() -> None:
    frozen = torch.nn.Linear(8, 4).requires_grad_(False)
    with pytest.raises(
        ValueError,
        match=r"Expected a module with trainable parameters to fit, but Linear has 2 parameter "
        r"tensor\(s\), none with requires_grad=True\. Unfreeze",
    ):
        ppetrace.Trainer(progress=False).fit(
            frozen,
            loader(),
            optimizer=torch.optim.SGD(frozen.parameters(), lr=0.1),
            loss_fn=F.cross_entropy,
        )
    other = torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match=r"but ReLU has no parameters at all\."):
        ppetrace.Trainer(progress=False).fit(
            torch.nn.ReLU(),
            loader(),
            optimizer=torch.optim.SGD([other], lr=0.1),
            loss_fn=F.mse_loss,
        )


def test_a_trace_path_that_is_not_a_path_is_rejected_at_once(tmp_path: Any) -> None:
    with pytest.raises(
        TypeError, match=r"Expected a str or os.PathLike for trace_path .* but received int 5\."
    ):
        ppetrace.Trainer(trace_path=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Expected a file name for trace_path, but received an"):
        ppetrace.Trainer(trace_path=" ")
    with pytest.raises(ValueError, match=r"Expected a file for trace_path, but .* is a directory"):
        ppetrace.Trainer(trace_path=tmp_path)
    assert ppetrace.Trainer(trace_path=tmp_path / "t.json").trace_path == tmp_path / "t.json"
    (tmp_path / "a_file").write_text("x")
    folders = r"Expected a file path for trace_path whose folders can be made, but .*a_file"
    with pytest.raises(ValueError, match=folders):
        ppetrace.Trainer(trace_path=tmp_path / "a_file" / "t.json")
    # the same check, at once, in instrument() and LightningProfiler
    with pytest.raises(ValueError, match=r"is a directory"):
        ppetrace.instrument(trace_path=tmp_path)
    with pytest.raises(ValueError, match=folders):
        ppetrace.instrument(trace_path=tmp_path / "a_file" / "t.json")
    with pytest.raises(ValueError, match=r"Expected 'warn' or 'raise' for on_nonfinite_loss"):
        ppetrace.Trainer(on_nonfinite_loss="ignore")  # type: ignore[arg-type]
