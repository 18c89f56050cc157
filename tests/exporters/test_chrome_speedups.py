"""The C event assembler writes exactly what the pure-Python encoder writes."""

from __future__ import annotations

import pytest

from exporters import ChromeTraceExporter, SpanRow, chrome

pytestmark = pytest.mark.skipif(chrome._speedups is None, reason="exporters._speedups not built")


def _rows() -> list[SpanRow]:
    base = 1_700_000_000_123_456_789
    return [
        SpanRow("trainer.step", 2**64 - 1, 0, 7, base, base + 1_234_567, 42, {"ppetrace.step": 3}),
        SpanRow(
            'user "quoted" \\ name é',
            5,
            2**64 - 1,
            7,
            base - 1,  # before the origin: a negative ts
            base - 1,  # zero duration
            2**31,
            {"weird key \n": 'välue\t"x"', "t": (1, 2.5, "a"), "b": True, "n": None},
        ),
        SpanRow("runtime.convert_batch", 9, 5, 7, base + 10, base + 5, 1, {}, "ERROR", "E: x\ny"),
        SpanRow("module.train_step", 10, 5, 7, base + 10, base + 999_999, 1, {"f": 0.1}, "OK", ""),
    ]


def test_c_and_python_encoders_agree(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = _rows()
    origin = 1_700_000_000_000_000_000
    exporter = ChromeTraceExporter(str(tmp_path) + "/a.json")  # type: ignore[operator]
    try:
        fast = chrome._encode_columns(exporter, rows, 1234, origin)
        monkeypatch.setattr(chrome, "_speedups", None)
        slow = chrome._encode_columns(exporter, rows, 1234, origin)
    finally:
        exporter.shutdown()
    assert fast == slow
    assert len(fast) == 4
    assert any('"ts":-0.001' in e or '"ts":123456.788' in e for e in fast)
    assert any('"parent_id":"ffffffffffffffff"' in e for e in fast)
    assert any('"error":"E: x\\ny"' in e for e in fast)


def test_c_and_python_attribute_encoders_agree(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import enum
    from types import MappingProxyType

    class Color(enum.IntEnum):
        RED = 1

    attrs = [
        {"b": 1, "a": "x", "n": None, "status": "clash"},
        MappingProxyType({}),
        {"big": 2**70, "neg": -5, "f": 0.1, "nan": float("nan"), "inf": float("-inf")},
        {"t": (1, "é", 2.5), "l": [True, None], "enum": Color.RED, "obj": object.__name__},
        {"bool": True, "false": False, "uni": 'ünïcode \u2028 "q" \\'},
        {},
    ]
    exporter = chrome.ChromeTraceExporter(str(tmp_path) + "/b.json")  # type: ignore[operator]
    try:
        fast = chrome._attribute_strings(exporter, attrs)  # type: ignore[arg-type]
        monkeypatch.setattr(chrome, "_speedups", None)
        slow = chrome._attribute_strings(exporter, attrs)  # type: ignore[arg-type]
    finally:
        exporter.shutdown()
    assert fast == slow
    assert fast[0] == ',"a":"x","b":1,"attr.status":"clash"'
    assert fast[1] == "" and fast[5] == ""


def test_c_and_python_frame_columns_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    import pandas as pd

    from exporters import frame, spans_to_frame

    rows = _rows()
    fast = spans_to_frame(rows)
    monkeypatch.setattr(frame, "_speedups", None)
    slow = spans_to_frame(rows)
    pd.testing.assert_frame_equal(fast, slow)
    assert fast["span_id"].tolist()[0] == 2**64 - 1


def test_c_and_python_typed_attribute_columns_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import MappingProxyType

    import pandas as pd

    from exporters import SpanRow, frame, spans_to_frame

    attrs: list[object] = [
        {"i": 1, "im": 2**62, "f": 1, "b": True, "s": "x", "big": 2**70, "mix": True},
        MappingProxyType({}),
        {"i": -3, "f": 2.5, "b": False, "s": "y", "big": 1, "mix": 2, "none": None},
        {"i": 7, "im": None, "f": None, "b": None, "s": None, "big": None},
    ]
    rows = [
        SpanRow(f"e{i}", i + 1, 0, 7, 1_000 * i, 1_000 * i + 500, 1, a)  # type: ignore[arg-type]
        for i, a in enumerate(attrs)
    ]
    fast = spans_to_frame(rows)
    monkeypatch.setattr(frame, "_speedups", None)
    slow = spans_to_frame(rows)
    pd.testing.assert_frame_equal(fast, slow)
    assert str(fast["im"].dtype) == "Int64" and fast["im"].tolist()[0] == 2**62
    assert fast["i"].dtype == "int64" or str(fast["i"].dtype) == "Int64"
