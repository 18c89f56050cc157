"""Fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import isolation_guard
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torchrun_launch import torchrun_two_processes

import ppetrace
from exporters import SpanBatch, SpanRow
from ppetrace.tracing._recorder import RECORDER


@pytest.fixture
def span_exporter() -> Iterator[InMemorySpanExporter]:
    """ppetrace configured to send every span to a fresh in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    ppetrace.configure(tracer_provider=provider, service_name="ppetrace-tests")
    yield exporter
    ppetrace.flush()
    ppetrace.configure()


class RowSink:
    """A ppetrace sink that keeps the rows it is given, with their attribute objects."""

    def __init__(self) -> None:
        self.rows: list[SpanRow] = []

    def export_batch(self, batch: SpanBatch) -> None:
        self.rows.extend(batch.rows)

    def shutdown(self) -> None:
        pass


def _event_counts(frame: Any) -> dict[str, int]:
    """Each event's count in a trace frame: its spans, plus the counts in the aggregates
    of the summarised steps (``ppetrace.hooks`` under the ``ppetrace.hook_names`` in force),
    read here independently of exporters' own reader."""
    counts = {str(k): int(v) for k, v in frame["name"].value_counts().items()}
    names: list[str] = []
    steps = frame[frame["name"] == "trainer.step"].sort_values("start_ns")
    for row in steps.to_dict("records"):
        if isinstance(row.get("ppetrace.hook_names"), str):
            names = row["ppetrace.hook_names"].split(";")
        if isinstance(row.get("ppetrace.hooks"), str):
            for name, entry in zip(names, row["ppetrace.hooks"].split(";"), strict=False):
                if entry:
                    parts = entry.split("/")
                    counts[name] = counts.get(name, 0) + (int(parts[2]) if len(parts) > 2 else 1)
    return counts


@pytest.fixture
def event_counts() -> Callable[[Any], dict[str, int]]:
    """:func:`_event_counts`: spans plus the aggregates of summarised steps, per event."""
    return _event_counts


@pytest.fixture
def row_sink() -> Iterator[RowSink]:
    """ppetrace configured with one :class:`RowSink` as its only sink."""
    sink = RowSink()
    ppetrace.configure(exporters=[sink])
    yield sink
    ppetrace.configure()


@pytest.fixture(autouse=True)
def _recorder_left_clean() -> Iterator[None]:
    """Every test leaves tracing enabled, with no span still open on this thread, and
    nothing behind that goes on feeding the recorder (tests/isolation_guard.py): those
    would change the process-wide counts and the flusher's work in later tests, so they
    fail the test that left them."""
    before = isolation_guard.snapshot()
    yield
    from opentelemetry import trace as otel_trace

    current = otel_trace.get_current_span()
    assert not isinstance(current, ppetrace.tracing._recorder.Span), (
        f"a test left the span {current!r} open"
    )
    if not RECORDER.enabled:
        ppetrace.configure()
    left = isolation_guard.leftovers(before)
    assert not left, (
        "Expected the test to leave nothing that goes on recording spans or adds work to "
        f"the flusher, but it left {'; '.join(left)}. Stop, join or close them in the test "
        "(or in a fixture's teardown)."
    )


@pytest.fixture
def torchrun_two() -> Callable[..., str]:
    """:func:`torchrun_two_processes`, for tests that launch a 2-process run of their own."""
    return torchrun_two_processes


@pytest.fixture(scope="session")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-process torchrun run (gloo, CPU, loopback only) of
    tests/ppetrace/training/ddp_worker.py, shared by the distributed tests; returns its
    output folder (``result_rank<R>.json``, traces, checkpoints)."""
    out = tmp_path_factory.mktemp("torchrun")
    worker = Path(__file__).parent / "ppetrace" / "training" / "ddp_worker.py"
    torchrun_two_processes(str(worker), str(out))
    return out
