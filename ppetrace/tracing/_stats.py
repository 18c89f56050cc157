"""What :func:`ppetrace.stats` returns: where every span went, in total and per sink."""

from __future__ import annotations

from dataclasses import dataclass

from ._sinks import REASONS, SinkStats

__all__ = ["REASONS", "RecorderStats", "SinkStats"]


@dataclass(frozen=True)
class RecorderStats:
    """The recorder's counters since the process started (a forked child goes on from
    its parent's counts, without the parent's buffered spans).

    Totals, before any sink: ``recorded == exported + dropped + buffered``.

    - ``recorded``: spans recorded (in DataLoader workers too, once received).
    - ``exported``: spans that left the thread buffers for the sinks.
    - ``dropped``: spans dropped before any sink (``buffer_full``: a full
      thread buffer found ``max_queued_buffers`` full buffers already waiting).
    - ``buffered``: spans in thread buffers or waiting full buffers.
    - ``flushes``: drains that moved at least one span.
    - ``export_errors``: failed calls into exporters and processors, of every
      sink (force_flush and shutdown included), plus failed before-flush hooks.
    - ``sinks``: one :class:`SinkStats` per exporter and span processor now
      attached, each with ``recorded == delivered + dropped + buffered``.
    - ``closed``: the final :class:`SinkStats` of the last 16 sinks shut down (an
      exporter removed, ``configure`` replacing them, ``shutdown``, the end of a
      Trainer's or ``instrument()``'s file), oldest first: what each delivered and
      dropped by reason, once it is gone from ``sinks``.
    """

    recorded: int
    exported: int
    dropped: int
    buffered: int
    flushes: int
    export_errors: int
    sinks: tuple[SinkStats, ...] = ()
    closed: tuple[SinkStats, ...] = ()

    def sink(self, name: str) -> SinkStats:
        """The stats of the sink whose name (``repr`` of the exporter, or
        ``Processor(Exporter)``) is or starts with ``name``."""
        for s in self.sinks:
            if s.name == name:
                return s
        for s in self.sinks:
            if s.name.startswith(name):
                return s
        names = ", ".join(s.name for s in self.sinks) or "none"
        raise KeyError(
            f"Expected the name of an attached sink, but received {name!r}; sinks: {names}."
        )

    @property
    def delivered(self) -> int:
        """Spans delivered, summed over the sinks."""
        return sum(s.delivered for s in self.sinks)
