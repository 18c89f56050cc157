"""Rows to ReadableSpans: the fast path gives exactly what the SDK's constructor gives."""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from exporters._spans import FrozenAttributes, SpanBatch, SpanRow
from ppetrace.tracing._attributes import _EMPTY
from ppetrace.tracing._convert import SpanBuilder


def test_the_fast_path_equals_the_sdk_constructor_field_by_field() -> None:
    builder = SpanBuilder(Resource({"service.name": "t"}), InstrumentationScope("ppetrace", "1"))
    assert builder._fast  # this SDK keeps the fields the fast path fills
    shared = FrozenAttributes({"ppetrace.step": 3, "ppetrace.stage": "train"})
    rows = [
        SpanRow("a", 5, 0, 7, 10, 20, 1, shared),
        SpanRow("b", 6, 5, 7, 11, 19, 1, shared),
        SpanRow("c", 8, 5, 7, 12, 13, 2, {"k": 2**70, "t": (1, 2)}),
        SpanRow("d", 9, 0, 2**128 - 1, 14, 15, 2, _EMPTY, "ERROR", "ValueError: no\nstack"),
        SpanRow("e", 2**64 - 1, 9, 3, 16, 17, 3, {}),
    ]
    batch = SpanBatch(rows, {}, 1, {1: "MainThread", 2: "worker"})
    fast = builder.build_all(batch)
    for row, got in zip(rows, fast, strict=True):
        want = builder.build(row, batch.thread_names)
        # Status and Event have no __eq__: compared through to_json (which holds them)
        # (the fields every ppetrace span shares are class attributes of the fast path's)
        plain = {k: v for k, v in vars(want).items() if k not in ("_status", "_events")}
        assert {k: getattr(got, k) for k in plain} == plain, row.name
        assert isinstance(got, ReadableSpan)
        assert got.to_json() == want.to_json()
    # a shared FrozenAttributes gives one converted mapping per thread, read-only to users
    assert fast[0]._attributes is fast[1]._attributes
    assert fast[0].attributes == {
        "ppetrace.step": 3,
        "ppetrace.stage": "train",
        "thread.id": 1,
        "thread.name": "MainThread",
    }
    assert fast[2].attributes == {
        "k": str(2**70),
        "t": (1, 2),
        "thread.id": 2,
        "thread.name": "worker",
    }
    assert fast[3].status.description == "ValueError: no"
