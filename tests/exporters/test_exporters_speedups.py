"""The C event assembler writes exactly what the pure-Python encoder writes."""

from __future__ import annotations

from typing import Any

import pytest

from exporters import ChromeTraceExporter, SpanRow
from exporters.chrome import _encode as chrome

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


def _encode(
    exporter: ChromeTraceExporter, rows: list[SpanRow], pid: int, origin: int, first: bool
) -> bytes:
    """All parts of chrome._encode_columns, joined (encoded now, not lazily)."""
    return b"".join(data for data, _ in chrome._encode_columns(exporter, rows, pid, origin, first))


def test_c_and_python_encoders_agree(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = _rows()
    origin = 1_700_000_000_000_000_000
    exporter = ChromeTraceExporter(str(tmp_path) + "/a.json")  # type: ignore[operator]
    try:
        fast = [_encode(exporter, rows, 1234, origin, first) for first in (True, False)]
        monkeypatch.setattr(chrome, "_speedups", None)
        slow = [_encode(exporter, rows, 1234, origin, first) for first in (True, False)]
    finally:
        exporter.shutdown()
    assert fast == slow
    assert fast[0].startswith(b'\n{"ph":"X"') and fast[1].startswith(b',\n{"ph":"X"')
    events = fast[0].decode("ascii").split(",\n")
    assert len(events) == 4
    assert any('"ts":-0.001' in e or '"ts":123456.788' in e for e in events)
    assert any('"parent_id":"ffffffffffffffff"' in e for e in events)
    assert any('"error":"E: x\\ny"' in e for e in events)


#: ints around the places where the C reader changes how it reads them: one, two and
#: three 30-bit digits, the int64 and uint64 ends
_DIGIT_EDGES = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**62, 2**63 - 1]


@pytest.mark.parametrize("edge", _DIGIT_EDGES)
def test_c_and_python_write_the_same_ints_at_the_digit_boundaries(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, edge: int
) -> None:
    rows = [
        SpanRow("a", edge, edge, 7, edge, edge, edge, {}),
        SpanRow("b", 2**64 - 1 - edge, 2**63 + edge, 7, -edge, -edge, -edge, {}),
        SpanRow("c", 3, 0, 7, -(2**63), 2**63 - 1, -(2**31), {}, "ERROR", "x"),
    ]
    exporter = ChromeTraceExporter(tmp_path / "edges.json")
    try:
        fast = _encode(exporter, rows, 1, 0, True)
        with monkeypatch.context() as m:
            m.setattr(chrome, "_speedups", None)
            slow = _encode(exporter, rows, 1, 0, True)
    finally:
        exporter.shutdown()
    assert fast == slow
    assert f'"span_id":"{edge:016x}"'.encode() in fast


@pytest.mark.parametrize(
    "field,value", [(4, 2**63), (5, -(2**63) - 1), (1, 2**64), (2, -1), (6, 2**63)]
)
def test_c_and_python_refuse_the_same_ints_past_the_ends(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, field: int, value: int
) -> None:
    fields: list[Any] = ["a", 5, 0, 7, 10, 20, 3, {}, "UNSET", ""]
    fields[field] = value
    rows = [SpanRow(*fields)]
    exporter = ChromeTraceExporter(tmp_path / "past.json")
    try:
        with pytest.raises(OverflowError):
            _encode(exporter, rows, 1, 0, True)
        with monkeypatch.context() as m:
            m.setattr(chrome, "_speedups", None)
            with pytest.raises(OverflowError):
                _encode(exporter, rows, 1, 0, True)
    finally:
        exporter.shutdown()


def _attribute_strings_both_ways(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, attrs: list[Any]
) -> list[str]:
    """The attribute strings of ``attrs`` from the C encoder, checked equal to the
    pure-Python encoder's."""
    exporter = ChromeTraceExporter(str(tmp_path) + "/attrs.json")
    try:
        fast = chrome._attribute_strings(exporter, attrs)
        with monkeypatch.context() as m:
            m.setattr(chrome, "_speedups", None)
            slow = chrome._attribute_strings(exporter, attrs)
    finally:
        exporter.shutdown()
    assert fast == slow
    return fast


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
    fast = _attribute_strings_both_ways(tmp_path, monkeypatch, attrs)
    assert fast[0] == ',"a":"x","b":1,"status":"clash"'  # attrs is its own object
    assert fast[1] == "" and fast[5] == ""


def test_c_and_python_agree_on_every_byte_to_escape_at_every_place(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The C encoder tests ASCII values eight bytes at a time for a byte that JSON must
    # escape: each such byte, at each place of values of 0 to 24 bytes (each side of a
    # word boundary), and the ints at the edges of the digit writer.
    values: list[Any] = []
    for n in range(25):
        values.append("a" * n)
        for bad in ('"', "\\", "\x7f", "\x1f", "\x00", "\n", "~", " ", "\x80"):
            values += ["a" * k + bad + "b" * (n - k - 1) for k in range(n)]
    values += [0, 9, 10, 99, 100, 101, -1, -10, 2**63 - 1, -(2**63), 10**18, 10**19 - 1]
    attrs = [{"v": v, "w": "x"} for v in values]
    fast = _attribute_strings_both_ways(tmp_path, monkeypatch, attrs)
    assert fast[0] == ',"v":"","w":"x"'
    assert ',"v":"aa\\"b","w":"x"' in fast and ',"v":-9223372036854775808,"w":"x"' in fast


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


def _pure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every exporters module on its pure-Python path."""
    from exporters import _pandas, frame

    monkeypatch.setattr(frame, "_speedups", None)
    monkeypatch.setattr(_pandas, "_speedups", None)


class _Name(str):
    """A str subclass: not encoded in C, so the name column falls back to a list."""


def _many_rows(n: int, odd_name: bool = False) -> list[SpanRow]:
    base = 1_700_000_000_000_000_000
    names = ["trainer.step", "module.train_step", "user.\ud800odd", 'q"x']
    rows = []
    for i in range(n):
        attrs: dict[str, object] = {
            "ppetrace.step": i // 10,
            "ppetrace.stage": ("train", "val", None)[i % 3],
            "s": f"v{i % 7}",
            "f": 0.5 * i if i % 5 else i,
            "b": bool(i % 2),
            "big": 2**70 if i == 5 else i,
            "o": (1, 2) if i % 11 == 0 else "x",
            "none": None,
        }
        if i % 4 == 0:
            attrs = {"late": i, **attrs}  # another key order
        if i % 13 == 0:
            attrs["ppetrace.epoch"] = i // 13
        name = _Name(names[i % 4]) if odd_name and i == n // 2 else names[i % 4]
        parent = (i // 10) * 10 + 1 if i % 10 else 0
        start = base + i * 1_000
        status, error = (("UNSET", ""), ("OK", ""), ("ERROR", f"E{i % 2}: x"))[i % 3]
        rows.append(
            SpanRow(name, i + 1, parent, 7, start, start + 500, 1 + i % 2, attrs, status, error)
        )
    return rows


@pytest.mark.parametrize("odd_name", [False, True])
def test_c_and_python_frames_of_many_rows_agree(
    monkeypatch: pytest.MonkeyPatch, string_storage: str, odd_name: bool
) -> None:
    """Long columns take the encoded paths: span_columns, attr_table, dict_encode."""
    import pandas as pd

    from exporters import spans_to_frame
    from exporters._pandas import STRING_DTYPE

    rows = _many_rows(3_000, odd_name)
    fast = spans_to_frame(rows)
    _pure(monkeypatch)
    slow = spans_to_frame(rows)
    pd.testing.assert_frame_equal(fast, slow)
    expected = [r.name for r in rows]
    assert fast["name"].tolist() == expected
    for col in ("name", "trace_id", "status", "error", "stage", "s"):
        assert fast[col].dtype == (object if STRING_DTYPE is None else STRING_DTYPE), col
    assert fast["stage"].isna().sum() == 1_000
    assert fast["o"].dtype == object and fast.loc[0, "o"] == (1, 2)
    assert fast["big"].dtype == object and fast.loc[5, "big"] == 2**70
    assert str(fast["b"].dtype) == "boolean" and fast["f"].dtype == "float64"
    assert str(fast["late"].dtype) == "Int64" and fast["late"].isna().sum() == 2_250
    assert fast["none"].isna().all()
    # epoch: on every 13th row, and inherited from the roots (rows 0, 10, 20, ...)
    assert fast.loc[13, "epoch"] == 1 and fast.loc[130, "epoch"] == 10
    assert fast.loc[131, "epoch"] == 10 and fast.loc[1, "epoch"] == 0
    assert pd.isna(fast.loc[10, "epoch"]) and pd.isna(fast.loc[11, "epoch"])


def test_attr_table_types_each_key_in_one_pass() -> None:
    from types import MappingProxyType

    from exporters import frame

    table = frame._speedups.attr_table(
        [{"a": 1, "s": "x"}, {}, {"a": None, "s": "y", "z": 2**70}, MappingProxyType({})]
    )
    keys, columns = table
    assert keys == ["a", "s", "z"]
    kinds = {k: c[0] for k, c in zip(keys, columns, strict=True)}
    assert kinds == {"a": "i", "s": "s", "z": "o"}
    assert columns[1][2] == ["x", "y"]
    assert frame._speedups.attr_table([{"a": 1}, MappingProxyType({"a": 2})]) is None
    keys, columns = frame._speedups.attr_table([{"a": 1, "s": "x"}, {"z": 3}], frozenset({"s"}))
    assert keys == ["a", "z"] and [c[0] for c in columns] == ["i", "i"]
    assert frame._speedups.dict_encode(["a", None, "b", "a"])[1] == ["a", "b"]
    assert frame._speedups.dict_encode(["a", 1]) is None


def test_c_and_python_batches_agree_on_every_attribute_path(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C batch encoder reuses each key order; rows it cannot do go to Python."""
    from types import MappingProxyType

    base = 1_700_000_000_000_000_000
    shared = [  # first seen: b before a, so that only sorting puts a first
        {"b": i, "a": "x", "n": None, "f": 0.5} if i % 3 != 1 else {"a": "x", "b": i, "z": (1, "y")}
        for i in range(50)
    ]
    cases: dict[str, list[object]] = {
        "orders": list(shared),
        "many keys": [*shared, {f"k{j:02d}": j for j in range(40)}],
        "not a dict": [*shared, MappingProxyType({"a": 1})],
        "unsortable": [*shared, {1: "one", "a": 2}],
    }
    origin = base - 1_000
    for label, attrs in cases.items():
        rows = [
            SpanRow(f"e{i % 4}", i + 1, 0, 7, base + i, base + i + 9, 1, a)  # type: ignore[arg-type]
            for i, a in enumerate(attrs)
        ]
        path = str(tmp_path) + f"/{label}.json"  # type: ignore[operator]
        exporter = ChromeTraceExporter(path)
        try:
            fast = _encode(exporter, rows, 1, origin, True)
            with monkeypatch.context() as m:
                m.setattr(chrome, "_speedups", None)
                slow = _encode(exporter, rows, 1, origin, True)
                m.setattr(chrome, "_PART_ROWS", 7)  # many parts
                slow_parts = _encode(exporter, rows, 1, origin, True)
            with monkeypatch.context() as m:
                m.setattr(chrome, "_PART_ROWS", 7)
                assert _encode(exporter, rows, 1, origin, True) == slow_parts, label
            assert slow_parts == slow, label
        finally:
            exporter.shutdown()
        assert fast == slow, label
        assert fast.count(b'"a":"x"') == 50, label
        assert fast.count(b'"a":"x","b":') == 50, label  # sorted keys on every path
        assert (b'"k39":39' in fast) == (label == "many keys"), label


def test_event_columns_reads_slots_and_attributes_alike_and_declines_other_shapes() -> None:
    """The reader's C pass gives the same columns from msgspec structs (their slots) and
    from any object with the fields (getattr), and None for an event of another shape."""
    import types

    import msgspec

    from exporters._accel import SPEEDUPS
    from exporters.chrome._events import _FIELDS
    from exporters.chrome._parse import TypedEvent

    if SPEEDUPS is None:
        pytest.skip("exporters._speedups is not built")
    raw = msgspec.Raw(b'{"a":1}')
    base = dict(
        ph="X", name="s", pid=2**40, tid=-3, ts=1.5, dur=0.25, span_id="00000000000000aB",
        parent_id="0000000000000000", status="UNSET", attrs=raw, args=None,
    )  # fmt: skip
    structs = [TypedEvent(**base), TypedEvent(**{**base, "name": "t", "attrs": msgspec.Raw()})]
    plain = [types.SimpleNamespace(**vars_of(e)) for e in structs]

    def run(events: list[Any]) -> Any:
        return SPEEDUPS.event_columns(events, _FIELDS, {b"": 0}, [b""])

    fast, slow = run(structs), run(plain)
    assert fast == slow
    names, statuses, *arrays = fast
    assert names[1] == ["s", "t"] and statuses[1] == ["UNSET"]
    assert bytes(arrays[4]) == (0xAB).to_bytes(8, "little") * 2  # span ids, either case
    assert list(memoryview(arrays[6]).cast("q")) == [1, 0]  # attrs: new code, then none
    for change in ({"ts": None}, {"span_id": "xyz"}, {"args": {"error": "e"}}, {"pid": 2**63}):
        assert run([TypedEvent(**{**base, **change})]) is None


def vars_of(event: Any) -> dict[str, Any]:
    return {f: getattr(event, f) for f in event.__struct_fields__}
