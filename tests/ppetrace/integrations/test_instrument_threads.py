"""``instrument()`` on loops that a new user's trial found it got wrong: a training thread
that ends before ``close()``, ``module_depth=0``, and activation checkpointing."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_instrument_decisions import _model, _names
from torch import nn
from torch.utils.checkpoint import checkpoint

import ppetrace
from exporters import read_chrome_trace, step_report

Loader = Any


def _busy(ms: float) -> None:
    end = time.perf_counter_ns() + int(ms * 1e6)
    while time.perf_counter_ns() < end:
        pass


def _train(loader: Any, steps: int | None = None, fail_at: int | None = None) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(x), y)
        if i == fail_at:
            raise RuntimeError(f"the worker thread failed at batch {i}")
        loss.backward()
        opt.step()
        opt.zero_grad()
        if steps is not None and i + 1 == steps:
            break
    with torch.no_grad():
        model(next(iter(loader))[0])  # a last evaluation


def test_a_training_thread_that_ended_before_close_keeps_its_last_step_and_validation(
    tmp_path: Path, make_loader: Loader
) -> None:
    """The loop ran in a thread that the main thread joined before the end of the block:
    its last step (closed by its optimizer step, no later fetch) and the evaluation after
    it are recorded, as on the main thread (before: 4 steps of 5, no validation)."""
    path = tmp_path / "t.json"
    with ppetrace.instrument(trace_path=path):
        worker = threading.Thread(target=_train, args=(make_loader(64, 8), 5))
        worker.start()
        worker.join()
        joined = time.time_ns()
        _busy(2)  # the main thread goes on: no step may reach this far
    frame = read_chrome_trace(path)
    steps = _names(frame, "trainer.step")
    assert len(steps) == 5 and set(steps["tid"]) == {worker.native_id}
    last_opt = _names(frame, "trainer.optimizer_step")["end_ns"].max()
    assert steps["end_ns"].max() == last_opt
    (validation,) = _names(frame, "trainer.validation").itertuples()
    assert validation.tid == worker.native_id and validation.start_ns >= last_opt
    last_forward = frame.loc[frame["name"] == "module.forward", "end_ns"].max()
    assert last_forward <= validation.end_ns < joined + 1_000_000  # not to close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_training_thread_that_raised_leaves_its_step_with_error_status(
    tmp_path: Path, make_loader: Loader
) -> None:
    """A thread whose loop raised (threading.excepthook): its broken step is an ERROR
    ``trainer.step`` with the exception's text, ending where the exception left the thread,
    and its last forward is in the trace (before: no step, and that forward was lost)."""
    path = tmp_path / "t.json"
    hook = threading.excepthook
    with ppetrace.instrument(trace_path=path):
        worker = threading.Thread(target=_train, args=(make_loader(64, 8), None, 4))
        worker.start()
        worker.join()
        joined = time.time_ns()
        _busy(2)  # close() comes 2 ms after the thread died: the step must not reach it
    assert threading.excepthook is hook  # restored
    frame = read_chrome_trace(path)
    steps = _names(frame, "trainer.step")
    assert list(steps["status"]) == ["UNSET"] * 4 + ["ERROR"]
    assert "the worker thread failed at batch 4" in steps["error"].iloc[-1]
    forwards = _names(frame, "module.forward")
    assert len(forwards) == 5 and steps["end_ns"].iloc[-1] >= forwards["end_ns"].max()
    assert steps["end_ns"].iloc[-1] < joined + 1_000_000  # where it died, not at close()


def test_module_depth_0_records_no_module_spans_but_still_finds_validation_and_errors(
    tmp_path: Path, make_loader: Loader
) -> None:
    """``module_depth=0`` turns off the ``module.forward`` spans only: evaluation under
    no_grad is still a ``trainer.validation`` (before: none, and its fetches counted as
    training data wait), and a step broken by an exception is still an ERROR step."""
    model, data, val = _model(), make_loader(32, 8), make_loader(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "t.json"
    with (
        pytest.raises(RuntimeError, match="stop"),
        ppetrace.instrument(trace_path=path, module_depth=0),
    ):
        for _ in range(2):
            for x, y in data:
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            with torch.no_grad():
                for x, _ in val:
                    model(x)
        for x, y in data:
            nn.functional.cross_entropy(model(x), y)  # a forward, then the loop fails
            raise RuntimeError("stop")
    frame = read_chrome_trace(path)
    assert not (frame["name"] == "module.forward").any()
    assert len(_names(frame, "trainer.validation")) == 2
    steps = _names(frame, "trainer.step")
    assert len(steps) == 9 and steps["status"].iloc[-1] == "ERROR"
    report = step_report(frame, warmup_steps=0)
    assert report.failed_steps == 1
    training = report.events.set_index("event")["count"]
    evaluation = report.validation.set_index("event")["count"]
    # the evaluation's 4 fetches are the validation's, not the training steps' data wait
    assert training["trainer.fetch_batch"] == 8 and evaluation["trainer.fetch_batch"] == 4


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recomputes_inside_the_backward(
    tmp_path: Path, make_loader: Loader, reentrant: bool
) -> None:
    """A model whose blocks are checkpointed recomputes them inside backward: that time is
    the backward's, and each step has one outermost ``module.forward`` (before: each
    recomputed block was another forward, and forward/backward came out reversed)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            _busy(1)
            return torch.relu(self.lin(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b1, self.b2, self.head = Block(), Block(), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = checkpoint(self.b1, x, use_reentrant=reentrant)
            x = checkpoint(self.b2, x, use_reentrant=reentrant)
            return self.head(x)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "t.json"
    with ppetrace.instrument(trace_path=path, module_depth=2):
        for x, y in make_loader(32, 8):
            x.requires_grad_(reentrant)  # the reentrant variant needs an input with grad
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    frame = read_chrome_trace(path)
    forwards = _names(frame, "module.forward")
    outer = forwards[forwards["ppetrace.module"] == "Net"]
    assert len(outer) == 4 and len(_names(frame, "trainer.step")) == 4
    assert sorted(set(forwards["ppetrace.module"])) == ["Net", "Net.b1", "Net.b2", "Net.head"]
    assert (forwards["ppetrace.module"] == "Net.b1").sum() == 4  # not again in backward
    backward = _names(frame, "trainer.backward")
    assert (backward["dur_ns"] >= 2_000_000).all()  # the two blocks' recomputation
    assert (outer["dur_ns"] >= 2_000_000).all()  # (the counts above: no recomputed forward)


def test_a_loader_inside_another_loaders_dataset_ends_in_loader_end(
    tmp_path: Path, make_loader: Loader
) -> None:
    """The fetch that finds the end of a loader iterated inside another loader's fetch is
    ``trainer.loader_end``, as at the top level (before: a fetch_batch, and 14 loader
    starts had 2 ends)."""
    inner = make_loader(16, 4)

    class Tasks(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.cat([x for x, _ in inner])

    path = tmp_path / "t.json"
    with ppetrace.instrument(trace_path=path):
        for _ in torch.utils.data.DataLoader(Tasks(), batch_size=2):
            pass
    frame = read_chrome_trace(path)
    names = frame["name"].value_counts()
    assert names["trainer.loader_start"] == names["trainer.loader_end"] == 1 + 4
    assert names["trainer.fetch_batch"] == 2 + 4 * 4
    assert (frame["status"] != "ERROR").all()  # a loader's end is no error


def test_threads_that_ended_long_before_close_keep_their_steps(tmp_path: Path) -> None:
    """The tracker forgets a thread that ended when a new thread takes its id, or past 64
    threads; what the ended thread left open (its step, its last backward) is recorded
    then, as close() records it for the threads it still knows."""
    model = _model()
    path = tmp_path / "trace.json"
    n = 80

    def one_step() -> None:  # a forward and a backward, no optimizer, no DataLoader
        nn.functional.cross_entropy(model(torch.randn(4, 16)), torch.zeros(4).long()).backward()

    with ppetrace.instrument(trace_path=path):
        for _ in range(n):
            thread = threading.Thread(target=one_step)
            thread.start()
            thread.join()
    counts = read_chrome_trace(path)["name"].value_counts()
    for name in ("module.forward", "trainer.backward", "trainer.step"):
        assert counts[name] == n, name
