"""Where spans go: :func:`configure`, :func:`flush`, exporters and stats.

The hot path lives in :mod:`._recorder`, the schedule in :mod:`._flusher` and
the destinations in :mod:`._sinks`; this module decides which
OpenTelemetry ``TracerProvider`` (and so which span processors) and which
exporters receive the recorded spans, checks every option before anything
changes, and hooks the end of the process (``atexit`` and SIGTERM).
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import logging
import math
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from .._version import __version__
from . import _signals
from ._convert import SpanBuilder
from ._flusher import Flusher
from ._recorder import RECORDER, Span, trace
from ._stats import RecorderStats

__all__ = [
    "FLUSHER",
    "RecorderStats",
    "Span",
    "add_exporter",
    "bind_context",
    "configure",
    "flush",
    "remove_exporter",
    "shutdown",
    "stats",
    "trace",
]

F = TypeVar("F", bound=Callable[..., Any])
_log = logging.getLogger("ppetrace")

FLUSHER = Flusher(RECORDER)
_configure_lock = threading.RLock()
_configured = False
_atexit_registered = False
_env_exporters: list[Any] | None = None  # made once from $OTEL_TRACES_EXPORTER
_MAX_BUFFER = 1 << 24


def _default_service_name() -> str:
    return os.environ.get("OTEL_SERVICE_NAME") or "ppetrace"


def _rank_from_env() -> int:
    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


# -- checks ---------------------------------------------------------------------


def _count(name: str, value: Any, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise ValueError(
            f"Expected a positive int of at most {most:,} for {name}, but received {value!r}."
        )
    return value


def _seconds(name: str, value: Any) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or not math.isfinite(value) or not 0 < value <= 86_400:
        raise ValueError(
            f"Expected a positive, finite number of seconds (at most one day) for {name}, "
            f"but received {value!r}."
        )
    return float(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"Expected True or False for {name}, but received {value!r}.")
    return value


def _exporter_list(exporters: Any) -> list[Any]:
    if (
        exporters is None
        or isinstance(exporters, (str, bytes))
        or not hasattr(exporters, "__iter__")
    ):
        raise TypeError(
            "Expected an iterable of exporters for exporters (() for none), but received "
            f"{exporters!r}."
        )
    out = list(exporters)
    for exporter in out:
        if not hasattr(exporter, "export_batch") and not hasattr(exporter, "export"):
            raise TypeError(
                "Expected an exporter with export_batch(batch) (a ppetrace exporter) or "
                f"export(spans) (an OpenTelemetry SpanExporter), but received "
                f"{type(exporter).__name__}. Pass exporters.ChromeTraceExporter(path) or an "
                "OpenTelemetry SpanExporter."
            )
    return out


def configure(
    *,
    tracer_provider: TracerProvider | None = None,
    enabled: bool = True,
    service_name: str | None = None,
    buffer_spans: int = 65_536,
    exporters: Iterable[Any] = (),
    rank: int | None = None,
    flush_interval: float = 1.0,
    export_timeout: float = 30.0,
    queue_spans: int = 1_048_576,
    max_queued_buffers: int = 16,
    handle_sigterm: bool = True,
) -> None:
    """Decide where ppetrace's spans go. Calling it again replaces the setup.

    - ``tracer_provider``: an SDK ``TracerProvider`` whose span processors get
      every span. Without one, ppetrace uses the global provider when the user
      installed an SDK one, and otherwise an internal provider that has no
      processor (spans then reach only ``exporters``).
    - ``enabled``: ``False`` makes :func:`trace` a near no-op.
    - ``service_name``: the resource's ``service.name``; defaults to
      ``$OTEL_SERVICE_NAME``, then the provider's own, then ``"ppetrace"``.
    - ``buffer_spans``: finished spans each thread keeps before its buffer is
      handed to the flusher (at most 2**24).
    - ``exporters``: ppetrace exporters (objects with ``export_batch``, such as
      :class:`exporters.ChromeTraceExporter`) or OpenTelemetry
      ``SpanExporter``\\ s; ``shutdown``/``force_flush`` are used where they
      exist. They are shut down at exit. ``$OTEL_TRACES_EXPORTER=otlp`` adds
      an OTLP exporter configured by its own ``$OTEL_EXPORTER_OTLP_*``.
    - ``rank``: the process rank, stored as ``ppetrace.rank`` in the resource;
      defaults to ``$RANK``, ``$LOCAL_RANK`` or ``$SLURM_PROCID``, else 0.
    - ``flush_interval``: seconds between background drains (a SIGKILL loses
      about this much).
    - ``export_timeout``: seconds a call into an exporter may take before it is
      abandoned and its spans are counted as dropped (``timeout``).
    - ``queue_spans``: the bound of each sink's queue, in spans; beyond it
      spans are dropped for that sink (``queue_full``).
    - ``max_queued_buffers``: full thread buffers that may wait for the
      flusher; beyond it spans are dropped (``buffer_full``).
    - ``handle_sigterm``: on SIGTERM, flush and close the exporters, then chain
      to the previous handler or the default action. ``False`` installs no
      handler (and removes ppetrace's).

    Every argument is checked before anything changes. Pending spans are
    flushed to the old setup first.
    """
    global _configured, _atexit_registered
    if tracer_provider is not None and not isinstance(tracer_provider, TracerProvider):
        raise TypeError(
            "Expected an opentelemetry.sdk.trace.TracerProvider for tracer_provider, but "
            f"received {type(tracer_provider).__name__}. Build one with "
            "opentelemetry.sdk.trace.TracerProvider() and add span processors to it."
        )
    enabled = _flag("enabled", enabled)
    handle_sigterm = _flag("handle_sigterm", handle_sigterm)
    if service_name is not None and not isinstance(service_name, str):
        raise TypeError(
            "Expected a str for service_name, or None for $OTEL_SERVICE_NAME or "
            f"'ppetrace', but received {service_name!r}."
        )
    buffer_spans = _count("buffer_spans", buffer_spans, _MAX_BUFFER)
    queue_spans = _count("queue_spans", queue_spans, 1 << 30)
    max_queued_buffers = _count("max_queued_buffers", max_queued_buffers, 1 << 16)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise TypeError(
            "Expected a non-negative int for rank, or None to read $RANK, $LOCAL_RANK or "
            f"$SLURM_PROCID, but received {rank!r}."
        )
    flush_interval = _seconds("flush_interval", flush_interval)
    export_timeout = _seconds("export_timeout", export_timeout)
    exporters = _exporter_list(exporters)
    with _configure_lock:
        exporters = exporters + [e for e in _from_environment() if e not in exporters]
        if _configured:
            FLUSHER.flush()
        provider = tracer_provider
        if provider is None:
            global_provider = otel_trace.get_tracer_provider()
            if isinstance(global_provider, TracerProvider):
                provider = global_provider
        provider_resource = provider.resource if provider is not None else Resource.create({})
        name = service_name or os.environ.get("OTEL_SERVICE_NAME")
        if not name:
            name = str(provider_resource.attributes.get("service.name", ""))
            if not name or name.startswith("unknown_service"):
                name = _default_service_name()
        resource = provider_resource.merge(
            Resource(
                {
                    "service.name": name,
                    "ppetrace.version": __version__,
                    "ppetrace.rank": _rank_from_env() if rank is None else rank,
                    "host.name": socket.gethostname(),
                    "process.pid": os.getpid(),
                }
            )
        )
        kept = {id(s.target): s for s in FLUSHER.sinks if any(s.target is e for e in exporters)}
        replaced = [s for s in FLUSHER.sinks if id(s.target) not in kept]
        with FLUSHER._lock:
            FLUSHER.resource_attrs = dict(resource.attributes)
            FLUSHER.builder = SpanBuilder(resource, InstrumentationScope("ppetrace", __version__))
            FLUSHER.interval = flush_interval
            FLUSHER.export_timeout = export_timeout
            FLUSHER.queue_spans = queue_spans
            # kept even while it has no processor: processors added later are served
            processor = getattr(provider, "_active_span_processor", None) if provider else None
            if processor is not FLUSHER.processor:  # the old one's spans were flushed above
                FLUSHER.processor = processor
                FLUSHER.reset_processor_sinks()
            sinks = [kept.get(id(e)) or FLUSHER.new_sink(e) for e in exporters]
            for sink in sinks:
                sink.queue_spans, sink.export_timeout = queue_spans, export_timeout
            FLUSHER.sinks = sinks
            # the processors' sinks count from now on, as the exporters' do; processors
            # added to the provider later count from the first drain or stats() after
            FLUSHER.all_sinks()
            RECORDER.capacity = buffer_spans
            RECORDER.max_queued_buffers = max_queued_buffers
            RECORDER.enabled = enabled
            RECORDER.apply()
        _configured = True
        FLUSHER.close(replaced)
        if handle_sigterm:
            _signals.install(_on_sigterm, lambda: FLUSHER.export_timeout + 5.0)
            # off the main thread none can be installed (one installed before still holds)
            if threading.current_thread() is not threading.main_thread() and not _signals.active():
                _warn_no_sigterm()
        else:
            _signals.uninstall()
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True


_sigterm_warned = False


def _warn_no_sigterm() -> None:
    """Once per process: tracing was set up outside the main thread, where no signal
    handler can be installed."""
    global _sigterm_warned
    if _sigterm_warned:
        return
    _sigterm_warned = True
    _log.warning(
        "ppetrace: tracing was configured outside the main thread (%s), where Python cannot "
        "install ppetrace's SIGTERM handler: a SIGTERM (a scheduler's stop, kill) would cut "
        "the trace off without its last spans. Call ppetrace.configure() on the main "
        "thread before the other thread starts tracing.",
        threading.current_thread().name,
    )


def _from_environment() -> list[Any]:
    """The exporters that ``$OTEL_TRACES_EXPORTER`` asks for (made once per process)."""
    global _env_exporters
    if _env_exporters is not None:
        return _env_exporters
    wanted = [
        w.strip().lower()
        for w in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")
        if w.strip() and w.strip().lower() != "none"
    ]
    made: list[Any] = []
    for kind in wanted:
        try:
            made.append(_env_exporter(kind))
        except Exception as exc:
            _log.error("ppetrace: %s", exc)
    _env_exporters = made
    return made


def _env_exporter(kind: str) -> Any:
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind != "otlp":
        raise ValueError(
            f"Expected otlp, console or none in $OTEL_TRACES_EXPORTER, but received {kind!r}; "
            "no exporter was added for it."
        )
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    module = (
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
        if protocol == "grpc"
        else "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    )
    try:
        import importlib

        return importlib.import_module(module).OTLPSpanExporter()
    except ImportError as exc:
        package = "opentelemetry-exporter-otlp-proto-" + ("grpc" if protocol == "grpc" else "http")
        raise RuntimeError(
            f"Expected {package} for $OTEL_TRACES_EXPORTER=otlp (protocol {protocol}), but it "
            f"cannot be imported ({exc}). Install ppetrace[otlp], or unset "
            "OTEL_TRACES_EXPORTER; no OTLP exporter was added."
        ) from exc


def configure_worker(exporter: Any, interval: float) -> None:
    """In a child process that forwards its spans (a DataLoader worker): ``exporter`` is
    the only sink, nothing is converted, no environment exporter, signal handler or
    ``atexit`` hook is added, and the flusher runs every ``interval`` seconds."""
    global _configured
    with _configure_lock:
        with FLUSHER._lock:
            FLUSHER.interval = interval
            FLUSHER.processor = None
            FLUSHER.reset_processor_sinks()
            FLUSHER.builder = None
            FLUSHER.sinks = [FLUSHER.new_sink(exporter)]
        _configured = True
    FLUSHER.ensure_started()


def _ensure_configured() -> None:
    if not _configured:
        configure()
    FLUSHER.ensure_started()


RECORDER.on_first_use = _ensure_configured


def _flush_for_recorder(wait: bool) -> None:
    FLUSHER.flush(wait=wait)


RECORDER.flush_impl = _flush_for_recorder


def add_exporter(exporter: Any) -> None:
    """Send every span flushed from now on to ``exporter`` as well.

    Spans still buffered are flushed to the current exporters first, so the
    new one sees only spans that ended after this call.
    """
    (exporter,) = _exporter_list([exporter])
    _ensure_configured()
    with FLUSHER._lock:
        FLUSHER.drain(background=False)
        FLUSHER.sinks = [*FLUSHER.sinks, FLUSHER.new_sink(exporter)]


def remove_exporter(exporter: Any, *, shutdown: bool = True) -> None:
    """Deliver pending spans to ``exporter``, stop sending it spans and (with
    ``shutdown``) shut it down if it has ``shutdown()``. Waits at most
    ``export_timeout`` for it. Does nothing while the interpreter shuts down (no thread
    can start then; the process-end flush has run)."""
    if sys.is_finalizing():
        return
    with FLUSHER._lock:
        FLUSHER.drain(background=False)
        mine = [s for s in FLUSHER.sinks if s.target is exporter]
        FLUSHER.sinks = [s for s in FLUSHER.sinks if s.target is not exporter]
    if not mine:
        return
    if shutdown:  # one wait for both calls: the flush, then the shutdown
        FLUSHER.close(mine, flush=True)
    else:
        FLUSHER.flush(wait=True, sinks=mine)


def flush() -> None:
    """Deliver every finished span, from every thread, to the processors and exporters.

    Returns when each sink has delivered what was recorded before the call (and
    its ``force_flush`` ran), or has abandoned a call after ``export_timeout``
    (its spans are then counted as dropped, ``timeout``). A sink still stuck in
    an abandoned call is not waited for again. Failures are logged and counted
    in :func:`stats`, never raised. Does nothing while the interpreter shuts down (a
    finalizer's call: no thread can start then; the process-end flush has run).
    """
    if sys.is_finalizing():
        return
    _ensure_configured()
    FLUSHER.flush(wait=True)


def shutdown() -> None:
    """Flush, then shut down every exporter given to :func:`configure` (at most
    ``export_timeout`` each, in parallel); failures are logged and counted, never
    raised."""
    if not _configured:
        return
    with _configure_lock:
        FLUSHER.flush(wait=True)
        sinks = FLUSHER.sinks
        FLUSHER.sinks = []
        FLUSHER.close(sinks)
        FLUSHER.stop()


def _at_exit() -> None:
    if RECORDER.pid == os.getpid():
        shutdown()


def _on_sigterm() -> None:
    if RECORDER.pid == os.getpid():
        shutdown()


def stats() -> RecorderStats:
    """Where every span went: totals, and per sink delivered, dropped by reason and
    buffered (see :class:`RecorderStats` and :class:`SinkStats`)."""
    for sink in FLUSHER.all_sinks():
        sink.check_timeout()
    sinks = FLUSHER.sink_stats()
    taken, dropped, buffered = RECORDER.counts()
    errors = RECORDER.hook_errors + sum(s.errors for s in sinks)
    return RecorderStats(
        recorded=taken + dropped + buffered,
        exported=taken,
        dropped=dropped,
        buffered=buffered,
        flushes=FLUSHER.flushes,
        export_errors=errors,
        sinks=sinks,
        closed=tuple(FLUSHER.closed),
    )


def bind_context(func: F) -> F:
    """Bind ``func`` to the current context, so spans it records in another
    thread are children of the span that is open here.

    Example::

        with ppetrace.trace("load"):
            threading.Thread(target=ppetrace.bind_context(work)).start()

    It is ``contextvars.copy_context().run`` around ``func``; passing
    ``contextvars.copy_context().run`` to the thread yourself works as well.
    """
    ctx = contextvars.copy_context()

    @functools.wraps(func)
    def bound(*args: Any, **kwargs: Any) -> Any:
        return ctx.copy().run(func, *args, **kwargs)

    return bound  # type: ignore[return-value]


def _after_fork_in_child() -> None:
    global _configured
    FLUSHER.reset_after_fork()
    # the child records into its own buffers; a worker integration may configure it
    _configured = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
