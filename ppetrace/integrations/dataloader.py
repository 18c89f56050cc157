"""DataLoader workers: spans recorded in worker processes reach this process's trace.

Takes in: a ``torch.utils.data.DataLoader`` with ``num_workers > 0`` (fork or
spawn), whose ``Dataset.__getitem__`` and ``collate_fn`` may call
:func:`ppetrace.trace`, and which ppetrace records in its workers as well.
Gives out: those spans, in this process's sinks (Chrome file, span
processors), in the run's trace, each worker on its own track named
``dataloader worker N`` under this process. Method: :func:`trace_workers`
wraps the loader's ``worker_init_fn``. In each worker it points the recorder
at the parent's trace (and, for workers that live one epoch, at the span open
when iteration started) and replaces the exporters with one that puts the
rows on a multiprocessing queue (written at once, no feeder thread), drained by
the parent's flusher. A worker
pays only for recording and pickling, never for the parent's exporters; its
own flusher sends at the parent's ``flush_interval`` (persistent workers, which
outlive the run's last flush and die with the process: every
:data:`PERSISTENT_INTERVAL`), so a worker that dies loses at most that interval,
and one that ends normally sends the rest when it exits. The Trainer calls
:func:`trace_workers` on its loaders; for a plain loop, call it once before iterating.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler as _ForkingPickler
from typing import Any, TypeVar

from opentelemetry import trace as otel_trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from exporters._spans import FrozenAttributes, SpanBatch, SpanRow

from ..tracing import _recorder, _setup

__all__ = [
    "PERSISTENT_INTERVAL",
    "settle_workers",
    "stop_workers",
    "trace_loaders",
    "trace_workers",
    "tracing_iter",
    "tracked",
    "workers_mark",
]

_log = logging.getLogger("ppetrace")
L = TypeVar("L")

_channels: dict[tuple[int, str], _Channel] = {}
_channels_lock = threading.Lock()
#: ids of the queues of retired channels (their loaders' next workers get a new channel)
_retired: set[int] = set()


def trace_workers(loader: L) -> L:
    """Trace the worker processes of ``loader`` into this process's trace; returns it.

    Does nothing for anything that is not a ``torch.utils.data.DataLoader``
    with ``num_workers > 0``, or while tracing is disabled. Calling it again on
    the same loader (each epoch) only updates the parent span of the workers
    started next. Call it before ``iter(loader)``; workers already running
    (``persistent_workers``) keep what they were started with.
    """
    try:
        from torch.utils.data import DataLoader
    except ImportError:  # pragma: no cover - torch is a dependency
        return loader
    if not isinstance(loader, DataLoader) or loader.num_workers <= 0:
        return loader
    if not _recorder.RECORDER.enabled:
        return loader
    init = loader.worker_init_fn
    if not isinstance(init, _WorkerInit):
        channel = _channel(loader.multiprocessing_context)
        init = _WorkerInit(init, channel.queue)
        loader.worker_init_fn = init
    elif id(init.queue) in _retired:  # its channel was given up: the next workers get a new one
        init.queue = _channel(loader.multiprocessing_context).queue
    init.trace_id = _recorder.RECORDER.trace_id
    init.interval = _setup.FLUSHER.interval
    init.parent_id = 0 if loader.persistent_workers else _current_span_id()
    if loader.persistent_workers:
        # such workers live until the loader goes, often past the run's last flush (and
        # die with the process, with what they hold): they send at a short interval, and
        # settle_workers() waits for them before a run's last flush
        init.interval = min(init.interval, PERSISTENT_INTERVAL)
        global _persistent
        _persistent = True
    return loader


#: how often persistent workers send their spans (seconds)
PERSISTENT_INTERVAL = 0.01
_persistent = False
#: the DataLoader iterators with workers that runs made (:func:`tracked`), by the order
#: they came in and the thread that made them
_live: weakref.WeakValueDictionary[tuple[int, int], Any] = weakref.WeakValueDictionary()
_live_count = itertools.count(1)


def tracing_iter(
    orig: Callable[[Any], Any],
    when: Callable[[], bool] | None = None,
    span: str | None = None,
    started: Callable[[Any, Any, int], None] | None = None,
) -> Callable[[Any], Any]:
    """``DataLoader.__iter__`` made to call :func:`trace_workers` on the loader first
    (while ``when()`` is true, when given) and, with ``span``, to run inside a span of
    that name (the workers' start), whose start ``started(loader, iterator, start_ns)``
    is told; a failure is logged, never raised."""

    @functools.wraps(orig)
    def __iter__(loader: Any) -> Any:
        if when is None or when():
            try:
                trace_workers(loader)
            except Exception:  # telemetry never breaks training
                _log.exception("ppetrace: tracing the workers of %r failed", loader)
            if span is not None:
                with _recorder.trace(span) as opened:
                    iterator = orig(loader)
                start = getattr(opened, "start_ns", None)
                if started is not None and start:
                    try:
                        started(loader, iterator, start)
                    except Exception:
                        _log.exception("ppetrace: noting the start of %r failed", loader)
            else:
                iterator = orig(loader)
            return tracked(iterator)
        return orig(loader)

    return __iter__


def trace_loaders() -> Callable[[], None]:
    """Patch ``DataLoader.__iter__`` to call :func:`trace_workers` on each loader before its
    workers start (for a loop that gets its loaders from elsewhere, as Lightning does);
    returns the function that takes the patch out again (a patch that someone replaced
    since is left to them)."""
    from torch.utils.data import DataLoader

    before = DataLoader.__dict__["__iter__"]
    __iter__ = tracing_iter(before)
    DataLoader.__iter__ = __iter__  # type: ignore[method-assign]

    def remove() -> None:
        if DataLoader.__dict__.get("__iter__") is __iter__:
            DataLoader.__iter__ = before  # type: ignore[method-assign]

    return remove


def settle_workers() -> None:
    """Before a run's last flush: when a loader with persistent workers was traced in
    this process, wait two of their send intervals, so that what their last batches
    recorded is on its way (a non-persistent worker sends the rest when it exits); then
    warn of a message cut off in a workers' pipe (:meth:`_Channel.report_cut`)."""
    if _persistent:
        time.sleep(2 * PERSISTENT_INTERVAL)
    with _channels_lock:
        channels = list(_channels.values())
    for channel in channels:
        channel.report_cut()


def tracked(iterator: L) -> L:
    """``iterator``, noted for :func:`stop_workers` with the thread that made it, when it
    is a DataLoader iterator whose workers live one epoch (held weakly: it still goes
    when its last reference does). Persistent workers are left alone: they send every
    :data:`PERSISTENT_INTERVAL`, and their loader reuses the iterator."""
    if hasattr(iterator, "_shutdown_workers") and not getattr(
        iterator, "_persistent_workers", True
    ):
        with _channels_lock:
            _live[next(_live_count), threading.get_ident()] = iterator
    return iterator


def workers_mark() -> int:
    """A mark for :func:`stop_workers`: the iterators noted after it are a run's own."""
    with _channels_lock:
        return max((n for n, _ in list(_live)), default=0)


def stop_workers(after: int) -> None:
    """Shut down the worker processes of the DataLoader iterators that this thread made
    after the mark ``after`` (:func:`workers_mark`, :func:`tracked`) and that still
    live, as each iterator's own ``__del__`` would: each worker sends the spans it holds
    as it exits. For the end of a run that an error ended: the traceback keeps the
    iterator, and a trace closed before its workers exit lacks their spans, which no
    count would show. Only for an iterator no one uses after: a stopped one cannot go
    on. torch's own shutdown waits up to 5 s for a worker busy with an item before it ends
    it (the wait its ``__del__`` would have later). A failure is logged, never raised; a
    ``KeyboardInterrupt`` goes on to the caller, whose cleanup runs in a ``finally``."""
    me = threading.get_ident()
    with _channels_lock:
        found = [it for (n, tid), it in list(_live.items()) if n > after and tid == me]
    for it in found:
        try:
            it._shutdown_workers()  # idempotent: it checks whether it ran
        except Exception:
            _log.exception("ppetrace: shutting down the DataLoader workers failed")


def _current_span_id() -> int:
    sc = otel_trace.get_current_span().get_span_context()
    return sc.span_id if sc.is_valid and sc.trace_id == _recorder.RECORDER.trace_id else 0


class _Channel:
    """The parent's end: a multiprocessing queue, drained at each flush without ever
    blocking.

    The workers ``put`` framed messages (multiprocessing's own framing: a 4-byte
    big-endian length, or -1 and an 8-byte one, then the pickle). The parent reads the
    pipe's bytes without blocking and unpickles whole messages only: a worker that dies
    while writing a message larger than the pipe's buffer (the OOM killer; the loader
    terminating a worker stuck at exit) leaves a part of one, which a blocking ``get``
    waited for forever, holding the flusher's lock (every flush, the run's end and the
    process's exit waited behind it). A part that gets no further for
    :data:`STALLED_AFTER` seconds is given up (logged, its spans lost) and the channel
    retired: its write lock may be held by the dead worker, so later loaders get a new
    one."""

    def __init__(self, context: Any) -> None:
        # a SimpleQueue writes on put() (no feeder thread): what a worker's flusher has
        # sent is in the pipe, even if the worker is killed the next moment
        self.queue = context.SimpleQueue()
        self.pid = os.getpid()
        # Windows: the reader is a pipe handle, not a file descriptor: read whole
        # messages through the queue there (a worker killed mid-message can block)
        self._fd = -1 if sys.platform == "win32" else self.queue._reader.fileno()
        if self._fd >= 0:
            os.set_blocking(self._fd, False)
        self._buf = bytearray()
        self._since = 0.0  # when the part in _buf last grew (0: no part)
        self.retired = False
        self.lost_messages = 0
        self._reported = 0.0  # the _since of the part last reported by report_cut

    def _read(self) -> bool:
        """Append what the pipe holds to the buffer; whether anything came."""
        got = False
        while self._fd >= 0:
            try:
                chunk = os.read(self._fd, 1 << 20)
            except BlockingIOError:
                return got
            except OSError:  # closed under us
                return got
            if not chunk:
                return got
            self._buf += chunk
            got = True
        return got

    def _messages(self) -> list[Any]:
        """The whole messages at the front of the buffer, unpickled."""
        out = []
        buf = self._buf
        at = 0
        while len(buf) - at >= 4:
            (size,) = struct.unpack_from("!i", buf, at)
            head = 4
            if size == -1:
                if len(buf) - at < 12:
                    break
                (size,) = struct.unpack_from("!Q", buf, at + 4)
                head = 12
            if len(buf) - at - head < size:
                break
            out.append(_ForkingPickler.loads(bytes(buf[at + head : at + head + size])))
            at += head + size
        del buf[:at]
        return out

    def drain(self) -> None:
        """Hand every batch the workers have sent so far to the sinks (the flusher's
        drain calls this, on its lock). Never blocks."""
        if self.pid != os.getpid():
            return
        if sys.platform == "win32":
            self._drain_queue()
            return
        grew = self._read()
        try:
            messages = self._messages()
        except Exception:  # not a message of ours: drop what is there
            _log.exception("ppetrace: a DataLoader worker's message could not be read")
            self._buf.clear()
            messages = []
        now = time.monotonic()
        if not self._buf:
            self._since = 0.0
        elif grew or not self._since:
            self._since = now
        elif now - self._since > STALLED_AFTER:
            self._give_up()
        for message in messages:
            self._inject(*message)

    def _drain_queue(self) -> None:
        """Windows: whole messages through the queue's own reads."""
        while True:
            try:
                if self.queue.empty():
                    return
                message = self.queue.get()
            except (EOFError, OSError):  # the queue was closed under us
                return
            self._inject(*message)

    @staticmethod
    def _inject(worker_id: int, rows: Any, names: Any) -> None:
        """One worker's batch, to the sinks."""
        labels = {
            tid: f"dataloader worker {worker_id}"
            if i == 0
            else f"dataloader worker {worker_id}: {name}"
            for i, (tid, name) in enumerate(names)
        }
        batch = SpanBatch(
            [SpanRow(*row) for row in rows], _setup.FLUSHER.resource_attrs, os.getpid(), labels
        )
        _setup.FLUSHER.inject(batch)

    def report_cut(self) -> None:
        """At a run's end: say so if a part of a message waits (a worker killed while it
        sent it), once per part; the part stays, in case its rest still comes."""
        if self.pid != os.getpid() or self._fd < 0:
            return
        with _setup.FLUSHER._lock:  # the one reader of the pipe: the flusher's drain
            self.drain()
            size = len(self._buf)
            if not size or self._reported == self._since:
                return
            self._reported = self._since
        _log.warning(
            "ppetrace: %d bytes of a message from the DataLoader workers are incomplete at "
            "the end of the run (a worker killed while it sent them?): the spans in it are "
            "not in the trace, nor those of workers that waited to send after it.",
            size,
        )

    def _give_up(self) -> None:
        """A part of a message that got no further: its worker died while sending."""
        self.lost_messages += 1
        _log.warning(
            "ppetrace: a DataLoader worker stopped while sending its spans (killed, or "
            "terminated by the loader): %d bytes of its last message are lost, with its "
            "spans. Later loaders' workers send through a new channel.",
            len(self._buf),
        )
        self._buf.clear()
        self._since = 0.0
        with _channels_lock:
            self.retired = True
            _retired.add(id(self.queue))  # (the queue object lives on in _WorkerInits)
            for key, channel in list(_channels.items()):
                if channel is self:
                    del _channels[key]
        # read no more: what comes next would be the rest of a message given up
        with contextlib.suppress(ValueError):
            _setup.FLUSHER.sources.remove(self.drain)
        with contextlib.suppress(OSError):
            self.queue._reader.close()
        self._fd = -1


#: seconds a part of a worker's message may wait for the rest before it is given up
STALLED_AFTER = 10.0


def _channel(context: Any) -> _Channel:
    if context is None:
        import multiprocessing

        # the start method the loader's workers will use (they fix it when they start)
        context = multiprocessing.get_context()
    elif isinstance(context, str):
        import multiprocessing

        context = multiprocessing.get_context(context)
    key = (os.getpid(), context.get_start_method())
    with _channels_lock:
        channel = _channels.get(key)
        if channel is None:
            channel = _channels[key] = _Channel(context)
            _setup.FLUSHER.sources.append(channel.drain)
    # the pipe must be read while the workers run: a worker writing more than the pipe
    # holds waits for it (at its exit too, where the loader terminates it after 5 s)
    _setup.FLUSHER.ensure_started()
    return channel


class _QueueExporter:
    """In a worker: the only exporter, sending rows (and thread names) to the parent."""

    def __init__(self, queue: Any, worker_id: int) -> None:
        self.queue = queue
        self.worker_id = worker_id

    def export_batch(self, batch: SpanBatch) -> None:
        main = threading.main_thread().native_id
        names = sorted(batch.thread_names.items(), key=lambda item: item[0] != main)
        rows = [(*row[:7], _plain(row.attributes), row.status, row.error) for row in batch.rows]
        self.queue.put((self.worker_id, rows, names))


def _plain(attrs: Any) -> Any:
    """Attributes that pickle: the shared empty mapping of a span without arg becomes {}."""
    kind = type(attrs)
    return attrs if kind is dict or kind is FrozenAttributes else dict(attrs)


class _WorkerInit:
    """The loader's ``worker_init_fn``, wrapped: sets up tracing in the worker, then
    calls the user's function. Picklable, for spawned workers."""

    def __init__(self, user_fn: Any, queue: Any) -> None:
        self.user_fn = user_fn
        self.queue = queue
        self.trace_id = 0
        self.parent_id = 0
        self.interval = 1.0

    def __call__(self, worker_id: int) -> None:
        try:
            _start_worker(self, worker_id)
        except Exception:  # telemetry never breaks training
            _log.exception("ppetrace: tracing DataLoader worker %d failed", worker_id)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _start_worker(init: _WorkerInit, worker_id: int) -> None:
    import multiprocessing.util

    rec = _recorder.RECORDER
    rec.trace_id = init.trace_id or rec.trace_id
    rec.apply()
    _setup.configure_worker(_QueueExporter(init.queue, worker_id), init.interval)
    if init.parent_id:
        parent = NonRecordingSpan(
            SpanContext(rec.trace_id, init.parent_id, is_remote=True, trace_flags=TraceFlags(1))
        )
        # the worker's main thread runs every __getitem__ and collate_fn in this context
        from opentelemetry import context as otel_context

        otel_context.attach(otel_trace.set_span_in_context(parent))
    # multiprocessing runs these when the worker ends normally (atexit does not run there)
    multiprocessing.util.Finalize(None, _setup.FLUSHER.flush, exitpriority=100)
