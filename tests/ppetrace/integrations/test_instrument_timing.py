"""instrument() against known times: device time from a fake event source (CudaTimer), and
spans around known busy-waits in forward, a custom backward and the data loader."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ppetrace
from exporters import read_chrome_trace, step_report
from exporters.chrome import load_chrome_trace
from ppetrace.profilers import CudaTimer
from ppetrace.profilers._base import DEVICE_TID

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the repository, not installed
    sys.path.insert(0, str(ROOT))

# the busy-wait workload and its timed loop (one torch thread) are the benchmark's own
from benchmarks.bench_instrument import INSIDE, WAITS_NS, run_truth_loop  # noqa: E402

FORWARD_NS, BACKWARD_NS, OPTIMIZER_NS = 1_000, 10_000, 100_000


class _DeviceWork(torch.autograd.Function):
    """Identity whose backward "runs" BACKWARD_NS on the fake device."""

    source: Any = None

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _DeviceWork.source.advance(BACKWARD_NS)
        return grad


class _Net(nn.Module):
    def __init__(self, source: Any) -> None:
        super().__init__()
        self.source = source
        self.layer = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.source.advance(FORWARD_NS)
        return _DeviceWork.apply(self.layer(x))


def test_cuda_timer_gives_device_time_to_steps_backward_and_optimizer_steps(
    tmp_path: Path, fake_source: Any, make_loader: Callable[..., Any]
) -> None:
    _DeviceWork.source = fake_source
    model = _Net(fake_source)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_pre_hook(lambda *_: fake_source.advance(OPTIMIZER_NS))
    timer = CudaTimer(source=fake_source)
    path = tmp_path / "t.json"
    with ppetrace.instrument(trace_path=path, profilers=[timer]):
        for x, y in make_loader(32, 8):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        for x, _y in make_loader(16, 8):  # batches that do not train: no device step
            model(x)
    assert timer.pending == 0
    frame = read_chrome_trace(path)

    def device(name: str) -> list[float]:
        return list(frame.loc[frame["name"] == name, "device_dur_ns"])

    assert device("trainer.step") == [FORWARD_NS + BACKWARD_NS + OPTIMIZER_NS] * 4
    assert device("trainer.backward") == [BACKWARD_NS] * 4
    assert device("trainer.optimizer_step") == [OPTIMIZER_NS] * 4
    events = load_chrome_trace(path).events
    track = [e["name"] for e in events if e.get("tid") == DEVICE_TID and e.get("ph") == "X"]
    assert sorted(track) == sorted(
        ["trainer.step"] * 4 + ["trainer.backward"] * 4 + ["trainer.optimizer_step"] * 4
    )
    report = step_report(frame, warmup_steps=0)
    assert list(report.steps["device_ns"]) == [float(FORWARD_NS + BACKWARD_NS + OPTIMIZER_NS)] * 4


# -- spans against busy-waits ---------------------------------------------------------------


def test_spans_match_the_busy_waits_they_wrap_and_steps_tile_the_loop(tmp_path: Path) -> None:
    """Each span holds the busy-wait it wraps (as the wait measured itself) and matches the
    call around it as the loop measures it, within max(5%, 300 µs) (median of 12 steps: a
    bound that scheduling noise on a shared machine does not reach); the step spans with
    their data wait cover >= 95% of the loop's wall time."""
    path = tmp_path / "t.json"
    calls, loop_ns = run_truth_loop(path, steps=12)
    frame = read_chrome_trace(path)
    for name, wait in WAITS_NS.items():
        inside, outside = INSIDE[name], calls[name]
        spans = frame.loc[frame["name"] == name].sort_values("start_ns")["dur_ns"]
        spans = list(spans[: len(outside)])  # not the loader's last, empty fetch
        assert len(spans) == len(inside) == len(outside) == 12, name
        assert all(s >= i >= wait for s, i in zip(spans, inside, strict=True)), name
        gaps = [o - s for o, s in zip(outside, spans, strict=True)]
        assert min(gaps) >= 0, name  # the span lies within the call
        assert statistics.median(gaps) <= max(0.05 * wait, 300_000), (name, gaps)
    steps = step_report(frame, warmup_steps=0).steps
    covered = int((steps["compute_ns"] + steps["data_wait_ns"]).sum())
    assert covered >= 0.95 * loop_ns, covered / loop_ns
