"""The flusher: moves finished spans from the thread buffers to the sinks, on a schedule.

Takes in: the recorder's thread buffers and queued full buffers
(:meth:`Recorder.take`), batches from other processes (:meth:`Flusher.inject`,
DataLoader workers), and the sinks that :mod:`._setup` attaches. Gives out:
each drained batch, offered to every sink's bounded queue
(:mod:`._sinks`). Method: a daemon thread, started on first use (never at
import), drains every ``interval`` seconds and whenever a thread's buffer
fills, so a SIGKILL loses at most about one interval; draining is cheap
(lists are moved, nothing is converted), and every conversion and export runs
on the sinks' own threads. :meth:`Flusher.flush` drains on the calling thread
and waits until each sink has delivered everything, or abandoned a call after
``export_timeout``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from exporters._spans import SpanBatch

from ._convert import Delivery, SpanBuilder
from ._processor_sinks import make_processor_sink
from ._recorder import Recorder
from ._sinks import Sink, SinkStats, make_sink

__all__ = ["Flusher"]

_log = logging.getLogger("ppetrace")
#: how many shut-down sinks' final stats ``stats().closed`` keeps
CLOSED_KEPT = 16
_PART = 65_536  # spans per batch offered to the sinks


class Flusher:
    """Drains the recorder into the sinks (see the module doc)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.interval = 1.0
        self.export_timeout = 30.0
        self.queue_spans = 1_048_576
        self.builder: SpanBuilder | None = None
        self.resource_attrs: dict[str, Any] = {}
        self.sinks: list[Sink] = []  # for exporters, in the order given
        self.processor: Any = None  # the provider's active span processor, or None
        self._processor_sinks: dict[int, Sink] = {}
        # called at each drain before the buffers are taken (DataLoader worker receivers)
        self.sources: list[Callable[[], None]] = []
        self.flushes = 0
        #: the final stats of the last sinks shut down (``stats().closed``)
        self.closed: deque[SinkStats] = deque(maxlen=CLOSED_KEPT)
        self._dropped_said = False  # buffer_full drops were logged (once per process)
        self._lock = threading.RLock()  # one drain at a time
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._stop = False
        recorder.wake = self.wake

    # -- the schedule ----------------------------------------------------------

    def wake(self) -> None:
        """Drain soon, on the flusher thread (a full buffer calls this)."""
        self.ensure_started()
        self._wake.set()

    def ensure_started(self) -> None:
        """Start the flusher thread of this process if it is not running."""
        thread = self._thread
        if thread is not None and self._pid == os.getpid() and thread.is_alive():
            return
        with self._lock:
            thread = self._thread
            if thread is not None and self._pid == os.getpid() and thread.is_alive():
                return
            self._pid = os.getpid()
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="ppetrace-flusher", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the flusher thread (at shutdown); a later span starts it again."""
        self._stop = True
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop or self._pid != os.getpid():
                return
            try:
                self.drain(background=True)
                for sink in self.all_sinks():
                    sink.check_timeout()
            except Exception:  # the flusher must outlive any failure
                _log.exception("ppetrace: a scheduled flush failed")

    # -- draining --------------------------------------------------------------

    def drain(self, *, background: bool) -> int:
        """Run the before-flush hooks, take every finished span and offer it to every
        sink. ``background``: the hooks must not wait (``Recorder.inline_flush``).
        Returns the number of spans offered."""
        rec = self.recorder
        with self._lock:
            rec.inline_flush = background
            try:
                for hook in list(rec.before_flush):
                    try:
                        hook()
                    except Exception:
                        rec.hook_errors += 1
                        _log.exception("ppetrace: before-flush hook %r failed", hook)
            finally:
                rec.inline_flush = False
            for source in list(self.sources):
                try:
                    source()
                except Exception:
                    _log.exception("ppetrace: span source %r failed", source)
            sinks = self.all_sinks()  # before take(): a new sink counts these spans
            rows, names = rec.take()
            if rec.dropped and not self._dropped_said:
                self._dropped_said = True
                _log.warning(
                    "ppetrace: %d spans were dropped: a thread's buffer filled while "
                    "max_queued_buffers=%d full buffers waited for the flusher (stats(): "
                    "buffer_full). Record fewer spans, raise buffer_spans or "
                    "max_queued_buffers, or lower flush_interval. Later drops are counted, "
                    "not logged.",
                    rec.dropped,
                    rec.max_queued_buffers,
                )
            if not rows:
                return 0
            self.flushes += 1
            for i in range(0, len(rows), _PART):  # a sink's queue takes what fits
                part = rows[i : i + _PART] if len(rows) > _PART else rows
                self._offer(SpanBatch(part, self.resource_attrs, rec.pid, names), sinks)
            return len(rows)

    def inject(self, batch: SpanBatch) -> None:
        """Offer spans recorded elsewhere (another process) to every sink; they count as
        recorded and taken here."""
        if not batch.rows:
            return
        with self._lock:
            sinks = self.all_sinks()
            self.recorder.count_taken(len(batch.rows))
            self._offer(batch, sinks)

    def _offer(self, batch: SpanBatch, sinks: list[Sink]) -> None:
        """Lock held."""
        delivery = Delivery(batch, self.builder)
        for sink in sinks:
            sink.offer(delivery)

    def all_sinks(self) -> list[Sink]:
        """The exporter sinks, then one per span processor of the provider (processors
        added to the provider later are found here)."""
        sinks = list(self.sinks)
        processor = self.processor
        if processor is None:
            return sinks
        inner = getattr(processor, "_span_processors", None)
        processors = (processor,) if inner is None else tuple(inner)
        known = self._processor_sinks
        if len(known) != len(processors) or any(id(p) not in known for p in processors):
            with self._lock:
                fresh = {}
                for p in processors:
                    fresh[id(p)] = known.get(id(p)) or make_processor_sink(p, **self._kw())
                for key, gone in known.items():
                    if key not in fresh:
                        gone.request("stop")  # the processor is the user's: not shut down
                self._processor_sinks = known = fresh
        sinks.extend(known.values())
        return sinks

    def _kw(self) -> dict[str, Any]:
        return {
            "queue_spans": self.queue_spans,
            "export_timeout": self.export_timeout,
            "baseline": self.recorder.baseline(),
        }

    def new_sink(self, exporter: Any) -> Sink:
        """A sink for ``exporter`` whose accounting starts now."""
        return make_sink(exporter, **self._kw())

    def reset_processor_sinks(self) -> None:
        """Forget the processors' sinks (a new provider); their threads end."""
        for sink in self._processor_sinks.values():
            sink.request("stop")
        self._processor_sinks = {}

    # -- flushing --------------------------------------------------------------

    def flush(self, *, wait: bool = True, sinks: list[Sink] | None = None) -> bool:
        """Drain on this thread; with ``wait``, also ask every sink to flush and wait
        until it has (each at most ``export_timeout`` per call). Returns False if some
        sink abandoned a call or is stalled in one."""
        self.drain(background=False)
        if not wait:
            self.wake()
            return True
        targets = self.all_sinks() if sinks is None else sinks
        seqs = [(sink, sink.request("flush")) for sink in targets]
        ok = True
        for sink, seq in seqs:
            ok = sink.wait(seq) and ok
        return ok

    def close(self, sinks: list[Sink], *, flush: bool = False) -> None:
        """Shut ``sinks`` down (their queues are delivered first; with ``flush``, their
        targets' ``force_flush`` runs before ``shutdown``, in the same wait); a sink that does
        not finish within ``export_timeout`` gives up, counting what it still holds."""
        if flush:
            for sink in sinks:
                sink.request("flush")
        seqs = [(sink, sink.request("shutdown")) for sink in sinks]
        for sink, seq in seqs:
            if not sink.wait(seq):
                sink.give_up()
        full = self.recorder.counts()[1]
        for sink in sinks:  # what each delivered, for stats() after it is gone
            dropped = full - sink.baseline[1]
            self.closed.append(sink.stats(sink.received + dropped, dropped, 0))

    # -- stats and fork --------------------------------------------------------

    def sink_stats(self) -> tuple[SinkStats, ...]:
        """Per sink: recorded = delivered + dropped + buffered (one consistent snapshot)."""
        with self._lock:
            taken, buffer_full, buffered = self.recorder.counts()
            out = []
            for sink in self.all_sinks():
                base_taken, base_full = sink.baseline
                full = buffer_full - base_full
                recorded = (taken - base_taken) + full + buffered
                out.append(sink.stats(recorded, full, buffered))
            return tuple(out)

    def reset_after_fork(self) -> None:
        """In a forked child: no thread, no sinks (the parent's exporters stay the
        parent's)."""
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._thread = None
        self._pid = os.getpid()
        self.sinks = []
        self.processor = None
        self._processor_sinks = {}
        self.sources = []
        self.flushes = 0
        self.closed = deque(maxlen=CLOSED_KEPT)
        self._dropped_said = False  # the child's own first drop is said too
