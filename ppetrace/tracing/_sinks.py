"""Sinks: where drained spans go, each with its own worker thread and bounded queue.

Takes in: :class:`~._convert.Delivery` objects (one drained batch each) from
the flusher, and flush and shutdown requests. Gives out: calls to one
destination, made on the sink's own daemon thread, so that a slow or hung
destination delays no other sink and never the training thread. Kinds, one
per destination: a ppetrace exporter (``export_batch``), an OpenTelemetry
``SpanExporter`` (``export``), the SDK's ``SimpleSpanProcessor`` and
``BatchSpanProcessor`` (their exporter is handed batches directly: Simple
exports at once, Batch in batches of its ``max_export_batch_size`` on its own
schedule), and any other span processor (``on_end`` per span); the
processors' sinks are in :mod:`._processor_sinks`.

Accounting, per sink: every span offered is delivered, dropped with a reason
(``queue_full`` when the bounded queue is full, ``exporter_error`` when a call
fails, ``timeout`` when a call does not return within ``export_timeout`` and
is abandoned), or still pending. The first failure of a sink is logged with
its count; later ones are counted, not logged.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

from ._convert import Delivery

__all__ = ["REASONS", "BatchExporterSink", "Sink", "SinkStats", "SpanExporterSink", "make_sink"]

_log = logging.getLogger("ppetrace")

REASONS = ("buffer_full", "queue_full", "exporter_error", "timeout")
_SUPPRESS = getattr(otel_context, "_SUPPRESS_INSTRUMENTATION_KEY", "suppress_instrumentation")
_clock = time.monotonic


@dataclass(frozen=True)
class SinkStats:
    """Where the spans meant for one sink went, since it was attached.

    ``recorded == delivered + sum(dropped.values()) + buffered`` always holds.
    ``dropped`` has one count per reason: ``buffer_full`` (a full thread
    buffer found the queue of full buffers at its cap), ``queue_full`` (this
    sink's queue was full), ``exporter_error`` (a call raised, returned
    ``FAILURE`` or reported lost spans), ``timeout`` (a call was abandoned
    after ``export_timeout``). ``buffered`` counts spans still on their way:
    in thread buffers, in this sink's queue or in a call. ``errors`` counts
    failed calls (force_flush and shutdown included); ``last_error`` is the
    text of the last one, or None. ``summarised`` counts the spans that the
    exporter folded into the aggregates of summarised steps
    (``ChromeTraceExporter.spans_summarised``) instead of writing them: delivered
    spans it folded, and the spans of *light* steps, which the recorder took as
    aggregates without making rows (``ppetrace.tracing._light``: the Trainer's
    summarised steps while the exporter is the only sink). Those are in no other
    count: never recorded as rows, they are not in ``recorded`` or ``delivered``.
    """

    name: str
    recorded: int
    delivered: int
    dropped: dict[str, int]
    buffered: int
    errors: int
    last_error: str | None
    summarised: int = 0

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


class _Job:
    __slots__ = ("kind", "delivery", "seq")

    def __init__(self, kind: str, delivery: Delivery | None, seq: int) -> None:
        self.kind = kind  # "spans", "flush" or "shutdown"
        self.delivery = delivery
        self.seq = seq


class _Call:
    """One call into the destination, timed against ``export_timeout``."""

    __slots__ = ("n", "started", "abandoned")

    def __init__(self, n: int) -> None:
        self.n = n
        self.started = _clock()
        self.abandoned = False


class Sink:
    """One destination, fed by its own daemon thread from a queue of at most
    ``queue_spans`` spans. Subclasses implement :meth:`_spans` (and may
    override :meth:`_flush`, :meth:`_shutdown` and the idle schedule)."""

    def __init__(
        self, target: Any, *, queue_spans: int, export_timeout: float, baseline: tuple[int, int]
    ) -> None:
        self.target = target
        self.name = _describe(target)
        self.queue_spans = queue_spans
        self.export_timeout = export_timeout
        self.baseline = baseline  # the recorder's (taken, buffer_full) when attached
        self.received = 0
        self.delivered = 0
        self.dropped = dict.fromkeys(REASONS, 0)
        self.errors = 0
        self.last_error: str | None = None
        self._logged: set[str] = set()
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Job] = deque()
        self._pending = 0  # spans queued, in a call, or held for a later call
        self._seq = 0
        self._done = 0
        self._call: _Call | None = None
        self._stalled = False
        self._closed = False
        self._given_up = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"<ppetrace sink {self.name}>"

    # -- the flusher's side ----------------------------------------------------

    def offer(self, delivery: Delivery) -> None:
        """Queue a batch, or count it as ``queue_full`` when it does not fit."""
        n = len(delivery)
        with self._cond:
            self.received += n
            if self._closed or self._pending + n > self.queue_spans:
                self.dropped["queue_full"] += n
                self._warn_once(
                    "queue_full",
                    "ppetrace: the queue of %s is full (%d spans); %d spans dropped "
                    "(stats(): queue_full). It does not keep up; further drops are counted, "
                    "not logged.",
                    self.name,
                    self.queue_spans,
                    n,
                )
                return
            self._pending += n
            self._push("spans", delivery)

    def request(self, kind: str) -> int:
        """Queue a ``"flush"``, a ``"shutdown"`` (the target's ``shutdown()``, then the
        worker ends) or a ``"stop"`` (the worker ends, the target stays as it is; for span
        processors that the user owns); return the sequence number to wait for."""
        with self._cond:
            if self._closed:
                return self._done
            if kind in ("shutdown", "stop"):
                self._closed = True
                if kind == "stop" and self._thread is None and not self._queue:
                    return self._done  # never started: nothing to end
            return self._push(kind, None)

    def _push(self, kind: str, delivery: Delivery | None) -> int:
        self._seq += 1
        self._queue.append(_Job(kind, delivery, self._seq))
        self._cond.notify_all()
        if self._thread is None or self._pid != os.getpid():
            self._pid = os.getpid()
            self._thread = threading.Thread(
                target=self._work, name=f"ppetrace-sink {self.name}"[:60], daemon=True
            )
            self._thread.start()
        return self._seq

    def wait(self, seq: int) -> bool:
        """Wait until job ``seq`` is done; False if a call of it was abandoned after
        ``export_timeout``, or the sink is stalled in one abandoned before."""
        with self._cond:
            while self._done < seq:
                if self._stalled:
                    return False
                call = self._call
                if call is None:
                    self._cond.wait(self.export_timeout)
                    continue
                left = call.started + self.export_timeout - _clock()
                if left <= 0:
                    self._abandon(call)
                    return False
                self._cond.wait(left)
            return True

    def check_timeout(self) -> None:
        """Abandon a call that has run past ``export_timeout`` (the flusher calls this)."""
        with self._cond:
            call = self._call
            if call is not None and _clock() - call.started >= self.export_timeout:
                self._abandon(call)

    def give_up(self) -> None:
        """At shutdown: count what is still queued or held here as ``timeout``."""
        with self._cond:
            call = self._call
            if call is not None:
                self._abandon(call)
            left = self._pending
            if left > 0:
                self.dropped["timeout"] += left
                self._pending = 0
            self._queue.clear()
            self._closed = self._given_up = True
            self._done = self._seq
            self._cond.notify_all()
        if left > 0:
            _log.warning(
                "ppetrace: %s did not finish within export_timeout=%g s at shutdown; the %d "
                "spans still queued for it are counted as dropped (timeout).",
                self.name,
                self.export_timeout,
                left,
            )

    def _abandon(self, call: _Call) -> None:
        """Lock held."""
        if call.abandoned:
            return
        call.abandoned = True
        self._call = None
        self._stalled = True
        self.dropped["timeout"] += call.n
        self._pending -= call.n
        self.errors += 1
        self.last_error = (
            f"a call to {self.name} did not return within export_timeout="
            f"{self.export_timeout:g} s; its {call.n} spans are counted as dropped (timeout)"
        )
        self._warn_once("timeout", "ppetrace: %s", self.last_error)
        self._cond.notify_all()

    def stats(self, recorded: int, buffer_full: int, buffered: int) -> SinkStats:
        # spans the target accepted but still writes on a thread of its own (a Chrome
        # trace's large batch): not delivered until they are in the file
        with self._cond:
            dropped = dict(self.dropped)
            dropped["buffer_full"] = buffer_full
            flying = 0
            if self._call is None:  # (during a call its spans are pending, not delivered)
                flying = getattr(self.target, "spans_in_flight", 0)
                flying = min(flying, self.delivered) if type(flying) is int and flying > 0 else 0
            return SinkStats(
                name=self.name,
                recorded=recorded,
                delivered=self.delivered - flying,
                dropped=dropped,
                buffered=buffered + self._pending + flying,
                errors=self.errors,
                last_error=self.last_error,
                summarised=_summarised(self.target),
            )

    # -- the worker's side -----------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    idle = self._idle_after()
                    if idle is not None and idle <= 0:
                        break
                    self._cond.wait(idle)
                job = self._queue.popleft() if self._queue else None
            if job is None:
                self._on_idle()
                continue
            try:
                if job.kind == "spans":
                    assert job.delivery is not None
                    self._spans(job.delivery)
                elif job.kind == "flush":
                    self._flush()
                elif job.kind == "shutdown":
                    self._shutdown()
                else:
                    self._stop()
            except BaseException as exc:  # a bug here must not kill the worker silently
                self._failed(f"{type(exc).__name__}: {exc}", 0, exc)
            with self._cond:
                self._done = max(self._done, job.seq)
                self._cond.notify_all()
                if job.kind in ("shutdown", "stop"):
                    return

    def _run(
        self, n: int, fn: Callable[[], Any], landed: Callable[[Any], int] | None = None
    ) -> tuple[bool, Any]:
        """Call ``fn`` for ``n`` spans, timed. Returns (False, None) if the call was
        abandoned meanwhile (its spans are counted already: ``timeout``; when it returns
        after all, ``landed(result)`` of them, all by default, move to delivered), else
        (True, result); an exception is counted as ``exporter_error`` for the ``n``
        spans."""
        call = _Call(n)
        with self._cond:
            self._call = call
            self._cond.notify_all()
        try:
            result = fn()
        except Exception as exc:
            with self._cond:
                if call.abandoned:
                    self._stalled = False
                    return False, None
                self._call = None
            self._failed(f"{type(exc).__name__}: {exc}", n, exc, call)
            return False, None
        with self._cond:
            if call.abandoned:  # it came back after all: the sink works again
                self._stalled = False
                moved = n if landed is None else max(0, min(n, landed(result)))
                if moved and not self._given_up:  # and (some of) its spans were delivered
                    self.dropped["timeout"] -= moved
                    self.delivered += moved
                self._cond.notify_all()
                return False, None
            self._call = None
        return True, result

    def _account(self, delivered: int, failed: int, error: str | None = None) -> None:
        """Count spans of a completed call (``failed`` as exporter_error)."""
        with self._cond:
            if self._given_up:
                return
            self.delivered += delivered
            self._pending -= delivered + failed
            self.dropped["exporter_error"] += failed
        if failed and error is not None:
            self._note_error(error, failed, None)

    def _failed(
        self, error: str, n: int, exc: BaseException | None, call: _Call | None = None
    ) -> None:
        with self._cond:
            if self._given_up:
                return
            self._pending -= n
            self.dropped["exporter_error"] += n
        self._note_error(error, n, exc)

    def _note_error(self, error: str, n: int, exc: BaseException | None) -> None:
        with self._cond:
            self.errors += 1
            self.last_error = error
            first = "exporter_error" not in self._logged
            self._logged.add("exporter_error")
        if first:
            _log.error(
                "ppetrace: %s failed (%s); %d spans lost, counted in stats() as "
                "exporter_error. Further failures of this sink are counted, not logged.",
                self.name,
                error.splitlines()[0] if error else "",
                n,
                exc_info=None if exc is None else (type(exc), exc, exc.__traceback__),
            )
        else:
            _log.debug("ppetrace: %s failed again (%s); %d spans lost", self.name, error, n)

    def _warn_once(self, reason: str, msg: str, *args: Any) -> None:
        """Lock held."""
        if reason not in self._logged:
            self._logged.add(reason)
            _log.warning(msg, *args)

    # -- what subclasses do ----------------------------------------------------

    def _spans(self, delivery: Delivery) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        self._call_method("force_flush")

    def _shutdown(self) -> None:
        self._call_method("shutdown")

    def _stop(self) -> None:
        """The worker ends without shutting the target down: deliver what is held."""

    def _call_method(self, method: str, target: Any = None) -> None:
        fn = getattr(self.target if target is None else target, method, None)
        if fn is None:
            return
        ok, result = self._run(0, fn)
        if ok and result is False:
            said = getattr(self.target, "last_error", None)
            self._note_error(str(said) if said else f"{method}() returned False", 0, None)

    def _idle_after(self) -> float | None:
        """Seconds until :meth:`_on_idle` is due with an empty queue (None: never)."""
        return None

    def _on_idle(self) -> None:
        """Runs when :meth:`_idle_after` reached 0 and nothing is queued."""


def _landed(n: int, result: Any) -> int:
    """The spans an OpenTelemetry export call that returned ``result`` delivered."""
    return 0 if result == SpanExportResult.FAILURE else n


class BatchExporterSink(Sink):
    """A ppetrace exporter: ``export_batch(batch)``, whole batches. Its optional
    ``spans_lost`` count (spans of accepted batches that never reached the output,
    such as a write that failed on a full disk) moves spans from delivered to
    ``exporter_error``."""

    def __init__(self, target: Any, **kw: Any) -> None:
        super().__init__(target, **kw)
        self._lost_seen = _lost(target)

    def _spans(self, delivery: Delivery) -> None:
        n = len(delivery)
        ok, _ = self._run(n, lambda: self.target.export_batch(delivery.batch))
        if ok:
            self._account(n, 0)
        self._reconcile()

    def _flush(self) -> None:
        super()._flush()
        self._reconcile()

    def _shutdown(self) -> None:
        super()._shutdown()
        self._reconcile()

    def _reconcile(self) -> None:
        lost = _lost(self.target)
        extra = lost - self._lost_seen
        if extra > 0:
            self._lost_seen = lost
            with self._cond:
                self.delivered -= extra
                self.dropped["exporter_error"] += extra
            error = getattr(self.target, "last_error", None) or f"{extra} spans not written"
            self._note_error(str(error), extra, None)


def _summarised(target: Any) -> int:
    value = getattr(target, "spans_summarised", 0)
    return value if isinstance(value, int) else 0


def _lost(target: Any) -> int:
    value = getattr(target, "spans_lost", 0)
    return value if isinstance(value, int) else 0


class SpanExporterSink(Sink):
    """An OpenTelemetry ``SpanExporter``: ``export(spans)`` in chunks of ``chunk``."""

    chunk = 512

    def exporter(self) -> Any:
        return self.target

    def _spans(self, delivery: Delivery) -> None:
        n = len(delivery)
        try:
            spans = delivery.spans()
        except Exception as exc:
            self._failed(f"converting spans failed: {type(exc).__name__}: {exc}", n, exc)
            return
        self._export(spans)

    def _export(self, spans: Sequence[ReadableSpan]) -> None:
        exporter = self.exporter()
        step = self.chunk
        for i in range(0, len(spans), step):
            part = spans[i : i + step]
            ok, result = self._run(
                len(part),
                functools.partial(self._export_call, exporter, part),
                functools.partial(_landed, len(part)),
            )
            if not ok:  # raised (counted) or abandoned (counted as timeout): go on
                continue
            if result == SpanExportResult.FAILURE:
                self._account(0, len(part), f"{self.name} returned FAILURE")
            else:
                self._account(len(part), 0)

    def _export_call(self, exporter: Any, part: Sequence[ReadableSpan]) -> Any:
        token = otel_context.attach(otel_context.set_value(_SUPPRESS, True))
        try:
            return exporter.export(part)
        finally:
            otel_context.detach(token)


def make_sink(target: Any, **kw: Any) -> Sink:
    """The sink for an exporter given to ``configure`` or ``add_exporter``."""
    if hasattr(target, "export_batch"):
        return BatchExporterSink(target, **kw)
    return SpanExporterSink(target, **kw)


def _describe(target: Any) -> str:
    try:
        kind = type(target).__name__
        inner = getattr(target, "span_exporter", None)
        if inner is not None:
            return f"{kind}({type(inner).__name__})"
        text = repr(target)
        return text if len(text) <= 120 and not text.startswith("<") else kind
    except Exception:
        return type(target).__name__
