"""The profilers on a real CUDA device; skipped where there is none."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from profiler_harness import FakeTrainer

import ppetrace
from exporters.chrome import ChromeTraceExporter, load_chrome_trace
from ppetrace.profilers import CudaEventSource, CudaTimer, Schedule, SystemCounters, TorchProfiler
from ppetrace.profilers._base import DEVICE_TID, TORCH_TID_BASE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


_Trainer = functools.partial(FakeTrainer, device="cuda")


def _matmuls(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = torch.tanh(x @ x)
    return x


@pytest.fixture
def no_synchronize(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Record every torch.cuda.synchronize() call."""
    calls: list[str] = []
    real = torch.cuda.synchronize

    def spy(device: Any = None) -> None:
        calls.append("synchronize")
        real(device)

    monkeypatch.setattr(torch.cuda, "synchronize", spy)
    yield calls


def test_cuda_events_give_device_time_without_synchronizing_in_hooks(
    span_exporter: InMemorySpanExporter, no_synchronize: list[str]
) -> None:
    timer = CudaTimer()
    timer.setup(_Trainer())
    try:
        assert isinstance(timer.source, CudaEventSource)
        x = torch.randn(2048, 2048, device="cuda") / 64
        for step in range(3):
            timer.step_begin(step)
            with timer.span("trainer.step", {"ppetrace.batch_idx": step}):
                with timer.span("module.train_step", {}):
                    y = _matmuls(x, 20)
                with timer.span("trainer.backward", {}):
                    y = _matmuls(y, 5)
            timer.step_end(step)
        assert no_synchronize == []
        ppetrace.flush()
    finally:
        timer.teardown()
    spans = span_exporter.get_finished_spans()
    dev: dict[str, list[Any]] = {}
    for s in spans:
        attrs = s.attributes or {}
        dev.setdefault(s.name, []).append(attrs.get("ppetrace.device_dur_ns"))
    assert len(dev["trainer.step"]) == 3
    for step_ns, fwd_ns, bwd_ns in zip(
        dev["trainer.step"], dev["module.train_step"], dev["trainer.backward"], strict=True
    ):
        assert isinstance(step_ns, int) and isinstance(fwd_ns, int) and isinstance(bwd_ns, int)
        assert fwd_ns > 0 and bwd_ns > 0
        assert fwd_ns + bwd_ns <= step_ns  # children run inside their parent on the stream
        assert fwd_ns > bwd_ns  # 20 matmuls against 5


def test_kernels_and_the_device_track_reach_the_trace(tmp_path: Path) -> None:
    exporter = ChromeTraceExporter(tmp_path / "trace.json")
    ppetrace.configure(exporters=[exporter])
    schedule = Schedule(warmup=1, active=2)
    torch_prof = TorchProfiler(schedule=schedule, output_dir=tmp_path)
    counters = SystemCounters(schedule=schedule)
    timer = CudaTimer()
    profilers = [torch_prof, counters, timer]
    trainer = _Trainer(exporter)
    try:
        for p in profilers:
            p.setup(trainer)
        x = torch.randn(1024, 1024, device="cuda") / 32
        for step in range(4):
            for p in profilers:
                p.step_begin(step)
            with timer.span("trainer.step", {"ppetrace.batch_idx": step}):
                _matmuls(x, 10)
            for p in profilers:
                p.step_end(step)
        for p in profilers:
            p.teardown()
        ppetrace.shutdown()
        events = load_chrome_trace(exporter.path).events
    finally:
        ppetrace.configure()
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("tid", 0) >= TORCH_TID_BASE]
    assert kernels, "no CUDA kernels were merged"
    device = [e for e in events if e.get("tid") == DEVICE_TID and e.get("ph") == "X"]
    assert [e["name"] for e in device] == ["trainer.step"] * 4
    assert all(e["dur"] > 0 for e in device)
    assert "cuda_allocated_bytes" in counters.counters_frame().columns


def test_a_cuda_trainer_run_has_device_time_per_span(tmp_path: Path) -> None:
    from exporters import read_chrome_trace

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 512), torch.randn(64, 8))
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8)
    )
    trainer = ppetrace.Trainer(
        device="cuda",
        max_epochs=1,
        val_every_n_epochs=None,
        profilers=[CudaTimer()],
        progress=False,
        trace_path=tmp_path / "trace.json",
    )
    trainer.fit(
        model,
        torch.utils.data.DataLoader(data, batch_size=16),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        loss_fn=torch.nn.functional.mse_loss,
    )
    frame = read_chrome_trace(tmp_path / "trace.json")
    steps = frame[frame["name"] == "trainer.step"]
    assert len(steps) == 4
    assert (steps["device_dur_ns"] > 0).all()
    inner = frame[frame["name"].isin(["module.train_step", "trainer.backward"])]
    assert (inner["device_dur_ns"] > 0).all()
