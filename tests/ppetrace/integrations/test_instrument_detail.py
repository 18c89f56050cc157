"""instrument(trace_detail=...): summarised steps of a hand-written loop, counted in full."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ppetrace
from exporters import read_chrome_trace

HOOKS, NAMES = "ppetrace.hooks", "ppetrace.hook_names"


def _run(path: Path, make_loader: Callable[..., Any], **options: Any) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = make_loader(64, 4)
    with ppetrace.instrument(trace_path=path, **options) as handle:
        for x, y in data:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():  # an evaluation pass: no step, nothing summarised
            for x, _ in make_loader(8, 4):
                model(x)
    return handle


def test_instrument_summarises_the_steps_of_its_schedule(
    tmp_path: Path,
    make_loader: Callable[..., Any],
    event_counts: Callable[[Any], dict[str, int]],
) -> None:
    full = _run(tmp_path / "full.json", make_loader, trace_detail="all")
    every_other = ppetrace.Schedule(wait=1, warmup=0, active=1, repeat=0)
    summ = _run(tmp_path / "summ.json", make_loader, trace_detail=every_other)
    a, b = read_chrome_trace(full.trace_path), read_chrome_trace(summ.trace_path)
    steps = b[b["name"] == "trainer.step"].sort_values("start_ns")
    assert [isinstance(v, str) for v in steps[HOOKS]] == [i % 2 == 0 for i in range(16)]
    assert event_counts(b) == event_counts(a)
    assert summ.trace_exporter.steps_summarised == 8
    assert b.attrs["metadata"]["ppetrace.detail"]["policy"] == "schedule"
    # the evaluation forwards are written in full, tagged val
    assert (b.loc[b["name"] == "module.forward", "stage"] == "val").sum() == 2


def test_instrument_refuses_a_bad_trace_detail() -> None:
    with pytest.raises(ValueError, match=r"Expected 'auto', 'all' or a ppetrace.Schedule"):
        ppetrace.instrument(trace_detail="none")


def test_a_loop_without_a_dataloader_is_summarised_too(
    tmp_path: Path, event_counts: Callable[[Any], dict[str, int]]
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    every_fifth = ppetrace.Schedule(wait=4, warmup=0, active=1, repeat=0)
    with ppetrace.instrument(trace_path=tmp_path / "t.json", trace_detail=every_fifth):
        for _ in range(20):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    frame = read_chrome_trace(tmp_path / "t.json")
    steps = frame[frame["name"] == "trainer.step"].sort_values("start_ns")
    summarised = [isinstance(h, str) for h in steps[HOOKS]]
    assert summarised == [i % 5 != 4 for i in range(20)]  # steps 4, 9, 14, 19 in full
    assert all(h for h in steps[HOOKS] if isinstance(h, str))  # each holds its hooks
    assert (frame["name"] == "trainer.backward").sum() == 4
    assert event_counts(frame)["trainer.backward"] == 20


def test_every_step_of_a_profilers_window_leaves_the_report_under_instrument(
    tmp_path: Path, make_loader: Callable[..., Any]
) -> None:
    """instrument() opens a step when its fetch ends, before the profiler opens its
    window: the window's first step counts as profiled all the same."""
    from exporters import step_report
    from ppetrace.profilers import Pyinstrument, Schedule

    prof = Pyinstrument(
        schedule=Schedule(wait=1, warmup=0, active=2, repeat=2),
        output_dir=tmp_path,
        html=False,
        speedscope=False,
    )
    handle = _run(tmp_path / "t.json", make_loader, profilers=[prof])
    assert handle.steps == 16
    assert [(w.first_step, w.last_step) for w in prof.windows] == [(1, 2), (4, 5)]
    report = step_report(read_chrome_trace(tmp_path / "t.json"), warmup_steps=0)
    assert (report.total_steps, report.profiled_steps) == (16, 4)
    assert report.steps["batch_idx"].tolist() == [0, 3, *range(6, 16)]
