"""The Trainer's per-step path: what it shares, skips and covers, without timing anything."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from opentelemetry import trace as otel_trace
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    SequentialSampler,
    TensorDataset,
)

import ppetrace
from exporters import SpanRow, read_chrome_trace
from ppetrace import PyTorchRuntime
from ppetrace.interfaces.network import _ACTIVE_MOVE, _ACTIVE_SCALING
from ppetrace.runtime._hooks import StepHooks, bound_hook
from ppetrace.tracing import FrozenAttributes
from ppetrace.training._run import known_batch_sizes

STEP_SPANS = {
    "trainer.step",
    "runtime.train_pre_step",
    "runtime.convert_batch",
    "module.train_step",
    "trainer.backward",
    "trainer.optimizer_step",
    "runtime.train_post_step",
}


RowSink = Any  # conftest.py's row_sink fixture: a sink that keeps the rows it is given


def data(n: int = 20) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def fit(loader: Any, runtime: Any = "cpu", **options: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4)
    trainer = ppetrace.Trainer(device=runtime, progress=False, val_every_n_epochs=None, **options)
    trainer.fit(
        net, loader, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=F.cross_entropy
    )
    return net


def by_step(rows: list[SpanRow]) -> dict[int, list[SpanRow]]:
    """The rows of each training batch (by ``ppetrace.batch_idx``), fetch included."""
    out: dict[int, list[SpanRow]] = {}
    for row in rows:
        if row.name in STEP_SPANS | {"trainer.fetch_batch"}:
            out.setdefault(row.attributes["ppetrace.batch_idx"], []).append(row)
    return out


def test_one_frozen_mapping_per_step_shared_by_its_spans_and_its_fetch(row_sink: RowSink) -> None:
    fit(DataLoader(data(20), batch_size=8))  # batches of 8, 8 and 4
    ppetrace.flush()
    steps = by_step(row_sink.rows)
    assert sorted(steps) == [0, 1, 2]
    for i, spans in steps.items():
        assert {r.name for r in spans} == STEP_SPANS | {"trainer.fetch_batch"}
        shared = spans[0].attributes
        assert type(shared) is FrozenAttributes
        assert all(r.attributes is shared for r in spans), i  # one object, no copies
        # the batch size known from the DataLoader before the fetch: the last one is 4
        assert shared["ppetrace.batch_size"] == (4 if i == 2 else 8)
    assert len({id(s[0].attributes) for s in steps.values()}) == 3  # a new one each step
    with pytest.raises(TypeError, match=r"Expected no change to a FrozenAttributes"):
        steps[0][0].attributes["ppetrace.step"] = 5  # type: ignore[index]


def test_a_loader_of_unknown_sizes_gives_the_fetch_its_own_mapping(row_sink: RowSink) -> None:
    ds = data(12)
    batches = [(ds.tensors[0][i : i + 5], ds.tensors[1][i : i + 5]) for i in (0, 5, 10)]
    fit(batches)  # a list: no DataLoader, so each batch's leading dimension
    ppetrace.flush()
    for i, spans in by_step(row_sink.rows).items():
        fetch = next(r for r in spans if r.name == "trainer.fetch_batch")
        rest = [r for r in spans if r is not fetch]
        assert "ppetrace.batch_size" not in fetch.attributes
        assert all(r.attributes is rest[0].attributes for r in rest)
        assert rest[0].attributes["ppetrace.batch_size"] == (2 if i == 2 else 5)
        assert {k: v for k, v in rest[0].attributes.items() if k != "ppetrace.batch_size"} == dict(
            fetch.attributes
        )


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from zip(*data(6).tensors, strict=True)


def test_known_batch_sizes_come_from_the_loader_only_where_they_are_fixed() -> None:
    ds = data(20)
    assert known_batch_sizes(DataLoader(ds, batch_size=8)) == (8, 2, 4)
    assert known_batch_sizes(DataLoader(ds, batch_size=8, drop_last=True)) == (8, 2, 0)
    assert known_batch_sizes(DataLoader(ds, batch_size=5, shuffle=True)) == (5, 4, 0)
    sampler = BatchSampler(SequentialSampler(ds), batch_size=8, drop_last=False)
    assert known_batch_sizes(DataLoader(ds, batch_sampler=sampler)) is None  # user's sampler
    assert known_batch_sizes(DataLoader(ds, batch_size=None)) is None  # no batching
    assert known_batch_sizes(DataLoader(Stream(), batch_size=2)) is None  # iterable
    assert known_batch_sizes([1, 2, 3]) is None


class QuietRuntime(PyTorchRuntime):
    """Overrides the post-step hook only; its pre-step hook is BaseRuntime's no-op."""

    def __init__(self, device_spec: Any, options: Any) -> None:
        super().__init__(device_spec, options)
        self.posts: list[int] = []

    def train_post_step(
        self, trainer: Any, module: Any, batch_idx: int, batch: Any, outs: Any
    ) -> None:
        self.posts.append(batch_idx)


def test_a_hook_the_runtime_does_not_override_gets_its_span_and_no_call(row_sink: RowSink) -> None:
    runtime = QuietRuntime("cpu", {})
    hooks = StepHooks(
        runtime, (("main", torch.nn.Linear(1, 1), runtime),), "train_pre_step", "train_post_step"
    )
    pre, opener, _, post = hooks.plain
    assert pre[0].fn is None and pre[0].open is ppetrace.trace  # span only, no call
    assert post[0].fn is not None and opener is ppetrace.trace
    assert hooks.ranged[0][0].open is not ppetrace.trace  # through the class's trace
    seen: list[int] = []
    vars(runtime)["train_pre_step"] = lambda trainer, module, i, batch: seen.append(i)
    assert bound_hook(runtime, "train_pre_step") is not None  # an instance's own is honoured
    fit(DataLoader(data(16), batch_size=8), runtime)
    ppetrace.flush()
    assert runtime.posts == [0, 1] and seen == [0, 1]
    names = [r.name for r in row_sink.rows]
    assert names.count("runtime.train_pre_step") == names.count("runtime.train_post_step") == 2


def test_cpu_batches_already_on_the_cpu_are_not_moved() -> None:
    runtime = PyTorchRuntime("cpu", {})
    x, y = torch.zeros(2, 3), torch.ones(2)
    as_list = runtime.convert_batch([x, y])
    assert type(as_list) is list and as_list[0] is x and as_list[1] is y
    assert runtime.convert_batch((x, y)) == (x, y)
    as_dict = runtime.convert_batch({"x": x})
    assert as_dict == {"x": x} and as_dict["x"] is x
    assert runtime.convert_batch(x) is x
    mixed = runtime.convert_batch([x, "label", 3])  # other values: the generic path, same result
    assert mixed[0] is x and mixed[1:] == ["label", 3]

    class Counting(PyTorchRuntime):
        moved = 0

        def move_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
            Counting.moved += 1
            return super().move_tensor(tensor)

    Counting("cpu", {}).convert_batch([x, y])
    assert Counting.moved == 2  # a subclass's move_tensor sees every tensor


def test_iterator_creation_is_inside_trainer_loader_start(row_sink: RowSink) -> None:
    seen: list[str] = []

    class Loader:
        def __init__(self) -> None:
            self.batches = list(DataLoader(data(16), batch_size=8))

        def __len__(self) -> int:
            return len(self.batches)

        def __iter__(self) -> Iterator[Any]:
            seen.append(otel_trace.get_current_span().name)  # type: ignore[attr-defined]
            return iter(self.batches)

    fit(Loader(), max_epochs=2)
    ppetrace.flush()
    assert seen == ["trainer.loader_start"] * 2
    by_id = {r.span_id: r for r in row_sink.rows}
    starts = [r for r in row_sink.rows if r.name == "trainer.loader_start"]
    for start in starts:
        assert by_id[start.parent_id].name == "trainer.epoch"
    first_fetch = min(
        (r for r in row_sink.rows if r.name == "trainer.fetch_batch"), key=lambda r: r.start_ns
    )
    assert min(s.end_ns for s in starts) <= first_fetch.start_ns


def test_children_cover_the_epoch_and_the_run(tmp_path: Any) -> None:
    """No time inside an epoch or a run that no child span accounts for. Steps of several ms
    make the loop's own gaps (a few µs) and the epoch-end hand-off of the spans to the sink
    worker a small share. After that hand-off the training thread stalled for about 4 ms
    on a busy machine (the sink worker takes the GIL to encode), 10% of a 16-step run;
    64 steps (about 150 ms) keep 95% safe."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 4))
    ds = TensorDataset(torch.randn(64 * 64, 256), torch.randint(0, 4, (64 * 64,)))
    path = tmp_path / "trace.json"
    trainer = ppetrace.Trainer(progress=False, val_every_n_epochs=None, trace_path=path)
    trainer.fit(
        net,
        DataLoader(ds, batch_size=64),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
        loss_fn=F.cross_entropy,
    )
    frame = read_chrome_trace(path)
    for name in ("trainer.epoch", "trainer.run"):
        spans = frame[frame["name"] == name]
        covered = 1 - spans["self_ns"].sum() / spans["dur_ns"].sum()
        assert covered >= 0.95, (name, covered)


class Net(ppetrace.AbstractPyTorchNetwork):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    @staticmethod
    def prepare_batch(batch: Any, input_device: Any, output_device: Any) -> dict[str, Any]:
        SEEN.append((_ACTIVE_SCALING.get() is not None, _ACTIVE_MOVE.get() is not None))
        return ppetrace.AbstractPyTorchNetwork.prepare_batch(batch, input_device, output_device)


SEEN: list[tuple[bool, bool]] = []


def test_a_network_fit_sets_its_context_once_and_resets_it() -> None:
    SEEN.clear()
    net = Net()
    trainer = ppetrace.Trainer(progress=False)
    trainer.fit(
        net,
        DataLoader(data(16), batch_size=8),
        DataLoader(data(8), batch_size=8),
        optimizer={"default": torch.optim.SGD(net.parameters(), lr=0.1)},
        loss_fn={"ce": F.cross_entropy},
    )
    # training steps see the Trainer's scaling and moves; validation the moves only
    assert SEEN == [(True, True), (True, True), (False, True)]
    assert _ACTIVE_SCALING.get() is None and _ACTIVE_MOVE.get() is None
    loss = torch.ones(())
    with ppetrace.scale_loss(loss, None) as scaled:
        assert scaled is loss  # outside a fit: unchanged


class Failing(Net):
    @staticmethod
    def closure(
        model: Any,
        data_dict: dict[str, Any],
        optimizers: Any,
        losses: Any = None,
        metrics: Any = None,
        fold: int = 0,
        **kwargs: Any,
    ) -> Any:
        loss = model(data_dict["data"]).sum()
        with ppetrace.scale_loss(loss, optimizers) as scaled:
            scaled.backward()
            raise RuntimeError("inside scale_loss")


def test_an_error_inside_scale_loss_ends_the_backward_span_and_propagates(
    row_sink: RowSink,
) -> None:
    net = Failing()
    with pytest.raises(RuntimeError, match=r"^inside scale_loss$"):
        ppetrace.Trainer(progress=False).fit(
            net,
            DataLoader(data(8), batch_size=8),
            optimizer={"default": torch.optim.SGD(net.parameters(), lr=0.1)},
            loss_fn={"ce": F.cross_entropy},
        )
    ppetrace.flush()
    backward = [r for r in row_sink.rows if r.name == "trainer.backward"]
    assert len(backward) == 1 and backward[0].status == "ERROR"
    assert "inside scale_loss" in backward[0].error
    assert _ACTIVE_SCALING.get() is None
