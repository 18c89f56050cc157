"""Non-finite losses: a one-time warning with the step, a span attribute, an opt-in raise."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ppetrace
from ppetrace.tracing._recorder import RECORDER
from ppetrace.training._nonfinite import NONFINITE_ATTRIBUTE, LossWatch
from ppetrace.training._progress import ProgressBar

RowSink = Any  # conftest.py's row_sink fixture: a sink that keeps the rows it is given


def nan_at(*batches: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross-entropy whose value is NaN at the given batches of each epoch (4 per epoch).
    The NaN is a constant added to the loss: the gradients stay finite."""
    calls = [0]

    def loss_fn(preds: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        i = calls[0] % 4
        calls[0] += 1
        loss = F.cross_entropy(preds, targets)
        return loss + float("nan") if i in batches else loss

    return loss_fn


def batches() -> DataLoader[Any]:
    ds = TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,)))
    return DataLoader(ds, batch_size=4)


def fit(loss_fn: Any, loader: Any = None, **options: Any) -> ppetrace.Trainer:
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4)
    trainer = ppetrace.Trainer(progress=False, val_every_n_epochs=None, **options)
    trainer.fit(
        net,
        batches() if loader is None else loader,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss_fn=loss_fn,
    )
    return trainer


def test_warns_once_with_the_step_and_marks_the_epoch_span(row_sink: RowSink) -> None:
    with pytest.warns(RuntimeWarning) as caught:
        fit(nan_at(3), max_epochs=2)  # the last batch of each epoch: seen at each epoch end
    found = [w for w in caught if "is nan" in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in caught]
    assert str(found[0].message).startswith(
        "ppetrace: the loss at global step 3 (epoch 0, batch 3) is nan; training goes on; "
        "pass on_nonfinite_loss='raise' to stop there."
    )
    ppetrace.flush()
    epochs = sorted(
        (r for r in row_sink.rows if r.name == "trainer.epoch"), key=lambda r: r.start_ns
    )
    assert epochs[0].attributes[NONFINITE_ATTRIBUTE] == 3
    assert NONFINITE_ATTRIBUTE not in epochs[1].attributes  # reported once


def test_a_loader_without_a_length_names_the_step_of_its_last_batch() -> None:
    class Stream:
        def __iter__(self) -> Iterator[Any]:
            return iter(list(batches()))

    with pytest.warns(RuntimeWarning, match=r"global step 3 \(epoch 0, batch 3\) is nan"):
        fit(nan_at(3), Stream())


def test_a_finite_run_warns_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fit(F.cross_entropy, max_epochs=1)


def test_raise_stops_after_the_step_that_gave_it(row_sink: RowSink) -> None:
    with (
        pytest.raises(
            FloatingPointError,
            match=r"Expected a finite loss, but the loss at global step 1 \(epoch 0, batch 1\) is "
            r"nan; training stops there because on_nonfinite_loss='raise'\.",
        ),
        pytest.warns(RuntimeWarning, match=r"global step 1 \(epoch 0, batch 1\) is nan"),
    ):
        fit(nan_at(1), on_nonfinite_loss="raise")
    ppetrace.flush()
    assert [r.name for r in row_sink.rows].count("trainer.step") == 2  # batches 0 and 1 only
    epoch = next(r for r in row_sink.rows if r.name == "trainer.epoch")
    assert epoch.status == "ERROR" and epoch.attributes[NONFINITE_ATTRIBUTE] == 1


class FakeFlag:
    """An asynchronous isfinite flag whose device has or has not reached it yet."""

    def __init__(self, finite: bool) -> None:
        self.done = False
        self.value = finite
        self.waited = False

    def ready(self) -> bool:
        return self.done

    def finite(self) -> bool:
        self.waited = not self.done
        return self.value


def test_a_device_loss_is_resolved_at_flush_without_waiting_inside_a_hook() -> None:
    flags: list[FakeFlag] = []

    def factory(loss: torch.Tensor) -> FakeFlag:
        flags.append(FakeFlag(finite=False))
        return flags[-1]

    watch = LossWatch("warn", flag_factory=factory)
    attrs: dict[str, Any] = {}
    watch.epoch_attrs = attrs
    device_loss = torch.zeros((), device="meta")  # not on the CPU: never read in place
    watch.sample(device_loss, 7, 1, 2)
    assert watch.found is None and len(flags) == 1
    watch.install()
    try:
        RECORDER.inline_flush = True  # a flush forced inside a hook: it must not wait
        try:
            RECORDER.before_flush[-1]()
        finally:
            RECORDER.inline_flush = False
        assert watch.found is None and not flags[0].waited
        with pytest.warns(RuntimeWarning, match=r"global step 7 \(epoch 1, batch 2\) is not fin"):
            ppetrace.flush()  # an explicit flush, outside every hook: waits for the flag
        assert flags[0].waited and watch.found == (7, 1, 2, None)
        assert attrs == {NONFINITE_ATTRIBUTE: 7}
    finally:
        watch.uninstall()
    assert watch._on_flush not in RECORDER.before_flush


def test_the_progress_bar_hands_over_the_loss_it_read() -> None:
    now = [0.0]
    bar = ProgressBar(10, stream=io.StringIO(), clock=lambda: now[0], interval=1.0)
    try:
        assert bar.update(1, 1, torch.tensor(2.5)) is False  # no redraw yet: nothing read
        now[0] = 2.0
        assert bar.update(2, 2, torch.tensor(float("inf"))) is True
        read = bar.loss_value
    finally:
        bar.close(2, 2, None)
    assert read == float("inf")
    watch = LossWatch("warn")
    with pytest.warns(RuntimeWarning, match=r"global step 4 \(epoch 0, batch 5\) is inf"):
        watch.observe(read, 4, 0, 5)
