"""The summarised-step API of :class:`~exporters.chrome.ChromeTraceExporter` (see
"Summarised steps" and "Light steps" in its docstring), kept apart from the writing."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ._detail import DetailFilter

__all__ = ["SummaryAPI"]


class SummaryAPI:
    """What loops call to have steps summarised, and the counts of what was."""

    _detail: DetailFilter
    _pid: int
    _lock: threading.RLock
    _bytes: int

    @property
    def spans_summarised(self) -> int:
        """Spans folded into the aggregates of summarised steps (not written as rows)."""
        return self._detail.spans_summarised

    @property
    def steps_summarised(self) -> int:
        """``trainer.step`` rows written with aggregates (``ppetrace.hooks``)."""
        return self._detail.steps_summarised

    def summarise_step(self, tid: int, start_ns: int, *, pid: int | None = None) -> None:
        """Summarise the step that starts at ``start_ns`` (epoch ns, exactly the start its
        ``trainer.step`` row will have) on thread ``tid`` (the rows' ``tid``) of process
        ``pid`` (default: this one): see "Summarised steps" in the class doc.

        Call it once the step has started, before any of its hook-level spans ends.
        Thread-safe, and cheap: it queues the start, the writer does the rest.
        """
        self._detail.publish(self._pid if pid is None else pid, tid, start_ns)

    def step_summariser(self, tid: int, *, pid: int | None = None) -> Callable[[int], None]:
        """``summarise_step`` bound to one thread: a callable of ``start_ns`` alone, for a
        training loop that calls it on every summarised step."""
        return self._detail.publisher(self._pid if pid is None else pid, tid)

    def light_summariser(
        self, tid: int, *, pid: int | None = None
    ) -> Callable[[tuple[int, tuple[Any, ...]]], None]:
        """For a loop whose recorder takes the spans of summarised steps as aggregates
        (``begin_light`` in ``ppetrace.tracing._fold``): a callable of one pair
        ``(start_ns, aggregates)`` that publishes such a step of thread ``tid`` when it
        ends, before its ``trainer.step`` row is made. Its spans count in
        :attr:`spans_summarised`; those of a step whose row never comes, in
        :attr:`light_spans_lost`."""
        return self._detail.light_publisher(self._pid if pid is None else pid, tid)

    @property
    def light_spans_lost(self) -> int:
        """Spans of light steps whose step row never came: their aggregates are not in the
        file (the row was dropped, or the exporter shut down first)."""
        return self._detail.light_lost

    def on_bytes(self, limit: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once, when :attr:`bytes_written` reaches ``limit`` (at once if
        it has): on the writing thread with the exporter's lock held, so it must only set a
        flag. One alarm at a time: a new one replaces the last."""
        with self._lock:
            if self._bytes < limit:
                self._detail.alarm_bytes, self._detail.alarm = limit, callback
                return
        callback()
