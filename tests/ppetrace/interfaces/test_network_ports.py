"""delira ports: ``{"pred": ...}`` networks, float64 NumPy batches, the closure's arguments,
custom device moves and closures that step several optimizers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ppetrace
from ppetrace import AbstractPyTorchNetwork, DataParallelPyTorchNetwork, scale_loss


class DictNet(AbstractPyTorchNetwork):
    def __init__(self) -> None:
        super().__init__(width=4)
        torch.manual_seed(0)
        self.body = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.body(x), "feat": x.sum(1)}


def numpy_batches(n: int = 3, size: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {"data": rng.normal(size=(size, 5)), "label": rng.integers(0, 3, size)} for _ in range(n)
    ]


def test_the_default_closure_uses_preds_pred_as_delira() -> None:
    net = DictNet()
    x, y = torch.randn(4, 5), torch.tensor([0, 1, 2, 0])
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    expected = F.cross_entropy(net.body(x), y)
    metrics, losses, preds = net.closure(
        net, {"data": x, "label": y}, {"default": opt}, {"ce": F.cross_entropy},
        {"n": lambda p, t: p.shape[1]},
    )  # fmt: skip
    assert torch.equal(losses["ce"], expected.detach()) and metrics == {"n": 3}
    assert set(preds) == {"pred", "feat"} and not preds["pred"].requires_grad
    assert not torch.equal(net.body.weight, DictNet().body.weight)  # it stepped


def test_losses_default_to_empty_and_init_kwargs_is_a_class_attribute() -> None:
    net = DictNet()
    metrics, losses, preds = net.closure(net, {"data": torch.zeros(2, 5)}, {})
    assert metrics == {} and losses == {} and preds["pred"].shape == (2, 3)
    assert AbstractPyTorchNetwork._init_kwargs == {}
    assert DataParallelPyTorchNetwork._init_kwargs == {}
    assert net.init_kwargs == {"width": 4} and AbstractPyTorchNetwork._init_kwargs == {}


def test_prepare_batch_makes_floating_point_float32_and_keeps_integers() -> None:
    (batch, *_) = numpy_batches()
    out = DictNet.prepare_batch(batch, "cpu", "cpu")
    assert batch["data"].dtype == np.float64
    assert out["data"].dtype == torch.float32 and out["label"].dtype == torch.int64
    assert torch.equal(out["data"], torch.from_numpy(batch["data"]).float())


def test_a_network_trains_on_float64_numpy_batches() -> None:
    net = DictNet()
    ppetrace.Trainer(progress=False).fit(
        net,
        numpy_batches(),
        optimizer={"default": torch.optim.SGD(net.parameters(), lr=0.1)},
        loss_fn={"ce": F.cross_entropy},
    )
    assert net.body.weight.dtype == torch.float32


class Recording(AbstractPyTorchNetwork):
    calls: ClassVar[list[dict[str, Any]]] = []

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.body(x)}

    @staticmethod
    def closure(
        model: Any,
        data_dict: dict[str, Any],
        optimizers: Any,
        losses: Any = {},  # noqa: B006 - delira's signature
        metrics: Any = {},  # noqa: B006
        fold: int = 0,
        **kwargs: Any,
    ) -> Any:
        Recording.calls.append({"fold": fold, "train": bool(optimizers), **kwargs})
        return AbstractPyTorchNetwork.closure(model, data_dict, optimizers, losses, metrics, fold)


def test_the_trainer_calls_the_closure_with_fold_and_batch_nr_as_delira() -> None:
    Recording.calls = []
    net = Recording()
    ppetrace.Trainer(max_epochs=2, progress=False).fit(
        net,
        numpy_batches(3),
        numpy_batches(2),
        optimizer={"default": torch.optim.SGD(net.parameters(), lr=0.1)},
        loss_fn={"ce": F.cross_entropy},
        fold=2,
    )
    train = [(c["batch_nr"], c["fold"]) for c in Recording.calls if c["train"]]
    val = [c["batch_nr"] for c in Recording.calls if not c["train"]]
    assert train == [(0, 2), (1, 2), (2, 2)] * 2 and val == [0, 1] * 2


def test_fold_is_only_for_networks() -> None:
    model = torch.nn.Linear(5, 3)
    with pytest.raises(ValueError, match=r"^Expected fold only for an AbstractPyTorchNetwork"):
        ppetrace.Trainer(progress=False).fit(
            model, [], optimizer=torch.optim.SGD(model.parameters(), lr=0.1), fold=1
        )


def test_dict_predictions_reach_callbacks_collated_per_key() -> None:
    seen: list[Any] = []

    class Keep(ppetrace.CallbackInterface):
        def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
            seen.append(outputs)

        def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str = "default") -> None:
            seen.append(outputs)

    net = DictNet()
    ppetrace.Trainer(callbacks=[Keep()], progress=False).fit(
        net,
        numpy_batches(3),
        numpy_batches(2, size=5),
        optimizer={"default": torch.optim.SGD(net.parameters(), lr=0.1)},
        loss_fn={"ce": F.cross_entropy},
    )
    (val,), (train,) = seen
    assert set(train) == {"pred", "feat"} and train["pred"].shape == (12, 3)
    assert train["feat"].shape == (12,) and val["pred"].shape == (10, 3)


class CountingRuntime(ppetrace.BaseRuntime):
    """A device torch does not know: every move is counted and stays on the CPU."""

    moves: ClassVar[int] = 0

    def move_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        CountingRuntime.moves += 1
        return tensor


@pytest.fixture
def mydev() -> Iterator[None]:
    CountingRuntime.moves = 0
    ppetrace.runtime_registry.register("mydev", CountingRuntime)
    yield
    ppetrace.runtime_registry.unregister("mydev")


def test_prepare_batch_moves_through_a_custom_runtime(mydev: None) -> None:
    net = DictNet()
    ppetrace.Trainer(device="mydev:0", progress=False).fit(
        net,
        numpy_batches(3),
        numpy_batches(1),
        optimizer={"default": torch.optim.SGD(net.parameters(), lr=0.1)},
        loss_fn={"ce": F.cross_entropy},
    )
    # NumPy arrays pass convert_batch untouched; prepare_batch moves data and label
    assert CountingRuntime.moves == 2 * (3 + 1)
    ppetrace.Evaluator(net, numpy_batches(2), device="mydev", loss_fn={"ce": F.cross_entropy}).run()
    assert CountingRuntime.moves == 2 * (3 + 1 + 2)


class GAN(AbstractPyTorchNetwork):
    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.nn.Linear(3, 5)
        self.discr = torch.nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.discr(x)}

    @staticmethod
    def closure(model: Any, data_dict: Any, optimizers: Any, losses: Any = {}, **kw: Any) -> Any:  # noqa: B006
        for name, part in (("discr", model.discr), ("gen", model.gen)):
            loss = part.weight.pow(2).sum()
            optimizers[name].zero_grad()
            with scale_loss(loss, optimizers[name]) as scaled:
                scaled.backward()
            optimizers[name].step()
        return {}, {}, {}


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"grad_accumulation": 2}, r"Expected grad_accumulation to be off for the network GAN"),
        ({"clip_grad_norm": 1.0}, r"Expected clip_grad_norm to be off for the network GAN"),
    ],
)
def test_a_closure_stepping_several_optimizers_rejects_accumulation_and_clipping(
    option: dict[str, Any], match: str
) -> None:
    net = GAN()
    opts = {
        "gen": torch.optim.SGD(net.gen.parameters(), 0.1),
        "discr": torch.optim.SGD(net.discr.parameters(), 0.1),
    }
    with pytest.raises(ValueError, match=match + r", whose closure steps its 2 optimizers itself"):
        ppetrace.Trainer(progress=False, **option).fit(
            net, numpy_batches(), optimizer=opts, loss_fn={"l": F.mse_loss}
        )
    assert net.gen.weight.grad is None  # rejected before anything ran
