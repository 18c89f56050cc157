"""configure() checks every argument before it changes anything, and stats() per sink."""

from __future__ import annotations

import re
from typing import Any

import pytest

import ppetrace
from exporters._spans import SpanBatch
from ppetrace.tracing._recorder import RECORDER
from ppetrace.tracing._setup import FLUSHER


class Sink:
    def __init__(self) -> None:
        self.rows = 0

    def export_batch(self, batch: SpanBatch) -> None:
        self.rows += len(batch.rows)


BAD = [
    (
        {"buffer_spans": 2**70},
        ValueError,
        "Expected a positive int of at most 16,777,216 for buffer_spans, but received "
        "1180591620717411303424.",
    ),
    (
        {"rank": "a"},
        TypeError,
        "Expected a non-negative int for rank, or None to read $RANK, $LOCAL_RANK or "
        "$SLURM_PROCID, but received 'a'.",
    ),
    (
        {"exporters": None},
        TypeError,
        "Expected an iterable of exporters for exporters (() for none), but received None.",
    ),
    ({"enabled": "no"}, TypeError, "Expected True or False for enabled, but received 'no'."),
    (
        {"service_name": 5},
        TypeError,
        "Expected a str for service_name, or None for $OTEL_SERVICE_NAME or 'ppetrace', but "
        "received 5.",
    ),
    (
        {"flush_interval": 0},
        ValueError,
        "Expected a positive, finite number of seconds (at most one day) for flush_interval, "
        "but received 0.",
    ),
    (
        {"export_timeout": float("nan")},
        ValueError,
        "Expected a positive, finite number of seconds (at most one day) for export_timeout, "
        "but received nan.",
    ),
    (
        {"queue_spans": -1},
        ValueError,
        "Expected a positive int of at most 1,073,741,824 for queue_spans, but received -1.",
    ),
    (
        {"handle_sigterm": 1},
        TypeError,
        "Expected True or False for handle_sigterm, but received 1.",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD, ids=[str(b[0]) for b in BAD])
def test_a_bad_argument_is_a_sentence_and_changes_nothing(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    sink = Sink()
    ppetrace.configure(exporters=[sink], service_name="kept", buffer_spans=1000)
    try:
        before = (RECORDER.capacity, RECORDER.enabled, dict(FLUSHER.resource_attrs))
        with pytest.raises(error, match=re.escape(message)):
            # valid changes alongside the bad one: none of them may happen
            ppetrace.configure(**{"enabled": False, "buffer_spans": 7, "exporters": (), **kwargs})
        assert (RECORDER.capacity, RECORDER.enabled, dict(FLUSHER.resource_attrs)) == before
        assert [s.target for s in FLUSHER.sinks] == [sink]
    finally:
        ppetrace.configure()


def test_stats_tell_per_sink_where_every_span_went() -> None:
    a, b = Sink(), Sink()
    ppetrace.configure(exporters=[a])
    try:
        with ppetrace.trace("before.b"):
            pass
        ppetrace.flush()
        ppetrace.tracing.add_exporter(b)
        for _ in range(3):
            with ppetrace.trace("both"):
                pass
        mid = ppetrace.stats()
        sa, sb = mid.sinks
        # still in the thread buffer: recorded and buffered, not yet delivered
        assert (sa.recorded, sa.delivered, sa.buffered) == (4, 1, 3)
        assert (sb.recorded, sb.delivered, sb.buffered) == (3, 0, 3)
        ppetrace.flush()
        end = ppetrace.stats()
        sa, sb = end.sinks
        assert (sa.recorded, sa.delivered, sa.buffered) == (4, 4, 0) and a.rows == 4
        assert (sb.recorded, sb.delivered, sb.buffered) == (3, 3, 0) and b.rows == 3
        for s in end.sinks:
            assert s.recorded == s.delivered + s.dropped_total + s.buffered
            assert s.dropped == dict.fromkeys(
                ("buffer_full", "queue_full", "exporter_error", "timeout"), 0
            )
        assert end.recorded == end.exported + end.dropped + end.buffered
        assert end.sink("Sink") is sa
        with pytest.raises(KeyError, match="Expected the name of an attached sink"):
            end.sink("nope")
    finally:
        ppetrace.configure()
