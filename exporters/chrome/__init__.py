r"""Chrome trace files: the streaming writer, the reader and the merger.

Takes in: :class:`exporters.SpanBatch` batches (or OpenTelemetry
``ReadableSpan``\ s) and raw events; hands on: trace files, and frames read
back from them (:func:`read_chrome_trace`). The writer is in ``_writer``
(encoding in ``_encode``, its pure-Python twin of the C helpers), the reader
in ``_reader`` (decoding in ``_parse``, events to a frame's columns in
``_events`` with ``_fields``), the merger in ``_merge``, the repair of cut-off
files in ``_repair``.

The file format
---------------

A JSON object in the Chrome "JSON Object Format", which Perfetto UI
(https://ui.perfetto.dev), speedscope and HolisticTraceAnalysis load::

    {"displayTimeUnit":"ns","otherData":{...},"traceEvents":[
    {"ph":"M","name":"process_name","pid":4242,"tid":0,"args":{"name":"ppetrace rank 0"}},
    {"ph":"X","cat":"trainer","name":"trainer.step","pid":4242,"tid":4242,"ts":1.500,
     "dur":2.250,"span_id":"...","parent_id":"...","status":"UNSET","attrs":{"ppetrace.step":3}},
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
  ``callback``, ``evaluator`` or ``dist``, else ``user``); ``span_id`` and
  ``parent_id`` (16 hex digits, all zeros for a root), ``status``
  (``UNSET``/``OK``/``ERROR``) and ``attrs`` (the span's attributes, left out
  when it has none) sit beside ``ts``; ``args`` is written only for a failed
  span and holds its ``error``. Nothing unique to a span is in ``args``,
  because speedscope keys its frames by name plus ``args``: so its Sandwich
  view adds up every ``trainer.step``, and Perfetto shows the error of a span
  that failed. (Perfetto does not show keys outside ``args``; the attributes
  are in the frame that :func:`read_chrome_trace` gives.) Files written
  before this layout kept ids, status and attributes in ``args``; the reader
  takes both.
- ``M`` events name each process (``process_name``, with the rank, and
  ``process_sort_index``; no pid, which viewers add themselves) and each
  thread (``thread_name``).
- A run written with ``max_part_bytes`` is split into parts (``trace.json``,
  ``trace.1.json``, ...), each a whole trace with ``otherData["part"]`` and
  ``otherData["first_part"]`` added (see ``_split``); the readers and the
  merger take part 0 as the whole run.
- Each event is on its own line, so a file cut off by a killed process loses
  at most the event being written; :func:`read_chrome_trace` reads such a
  file and warns, and :func:`repair_chrome_trace` (``ppetrace repair``)
  writes a closed copy for other viewers. A path ending in ``.gz`` is
  written as gzip, flushed after every batch so that a cut-off ``.json.gz``
  is readable as well.

Viewers
-------

- Perfetto UI reads ``ts``/``dur`` to the nanosecond (it rounds each
  ``value * 1000`` to an integer) and nests spans exactly.
- speedscope adds ``ts + dur`` in float64; spans nest there too, and frames
  of the sampled-Python track touch without overlapping (their times are
  whole µs).
- HolisticTraceAnalysis rounds each start up and each end down to a whole µs
  whenever ``ts`` is fractional, so a span shorter than a µs gets ``dur`` 0
  or -1. Set ``HTA_DISABLE_NS_ROUNDING=1`` before loading a ppetrace trace
  with HTA to keep the exact durations (benchmarks/check_hta.py checks both).
- ``chrome://tracing`` is disabled in current Chromium; use Perfetto UI.
"""

from __future__ import annotations

from ._detail import STEP_LEVEL_EVENTS
from ._encode import OWNERS, owner_of
from ._merge import merge_traces
from ._reader import ChromeTrace, TraceTruncatedWarning, load_chrome_trace, read_chrome_trace
from ._repair import Repaired, repair_chrome_trace
from ._split import trace_parts
from ._writer import ChromeTraceExporter

__all__ = [
    "OWNERS",
    "STEP_LEVEL_EVENTS",
    "ChromeTrace",
    "ChromeTraceExporter",
    "TraceTruncatedWarning",
    "load_chrome_trace",
    "merge_traces",
    "owner_of",
    "read_chrome_trace",
    "Repaired",
    "repair_chrome_trace",
    "trace_parts",
]
