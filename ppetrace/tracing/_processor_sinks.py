"""Sinks for the span processors of a ``TracerProvider``, one per processor.

Takes in: the processors of the provider that ppetrace feeds. Gives out: a
:class:`~._sinks.Sink` for each. The SDK's ``SimpleSpanProcessor`` and
``BatchSpanProcessor`` (exactly these classes) get their exporter called with
whole batches, keeping their semantics: Simple exports everything at once
(so it is all there when ``flush()`` returns), Batch exports batches of its
``max_export_batch_size``, a full one at once and the rest after its
``schedule_delay`` or at a flush, serialised with the processor's own worker.
Any other processor gets ``on_end`` per span, on the sink's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

from ._convert import Delivery
from ._sinks import Sink, SpanExporterSink, _clock

__all__ = ["make_processor_sink"]


class SimpleProcessorSink(SpanExporterSink):
    """The SDK's ``SimpleSpanProcessor``: its exporter gets each batch at once."""

    chunk = 65_536

    def exporter(self) -> Any:
        return self.target.span_exporter

    def _spans(self, delivery: Delivery) -> None:
        if getattr(self.target, "_shutdown", False):
            self._failed(f"{self.name} is shut down", len(delivery), None)
            return
        super()._spans(delivery)

    def _flush(self) -> None:  # Simple holds nothing back
        pass


class BatchProcessorSink(SpanExporterSink):
    """The SDK's ``BatchSpanProcessor``: its exporter gets batches of its
    ``max_export_batch_size``, at once when one is full, else after its
    ``schedule_delay`` or at a flush. Calls are serialised with the processor's
    own worker (its export lock), which still serves spans of the SDK's tracer."""

    def __init__(self, target: Any, **kw: Any) -> None:
        super().__init__(target, **kw)
        inner = getattr(target, "_batch_processor", target)
        self.chunk = int(getattr(inner, "_max_export_batch_size", None) or 512)
        delay_ms: Any = getattr(inner, "_schedule_delay_millis", None)
        self.delay = float(5000 if delay_ms is None else delay_ms) / 1e3
        self._lock = getattr(inner, "_export_lock", None) or threading.Lock()
        self._held: list[ReadableSpan] = []
        self._held_since = 0.0

    def exporter(self) -> Any:
        return self.target.span_exporter

    def _export_call(self, exporter: Any, part: Sequence[ReadableSpan]) -> Any:
        with self._lock:
            return super()._export_call(exporter, part)

    def _spans(self, delivery: Delivery) -> None:
        if getattr(getattr(self.target, "_batch_processor", self.target), "_shutdown", False):
            self._failed(f"{self.name} is shut down", len(delivery), None)
            return
        try:
            spans = delivery.spans()
        except Exception as exc:
            self._failed(
                f"converting spans failed: {type(exc).__name__}: {exc}", len(delivery), exc
            )
            return
        if not self._held:
            self._held_since = _clock()
        self._held.extend(spans)
        full = len(self._held) - len(self._held) % self.chunk
        if full:
            ready, self._held = self._held[:full], self._held[full:]
            self._export(ready)
            if self._held:
                self._held_since = _clock()

    def _release(self) -> None:
        held, self._held = self._held, []
        if held:
            self._export(held)

    def _idle_after(self) -> float | None:
        if not self._held:
            return None
        return self._held_since + self.delay - _clock()

    def _on_idle(self) -> None:
        self._release()

    def _flush(self) -> None:
        self._release()
        self._call_method("force_flush")  # what the SDK's own tracer queued there

    def _shutdown(self) -> None:
        self._release()
        self._call_method("shutdown")

    def _stop(self) -> None:
        self._release()


class ProcessorSink(SpanExporterSink):
    """Any other span processor: ``on_end(span)`` for each span."""

    def _export(self, spans: Sequence[ReadableSpan]) -> None:
        on_end = self.target.on_end
        failures: list[BaseException] = []

        def feed() -> int:
            for span in spans:
                try:
                    on_end(span)
                except Exception as exc:
                    failures.append(exc)
            return len(failures)

        total = len(spans)
        ok, _ = self._run(total, feed, lambda failed: total - failed)
        if ok:
            failed = len(failures)
            error = None
            if failed:
                exc = failures[-1]
                error = f"on_end raised {type(exc).__name__}: {exc}"
            self._account(len(spans) - failed, failed, error)


def make_processor_sink(processor: Any, **kw: Any) -> Sink:
    """The sink for one span processor of a ``TracerProvider``."""
    kind = type(processor)
    if kind is SimpleSpanProcessor:
        return SimpleProcessorSink(processor, **kw)
    if kind is BatchSpanProcessor and hasattr(processor, "span_exporter"):
        return BatchProcessorSink(processor, **kw)
    return ProcessorSink(processor, **kw)
