"""The compact span form shared by every exporter.

ppetrace's recorder hands its own exporters a :class:`SpanBatch` of plain
:class:`SpanRow` tuples, which skips building OpenTelemetry objects. Any other
OpenTelemetry program reaches the same code through
:func:`rows_from_readable_spans`, so both paths produce identical output.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NoReturn

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

__all__ = ["FrozenAttributes", "SpanBatch", "SpanRow", "rows_from_readable_spans"]

#: The ``otherData`` entry of a trace with spans recorded after the fact
#: (``ppetrace.instrument()``, ``LightningProfiler``): ``{NESTING: BY_TIME}`` makes
#: ``read_chrome_trace`` nest its frame by time (``self_ns``, ``depth``, inheritance;
#: :mod:`exporters._nesting`). Here, where importing it costs nothing.
NESTING, BY_TIME = "ppetrace.nesting", "time"


class FrozenAttributes(dict[Any, Any]):
    """Span attributes that cannot be changed, so that many spans can share one mapping.

    A ``dict`` whose mutating methods raise ``TypeError``. ``ppetrace.trace``
    copies every mapping it is given when the span starts (a snapshot, as
    OpenTelemetry copies attributes), except a ``FrozenAttributes``, which it
    keeps as it is: ppetrace's own code builds one per step and passes it to
    all of that step's spans. Build it from numbers, strings, bools, None or
    tuples of them (the values a snapshot keeps); it does not check. The
    exporters treat it exactly like a ``dict``, in C as in Python.
    """

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            "Expected no change to a FrozenAttributes (span attributes shared between "
            "spans), but received one. Build a new one: FrozenAttributes({**old, key: value})."
        )

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse
    __ior__ = _refuse

    def copy(self) -> dict[Any, Any]:
        """A plain, mutable ``dict`` with the same items."""
        return dict(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenAttributes, (dict(self),))

    def __repr__(self) -> str:
        return f"FrozenAttributes({dict.__repr__(self)})"


class SpanRow(NamedTuple):
    """One finished span.

    Times are epoch nanoseconds within int64 (the exporters compute with them
    exactly, without overflow). ``parent_id`` is 0 for a root span.
    ``attributes`` values are usually ``str``, ``bool``, ``int``, ``float`` or
    tuples of them; an exporter turns any other value into its ``str()``, and
    a value that cannot be encoded at all into ``"<unencodable: TypeName>"``
    (that value only: its row and batch are written as usual).
    ``status`` is ``"UNSET"``, ``"OK"`` or ``"ERROR"``; ``error`` holds the
    exception type and message when the span's block raised, else ``""``.
    """

    name: str
    span_id: int
    parent_id: int
    trace_id: int
    start_ns: int
    end_ns: int
    tid: int
    attributes: Mapping[str, Any]
    status: str = "UNSET"
    error: str = ""


@dataclass
class SpanBatch:
    """A batch of finished spans from one process.

    Rows come in the order the spans ended on each thread (children before
    their parents), not sorted by start time. ``resource`` holds the resource
    attributes (``service.name``,
    ``ppetrace.rank``, ``ppetrace.version`` ...). ``thread_names`` maps a
    ``tid`` to a readable name.
    """

    rows: list[SpanRow]
    resource: Mapping[str, Any] = field(default_factory=dict)
    pid: int = field(default_factory=os.getpid)
    thread_names: dict[int, str] = field(default_factory=dict)


_STATUS = {StatusCode.UNSET: "UNSET", StatusCode.OK: "OK", StatusCode.ERROR: "ERROR"}


def rows_from_readable_spans(spans: Iterable[ReadableSpan]) -> list[SpanBatch]:
    """Turn OpenTelemetry spans into batches, one per distinct resource.

    The thread id comes from the ``thread.id`` attribute when present (the
    OpenTelemetry semantic convention), else 0.
    """
    by_resource: dict[int, SpanBatch] = {}
    for span in spans:
        ctx = span.context
        if ctx is None:
            continue
        resource = span.resource
        key = id(resource)
        batch = by_resource.get(key)
        if batch is None:
            attrs = dict(resource.attributes) if resource is not None else {}
            pid = attrs.get("process.pid", os.getpid())
            batch = SpanBatch(rows=[], resource=attrs, pid=int(pid))  # type: ignore[arg-type]
            by_resource[key] = batch
        span_attrs = dict(span.attributes or {})
        tid = span_attrs.pop("thread.id", 0)
        tname = span_attrs.pop("thread.name", None)
        if tname is not None:
            batch.thread_names.setdefault(int(tid), str(tname))  # type: ignore[arg-type]
        error = ""
        status = _STATUS.get(span.status.status_code, "UNSET")
        if status == "ERROR":
            error = span.status.description or ""
            for event in span.events:
                if event.name == "exception":
                    ea = event.attributes or {}
                    error = f"{ea.get('exception.type', '')}: {ea.get('exception.message', '')}"
                    break
        parent = span.parent
        batch.rows.append(
            SpanRow(
                span.name,
                ctx.span_id,
                parent.span_id if parent is not None else 0,
                ctx.trace_id,
                span.start_time or 0,
                span.end_time or span.start_time or 0,
                int(tid),  # type: ignore[arg-type]
                span_attrs,
                status,
                error,
            )
        )
    return list(by_resource.values())


def concat_rows(batches: Sequence[SpanBatch]) -> list[SpanRow]:
    """All rows of several batches, in order."""
    out: list[SpanRow] = []
    for b in batches:
        out.extend(b.rows)
    return out
