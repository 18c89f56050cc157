"""The delira network API and its training through the Trainer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch.utils.data import DataLoader, TensorDataset

import ppetrace
from ppetrace import AbstractPyTorchNetwork, DataParallelPyTorchNetwork, scale_loss


class Net(AbstractPyTorchNetwork):
    def __init__(self, width: int = 16, seed: int = 0) -> None:
        super().__init__(width=width, seed=seed)
        torch.manual_seed(seed)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def dataset(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def test_forward_is_abstract() -> None:
    class NoForward(AbstractPyTorchNetwork):
        pass

    with pytest.raises(TypeError, match="Can't instantiate abstract class NoForward"):
        NoForward()  # type: ignore[abstract]


def test_init_kwargs_are_recorded() -> None:
    net = Net(width=12, seed=3)
    assert net.init_kwargs == {"width": 12, "seed": 3}
    net.init_kwargs["width"] = 0
    assert net.init_kwargs["width"] == 12  # a copy


def test_prepare_batch_converts_and_places_values() -> None:
    out = Net.prepare_batch(
        {"data": np.ones((2, 8), dtype=np.float32), "label": np.array([1, 2]), "id": "a"},
        "cpu",
        "cpu",
    )
    assert isinstance(out["data"], torch.Tensor) and out["data"].dtype == torch.float32
    assert out["label"].dtype == torch.int64 and out["id"] == "a"
    pair = Net.prepare_batch((torch.zeros(2, 8), torch.ones(2)), "cpu", "cpu")
    assert set(pair) == {"data", "label"}
    with pytest.raises(TypeError, match=r"Expected a dict batch .* but received int\."):
        Net.prepare_batch(3, "cpu", "cpu")


def test_closure_steps_like_a_hand_written_step() -> None:
    x, y = dataset(8).tensors
    net, ref = Net(), Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    metrics, losses, preds = net.closure(
        net,
        {"data": x, "label": y},
        {"default": opt},
        {"ce": F.cross_entropy},
        {"acc": lambda p, t: (p.argmax(1) == t).float().mean()},
    )
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    ref_opt.step()
    assert torch.equal(losses["ce"], ref_loss.detach())
    assert set(metrics) == {"acc"} and metrics["acc"].ndim == 0
    assert preds[0].shape == (8, 4) and not preds[0].requires_grad
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), ref.parameters(), strict=True))


def test_closure_without_optimizers_does_not_backpropagate() -> None:
    x, y = dataset(8).tensors
    net = Net()
    metrics, losses, _ = net.closure(
        net, {"data": x, "label": y}, {}, {"ce": F.cross_entropy}, {"n": lambda p, t: p.shape[0]}
    )
    assert all(p.grad is None for p in net.parameters())
    # delira prefixes validation values with "val_"
    assert list(losses) == ["val_ce"] and not losses["val_ce"].requires_grad
    assert metrics == {"val_n": 8}


def test_closure_asserts_on_missing_losses_or_default_optimizer() -> None:
    net = Net()
    data = {"data": torch.zeros(2, 8), "label": torch.zeros(2, dtype=torch.long)}
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(AssertionError, match="Expected at least one loss"):
        net.closure(net, data, {"default": opt}, {})
    with pytest.raises(AssertionError, match=r"Expected an optimizer named 'default'"):
        net.closure(net, data, {"other": opt}, {"ce": F.cross_entropy})


def test_scale_loss_outside_a_trainer_yields_the_loss_unchanged() -> None:
    loss = torch.tensor(2.0, requires_grad=True)
    with scale_loss(loss, [], loss_id=0, model=None, delay_unscale=False) as scaled:
        assert scaled is loss


def hand_train(net: Net, ds: TensorDataset, accum: int, epochs: int = 1) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    batches = list(DataLoader(ds, batch_size=8))
    for _ in range(epochs):
        for start in range(0, len(batches), accum):
            group = batches[start : start + accum]
            for x, y in group:
                (F.cross_entropy(net(x), y) / len(group)).backward()
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("accum", [1, 2])
def test_trainer_trains_a_network_like_a_hand_written_loop(accum: int) -> None:
    """The closure's zero_grad/step are deferred, so accumulation works through it."""
    ds = dataset(24)
    ref = Net()
    hand_train(ref, ds, accum, epochs=2)
    net = Net()
    trainer = ppetrace.Trainer(max_epochs=2, grad_accumulation=accum, progress=False)
    trainer.fit(
        net,
        DataLoader(ds, batch_size=8),
        optimizer={"default": torch.optim.SGD(net.parameters(), lr=0.5)},
        loss_fn={"ce": F.cross_entropy},
    )
    assert trainer.global_step == 2 * (3 if accum == 1 else 2)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), net.parameters(), strict=True))


def test_data_parallel_network_trains_on_cpu_like_the_plain_network(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch.nn.DataParallel moves the module to the first GPU whenever CUDA is present
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ds = dataset(24)
    ref = Net()
    hand_train(ref, ds, accum=1)
    inner = Net()
    dp = DataParallelPyTorchNetwork(inner)
    assert dp.init_kwargs == {"width": 16, "seed": 0}
    assert dp.closure is Net.closure and dp.prepare_batch is Net.prepare_batch
    assert torch.equal(dp(ds.tensors[0][:2]), inner(ds.tensors[0][:2]))
    ppetrace.Trainer(progress=False).fit(
        dp,
        DataLoader(ds, batch_size=8),
        optimizer=torch.optim.SGD(dp.parameters(), lr=0.5),
        loss_fn=F.cross_entropy,
    )
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), inner.parameters(), strict=True))
    with pytest.raises(TypeError, match=r"Expected an AbstractPyTorchNetwork to wrap"):
        DataParallelPyTorchNetwork(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_data_parallel_network_trains_on_cuda_like_the_plain_network() -> None:
    ds = dataset(24)
    ref = Net().cuda()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for x, y in DataLoader(ds, batch_size=8):
        F.cross_entropy(ref(x.cuda()), y.cuda()).backward()
        opt.step()
        opt.zero_grad()
    inner = Net()
    dp = DataParallelPyTorchNetwork(inner, device_ids=[0])
    assert next(inner.parameters()).device == torch.device("cuda", 0)
    ppetrace.Trainer(device="cuda", progress=False).fit(
        dp,
        DataLoader(ds, batch_size=8),
        optimizer=torch.optim.SGD(dp.parameters(), lr=0.5),
        loss_fn=F.cross_entropy,
    )
    for a, b in zip(ref.parameters(), inner.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def _children(spans: tuple[ReadableSpan, ...], parent: ReadableSpan) -> list[str]:
    assert parent.context is not None
    kids = [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]
    return [s.name for s in sorted(kids, key=lambda s: s.start_time or 0)]


def test_network_spans_nest_inside_the_training_step(span_exporter: InMemorySpanExporter) -> None:
    seen: list[Any] = []

    class Backward(ppetrace.CallbackInterface):
        def on_end_backward(self, global_step: int, loss_tensor: torch.Tensor) -> None:
            seen.append(loss_tensor.requires_grad)

    net = Net()
    trainer = ppetrace.Trainer(callbacks=[Backward()], progress=False)
    trainer.fit(
        net,
        DataLoader(dataset(8), batch_size=8),
        {"v": DataLoader(dataset(8), batch_size=8)},
        optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
        loss_fn=F.cross_entropy,
    )
    ppetrace.flush()
    spans = span_exporter.get_finished_spans()
    by_name = {s.name: s for s in spans if s.name != "network.closure"}
    assert _children(spans, by_name["trainer.step"]) == [
        "runtime.train_pre_step",
        "runtime.convert_batch",
        "module.train_step",
        "trainer.optimizer_step",
        "runtime.train_post_step",
    ]
    train_closure = [s for s in spans if s.name == "network.closure" and _children(spans, s)]
    assert _children(spans, by_name["module.train_step"]) == [
        "network.prepare_batch",
        "network.closure",
    ]
    assert [_children(spans, s) for s in train_closure] == [["trainer.backward"]]
    assert _children(spans, by_name["trainer.backward"]) == ["callback.on_end_backward"]
    assert _children(spans, by_name["module.val_step"]) == [
        "network.prepare_batch",
        "network.closure",
    ]
    assert seen == [True]


def test_scale_loss_uses_the_trainers_grad_scaler() -> None:
    scaled_values: list[float] = []

    class Probe(Net):
        @staticmethod
        def closure(
            model: Any,
            data_dict: Any,
            optimizers: Any,
            losses: Any,
            metrics: Any = {},  # noqa: B006
            fold: int = 0,
            **kwargs: Any,
        ) -> Any:
            loss = F.cross_entropy(model(data_dict["data"]), data_dict["label"])
            with scale_loss(loss, optimizers["default"]) as scaled:
                scaled_values.append(float((scaled / loss).detach()))
                scaled.backward()
            return {}, {"ce": loss.detach()}, []

    net = Probe()
    runtime = ppetrace.PyTorchRuntime(
        "cpu", {"grad_scaler": torch.amp.GradScaler("cpu", init_scale=256.0)}
    )
    ppetrace.Trainer(device=runtime, grad_accumulation=2, progress=False).fit(
        net,
        DataLoader(dataset(16), batch_size=8),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
        loss_fn=F.cross_entropy,
    )
    # scaled by 256 and divided by the accumulation group of 2
    assert scaled_values == [128.0, 128.0]


def test_network_without_optimizers_or_losses_is_rejected() -> None:
    net = Net()
    trainer = ppetrace.Trainer(progress=False)
    with pytest.raises(ValueError, match=r"Expected optimizers to fit the network Net"):
        trainer.fit(net, DataLoader(dataset(8), batch_size=8), loss_fn=F.cross_entropy)
    with pytest.raises(ValueError, match=r"Expected losses to fit the network Net"):
        trainer.fit(
            net,
            DataLoader(dataset(8), batch_size=8),
            optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
        )
