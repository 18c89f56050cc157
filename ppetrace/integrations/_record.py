"""Spans known only when they end, written into the recorder after the fact.

``instrument()`` learns where a training step ends only at the next fetch or
at the end of the optimizer step that closes it, and whether it was a
training step at all only then; torch's optimizer hooks give a start and an
end but no block to wrap. Such spans are appended here, with their own times,
as :class:`exporters.SpanRow` rows of the thread they ran on, to a buffer that
the recorder drains like its own. Their parent is the span that was current
when they started; the spans that ran inside them keep that parent too, and
the exporters nest them by time (:mod:`exporters._nesting`).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from opentelemetry import trace as otel_trace
from opentelemetry.trace.propagation import _SPAN_KEY

from exporters._spans import SpanRow

from ..tracing._recorder import RECORDER, Span, _get_ctx, random_bits

__all__ = ["RowBuffer", "SpanRow", "current_parent", "new_span_id", "next_ids"]

# Ids of spans recorded here live in [3 * 2**61, 2**63): the recorder's own ids count up
# from below 2**62 and would need 2**61 spans to get there, so the two never meet; and they
# stay below 2**63, which the exporters convert on their fast (signed 64-bit) path.
_BASE = 3 << 61
_tuple_new = tuple.__new__  # SpanRow(...) runs NamedTuple's Python __new__; this does not


def _fresh_ids() -> itertools.count[int]:
    return itertools.count(_BASE + random_bits(59))


_ids = _fresh_ids()


def new_span_id() -> int:
    """A span id no other span of this process has."""
    return next(_ids)


def next_ids() -> Any:
    """The id counter itself (``next(counter)`` is :func:`new_span_id` without the call); a
    forked child gets a new one, so hold it no longer than a run of one process."""
    return _ids


def current_parent() -> tuple[int, int]:
    """(trace id, span id) of the span current on this thread, or (the run's trace id, 0)."""
    span = _get_ctx().get(_SPAN_KEY)  # what otel_trace.get_current_span() reads, directly
    if span is None:
        return RECORDER.trace_id, 0
    if type(span) is Span:
        return span.trace_id, span.span_id
    ctx = span.get_span_context() if isinstance(span, otel_trace.Span) else None
    if ctx is not None and ctx.is_valid:
        return ctx.trace_id, ctx.span_id
    return RECORDER.trace_id, 0


class RowBuffer:
    """The rows one thread records after the fact. Make it on that thread (which gives
    the rows their ``tid``); :meth:`record` may also be called from another thread while
    the owner lives, e.g. when ``instrument()`` closes."""

    __slots__ = ("_buf", "pid", "records", "tid")

    def __init__(self) -> None:
        self._buf: Any = RECORDER._new_buffer_object()
        #: the process the buffer belongs to (``RECORDER.pid`` changes in a forked child)
        self.pid: int = RECORDER.pid
        #: the list the recorder drains, and the thread id of its rows: code on a hot path
        #: may append ``SpanRow`` tuples to ``records`` itself (see :meth:`record`)
        self.records: list[Any] = self._buf.records
        self.tid: int = self._buf.tid

    def alive(self) -> bool:
        """Whether the owning thread still runs (the recorder drains a dead one's buffer
        once more and then forgets it: record nothing for it after that)."""
        thread = self._buf.thread()
        return thread is not None and thread.is_alive()

    def close(self) -> None:
        """Record nothing more here: the recorder drains what this buffer holds and then
        forgets it (each ``instrument()`` and ``LightningProfiler`` stage makes one; without
        this, the recorder kept every one of them while their thread lived)."""
        RECORDER.retire(self._buf)

    def adopt(self) -> None:
        """The owning thread ended: record from now on into a buffer of the calling thread,
        the rows keeping the ended thread's id (``instrument()``'s close records what a
        joined training thread left open)."""
        tid = self.tid
        self._buf = RECORDER._new_buffer_object()
        self.records = self._buf.records
        self.tid = tid

    def refresh(self) -> None:
        """In a forked child the parent's buffers are gone: take a buffer of its own."""
        self._buf = RECORDER._new_buffer_object()
        self.pid = RECORDER.pid
        self.records = self._buf.records
        self.tid = self._buf.tid

    def record(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        parent: tuple[int, int],
        attrs: dict[str, Any],
        span_id: int | None = None,
        status: str = "UNSET",
        error: str = "",
    ) -> None:
        """Append the finished span ``name`` (``perf_counter_ns`` times) to the recorder;
        ``span_id`` when its id was handed out before (:func:`new_span_id`); ``status``
        ``"ERROR"`` and ``error`` (its text) for a span whose block raised."""
        rec = RECORDER
        if not rec.enabled:
            return
        if self.pid != rec.pid:  # a forked child (the recorder knows)
            self.refresh()
        records = self.records
        offset = rec.offset_ns
        records.append(
            _tuple_new(
                SpanRow,
                (
                    name,
                    next(_ids) if span_id is None else span_id,
                    parent[1],
                    parent[0],
                    start_ns + offset,
                    end_ns + offset,
                    self.tid,
                    attrs,
                    status,
                    error,
                ),
            )
        )
        if len(records) >= rec.capacity:
            rec.on_full(records)


def _after_fork_in_child() -> None:
    global _ids
    _ids = _fresh_ids()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
