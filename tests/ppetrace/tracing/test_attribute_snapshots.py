"""A span's attributes are a snapshot of its arg, taken when it is entered; bad values
cost only themselves (issues 18 and 11). Each test runs on the C hot path (where it
is built) and on the pure-Python one, in this process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import ppetrace
from exporters import ChromeTraceExporter, SpanBatch, SpanRow
from exporters._spans import FrozenAttributes
from ppetrace.tracing import _recorder
from ppetrace.tracing._recorder import _CTXVAR, span_attributes
from ppetrace.tracing._setup import FLUSHER

IMPLEMENTATIONS = [pytest.param(_recorder.PySpan, id="python")]
if _recorder.IMPLEMENTATION == "c":
    IMPLEMENTATIONS.insert(0, pytest.param(_recorder.Span, id="c"))


RowSink = Any  # conftest.py's row_sink fixture: a row_sink that keeps the rows it is given


def _flushed(row_sink: RowSink) -> dict[str, SpanRow]:
    ppetrace.flush()
    return {r.name: r for r in row_sink.rows}


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_a_dict_changed_after_enter_does_not_change_the_span(trace: Any, row_sink: RowSink) -> None:
    metrics: dict[str, Any] = {"loss": 1.0, "tag": "a"}
    with trace("step", metrics):
        metrics["loss"] = 2.0
        metrics["late"] = 3
    span = trace("reused", metrics)
    metrics["loss"] = 4.0  # before enter: part of the snapshot
    with span:
        pass
    metrics["loss"] = 5.0
    rows = _flushed(row_sink)
    assert rows["step"].attributes == {"loss": 1.0, "tag": "a"}
    assert rows["reused"].attributes == {"loss": 4.0, "tag": "a", "late": 3}
    assert rows["step"].attributes is not metrics


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_a_frozen_mapping_is_shared_not_copied(trace: Any, row_sink: RowSink) -> None:
    shared = FrozenAttributes({"ppetrace.step": 3, "ppetrace.stage": "train"})
    with trace("a", shared), trace("b", shared):
        pass
    rows = _flushed(row_sink)
    assert rows["a"].attributes is shared and rows["b"].attributes is shared
    with pytest.raises(TypeError, match="Expected no change to a FrozenAttributes"):
        shared["ppetrace.step"] = 4  # type: ignore[index]
    assert shared.copy() == {"ppetrace.step": 3, "ppetrace.stage": "train"}


class Tensorish:
    pass


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_the_snapshot_of_each_kind_of_arg(trace: Any, row_sink: RowSink) -> None:
    from types import MappingProxyType

    with trace("none"), trace("scalar", 7), trace("object", Tensorish()):
        pass
    with trace("mapping", MappingProxyType({"a": 1})), trace("mixed", {"t": Tensorish()}):
        pass
    rows = _flushed(row_sink)
    assert dict(rows["none"].attributes) == {}
    assert rows["scalar"].attributes == {"ppetrace.arg": 7}
    assert rows["object"].attributes == {"ppetrace.arg": "Tensorish"}
    assert rows["mapping"].attributes == {"a": 1}
    assert rows["mixed"].attributes == {"t": "Tensorish"}


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_a_mapping_that_cannot_be_read_does_not_break_the_block(
    trace: Any, row_sink: RowSink
) -> None:
    from collections.abc import Mapping

    class Broken(Mapping[str, Any]):
        def __getitem__(self, key: str) -> Any:
            raise KeyError(key)

        def __iter__(self) -> Iterator[str]:
            raise RuntimeError("cannot iterate")

        def __len__(self) -> int:
            return 1

    with trace("broken", Broken()):
        pass
    assert _flushed(row_sink)["broken"].attributes == {"ppetrace.arg": "<unencodable: Broken>"}


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_span_attributes_is_the_snapshot_that_reaches_the_exporters(
    trace: Any, row_sink: RowSink
) -> None:
    given = {"ppetrace.step": 1}
    with trace("timed", given) as span:
        own = span_attributes(span)
        assert own == given and own is not given
        assert own is not None
        own["ppetrace.device_dur_ns"] = 99  # what a before-flush hook does
    with trace("frozen", FrozenAttributes(given)) as span:
        assert span_attributes(span) is None  # shared: nobody writes into it
    assert span_attributes(trace("never.entered")) is None
    assert _flushed(row_sink)["timed"].attributes == {
        "ppetrace.step": 1,
        "ppetrace.device_dur_ns": 99,
    }


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_a_used_context_token_does_not_replace_the_blocks_exception(
    trace: Any, row_sink: RowSink
) -> None:
    """Span_exit let PyContextVar_Reset's RuntimeError (token used) replace the block's own
    exception."""
    assert _CTXVAR is not None
    with pytest.raises(KeyError, match="the block's own"), trace("reset.twice") as span:
        _CTXVAR.reset(span._token)  # the context is back; exit's reset now fails
        raise KeyError("the block's own")
    row = _flushed(row_sink)["reset.twice"]
    assert row.status == "ERROR" and row.error.startswith("KeyError")


class _BadRepr(float):
    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    __str__ = __repr__


@pytest.mark.parametrize("pure_exporter", [False, True], ids=["c-exporter", "python-exporter"])
@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_unencodable_values_cost_only_themselves_in_the_chrome_file(
    trace: Any, pure_exporter: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 11, case 3: {"v": 10**5000} or a float subclass whose repr raises among
    10,001 spans left 0 spans in the file, with stats() claiming all exported."""
    from exporters.chrome import _encode

    if pure_exporter:
        monkeypatch.setattr(_encode, "_speedups", None)
    path = tmp_path / "trace.json"
    exporter = ChromeTraceExporter(path)
    ppetrace.configure(exporters=[exporter], buffer_spans=100_000)
    before = ppetrace.stats()
    try:
        for i in range(10_001):
            if i == 3_000:
                arg: Any = {"v": 10**5000}
            elif i == 7_000:
                arg = {"v": _BadRepr(1.5), "w": 2}
            else:
                arg = {"i": i}
            with trace("span", arg):
                pass
        ppetrace.flush()
        exported = ppetrace.stats().exported - before.exported
    finally:
        ppetrace.configure()
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 10_001
    assert exported <= len(events)
    odd = [e["attrs"] for e in events if "v" in e.get("attrs", {})]
    assert [a["v"] for a in odd] == ["<unencodable: int>", "<unencodable: _BadRepr>"]
    assert odd[1]["w"] == 2


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_readable_spans_keep_every_span_and_convert_bad_values_alone(
    trace: Any, span_exporter: InMemorySpanExporter
) -> None:
    class NoStr:
        def __str__(self) -> str:
            raise ValueError("no str")

    with trace("plain"):
        pass
    with trace("odd", {"huge": 10**5000, "big": 2**70, "bad": _BadRepr(2.5), "none": None}):
        pass
    row = SpanRow("direct", 5, 0, 7, 1, 2, 1, {"obj": NoStr(), 3: "int key"})
    FLUSHER.inject(SpanBatch([row], {}, 1, {}))
    spans = {s.name: dict(s.attributes or {}) for s in span_exporter.get_finished_spans()}
    ppetrace.flush()
    spans.update({s.name: dict(s.attributes or {}) for s in span_exporter.get_finished_spans()})
    assert "ppetrace.arg" not in spans["plain"]  # no arg: no attribute (it was "{}")
    odd = spans["odd"]
    assert odd["huge"] == "<unencodable: int>" and odd["big"] == str(2**70)
    assert odd["bad"] == 2.5 and "none" not in odd
    assert spans["direct"]["obj"] == "<unencodable: NoStr>" and spans["direct"]["3"] == "int key"
