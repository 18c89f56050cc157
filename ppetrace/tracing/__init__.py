"""Tracing: ``trace(event_name, arg)`` and where its spans go.

Takes in: traced blocks, from the Trainer, the runtimes, the profilers and
user code. The hot path (:mod:`._recorder`, in C in ``_speedups.c`` with a
pure-Python twin) reads the clock twice and appends one compact
:class:`exporters.SpanRow` per finished span to a per-thread buffer; it
creates no OpenTelemetry object. :mod:`._setup` decides, once, where those
rows go (:func:`configure`) and pushes them there (:func:`flush`).

Hands on: :class:`exporters.SpanBatch` batches to ppetrace's own exporters
(``export_batch``), and OpenTelemetry ``ReadableSpan``\\ s to the user's span
processors and ``SpanExporter``\\ s. :func:`capture_environment` describes the
machine a run ran on, for a trace's ``otherData``. Nothing here imports torch.
"""

from __future__ import annotations

from exporters._spans import FrozenAttributes

from ._environment import ENVIRONMENT_FIELDS, capture_environment
from ._recorder import IMPLEMENTATION, Span, trace
from ._setup import (
    add_exporter,
    bind_context,
    configure,
    flush,
    remove_exporter,
    shutdown,
    stats,
)
from ._stats import RecorderStats, SinkStats

__all__ = [
    "ENVIRONMENT_FIELDS",
    "IMPLEMENTATION",
    "FrozenAttributes",
    "RecorderStats",
    "SinkStats",
    "Span",
    "add_exporter",
    "bind_context",
    "capture_environment",
    "configure",
    "flush",
    "remove_exporter",
    "shutdown",
    "stats",
    "trace",
]
