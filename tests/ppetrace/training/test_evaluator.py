"""The Evaluator: named loaders, no_grad, eval mode, callbacks and spans."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch.utils.data import DataLoader, TensorDataset

import ppetrace
from ppetrace import Evaluator, ModuleInterface, Stage


def dataset(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


class Probe(ModuleInterface):
    """Records the grad mode and training mode each step sees."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.seen: list[tuple[str, bool, bool]] = []
        self.val_ends: list[tuple[int, str, tuple[int, ...]]] = []

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int) -> Any:
        return [torch.optim.SGD(self.parameters(), lr=0.1)], []

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> Any:
        return DataLoader(dataset(8), batch_size=batch_size)

    def get_val_dataloaders(self, sampler: Any, batch_size: int) -> Any:
        return {
            "small": DataLoader(dataset(4, 1), batch_size=2),
            "big": DataLoader(dataset(6, 2), batch_size=4),
        }

    def get_test_dataloaders(self, sampler: Any, batch_size: int) -> Any:
        return DataLoader(dataset(5, 3), batch_size=batch_size)

    def train_step(self, global_step: int, batch: Any, device: Any) -> Any:
        return F.cross_entropy(self.lin(batch[0]), batch[1])

    def val_step(self, global_step: int, batch: Any, device: Any) -> Any:
        self.seen.append(("val", torch.is_grad_enabled(), self.training))
        return self.lin(batch[0]), batch[1]

    def test_step(self, global_step: int, batch: Any, device: Any) -> Any:
        self.seen.append(("test", torch.is_grad_enabled(), self.training))
        return self.lin(batch[0]).argmax(1)

    def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str = "default") -> None:
        self.val_ends.append((global_step, key, tuple(outputs[0].shape)))


def test_validation_runs_each_named_loader_without_grad_in_eval_mode() -> None:
    probe = Probe()
    results = Evaluator(probe).run(global_step=7)
    assert list(results) == ["small", "big"]
    logits, labels = results["big"]
    assert logits.shape == (6, 4) and torch.equal(labels, dataset(6, 2).tensors[1])
    assert probe.seen == [("val", False, False)] * 4
    assert probe.val_ends == [(7, "small", (4, 4)), (7, "big", (6, 4))]
    assert probe.training  # mode restored


def test_test_stage_uses_test_loaders_and_no_val_callback() -> None:
    probe = Probe()
    results = Evaluator(probe, stage="test", batch_size=2).run()
    (preds,) = results["default"]
    assert preds.shape == (5,) and preds.dtype == torch.int64
    assert [s[0] for s in probe.seen] == ["test"] * 3
    assert probe.val_ends == []


def test_plain_module_with_loss_and_input_only_batches() -> None:
    net = torch.nn.Linear(8, 4)
    ds = dataset(6)
    out = Evaluator(net, DataLoader(ds, batch_size=3), loss_fn=F.cross_entropy).run()
    losses, preds = out["default"]
    assert losses.shape == (2,)
    with torch.no_grad():
        assert torch.equal(preds, net(ds.tensors[0]))
    inputs_only = Evaluator(net, [ds.tensors[0][:3], ds.tensors[0][3:]], stage=Stage.TEST).run()
    assert inputs_only["default"][0].shape == (6, 4)


def test_extra_callbacks_get_on_end_val_epoch_after_the_module() -> None:
    order: list[str] = []

    class Cb(ppetrace.CallbackInterface):
        def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str = "default") -> None:
            order.append("cb:" + key)

    class P(Probe):
        def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str = "default") -> None:
            order.append("module:" + key)

    Evaluator(P(), callbacks=[Cb()]).run()
    assert order == ["module:small", "cb:small", "module:big", "cb:big"]


def test_spans_of_an_evaluation(span_exporter: InMemorySpanExporter) -> None:
    Evaluator(Probe()).run(global_step=3, epoch=1)
    ppetrace.flush()
    spans = span_exporter.get_finished_spans()
    runs = [s for s in spans if s.name == "evaluator.run"]
    assert [(s.attributes or {})["ppetrace.loader"] for s in runs] == ["small", "big"]
    steps = [s for s in spans if s.name == "evaluator.step"]
    assert [(s.attributes or {})["ppetrace.batch_idx"] for s in steps] == [0, 1, 0, 1]
    for s in steps:
        attrs = s.attributes or {}
        assert (attrs["ppetrace.epoch"], attrs["ppetrace.step"], attrs["ppetrace.stage"]) == (
            1,
            3,
            "val",
        )
        assert attrs["ppetrace.device"] == "cpu" and attrs["ppetrace.runtime"] == "PyTorchRuntime"
    names = [s.name for s in spans]
    assert names.count("module.val_step") == 4
    assert names.count("runtime.eval_pre_step") == names.count("runtime.eval_post_step") == 4
    assert names.count("callback.on_end_val_epoch") == 2


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"Expected Stage\.VAL or Stage\.TEST .* received 'train'"):
        Evaluator(Probe(), stage="train")
    net = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match=r"Expected at least one val loader for Linear"):
        Evaluator(net).run()
    with pytest.raises(TypeError, match=r"Expected a loader or a dict of named loaders"):
        Evaluator(net, 3).run()
    with pytest.raises(TypeError, match=r"Expected an iterable loader for val_loaders 'x'"):
        Evaluator(net, {"x": 3}).run()


class Loading(torch.utils.data.Dataset[Any]):
    """Items that trace their own loading (in a worker process too)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        with ppetrace.trace("data.load", {"item": i}):
            return torch.full((8,), float(i)), torch.tensor(i % 4)


def test_the_wait_on_the_loader_is_a_span_of_its_own(
    span_exporter: InMemorySpanExporter,
) -> None:
    Evaluator(torch.nn.Linear(8, 4), DataLoader(Loading(), batch_size=4)).run()
    ppetrace.flush()
    spans = span_exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    (run,) = [s for s in spans if s.name == "evaluator.run"]
    children = sorted(
        (s for s in spans if s.parent is not None and s.parent.span_id == run.context.span_id),
        key=lambda s: s.start_time or 0,
    )
    fetch = "evaluator.fetch_batch"
    assert [s.name for s in children] == [
        "evaluator.loader_start",
        *[fetch, "evaluator.step"] * 2,  # no fetch after the last batch: len(loader) is 2
        "evaluator.loader_end",
    ]
    fetches = [s for s in children if s.name == fetch]
    assert [(s.attributes or {})["ppetrace.batch_idx"] for s in fetches] == [0, 1]
    loads = [s for s in spans if s.name == "data.load"]
    assert len(loads) == 8
    assert {by_id[s.parent.span_id].name for s in loads if s.parent is not None} == {fetch}


def test_max_batches_keeps_the_workers_of_the_loader_traced(
    span_exporter: InMemorySpanExporter,
) -> None:
    loader = DataLoader(Loading(), batch_size=2, num_workers=2)
    Evaluator(torch.nn.Linear(8, 4), loader, max_batches=2).run()
    ppetrace.flush()
    spans = span_exporter.get_finished_spans()
    assert len([s for s in spans if s.name == "evaluator.step"]) == 2
    loads = [s for s in spans if s.name == "data.load"]
    # the two batches taken (and any the workers prefetched) came from the workers
    assert {(s.attributes or {})["item"] for s in loads} >= {0, 1, 2, 3}
    assert {(s.attributes or {})["thread.name"] for s in loads} <= {
        "dataloader worker 0",
        "dataloader worker 1",
    }


def test_the_workers_shut_down_inside_loader_end_and_an_iterable_gets_its_last_fetch(
    span_exporter: InMemorySpanExporter, traced_worker_shutdown: str
) -> None:
    loader = DataLoader(Loading(), batch_size=2, num_workers=2)
    Evaluator(torch.nn.Linear(8, 4), loader, max_batches=3).run()
    # an iterable without len(): the fetch that finds its end is the loop's last
    Evaluator(torch.nn.Linear(8, 4), iter([(torch.zeros(2, 8), torch.zeros(2))] * 2)).run()
    ppetrace.flush()
    spans = span_exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    (down, *_) = [s for s in spans if s.name == traced_worker_shutdown]
    assert down.parent is not None and by_id[down.parent.span_id].name == "evaluator.loader_end"
    runs = [s for s in spans if s.name == "evaluator.run"]
    fetches = [
        [s for s in spans if s.name == "evaluator.fetch_batch" and s.parent == r.context]
        for r in runs
    ]
    assert [len(f) for f in fetches] == [3, 3]  # max_batches=3; 2 batches and the end


def test_a_standalone_evaluation_is_reported_as_validation_not_training(tmp_path: Any) -> None:
    from exporters import ChromeTraceExporter, read_chrome_trace, step_report

    chrome = ChromeTraceExporter(tmp_path / "t.json")
    ppetrace.tracing.add_exporter(chrome)
    try:
        Evaluator(Probe(), stage="test").run()
    finally:
        ppetrace.tracing.remove_exporter(chrome)
    report = step_report(read_chrome_trace(tmp_path / "t.json"), warmup_steps=0)
    assert not report.events["event"].str.startswith(("evaluator.", "module.")).any()
    assert {"evaluator.run", "evaluator.step", "module.test_step"} <= set(
        report.validation["event"]
    )
    assert report.validation["share"].sum() > 0.9  # of the evaluator.run time
