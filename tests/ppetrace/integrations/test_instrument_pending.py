"""``instrument()``'s spans recorded after the fact wait in ``ThreadState.pending`` until
their step ends, and are then written together, before the step's row: never more
than the open step's, and never more than ``PENDING_MAX`` in a loop whose forwards end
no step."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ppetrace
from exporters import read_chrome_trace
from ppetrace.integrations._stepper import PENDING_MAX


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


def test_only_the_open_steps_spans_wait_and_every_span_is_written(
    tmp_path: Path, make_loader: Any
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "trace.json"
    waiting = []
    with ppetrace.instrument(trace_path=path) as handle:
        state = handle._tracker.state()
        for x, y in make_loader(40, 8):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            waiting.append([span[0] for span in state.pending])
    open_step = ["trainer.fetch_batch", "module.forward", "trainer.backward"]
    assert waiting == [[*open_step, "trainer.optimizer_step"]] * 5
    assert state.pending == []  # close() wrote the last step's
    frame = read_chrome_trace(path)
    counts = frame["name"].value_counts()
    for name in (*open_step, "trainer.optimizer_step", "trainer.step"):
        assert counts[name] == 5, name
    steps = frame[frame["name"] == "trainer.step"].sort_values("start_ns")
    fetches = frame[frame["name"] == "trainer.fetch_batch"].sort_values("start_ns")
    # each step starts where its batch's fetch ended, and holds its spans
    assert list(steps["start_ns"]) == list(fetches["end_ns"])
    for step in steps.itertuples():
        inside = frame[
            (frame["start_ns"] >= step.start_ns)
            & (frame["end_ns"] <= step.end_ns)
            & (frame["name"] != "trainer.step")
        ]
        assert sorted(inside["name"]) == sorted(
            ["module.forward", "trainer.backward", "trainer.optimizer_step"]
        )


def test_forwards_that_end_no_step_are_written_past_pending_max(tmp_path: Path) -> None:
    model = _model()
    path = tmp_path / "trace.json"
    n = 3 * PENDING_MAX + 5
    most = 0
    with ppetrace.instrument(trace_path=path) as handle:
        state = handle._tracker.state()
        for _ in range(n):  # gradients on, no backward, no DataLoader: no step ends
            model(torch.randn(4, 16))
            most = max(most, len(state.pending))
    assert 0 < most < PENDING_MAX
    frame = read_chrome_trace(path)
    assert (frame["name"] == "module.forward").sum() == n
    assert (frame["name"] == "trainer.step").sum() == 0


def test_a_long_steps_spans_are_written_as_they_end(
    tmp_path: Path, make_loader: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the oldest pending span began ``PENDING_NS`` ago, the hooks write what waits:
    a SIGKILL in a long step still finds its first spans in the trace."""
    from ppetrace.integrations import _hooks, _optim_hooks, _stepper

    real = time.perf_counter_ns
    calls = itertools.count()

    def slow_clock() -> int:  # each read PENDING_NS later than real time says
        return real() + next(calls) * _stepper.PENDING_NS

    for module in (_hooks, _optim_hooks, _stepper):
        monkeypatch.setattr(module, "_perf_ns", slow_clock)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "trace.json"
    waiting = []
    with ppetrace.instrument(trace_path=path) as handle:
        state = handle._tracker.state()
        for x, y in make_loader(24, 8):
            loss = nn.functional.cross_entropy(model(x), y)
            waiting.append(len(state.pending))
            loss.backward()
            waiting.append(len(state.pending))
            opt.step()
            opt.zero_grad()
            waiting.append(len(state.pending))
    assert waiting == [0] * 9
    counts = read_chrome_trace(path)["name"].value_counts()
    for name in ("trainer.fetch_batch", "module.forward", "trainer.backward", "trainer.step"):
        assert counts[name] == 3, name
