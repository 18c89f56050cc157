"""Fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import ppetrace
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


@pytest.fixture(autouse=True)
def _recorder_left_clean() -> Iterator[None]:
    """Every test leaves tracing enabled, with no span still open on this thread."""
    yield
    from opentelemetry import trace as otel_trace

    current = otel_trace.get_current_span()
    assert not isinstance(current, ppetrace.tracing._recorder.Span), (
        f"a test left the span {current!r} open"
    )
    if not RECORDER.enabled:
        ppetrace.configure()
