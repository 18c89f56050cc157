"""PyTorchRuntime's trace: a record_function range too, but only while a torch profiler records."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import ppetrace
from ppetrace.runtime import PyTorchRuntime, _ranges, call_hook


def _profiled(fn: Any) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.name for event in prof.events()}


def test_runtime_hooks_are_profiler_ranges_while_a_profiler_records(
    span_exporter: InMemorySpanExporter,
) -> None:
    runtime = PyTorchRuntime("cpu", None)
    model = torch.nn.Linear(2, 2)
    names = _profiled(lambda: call_hook(runtime, "train_epoch_begin", {}, model))
    assert "runtime.train_epoch_begin" in names
    names = _profiled(lambda: ppetrace.to(model, "cpu"))
    assert "runtime.move_module" in names
    ppetrace.flush()
    spans = [s.name for s in span_exporter.get_finished_spans()]
    assert spans.count("runtime.train_epoch_begin") == 1 and "runtime.move_module" in spans


def test_no_range_and_no_classmethod_call_while_no_profiler_records(
    monkeypatch: pytest.MonkeyPatch, span_exporter: InMemorySpanExporter
) -> None:
    opened: list[str] = []
    real = torch.profiler.record_function

    def recording(name: str, *args: Any) -> Any:
        opened.append(name)
        return real(name, *args)

    monkeypatch.setattr(torch.profiler, "record_function", recording)
    runtime = PyTorchRuntime("cpu", None)
    assert not _ranges.torch_profiler_active()
    call_hook(runtime, "train_epoch_begin", {}, torch.nn.Linear(2, 2))
    with PyTorchRuntime.trace("user.event", None):
        pass
    assert opened == []
    _profiled(lambda: call_hook(runtime, "train_epoch_end", {}, torch.nn.Linear(2, 2)))
    assert opened == ["runtime.train_epoch_end"]
    ppetrace.flush()
    names = [s.name for s in span_exporter.get_finished_spans()]
    assert names.count("runtime.train_epoch_begin") == 1 and "user.event" in names


def test_a_subclass_overriding_trace_still_gets_every_hook() -> None:
    seen: list[str] = []

    class Nvtx(PyTorchRuntime):
        @classmethod
        @contextlib.contextmanager
        def trace(cls, event_name: str | None, arg: Any) -> Iterator[None]:
            seen.append(str(event_name))
            with super().trace(event_name, arg):
                yield

    call_hook(Nvtx("cpu", None), "train_epoch_begin", {}, torch.nn.Linear(2, 2))
    assert seen == ["runtime.train_epoch_begin"]
    assert "runtime.train_epoch_end" in _profiled(
        lambda: call_hook(Nvtx("cpu", None), "train_epoch_end", {}, torch.nn.Linear(2, 2))
    )


def test_trace_of_no_event_records_nothing() -> None:
    assert isinstance(PyTorchRuntime.trace(None, None), contextlib.nullcontext)
