"""``instrument()``'s decisions made after the fact: batches that wait for their loader to
train (accumulation over a summed loss) and evaluations found only when the batch ends,
together with what else a loop does around them (a review's cases)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import torch.utils.data.dataloader as dl
from torch import nn

import ppetrace
from exporters import read_chrome_trace
from ppetrace.integrations import _stepper
from ppetrace.profilers import CudaTimer

Loader = Any


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


def _names(frame: pd.DataFrame, name: str) -> pd.DataFrame:
    return frame[frame["name"] == name].sort_values("start_ns")


def _inside(rows: pd.DataFrame, span: Any) -> pd.DataFrame:
    return rows[(rows["start_ns"] >= span.start_ns) & (rows["end_ns"] <= span.end_ns)]


def _accumulate(model: nn.Module, opt: Any, i: int, x: Any, y: Any, total: Any) -> Any:
    """Batch ``i`` of an accumulation over a summed loss, one backward per 4 batches: the
    running total (0 after the group's optimizer step)."""
    total = total + nn.functional.cross_entropy(model(x), y)
    if (i + 1) % 4:
        return total
    total.backward()
    opt.step()
    opt.zero_grad()
    return 0


def test_a_validation_inside_the_first_group_leaves_the_groups_batches_steps(
    tmp_path: Path, make_loader: Loader
) -> None:
    """A no_grad validation loop that runs out inside the first group of a summed-loss
    accumulation decides only its own batches: the training loader's waiting batches stay
    undecided (before, they became evaluation: 14 of 16 steps)."""
    model, data, val = _model(), make_loader(128, 8), make_loader(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        total: Any = 0
        for i, (x, y) in enumerate(data):
            total = _accumulate(model, opt, i, x, y, total)
            if i == 1:  # a validation inside the first group, after its second forward
                with torch.no_grad():
                    for vx, _vy in val:
                        model(vx)
    assert handle.steps == 16
    frame = read_chrome_trace(tmp_path / "t.json")
    (validation,) = _names(frame, "trainer.validation").itertuples()
    forwards = _inside(_names(frame, "module.forward"), validation)
    assert len(forwards) == 2 and set(forwards["stage"]) == {"val"}


def test_a_teachers_no_grad_forward_leaves_a_summed_loss_group_steps(
    tmp_path: Path, make_loader: Loader
) -> None:
    """Distillation over a summed loss: a teacher's no_grad forward before the student's
    forward with gradients does not make the batch evaluation (before: 26 of 32 steps and
    two validations)."""
    student, teacher, data = _model(), _model(), make_loader(128, 8)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        for _ in range(2):
            total: Any = 0
            for i, (x, _y) in enumerate(data):
                with torch.no_grad():
                    soft = teacher(x).softmax(-1)
                total = total + nn.functional.cross_entropy(student(x), soft)
                if (i + 1) % 4 == 0:
                    total.backward()
                    opt.step()
                    opt.zero_grad()
                    total = 0
    assert handle.steps == 32
    frame = read_chrome_trace(tmp_path / "t.json")
    assert "trainer.validation" not in set(frame["name"])


def test_a_cuda_timer_times_the_batches_that_waited_and_sees_late_evaluations(
    tmp_path: Path, make_loader: Loader, fake_source: Any
) -> None:
    """With a CudaTimer (every module call a span): the steps decided later keep their
    device time, and a forward with gradients after the optimizer step is still found to
    be an evaluation."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            fake_source.advance(1000)
            return self.body(x)  # type: ignore[no-any-return]

    model, data = Net(), make_loader(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    val_x = torch.randn(32, 16)
    timer = CudaTimer(source=fake_source)
    with ppetrace.instrument(trace_path=tmp_path / "t.json", profilers=[timer]) as handle:
        total: Any = 0
        for i, (x, y) in enumerate(data):
            total = _accumulate(model, opt, i, x, y, total)
            if (i + 1) % 4 == 0:  # after the group's optimizer step, without no_grad
                model(val_x)
    assert handle.steps == 8
    frame = read_chrome_trace(tmp_path / "t.json")
    steps = _names(frame, "trainer.step")
    assert steps["device_dur_ns"].notna().all()
    assert len(_names(frame, "trainer.validation")) == 2


def test_evaluations_decided_later_than_the_one_after_them_join_one_validation(
    tmp_path: Path, make_loader: Loader
) -> None:
    """After the optimizer step, a forward without no_grad and then one with it: both are
    in one validation, which starts at the first (it started at the second)."""
    model, data = _model(), make_loader(32, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    val_x = torch.randn(64, 16)
    with ppetrace.instrument(trace_path=tmp_path / "t.json"):
        for i, (x, y) in enumerate(data):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if i == 1:
                model(val_x)
                with torch.no_grad():
                    model(val_x)
    frame = read_chrome_trace(tmp_path / "t.json")
    (validation,) = _names(frame, "trainer.validation").itertuples()
    assert len(_inside(_names(frame, "module.forward"), validation)) == 2


def test_a_fresh_iterator_each_batch_of_a_summed_loss_group_is_one_loaders(
    tmp_path: Path, make_loader: Loader
) -> None:
    """``next(iter(loader))`` each batch, one backward per 4: the batches wait for their
    loader, not their iterator, to train (before: 4 steps and 4 validations of 16)."""
    model, data = _model(), make_loader(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        total: Any = 0
        for i in range(16):
            x, y = next(iter(data))
            total = _accumulate(model, opt, i, x, y, total)
    assert handle.steps == 16
    assert "trainer.validation" not in set(read_chrome_trace(tmp_path / "t.json")["name"])


def test_batches_that_never_train_wait_in_bounded_memory(
    tmp_path: Path, make_loader: Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forwards with gradients over a loader that neither trains nor runs out (inference
    without no_grad over part of a loader): past MAX_UNDECIDED, the oldest waiting batch
    is decided as evaluation."""
    monkeypatch.setattr(_stepper, "MAX_UNDECIDED", 4)
    model, data = _model(), make_loader(160, 8)
    held: list[int] = []
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        for i, (x, _y) in enumerate(data):
            model(x)
            if i == 15:
                break
            held.append(len(handle._tracker.state().undecided))
    assert max(held) == 4 and held[-1] == 4


def test_close_restores_the_grad_and_worker_shutdown_patches(make_loader: Loader) -> None:
    """``torch.autograd.grad`` and the worker iterator's shutdown come back exactly."""
    grad = torch.autograd.grad
    shutdown = dl._MultiProcessingDataLoaderIter.__dict__["_shutdown_workers"]
    handle = ppetrace.instrument()
    assert torch.autograd.grad is not grad
    assert dl._MultiProcessingDataLoaderIter.__dict__["_shutdown_workers"] is not shutdown
    handle.close()
    assert torch.autograd.grad is grad
    assert dl._MultiProcessingDataLoaderIter.__dict__["_shutdown_workers"] is shutdown
