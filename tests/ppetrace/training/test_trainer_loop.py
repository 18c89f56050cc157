"""The Trainer's training math against hand-written loops, and its loop options."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ppetrace
from ppetrace import PyTorchRuntime, Stage


def dataset(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def hand_loop(
    net: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    accum: int = 1,
    clip: float | None = None,
    epochs: int = 1,
) -> None:
    for _ in range(epochs):
        n = len(batches)
        for start in range(0, n, accum):
            group = batches[start : start + accum]
            for x, y in group:
                (F.cross_entropy(net(x), y) / len(group)).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(list(net.parameters()), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize(("accum", "clip"), [(1, None), (3, None), (1, 0.05), (3, 0.05), (4, None)])
def test_training_equals_a_hand_written_loop(accum: int, clip: float | None) -> None:
    ds = dataset(40)  # 5 batches of 8: accumulation 3 leaves a partial group of 2
    batches = list(DataLoader(ds, batch_size=8))
    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    hand_loop(ref, ref_opt, batches, accum=accum, clip=clip, epochs=2)

    net = model()
    trainer = ppetrace.Trainer(
        max_epochs=2, grad_accumulation=accum, clip_grad_norm=clip, progress=False
    )
    trainer.fit(
        net,
        DataLoader(ds, batch_size=8),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9),
        loss_fn=F.cross_entropy,
    )
    assert trainer.global_step == 2 * -(-5 // accum)
    assert params_equal(ref, net)
    # clipping changes the result (so the comparison above is meaningful)
    if clip is not None:
        unclipped = model()
        uopt = torch.optim.SGD(unclipped.parameters(), lr=0.5, momentum=0.9)
        hand_loop(unclipped, uopt, batches, accum=accum, epochs=2)
        assert not params_equal(unclipped, net)


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """A loader without len(): the Trainer learns of the last batch only when it ends."""

    def __init__(self, ds: TensorDataset) -> None:
        self.ds = ds

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.ds[i : i + 8] for i in range(0, len(self.ds), 8))


def test_partial_last_group_steps_for_a_loader_without_len() -> None:
    ds = dataset(40)
    net = model()
    seen: list[int] = []

    class Steps(ppetrace.CallbackInterface):
        def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
            seen.append(global_step)

    trainer = ppetrace.Trainer(grad_accumulation=3, callbacks=[Steps()], progress=False)
    trainer.fit(
        net,
        DataLoader(Stream(ds), batch_size=None),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
        loss_fn=F.cross_entropy,
    )
    assert seen == [1, 2]  # batches 0-2, then the partial group 3-4
    assert all(p.grad is None for p in net.parameters())  # zeroed after the last step
    ref = model()
    # without len() the group size is unknown: the last group is divided by 3 as well
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for start in (0, 3):
        for x, y in list(DataLoader(ds, batch_size=8))[start : start + 3]:
            (F.cross_entropy(ref(x), y) / 3).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert params_equal(ref, net)


@pytest.mark.parametrize(("interval", "expected"), [("step", 0.5**6), ("epoch", 0.5**2)])
def test_schedulers_step_per_step_or_per_epoch(interval: Any, expected: float) -> None:
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = ppetrace.Trainer(max_epochs=2, scheduler_interval=interval, progress=False)
    trainer.fit(
        net,
        DataLoader(dataset(24), batch_size=8),
        optimizer=opt,
        loss_fn=F.cross_entropy,
        schedulers=[sched],
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(expected)


class Counting(ppetrace.CallbackInterface):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str = "default") -> None:
        self.events.append(("val", global_step))

    def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
        self.events.append(("epoch", global_step))


def _fit_counting(**options: Any) -> tuple[Counting, ppetrace.Trainer]:
    net = model()
    counting = Counting()
    trainer = ppetrace.Trainer(callbacks=[counting], progress=False, **options)
    trainer.fit(
        net,
        DataLoader(dataset(40), batch_size=8),  # 5 batches
        DataLoader(dataset(8, seed=1), batch_size=4),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss_fn=F.cross_entropy,
    )
    return counting, trainer


def test_validation_every_n_epochs() -> None:
    counting, _ = _fit_counting(max_epochs=4, val_every_n_epochs=2)
    assert counting.events == [
        ("epoch", 5),
        ("val", 10),
        ("epoch", 10),
        ("epoch", 15),
        ("val", 20),
        ("epoch", 20),
    ]


def test_validation_every_n_steps_and_not_twice_at_an_epoch_end() -> None:
    counting, _ = _fit_counting(max_epochs=2, val_every_n_steps=2, val_every_n_epochs=1)
    assert counting.events == [
        ("val", 2),
        ("val", 4),
        ("val", 5),  # epoch end (step 5 was not a multiple of 2)
        ("epoch", 5),
        ("val", 6),
        ("val", 8),
        ("val", 10),  # step 10 is both: validated once
        ("epoch", 10),
    ]


def test_max_steps_stops_training_and_ends_the_epoch() -> None:
    counting, trainer = _fit_counting(max_epochs=5, max_steps=7, val_every_n_epochs=None)
    assert trainer.global_step == 7
    assert trainer.batches_seen == 7
    assert counting.events == [("epoch", 5), ("epoch", 7)]


def test_collated_outputs_are_detached_cpu_and_bounded() -> None:
    received: list[tuple[torch.Tensor, ...]] = []

    class Epoch(ppetrace.CallbackInterface):
        def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
            received.append(outputs)

    net = model()
    # one step's outputs: loss (4 bytes) + preds 8x4 floats (128 bytes) = 132 bytes
    trainer = ppetrace.Trainer(callbacks=[Epoch()], max_collated_bytes=3 * 132, progress=False)
    with pytest.warns(RuntimeWarning, match="exceed max_collated_bytes=396; the oldest steps"):
        trainer.fit(
            net,
            DataLoader(dataset(40), batch_size=8),
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            loss_fn=F.cross_entropy,
        )
    (losses, preds) = received[0]
    assert losses.shape == (3,) and preds.shape == (24, 4)  # only the 3 most recent steps
    assert not preds.requires_grad and preds.device.type == "cpu"
    with torch.no_grad():
        last_x = dataset(40).tensors[0][32:]
        assert not torch.equal(preds[-8:], net(last_x))  # outputs from before the last step


def test_outputs_are_not_copied_when_no_callback_needs_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def forbidden(outputs: Any) -> Any:
        raise AssertionError("outputs were collated without a callback that needs them")

    monkeypatch.setattr("ppetrace.training._run.to_host", forbidden)

    class OnlyBackward(ppetrace.CallbackInterface):
        def on_end_backward(self, global_step: int, loss_tensor: torch.Tensor) -> None:
            pass

    net = model()
    trainer = ppetrace.Trainer(callbacks=[OnlyBackward()], progress=False)
    trainer.fit(
        net,
        DataLoader(dataset(16), batch_size=8),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss_fn=F.cross_entropy,
    )
    assert trainer.global_step == 2


def test_hooks_a_callback_does_not_override_get_no_span(
    span_exporter: InMemorySpanExporter,
) -> None:
    class OnlyEnd(ppetrace.CallbackInterface):
        def on_end_train(self, global_step: int) -> None:
            pass

    net = model()
    trainer = ppetrace.Trainer(callbacks=[OnlyEnd()], progress=False)
    trainer.fit(
        net,
        DataLoader(dataset(16), batch_size=8),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss_fn=F.cross_entropy,
    )
    ppetrace.flush()
    names = [s.name for s in span_exporter.get_finished_spans()]
    assert [n for n in names if n.startswith("callback.")] == ["callback.on_end_train"]
    assert names.count("trainer.step") == 2


def test_callbacks_run_module_first_then_in_order() -> None:
    order: list[str] = []

    class Named(ppetrace.CallbackInterface):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_end_train(self, global_step: int) -> None:
            order.append(self.name)

    class Module(ppetrace.ModuleInterface):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int):
            return [torch.optim.SGD(self.parameters(), lr=0.1)], []

        def get_train_dataloader(self, sampler: Any, batch_size: int) -> Any:
            return DataLoader(dataset(8), batch_size=batch_size)

        def get_val_dataloaders(self, sampler: Any, batch_size: int) -> Any:
            return None

        def train_step(self, global_step: int, batch: Any, device: Any) -> Any:
            return F.cross_entropy(self.lin(batch[0]), batch[1])

        def val_step(self, global_step: int, batch: Any, device: Any) -> Any:
            return self.lin(batch[0])

        def on_end_train(self, global_step: int) -> None:
            order.append("module")

    trainer = ppetrace.Trainer(callbacks=[Named("a"), Named("b")], progress=False)
    trainer.fit(Module(), batch_size=8)
    assert order == ["module", "a", "b"]


class AmpProbe(ppetrace.ModuleInterface):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.dtypes: list[tuple[str, torch.dtype]] = []

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int):
        return [torch.optim.SGD(self.parameters(), lr=0.1)], []

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> Any:
        return DataLoader(dataset(16), batch_size=batch_size)

    def get_val_dataloaders(self, sampler: Any, batch_size: int) -> Any:
        return DataLoader(dataset(8), batch_size=batch_size)

    def train_step(self, global_step: int, batch: Any, device: Any) -> Any:
        logits = self.lin(batch[0])
        self.dtypes.append(("train", logits.dtype))
        return F.cross_entropy(logits.float(), batch[1])

    def val_step(self, global_step: int, batch: Any, device: Any) -> Any:
        logits = self.lin(batch[0])
        self.dtypes.append(("val", logits.dtype))
        return logits


def test_amp_on_cpu_is_bf16_autocast_without_a_scaler() -> None:
    probe = AmpProbe()
    trainer = ppetrace.Trainer(amp=True, progress=False)
    trainer.fit(probe, batch_size=8)
    assert trainer.runtime is not None and trainer.runtime.grad_scaler is None
    assert probe.dtypes == [("train", torch.bfloat16)] * 2 + [("val", torch.bfloat16)]
    assert probe.lin.weight.dtype == torch.float32


def test_without_amp_the_forward_is_float32() -> None:
    probe = AmpProbe()
    ppetrace.Trainer(progress=False).fit(probe, batch_size=8)
    assert {d for _, d in probe.dtypes} == {torch.float32}


def test_a_grad_scaler_scales_the_loss_and_unscales_before_clipping() -> None:
    """GradScaler on CPU exercises the CUDA AMP path: same result as unscaled training."""
    ds = dataset(24)
    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    hand_loop(ref, ref_opt, list(DataLoader(ds, batch_size=8)), accum=2, clip=0.05)

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    runtime = PyTorchRuntime("cpu", {"grad_scaler": scaler})
    net = model()
    seen: list[float] = []

    class Grads(ppetrace.CallbackInterface):
        def on_end_backward(self, global_step: int, loss_tensor: torch.Tensor) -> None:
            seen.append(float(next(net.parameters()).grad.abs().sum()))  # type: ignore[union-attr]

    trainer = ppetrace.Trainer(
        device=runtime,
        grad_accumulation=2,
        clip_grad_norm=0.05,
        callbacks=[Grads()],
        progress=False,
    )
    trainer.fit(
        net,
        DataLoader(ds, batch_size=8),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
        loss_fn=F.cross_entropy,
    )
    assert seen[0] > 10.0  # gradients were scaled by 1024 before unscaling
    for a, b in zip(ref.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert scaler.get_scale() == 1024.0


def test_test_stage_returns_collated_outputs(span_exporter: InMemorySpanExporter) -> None:
    net = model()
    trainer = ppetrace.Trainer(progress=False)
    out = trainer.test(
        net,
        {"x": DataLoader(dataset(12), batch_size=8), "y": DataLoader(dataset(4), batch_size=4)},
        loss_fn=F.cross_entropy,
    )
    assert list(out) == ["x", "y"]
    losses, preds = out["x"]
    assert losses.shape == (2,) and preds.shape == (12, 4)
    with torch.no_grad():
        assert torch.equal(preds, net(dataset(12).tensors[0]))
    ppetrace.flush()
    names = [s.name for s in span_exporter.get_finished_spans()]
    assert names.count("module.test_step") == 3 and "module.val_step" not in names
    stages = {
        (s.attributes or {}).get("ppetrace.stage")
        for s in span_exporter.get_finished_spans()
        if s.name == "evaluator.step"
    }
    assert stages == {Stage.TEST.label}


def test_validate_runs_the_validation_hooks_and_returns_outputs(
    span_exporter: InMemorySpanExporter,
) -> None:
    net = model()
    out = ppetrace.Trainer(progress=False).validate(net, DataLoader(dataset(8), batch_size=4))
    (preds,) = out["default"]
    assert preds.shape == (8, 4)
    assert net.training  # the previous mode is restored
    ppetrace.flush()
    tree = [s.name for s in span_exporter.get_finished_spans()]
    assert "runtime.train_validation_begin" in tree and "trainer.validation" in tree


def test_module_interface_test_step_defaults_to_val_step() -> None:
    probe = AmpProbe()
    out = ppetrace.Trainer(progress=False).test(probe, DataLoader(dataset(8), batch_size=4))
    assert out["default"][0].shape == (8, 4)
    assert probe.dtypes == [("val", torch.float32)] * 2


def test_the_training_loaders_workers_shut_down_inside_loader_end(
    span_exporter: InMemorySpanExporter, traced_worker_shutdown: str
) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,)))
    model = torch.nn.Linear(8, 4)
    ppetrace.Trainer(max_epochs=2, progress=False).fit(
        model,
        DataLoader(data, batch_size=4, num_workers=2),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=F.cross_entropy,
    )
    ppetrace.flush()
    spans = span_exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    downs = [s for s in spans if s.name == traced_worker_shutdown and s.parent is not None]
    # each epoch's workers, inside that epoch's trainer.loader_end (not in trainer.run's gap)
    assert len({by_id[s.parent.span_id].context.span_id for s in downs}) == 2
    assert {by_id[s.parent.span_id].name for s in downs} == {"trainer.loader_end"}
