"""The Trainer's hook order and span tree: the documented contract, checked exactly."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch.utils.data import DataLoader, TensorDataset

import ppetrace
from ppetrace import BaseRuntime, runtime_registry

LOG: list[tuple[Any, ...]] = []


class RecordingRuntime(BaseRuntime):
    """Logs every lifecycle hook with the arguments that identify the call."""

    def initialize_module(self, module: Any, loader_or_batch: Any, optimizer: Any = None) -> None:
        LOG.append(("initialize_module", type(module).__name__, type(optimizer).__name__))
        assert isinstance(loader_or_batch, DataLoader)

    def train_epoch_begin(self, module: Any) -> None:
        LOG.append(("train_epoch_begin",))

    def train_pre_step(self, trainer: Any, module: Any, batch_idx: int, batch: Any) -> None:
        assert isinstance(trainer, ppetrace.Trainer)
        LOG.append(("train_pre_step", batch_idx))

    def convert_batch(self, args: Any) -> Any:
        LOG.append(("convert_batch",))
        return super().convert_batch(args)

    def train_post_step(
        self, trainer: Any, module: Any, batch_idx: int, batch: Any, outs: Any
    ) -> None:
        LOG.append(("train_post_step", batch_idx, len(outs)))

    def train_validation_begin(self, module: Any) -> None:
        LOG.append(("train_validation_begin",))

    def eval_pre_step(self, evaluator: Any, module: Any, batch_idx: int, batch: Any) -> None:
        assert isinstance(evaluator, ppetrace.Evaluator)
        assert not module.training
        LOG.append(("eval_pre_step", batch_idx))

    def eval_post_step(
        self, evaluator: Any, module: Any, batch_idx: int, batch: Any, outs: Any
    ) -> None:
        LOG.append(("eval_post_step", batch_idx))

    def train_validation_end(self, module: Any) -> None:
        LOG.append(("train_validation_end",))

    def train_epoch_end(self, module: Any) -> None:
        LOG.append(("train_epoch_end",))

    def train_cleanup(self, module: Any) -> None:
        LOG.append(("train_cleanup",))


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


class Recorder(ppetrace.ModuleInterface):
    """A ModuleInterface that logs its steps and every callback hook."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int) -> Any:
        LOG.append(("get_optimizers_schedulers", estimated_global_steps_per_epoch, epochs))
        return [torch.optim.SGD(self.parameters(), lr=0.1)], []

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> Any:
        ds = _data(12, 0)
        return DataLoader(ds, batch_size=batch_size, sampler=sampler(ds))

    def get_val_dataloaders(self, sampler: Any, batch_size: int) -> Any:
        a, b = _data(4, 1), _data(6, 2)
        return {
            "a": DataLoader(a, batch_size=2, sampler=sampler(a)),
            "b": DataLoader(b, batch_size=3, sampler=sampler(b)),
        }

    def train_step(self, global_step: int, batch: Any, device: Any) -> Any:
        LOG.append(("module.train_step", global_step))
        x, y = batch
        logits = self.linear(x)
        return torch.nn.functional.cross_entropy(logits, y), logits

    def val_step(self, global_step: int, batch: Any, device: Any) -> Any:
        LOG.append(("module.val_step", global_step))
        x, y = batch
        logits = self.linear(x)
        return torch.nn.functional.cross_entropy(logits, y), logits

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        LOG.append(("on_begin_train_epoch", global_step, epoch))

    def on_end_backward(self, global_step: int, loss_tensor: torch.Tensor) -> None:
        assert loss_tensor.requires_grad and loss_tensor.ndim == 0
        LOG.append(("on_end_backward", global_step))

    def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
        LOG.append(("on_end_train_step", global_step, *(tuple(o.shape) for o in outputs)))

    def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str = "default") -> None:
        LOG.append(("on_end_val_epoch", global_step, key, *(tuple(o.shape) for o in outputs)))

    def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
        LOG.append(("on_end_train_epoch", global_step, *(tuple(o.shape) for o in outputs)))

    def on_end_train(self, global_step: int) -> None:
        LOG.append(("on_end_train", global_step))


@pytest.fixture
def recording() -> Iterator[str]:
    LOG.clear()
    runtime_registry.register("recording", RecordingRuntime)
    yield "recording"
    runtime_registry.unregister("recording")
    LOG.clear()


def _run(device: Any) -> Recorder:
    module = Recorder()
    trainer = ppetrace.Trainer(device=device, max_epochs=2, grad_accumulation=2, progress=False)
    trainer.fit(module, batch_size=4)  # 12 samples -> 3 batches of 4
    assert trainer.global_step == 4 and trainer.epoch == 2
    return module


def _expected_calls() -> list[tuple[Any, ...]]:
    """The hook order of the README, written out for 2 epochs x 3 batches, accumulation 2."""
    calls: list[tuple[Any, ...]] = [
        ("get_optimizers_schedulers", 2, 2),
        ("initialize_module", "Recorder", "SGD"),
    ]
    step = 0
    for epoch in range(2):
        calls += [("train_epoch_begin",), ("on_begin_train_epoch", step, epoch)]
        for batch_idx in range(3):
            calls += [
                ("train_pre_step", batch_idx),
                ("convert_batch",),
                ("module.train_step", step + 1),  # PyMarlin: completed + 1
                ("on_end_backward", step),
            ]
            if batch_idx in (1, 2):  # a full group of 2, then the partial last group of 1
                step += 1
                rows = 2 if batch_idx == 1 else 1
                calls.append(("on_end_train_step", step, (rows,), (4 * rows, 3)))
            calls.append(("train_post_step", batch_idx, 2))
        calls.append(("train_validation_begin",))
        for key, batches, size in (("a", 2, 2), ("b", 2, 3)):
            for batch_idx in range(batches):
                calls += [
                    ("eval_pre_step", batch_idx),
                    ("convert_batch",),
                    ("module.val_step", step),
                    ("eval_post_step", batch_idx),
                ]
            calls.append(("on_end_val_epoch", step, key, (batches,), (batches * size, 3)))
        calls += [
            ("train_validation_end",),
            ("train_epoch_end",),
            ("on_end_train_epoch", step, (3,), (12, 3)),
        ]
    calls += [("train_cleanup",), ("on_end_train", 4)]
    return calls


def test_hook_order_is_the_documented_contract(recording: str) -> None:
    _run(recording)
    assert _expected_calls() == LOG


def test_a_runtime_instance_gets_the_same_hooks() -> None:
    LOG.clear()
    _run(RecordingRuntime("recording", {}))
    assert _expected_calls() == LOG
    LOG.clear()


def _tree(spans: tuple[ReadableSpan, ...]) -> list[Any]:
    """The spans as nested ``[name, [children...]]`` lists, children in start order."""
    children: dict[int | None, list[ReadableSpan]] = {}
    for span in spans:
        parent = span.parent.span_id if span.parent is not None else None
        children.setdefault(parent, []).append(span)

    def build(span: ReadableSpan) -> list[Any]:
        assert span.context is not None
        kids = sorted(children.get(span.context.span_id, []), key=lambda s: s.start_time or 0)
        return [span.name, [build(k) for k in kids]]

    roots = sorted(children[None], key=lambda s: s.start_time or 0)
    return [build(r) for r in roots]


def leaf(name: str) -> list[Any]:
    return [name, []]


def _expected_tree() -> list[Any]:
    def step(boundary: bool) -> list[Any]:
        kids = [
            leaf("runtime.train_pre_step"),
            leaf("runtime.convert_batch"),
            leaf("module.train_step"),
            ["trainer.backward", [leaf("callback.on_end_backward")]],
        ]
        if boundary:
            kids.append(["trainer.optimizer_step", [leaf("callback.on_end_train_step")]])
        kids.append(leaf("runtime.train_post_step"))
        return ["trainer.step", kids]

    def eval_run(batches: int) -> list[Any]:
        eval_step = [
            "evaluator.step",
            [
                leaf("runtime.eval_pre_step"),
                leaf("runtime.convert_batch"),
                leaf("module.val_step"),
                leaf("runtime.eval_post_step"),
            ],
        ]
        fetch, start, end = (
            leaf(f"evaluator.{name}") for name in ("fetch_batch", "loader_start", "loader_end")
        )
        return ["evaluator.run", [start, *[fetch, eval_step] * batches, end]]

    epoch: list[Any] = [
        leaf("runtime.train_epoch_begin"),
        leaf("callback.on_begin_train_epoch"),
        leaf("trainer.loader_start"),
    ]
    for boundary in (False, True, True):
        epoch += [leaf("trainer.fetch_batch"), step(boundary)]
    epoch += [
        leaf("trainer.loader_end"),
        [
            "trainer.validation",
            [
                leaf("runtime.train_validation_begin"),
                eval_run(2),
                leaf("callback.on_end_val_epoch"),
                eval_run(2),
                leaf("callback.on_end_val_epoch"),
                leaf("runtime.train_validation_end"),
            ],
        ],
        leaf("runtime.train_epoch_end"),
        leaf("callback.on_end_train_epoch"),
    ]
    run = [
        leaf("runtime.initialize_module"),
        leaf("trainer.zero_grad"),
        ["trainer.epoch", epoch],
        ["trainer.epoch", epoch],
        leaf("runtime.train_cleanup"),
        leaf("callback.on_end_train"),
    ]
    return [leaf("runtime.move_module"), ["trainer.run", run]]


def test_span_tree_of_the_run(recording: str, span_exporter: InMemorySpanExporter) -> None:
    _run(recording)
    spans = span_exporter.get_finished_spans()
    assert _tree(spans) == _expected_tree()


def test_span_attributes(recording: str, span_exporter: InMemorySpanExporter) -> None:
    _run(recording)
    spans = span_exporter.get_finished_spans()
    for span in spans:
        attrs = dict(span.attributes or {})
        assert attrs["ppetrace.device"] == "recording", span.name
        assert attrs["ppetrace.runtime"] == "RecordingRuntime", span.name
        if span.name != "runtime.move_module":
            assert "ppetrace.step" in attrs, span.name
    steps = [s for s in spans if s.name == "trainer.step"]
    assert [(s.attributes or {})["ppetrace.batch_idx"] for s in steps] == [0, 1, 2] * 2
    assert [(s.attributes or {})["ppetrace.epoch"] for s in steps] == [0, 0, 0, 1, 1, 1]
    # the global optimizer step when each batch started
    assert [(s.attributes or {})["ppetrace.step"] for s in steps] == [0, 0, 1, 2, 2, 3]
    assert all((s.attributes or {})["ppetrace.batch_size"] == 4 for s in steps)
    assert all((s.attributes or {})["ppetrace.stage"] == "train" for s in steps)
    evals = [s for s in spans if s.name == "evaluator.step"]
    assert {(s.attributes or {})["ppetrace.stage"] for s in evals} == {"val"}
    assert [(s.attributes or {})["ppetrace.loader"] for s in evals] == ["a", "a", "b", "b"] * 2
    assert [(s.attributes or {})["ppetrace.step"] for s in evals] == [2] * 4 + [4] * 4
    pre = [s for s in spans if s.name == "runtime.train_pre_step"]
    assert [(s.attributes or {})["ppetrace.batch_idx"] for s in pre] == [0, 1, 2] * 2
    # one mapping per step, shared by its spans: the fetch and every hook carry the step's
    # attributes, batch size included (known from the DataLoader before the fetch)
    fetches = [s for s in spans if s.name == "trainer.fetch_batch"]
    for step, fetch, hook in zip(steps, fetches, pre, strict=True):
        assert dict(fetch.attributes or {}) == dict(step.attributes or {})
        assert dict(hook.attributes or {}) == dict(step.attributes or {})


class Boom(RuntimeError):
    pass


def test_an_exception_ends_every_open_span_with_error_and_propagates(
    recording: str, span_exporter: InMemorySpanExporter
) -> None:
    class Failing(Recorder):
        def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
            if global_step == 2:
                raise Boom("the callback failed")

    trainer = ppetrace.Trainer(device=recording, max_epochs=2, grad_accumulation=2, progress=False)
    with pytest.raises(Boom, match="the callback failed") as info:
        trainer.fit(Failing(), batch_size=4)
    assert type(info.value) is Boom
    # the spans were flushed without an explicit ppetrace.flush()
    spans = span_exporter.get_finished_spans()
    failed = {s.name for s in spans if not s.status.is_ok}
    assert failed == {
        "callback.on_end_train_step",
        "trainer.optimizer_step",
        "trainer.step",
        "trainer.epoch",
        "trainer.run",
    }
    run = next(s for s in spans if s.name == "trainer.run")
    assert run.events[0].attributes is not None
    assert run.events[0].attributes["exception.type"] == "Boom"
    # nothing after the failure ran
    names = [s.name for s in spans]
    assert "runtime.train_cleanup" not in names
    assert names.count("trainer.step") == 3
