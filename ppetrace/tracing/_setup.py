"""Where spans go: :func:`configure`, :func:`flush`, exporters and stats.

The hot path lives in :mod:`ppetrace.tracing._recorder`; this module decides, once,
which OpenTelemetry ``TracerProvider`` (and so which span processors) and
which ppetrace exporters receive the recorded spans.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

from exporters._spans import SpanRow

from .._version import __version__
from ._attributes import _otel_attributes
from ._recorder import RECORDER, RecorderStats, Span, trace

__all__ = [
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

_configure_lock = threading.Lock()
_configured = False
_atexit_registered = False
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def _default_service_name() -> str:
    return os.environ.get("OTEL_SERVICE_NAME") or "ppetrace"


def _rank_from_env() -> int:
    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def _make_span_builder(
    resource: Resource, scope: InstrumentationScope
) -> Callable[[SpanRow, dict[int, str]], ReadableSpan]:
    """A function that turns one row into an SDK ``ReadableSpan``.

    It shares one ``Resource`` and one scope between all spans: building a
    resource per span costs hundreds of microseconds.
    """
    ok = Status(StatusCode.UNSET)

    def build(row: SpanRow, thread_names: dict[int, str]) -> ReadableSpan:
        ctx = SpanContext(row.trace_id, row.span_id, is_remote=False, trace_flags=_SAMPLED)
        parent = (
            SpanContext(row.trace_id, row.parent_id, is_remote=False, trace_flags=_SAMPLED)
            if row.parent_id
            else None
        )
        # one attribute that cannot be converted costs only itself, never the span
        attributes = _otel_attributes(row.attributes)
        attributes["thread.id"] = row.tid
        name = thread_names.get(row.tid)
        if name is not None:
            attributes["thread.name"] = name
        if row.status == "ERROR":
            head, _, stack = row.error.partition("\n")
            etype, _, message = head.partition(": ")
            status = Status(StatusCode.ERROR, head)
            events: tuple[Event, ...] = (
                Event(
                    "exception",
                    {
                        "exception.type": etype,
                        "exception.message": message,
                        "exception.stacktrace": stack,
                        "exception.escaped": "True",
                    },
                    timestamp=row.end_ns,
                ),
            )
        else:
            status, events = ok, ()
        return ReadableSpan(
            name=row.name,
            context=ctx,
            parent=parent,
            resource=resource,
            attributes=attributes,
            events=events,
            status=status,
            start_time=row.start_ns,
            end_time=row.end_ns,
            instrumentation_scope=scope,
        )

    return build


def configure(
    *,
    tracer_provider: TracerProvider | None = None,
    enabled: bool = True,
    service_name: str | None = None,
    buffer_spans: int = 65_536,
    exporters: Iterable[Any] = (),
    rank: int | None = None,
) -> None:
    """Decide where ppetrace's spans go. Calling it again replaces the setup.

    - ``tracer_provider``: an SDK ``TracerProvider`` whose span processors get
      every span. Without one, ppetrace uses the global provider when the user
      installed an SDK one, and otherwise an internal provider that has no
      processor (spans then reach only ``exporters``).
    - ``enabled``: ``False`` makes :func:`trace` a near no-op.
    - ``service_name``: the resource's ``service.name``; defaults to
      ``$OTEL_SERVICE_NAME``, then the provider's own, then ``"ppetrace"``.
    - ``buffer_spans``: how many finished spans each thread keeps before it
      flushes. When a full buffer cannot be flushed at once (another flush is
      running), its spans are dropped and counted in :func:`stats`.
    - ``exporters``: ppetrace exporters (objects with ``export_batch``, such as
      :class:`exporters.ChromeTraceExporter`) or any OpenTelemetry
      ``SpanExporter``; they are shut down at exit.
    - ``rank``: the process rank, stored as ``ppetrace.rank`` in the resource;
      defaults to ``$RANK``, ``$LOCAL_RANK`` or ``$SLURM_PROCID``, else 0.

    Pending spans are flushed to the old setup first.
    """
    global _configured, _atexit_registered
    if isinstance(buffer_spans, bool) or not isinstance(buffer_spans, int) or buffer_spans < 1:
        raise ValueError(
            f"Expected a positive int for buffer_spans, but received {buffer_spans!r}."
        )
    if tracer_provider is not None and not isinstance(tracer_provider, TracerProvider):
        raise TypeError(
            "Expected an opentelemetry.sdk.trace.TracerProvider for tracer_provider, but "
            f"received {type(tracer_provider).__name__}. Build one with "
            "opentelemetry.sdk.trace.TracerProvider() and add span processors to it."
        )
    sinks, otel_sinks = _classify(exporters)  # checked before anything changes
    with _configure_lock:
        if _configured:
            RECORDER.flush()
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
                    "ppetrace.rank": _rank_from_env() if rank is None else int(rank),
                    "host.name": socket.gethostname(),
                    "process.pid": os.getpid(),
                }
            )
        )
        scope = InstrumentationScope("ppetrace", __version__)
        RECORDER.resource_attrs = dict(resource.attributes)
        RECORDER._span_builder = _make_span_builder(resource, scope)
        # kept even while it has no processor: processors added later are served
        RECORDER.processor = getattr(provider, "_active_span_processor", None) if provider else None
        RECORDER.capacity = buffer_spans
        RECORDER.enabled = bool(enabled)
        RECORDER.apply()
        replaced = [e for e in (*RECORDER.sinks, *RECORDER.otel_sinks) if e not in exporters]
        RECORDER.sinks = sinks
        RECORDER.otel_sinks = otel_sinks
        _configured = True
        _shutdown_all(replaced)
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True


def _ensure_configured() -> None:
    if not _configured:
        configure()


RECORDER.on_first_use = _ensure_configured


def _classify(exporters: Iterable[Any]) -> tuple[list[Any], list[Any]]:
    """Split exporters into ppetrace ones (``export_batch``) and OpenTelemetry ones."""
    sinks: list[Any] = []
    otel_sinks: list[Any] = []
    for exporter in exporters:
        if hasattr(exporter, "export_batch"):
            sinks.append(exporter)
        elif hasattr(exporter, "export"):
            otel_sinks.append(exporter)
        else:
            raise TypeError(
                "Expected an exporter with export_batch(batch) (a ppetrace exporter) or "
                f"export(spans) (an OpenTelemetry SpanExporter), but received "
                f"{type(exporter).__name__}. Pass exporters.ChromeTraceExporter(path) or an "
                "OpenTelemetry SpanExporter."
            )
    return sinks, otel_sinks


def _add(exporter: Any) -> None:
    sinks, otel_sinks = _classify([exporter])
    RECORDER.sinks.extend(sinks)
    RECORDER.otel_sinks.extend(otel_sinks)


def _guarded(what: str, call: Callable[[], Any]) -> None:
    """Run an exporter's flush or shutdown; log and count a failure, never raise it."""
    try:
        call()
    except Exception:
        RECORDER.export_errors += 1
        _log.exception("ppetrace: %s failed", what)


def _shutdown_all(exporters: Iterable[Any]) -> None:
    for exporter in exporters:
        _guarded(f"shutting down {exporter!r}", exporter.shutdown)


def add_exporter(exporter: Any) -> None:
    """Send every span flushed from now on to ``exporter`` as well.

    Spans still buffered are flushed to the current exporters first, so the
    new one sees only spans that ended after this call.
    """
    _ensure_configured()
    RECORDER.flush()
    _add(exporter)


def remove_exporter(exporter: Any, *, shutdown: bool = True) -> None:
    """Flush pending spans, stop sending spans to ``exporter`` and shut it down."""
    RECORDER.flush()
    for sinks in (RECORDER.sinks, RECORDER.otel_sinks):
        if exporter in sinks:
            sinks.remove(exporter)
    if shutdown:
        _shutdown_all([exporter])


def flush() -> None:
    """Push every finished span, from every thread, to the processors and exporters.

    An exporter or processor that fails is logged and counted in :func:`stats`;
    ``flush`` itself never raises because of one.
    """
    _ensure_configured()
    RECORDER.flush()
    processor = RECORDER.processor
    if processor is not None:
        _guarded("the span processor's force_flush", processor.force_flush)
    for exporter in [*RECORDER.sinks, *RECORDER.otel_sinks]:
        force = getattr(exporter, "force_flush", None)
        if force is not None:
            _guarded(f"force_flush of {exporter!r}", force)


def shutdown() -> None:
    """Flush, then shut down every exporter given to :func:`configure` (failures are
    logged and counted, never raised)."""
    if not _configured:
        return
    RECORDER.flush()
    exporters = [*RECORDER.sinks, *RECORDER.otel_sinks]
    RECORDER.sinks = []
    RECORDER.otel_sinks = []
    _shutdown_all(exporters)
    if RECORDER.processor is not None:
        _guarded("the span processor's force_flush", RECORDER.processor.force_flush)


def _at_exit() -> None:
    if RECORDER.pid == os.getpid():
        shutdown()


def stats() -> RecorderStats:
    """The recorder's counters: spans recorded, exported, dropped and still buffered."""
    return RECORDER.stats()


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
