r"""Chrome trace files: the streaming writer, the reader and the merger.

Takes in: :class:`exporters.SpanBatch` batches (or OpenTelemetry
``ReadableSpan``\ s) and raw events; hands on: trace files, and frames read
back from them (:func:`read_chrome_trace`). The writer is in ``_writer``
(encoding in ``_encode``, its pure-Python twin of the C helpers), the reader
in ``_reader`` with ``_events`` (events to a frame), the merger in ``_merge``.

The file format
---------------

A JSON object in the Chrome "JSON Object Format", which Perfetto and the
``chrome://tracing`` viewer load::

    {"displayTimeUnit":"ns","otherData":{...},"traceEvents":[
    {"ph":"M","name":"process_name","pid":4242,"tid":0,
     "args":{"name":"ppetrace rank 0 (pid 4242)"}},
    {"ph":"X","cat":"trainer","name":"trainer.step","pid":4242,"tid":4242,"ts":1.500,"dur":2.250,
     "args":{"span_id":"...","parent_id":"...","ppetrace.step":3,"status":"UNSET"}},
    ...
    ]}

- ``otherData`` holds the run's metadata: ``service_name``, ``trace_id``
  (32 hex digits), ``ppetrace_version``, ``host``, ``pid``, ``rank``,
  ``start_time_ns`` (epoch ns of the first span), ``origin_ns`` and
  ``clock_offset_ns``, plus the whole OpenTelemetry ``resource``.
- ``ts`` is in microseconds **relative to** ``otherData["origin_ns"]`` (an
  epoch time in ns, a whole second at or before the first span), written
  from integer nanoseconds as a decimal with exactly three fractional digits,
  so no precision is lost and float64 viewers keep nanoseconds for runs of
  up to ~100 days. A span that started before the origin (one that was open
  when the exporter was created) gets a negative ``ts``. ``dur`` is in µs
  the same way.
- ``clock_offset_ns`` (default 0) is how many ns to add to this file's times
  to put them on a reference clock; :func:`merge_traces` applies it.
- One ``X`` event per span: ``cat`` is the owner (the name's prefix before the
  first dot when it is ``trainer``, ``runtime``, ``module``, ``network``,
  ``callback`` or ``evaluator``, else ``user``), ``args`` holds the span's
  attributes plus ``span_id`` and ``parent_id`` (16 hex digits, all zeros for
  a root), ``status`` (``UNSET``/``OK``/``ERROR``) and, on failure, ``error``.
  Those four ``args`` keys are reserved: an attribute with one of these names
  is written as ``attr.<name>``.
- ``M`` events name each process (``process_name``, with the rank, and
  ``process_sort_index``) and each thread (``thread_name``).
- Each event is on its own line, so a file cut off by a killed process loses
  at most the event being written; :func:`read_chrome_trace` reads such a
  file and warns. A path ending in ``.gz`` is written as gzip, flushed after
  every batch so that a cut-off ``.json.gz`` is readable as well.
"""

from __future__ import annotations

from ._encode import OWNERS, owner_of
from ._merge import merge_traces
from ._reader import ChromeTrace, TraceTruncatedWarning, load_chrome_trace, read_chrome_trace
from ._writer import ChromeTraceExporter

__all__ = [
    "OWNERS",
    "ChromeTrace",
    "ChromeTraceExporter",
    "TraceTruncatedWarning",
    "load_chrome_trace",
    "merge_traces",
    "owner_of",
    "read_chrome_trace",
]
