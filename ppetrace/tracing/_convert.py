"""Rows to OpenTelemetry: the ``ReadableSpan``\\ s that span processors and exporters take.

Takes in: a :class:`~exporters.SpanBatch` of :class:`~exporters.SpanRow`\\ s,
one resource and one instrumentation scope. Gives out: SDK ``ReadableSpan``
objects with the row's ids, parent, times, attributes (plus ``thread.id`` and
``thread.name``), status and ``exception`` event. Method: the objects share
one ``Resource`` and one scope (a resource per span costs hundreds of
microseconds), attribute conversions are cached per shared
:class:`~exporters.FrozenAttributes`, and where the installed SDK's
``ReadableSpan`` keeps the fields this module knows (checked once, against
the SDK's own constructor), the object is filled without running
``__init__``. This runs on the sink workers, never on the training thread.
"""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

from exporters._spans import SpanBatch, SpanRow

from ._attributes import _otel_attributes

__all__ = ["Delivery", "SpanBuilder"]

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK = Status(StatusCode.UNSET)
_MAX_ID64 = (1 << 64) - 1
_MAX_ID128 = (1 << 128) - 1
_tuple_new = tuple.__new__
_object_new = object.__new__


def _context(trace_id: int, span_id: int) -> SpanContext:
    if 0 < trace_id <= _MAX_ID128 and 0 < span_id <= _MAX_ID64:
        # what SpanContext.__new__ builds for valid ids, without its checks
        return _tuple_new(
            SpanContext, (trace_id, span_id, False, _SAMPLED, DEFAULT_TRACE_STATE, True)
        )
    return SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED)


def _error_parts(row: SpanRow) -> tuple[Status, tuple[Event, ...]]:
    head, _, stack = row.error.partition("\n")
    etype, _, message = head.partition(": ")
    event = Event(
        "exception",
        {
            "exception.type": etype,
            "exception.message": message,
            "exception.stacktrace": stack,
            "exception.escaped": "True",
        },
        timestamp=row.end_ns,
    )
    return Status(StatusCode.ERROR, head), (event,)


class _RowSpan(ReadableSpan):
    """A ``ReadableSpan`` made from a row. The fields that are the same for every
    ppetrace span (kind, no links, no instrumentation info, and the status and events of
    a span that did not raise) are class attributes, so an instance holds only its own."""

    _kind = SpanKind.INTERNAL
    _instrumentation_info = None
    _links: tuple[Any, ...] = ()
    _events: tuple[Event, ...] = ()
    _status = _OK


class SpanBuilder:
    """Turns rows into ``ReadableSpan``\\ s sharing one resource and one scope."""

    def __init__(self, resource: Resource, scope: InstrumentationScope) -> None:
        self.resource = resource
        self.scope = scope
        self._fast = _fields_match(resource, scope)

    def build(self, row: SpanRow, thread_names: dict[int, str]) -> ReadableSpan:
        """One span (the reference path: the SDK's own constructor)."""
        attributes = _otel_attributes(row.attributes)
        attributes["thread.id"] = row.tid
        name = thread_names.get(row.tid)
        if name is not None:
            attributes["thread.name"] = name
        status, events = _error_parts(row) if row.status == "ERROR" else (_OK, ())
        return ReadableSpan(
            name=row.name,
            context=_context(row.trace_id, row.span_id),
            parent=_context(row.trace_id, row.parent_id) if row.parent_id else None,
            resource=self.resource,
            attributes=attributes,
            events=events,
            status=status,
            start_time=row.start_ns,
            end_time=row.end_ns,
            instrumentation_scope=self.scope,
        )

    def build_all(self, batch: SpanBatch) -> list[ReadableSpan]:
        """Every row of ``batch``, in order."""
        names = batch.thread_names
        if not self._fast:
            return [self.build(row, names) for row in batch.rows]
        out: list[ReadableSpan] = []
        append = out.append
        # Attribute mappings that cannot change (a FrozenAttributes shared by a step's
        # spans, the empty mapping of spans without arg) are converted once per batch and
        # thread, and the spans share the result: ReadableSpan.attributes is a read-only
        # view. Parents shared by siblings get one SpanContext.
        converted: dict[tuple[int, int], tuple[Any, dict[str, Any]]] = {}
        parents: dict[tuple[int, int], SpanContext] = {}
        resource, scope = self.resource, self.scope
        new_span, new_ctx = _object_new, _tuple_new
        sampled, state, max64, max128 = _SAMPLED, DEFAULT_TRACE_STATE, _MAX_ID64, _MAX_ID128
        for row in batch.rows:
            name, span_id, parent_id, trace_id, start, end, tid, attrs, status, _ = row
            if type(attrs) is dict:
                attributes = _otel_attributes(attrs)
                attributes["thread.id"] = tid
                tname = names.get(tid)
                if tname is not None:
                    attributes["thread.name"] = tname
            else:
                key = (id(attrs), tid)
                hit = converted.get(key)
                if hit is None or hit[0] is not attrs:
                    attributes = _otel_attributes(attrs)
                    attributes["thread.id"] = tid
                    tname = names.get(tid)
                    if tname is not None:
                        attributes["thread.name"] = tname
                    hit = converted[key] = (attrs, attributes)
                attributes = hit[1]
            if 0 < trace_id <= max128 and 0 < span_id <= max64 and parent_id <= max64:
                ctx = new_ctx(SpanContext, (trace_id, span_id, False, sampled, state, True))
                if parent_id:
                    parent = parents.get((parent_id, trace_id))
                    if parent is None:
                        parent = parents[(parent_id, trace_id)] = new_ctx(
                            SpanContext, (trace_id, parent_id, False, sampled, state, True)
                        )
                else:
                    parent = None
            else:
                ctx = _context(trace_id, span_id)
                parent = _context(trace_id, parent_id) if parent_id else None
            span = new_span(_RowSpan)
            span.__dict__ = {
                "_name": name,
                "_context": ctx,
                "_parent": parent,
                "_start_time": start,
                "_end_time": end,
                "_attributes": attributes,
                "_resource": resource,
                "_instrumentation_scope": scope,
            }
            if status == "ERROR":
                span._status, span._events = _error_parts(row)
            append(span)
        return out


def _fields_match(resource: Resource, scope: InstrumentationScope) -> bool:
    """Whether this SDK's ``ReadableSpan`` keeps exactly the fields the fast path fills."""
    try:
        probe = ReadableSpan(
            name="probe",
            context=_context(1, 1),
            resource=resource,
            instrumentation_scope=scope,
        )
        return set(vars(probe)) == {
            "_name",
            "_context",
            "_kind",
            "_instrumentation_info",
            "_instrumentation_scope",
            "_parent",
            "_start_time",
            "_end_time",
            "_attributes",
            "_events",
            "_links",
            "_resource",
            "_status",
        } and not hasattr(ReadableSpan, "__slots__")
    except Exception:  # an SDK that builds it differently: the constructor then
        return False


class Delivery:
    """One drained batch on its way to the sinks; its ``ReadableSpan``\\ s are built once,
    by the first sink that needs them, and shared."""

    __slots__ = ("batch", "_builder", "_spans", "_lock")

    def __init__(self, batch: SpanBatch, builder: SpanBuilder | None) -> None:
        self.batch = batch
        self._builder = builder
        self._spans: list[ReadableSpan] | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.batch.rows)

    def spans(self) -> list[ReadableSpan]:
        """The batch as ``ReadableSpan``\\ s (built on the first call)."""
        with self._lock:
            if self._spans is None:
                builder = self._builder
                if builder is None:
                    raise RuntimeError(
                        "Expected ppetrace to be configured before spans are converted, "
                        "but it has no resource yet. Call ppetrace.configure()."
                    )
                self._spans = builder.build_all(self.batch)
            return self._spans
