"""The C line scanner (``_speedups.scan_events``) reads what its msgspec twin reads.

The scanner takes the lines of ppetrace's own X events straight into columns and
hands every other line back; a frame read with it must equal the frame read
without it (the msgspec path, with and without the other C helpers), for any
line a file may hold: escapes, non-ASCII and broken UTF-8, numbers in every
JSON form, whitespace, duplicate keys, errors in ``args``, metadata and B/E
events, cut-off files.
"""

from __future__ import annotations

import io
import json
import math
import struct
import threading
import warnings
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporters import TraceError, read_chrome_trace
from exporters._accel import SPEEDUPS
from exporters.chrome import _events, _parse

pytestmark = pytest.mark.skipif(SPEEDUPS is None, reason="exporters._speedups not built")

_HEAD = b'{"displayTimeUnit":"ns","otherData":{"origin_ns":1000,"trace_id":"ab"},"traceEvents":[\n'
_META = b'{"ph":"M","name":"process_name","pid":7,"tid":0,"args":{"name":"x rank 3"}},\n'


def _line(i: int, **change: bytes) -> bytes:
    """One X event as ppetrace writes it, with some fields' raw JSON replaced."""
    fields = {
        "ph": b'"X"',
        "cat": b'"trainer"',
        "name": b'"trainer.step"',
        "pid": b"7",
        "tid": b"11",
        "ts": f"{i * 3.5:.3f}".encode(),
        "dur": b"2.250",
        "span_id": f'"{i + 1:016x}"'.encode(),
        "parent_id": f'"{(i + 1) // 2:016x}"'.encode(),
        "status": b'"UNSET"',
        "attrs": b'{"ppetrace.epoch":0,"ppetrace.stage":"train","ppetrace.step":%d}' % (i // 3),
    }
    fields.update(change)
    body = b",".join(b'"%s":%s' % (k.encode(), v) for k, v in fields.items() if v is not None)
    return b"{" + body + b"},\n"


def _read_all_ways(path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The frame (or the TraceError's text) read with the scanner, with msgspec and the
    other C helpers, and in pure Python."""
    out = []
    for way in ("scan", "msgspec", "python"):
        with monkeypatch.context() as m:
            if way == "msgspec":
                m.setattr(_events.SpanColumns, "scan", lambda self, *a: None)
            if way == "python":
                m.setattr(_events, "_speedups", None)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    result: Any = read_chrome_trace(path)
                except TraceError as exc:
                    result = str(exc)
            out.append((result, [str(w.message) for w in caught]))
    return out


def _assert_same(results: list[Any]) -> None:
    (first, warned), *others = results
    for result, more in others:
        assert more == warned
        if isinstance(first, str) or isinstance(result, str):
            assert result == first
            continue
        pd.testing.assert_frame_equal(result, first)
        assert result.attrs == first.attrs


def test_ppetrace_lines_are_read_by_the_scanner_and_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(_HEAD + _META + b"".join(_line(i) for i in range(300)) + b"]}\n")
    calls = []
    scan = _events.SpanColumns.scan

    def spy(self: Any, *args: Any) -> Any:
        calls.append(result := scan(self, *args))
        return result

    monkeypatch.setattr(_parse, "_BLOCK", 4096)  # many blocks
    with monkeypatch.context() as m:
        m.setattr(_events.SpanColumns, "scan", spy)
        frame = read_chrome_trace(path)
    taken = [c for c in calls if c is not None]
    assert len(taken) >= 5 and sum(len(c.columns[2]) // 8 for c in taken) >= 250
    assert len(frame) == 300 and frame["rank"].eq(3).all()
    assert frame["step"].tolist() == [i // 3 for i in range(300)]
    assert frame["start_ns"].tolist() == [1000 + round(i * 3500) for i in range(300)]
    _assert_same(_read_all_ways(path, monkeypatch))


_NAMES = [b'"a\\"b"', b'"caf\xc3\xa9"', b'"\xed\xa0\x80"', b'"\xff"', b'"tab\tin"', b'"\\u00e9"']
_NUMBERS = [b"5", b"-0.0", b"1e3", b"1.5E-2", b"12345678901234567890", b"1e400", b"01", b"1."]
_ATTRS = [
    b"{}",
    b"null",
    b"[1,2]",
    b'{"k": [1, {"a": null}], "s": "\\ud800"}',
    b'{"k":1e400}',
    b'{"k":"\\u00e9\\n","b":true,"f":false}',
    b'{"k":"\xc3\xa9"}',
    b'{"k":"\xff"}',
    b'{"ppetrace.step":1.5,"ppetrace.step":2}',
    b'{"ppetrace.st\\u0065p":3,"k":1}',
    b'{"k":2e}',
    b'{"k":9223372036854775808}',
]


@st.composite
def _lines(draw: st.DrawFn) -> bytes:
    """ppetrace's lines with a few fields, or whole lines, changed."""
    out = [_HEAD]
    for i in range(draw(st.integers(1, 12))):
        kind = draw(st.integers(0, 12))
        if kind == 0:
            out.append(_META)
            continue
        change: dict[str, Any] = {}
        if kind == 1:
            change["name"] = draw(st.sampled_from(_NAMES))
        elif kind == 2:
            change[draw(st.sampled_from(["ts", "dur", "pid", "tid"]))] = draw(
                st.sampled_from(_NUMBERS)
            )
        elif kind == 3:
            change["attrs"] = draw(st.sampled_from(_ATTRS))
        elif kind == 4:
            key = draw(st.sampled_from(["name", "ts", "span_id", "status", "attrs", "cat"]))
            change[key] = None  # absent
        elif kind == 5:
            change["args"] = b'{"error":"E: bad"}'
        elif kind == 6:
            change["span_id"] = draw(st.sampled_from([b'"0000000000000ABC"', b'"xyz"', b"5"]))
        elif kind == 7:
            change["ph"] = draw(st.sampled_from([b'"B"', b'"E"', b'"i"', b'"M"']))
        line = _line(i, **change)
        if kind == 8:  # whitespace, a key twice, another separator, no comma
            line = draw(
                st.sampled_from(
                    [
                        line.replace(b'"pid":7', b'"pid": 7'),
                        line.replace(b"},\n", b',"ph":"X"},\n'),
                        line.replace(b"},\n", b"} ,\r\n"),
                        line.replace(b"},\n", b"}\n"),
                        b"  " + line.replace(b"},\n", b"},\t\r\n"),
                        line + line.rstrip(b"\n"),
                    ]
                )
            )
        out.append(line)
    end = draw(st.sampled_from([b"]}\n", b'],"more":{"x":1}}', b"]", b""]))
    data = b"".join(out) + end
    if draw(st.integers(0, 5)) == 0:
        data = data[: draw(st.integers(len(_HEAD), len(data)))]
    return data


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=_lines(), block=st.sampled_from([97, 400, 1 << 20]))
def test_any_lines_read_the_same_with_and_without_the_scanner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes, block: int
) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(data)
    monkeypatch.setattr(_parse, "_BLOCK", block)
    _assert_same(_read_all_ways(path, monkeypatch))


@settings(max_examples=300, deadline=None)
@given(
    value=st.floats(allow_nan=False, allow_infinity=False),
    form=st.sampled_from(["{:.3f}", "{!r}", "{:.17e}", "{:.6g}", "{:.0f}", "{:.20f}"]),
)
def test_numbers_are_read_as_msgspec_reads_them(value: float, form: str) -> None:
    text = form.format(value).encode()
    if b"inf" in text or len(text) > 63:
        return
    line = _line(0, ts=text, dur=text)
    cols = SPEEDUPS.scan_events(bytearray(line), 0, len(line))
    expected = msgspec.json.decode(b"[" + line.rstrip(b",\n") + b"]", type=list[_parse.TypedEvent])
    ts, dur = struct.unpack("<d", cols[2])[0], struct.unpack("<d", cols[3])[0]
    assert struct.pack("<d", ts) == struct.pack("<d", expected[0].ts), text
    assert struct.pack("<d", dur) == struct.pack("<d", expected[0].dur), text
    assert math.isfinite(ts)


def test_lines_the_scanner_declines_come_back_whole() -> None:
    good = _line(1)
    odd = [
        _META,
        _line(2, name=b'"a\\u00e9"'),
        _line(3, args=b'{"error":"E"}'),
        _line(4, ts=b"1e400"),
        _line(5, pid=b"1234567890123456789"),
        _line(6, attrs=b'{"k":"\xff"}'),
    ]
    data = bytearray(good + b"".join(odd) + good)
    *cols, info, spans = SPEEDUPS.scan_events(data, 0, len(data))
    assert len(cols[2]) // 8 == 2
    back = [bytes(data[a:b]) + b"\n" for a, b in zip(spans[::2], spans[1::2], strict=True)]
    assert back == odd
    # both rows have the one distinct attrs object, taken apart by key
    assert struct.unpack("<2q", cols[8]) == (0, 0)
    keys, values, codes = info
    attrs = json.loads(good[:-2])["attrs"]
    assert keys == list(attrs)  # whole numbers as int64, other values raw
    assert values == [
        struct.pack("<q", v) if type(v) is int else [json.dumps(v).encode()] for v in attrs.values()
    ]
    assert [struct.unpack("<i", c) for c in codes] == [(0,)] * len(attrs)
    assert SPEEDUPS.scan_events(bytearray(b"\n\n"), 0, 2)[-1] == []
    with pytest.raises(ValueError, match="start <= end"):
        SPEEDUPS.scan_events(data, 5, len(data) + 1)


def test_a_keys_values_come_as_int64_only_when_all_are_small_integers() -> None:
    """The scanner's values of a key: int64 when every one is a JSON integer of at most
    18 digits (exactly what they decode to), else raw, all of them."""
    ints = [b"0", b"-0", b"-7", b"123456789012345678", b"-123456789012345678"]
    lines = b"".join(_line(i, attrs=b'{"k":%s,"s":"x"}' % v) for i, v in enumerate(ints))
    keys, values, _ = SPEEDUPS.scan_events(bytearray(lines), 0, len(lines))[9]
    assert keys == ["k", "s"] and values[1] == [b'"x"']
    assert struct.unpack("<5q", values[0]) == tuple(json.loads(v) for v in ints)
    for odd in (b"1234567890123456789", b"1.0", b"true", b"null", b"1e3", b'"1"'):
        more = lines + _line(9, attrs=b'{"k":%s}' % odd)
        (keys, values, _) = SPEEDUPS.scan_events(bytearray(more), 0, len(more))[9]
        assert values[0] == [*ints, odd], odd


def test_attrs_the_scanner_cannot_take_apart_come_back_whole() -> None:
    """A key with an escape, or a key twice: the line is read, and its chunk's distinct
    attrs objects come back whole (as attr_split declines them too)."""
    for odd in (b'{"a\\u0041":1}', b'{"a":1,"a":2}'):
        data = bytearray(_line(0) + _line(1, attrs=odd) + _line(2, attrs=b"7"))
        *cols, info, spans = SPEEDUPS.scan_events(data, 0, len(data))
        assert spans == [] and len(cols[2]) // 8 == 3
        assert type(info) is list and info[1:] == [odd, b"7"]
        assert struct.unpack("<3q", cols[8]) == (0, 1, 2)


_ATTR_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.sampled_from([2**63, -(2**63) - 1, 2**70, 1.5, -0.0, 1e300]),
    st.sampled_from(["train", "val", "é", "a\nb", ""]),
    st.lists(st.integers(0, 2), max_size=2),
    st.dictionaries(st.sampled_from(["x", "y"]), st.integers(0, 2), max_size=2),
)


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    attrs=st.lists(
        st.one_of(
            st.dictionaries(st.sampled_from(["a", "b", "c", "ppetrace.step"]), _ATTR_VALUES),
            st.sampled_from([None, [1], "s", 3]),
        ),
        min_size=1,
        max_size=8,
    ),
    spaced=st.booleans(),
    block=st.sampled_from([300, 1 << 20]),
)
def test_attributes_taken_apart_by_key_type_as_whole_objects_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attrs: list[Any], spaced: bool, block: int
) -> None:
    """The attrs taken apart by key (by the scanner, whose chunks may give a key's
    values as int64 in one chunk and raw in the next, and by _speedups.attr_split)
    against the objects decoded whole (the Python path), for every kind of value and
    missing keys."""
    monkeypatch.setattr(_parse, "_BLOCK", block)  # 300: a chunk of a line or two
    separators = (", ", ": ") if spaced else (",", ":")
    lines = [
        _line(i, attrs=json.dumps(a, separators=separators, ensure_ascii=False).encode())
        for i, a in enumerate(attrs * 3)
    ]
    path = tmp_path / "t.json"
    path.write_bytes(_HEAD + b"".join(lines) + b"]}\n")
    results = _read_all_ways(path, monkeypatch)
    with monkeypatch.context() as m:  # the C helpers, but the objects decoded whole
        m.setattr(_events, "_speedups", _NoSplit(SPEEDUPS))
        m.setattr(_events.SpanColumns, "scan", lambda self, *a: None)  # (it splits too)
        results.append((read_chrome_trace(path), []))
    _assert_same(results)


class _NoSplit:
    """exporters._speedups without attr_split (which then declines every table)."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        if name == "attr_split":
            return lambda items: None
        return getattr(self._module, name)


@pytest.mark.parametrize("odd", [b'{"ppetrace.st\\u0065p":"x","k":1}', b'{"k":1,"k":[2]}'])
def test_chunks_taken_apart_and_chunks_kept_whole_make_one_column_per_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, odd: bytes
) -> None:
    """One chunk's attrs kept whole (an escaped key, or a key twice: the msgspec path
    then decodes them), the others taken apart by key in C: a key that both have is
    one column, typed over all its values (here ints and a str, so objects)."""
    lines = [_line(i) for i in range(40)]
    lines[25] = _line(25, attrs=odd)
    path = tmp_path / "t.json"
    path.write_bytes(_HEAD + b"".join(lines) + b"]}\n")
    monkeypatch.setattr(_parse, "_BLOCK", 1024)  # several chunks
    results = _read_all_ways(path, monkeypatch)
    frame = results[0][0]
    step = frame["step"] if "step" in frame else frame["ppetrace.step"]
    assert len(frame) == 40 and frame["epoch"].eq(0).all()
    assert "k" in frame
    if b"u0065" in odd:
        expected: list[Any] = [i // 3 for i in range(40)]
        expected[25] = "x"
        assert step.tolist() == expected
    _assert_same(results)


def test_a_reset_drops_the_attribute_values_of_the_chunks_it_drops() -> None:
    """A file read again (the reader's fallback) first drops what its lines gave: the
    values of its split attributes too, or they would type the column."""
    columns = _events.SpanColumns()
    first = bytearray(_line(0, attrs=b'{"k":1}'))
    columns.add(columns.scan(first, 0, len(first)))
    mark = columns.mark()
    again = bytearray(_line(1, attrs=b'{"k":"x","j":2}'))
    columns.add(columns.scan(again, 0, len(again)))
    columns.reset(mark)
    frame = columns.frame(0, {})
    assert frame["k"].tolist() == [1] and frame["k"].dtype == "int64" and "j" not in frame


def test_attr_split_declines_what_it_cannot_take_apart() -> None:
    keys, codes, values = SPEEDUPS.attr_split(
        [b"", b'{"a":1,"b":"x"}', b'{"a":2, "c": [1]}', b"[1]"]
    )
    assert keys == ["a", "b", "c"]
    assert [list(struct.unpack("<4i", c)) for c in codes] == [
        [-1, 0, 1, -1],
        [-1, 0, -1, -1],
        [-1, -1, 0, -1],
    ]
    assert values == [[b"1", b"2"], [b'"x"'], [b"[1]"]]
    for odd in (b'{"a":1,"a":2}', b'{"a\\u0041":1}', b'{"a":1} x', b'{"a":01}', b'{"a":"\xff"}'):
        assert SPEEDUPS.attr_split([b'{"a":1}', odd]) is None, odd


def test_large_blocks_are_scanned_in_two_halves_on_two_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Big enough for the C scanner to let go of the GIL on each half (64 KiB), with
    # numbers that take the GIL back (more than 15 digits, exponents) and lines it
    # declines among them: the frame is the one read on one thread, and the twins'.
    forms = [b"%.3f", b"%.17e", b"%.6f"]
    lines = [
        _line(i, ts=forms[i % 3] % (1.7e9 + i * 3.5), dur=b"%.10f" % (2.25 + i % 7))
        if i % 5
        else _line(i)
        for i in range(6000)
    ]
    lines[10:10] = [_META]
    path = tmp_path / "t.json"
    path.write_bytes(_HEAD + b"".join(lines) + b"]}\n")
    halves = []
    scan_halves = _parse._scan_halves

    def spy(*args: Any) -> Any:
        result = scan_halves(*args)
        halves.append(None if result is None else len(result))
        return result

    monkeypatch.setattr(_parse, "_BLOCK", 200_000)
    monkeypatch.setattr(_parse, "_SPLIT_BYTES", 1)
    monkeypatch.setattr(_parse, "_cpus", lambda: 2)
    with monkeypatch.context() as m:
        m.setattr(_parse, "_scan_halves", spy)
        split = read_chrome_trace(path)
    assert halves.count(2) >= 2  # middle blocks, read in two halves
    assert len(split) == 6000
    monkeypatch.setattr(_parse, "_cpus", lambda: 1)
    pd.testing.assert_frame_equal(split, read_chrome_trace(path))
    monkeypatch.setattr(_parse, "_cpus", lambda: 2)
    _assert_same(_read_all_ways(path, monkeypatch))


class _Reads(io.BytesIO):
    """A file that records which thread made each read."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.threads: list[str] = []

    def read(self, size: int | None = -1, /) -> bytes:
        self.threads.append(threading.current_thread().name)
        return super().read(size)


def test_the_next_block_is_read_on_a_thread_while_this_one_is_scanned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = bytes(range(256)) * 40  # 10,240 bytes: blocks of 1,000, then 240
    monkeypatch.setattr(_parse, "_BLOCK", 1000)
    monkeypatch.setattr(_parse, "_cpus", lambda: 2)
    f = _Reads(data)
    blocks = list(_parse._read_ahead(f, f.read(1000)))
    assert b"".join(blocks) == data and [len(b) for b in blocks] == [1000] * 10 + [240]
    assert f.threads[0] == threading.current_thread().name
    assert all(name.startswith("ppetrace-read") for name in f.threads[1:])
    # stopped early: the read in flight is waited for (the file may be closed after)
    f = _Reads(data)
    reader = _parse._read_ahead(f, f.read(1000))
    assert next(reader) == data[:1000]
    reader.close()
    assert f.tell() == 2000
    monkeypatch.setattr(_parse, "_cpus", lambda: 1)  # one CPU: every read on this thread
    f = _Reads(data)
    assert b"".join(_parse._read_ahead(f, f.read(1000))) == data
    assert set(f.threads) == {threading.current_thread().name}


def test_numbers_are_read_as_msgspec_reads_them_without_the_gil() -> None:
    # 64 KiB and more: the scan runs without the GIL, and takes it back for the numbers
    # that need PyOS_string_to_double
    values = [1.7e9 + i / 7 for i in range(1500)]
    forms = ["{:.17e}", "{!r}", "{:.20f}", "{:.3f}"]
    texts = [forms[i % 4].format(v).encode() for i, v in enumerate(values)]
    block = b"".join(_line(i, ts=t, dur=t) for i, t in enumerate(texts))
    assert len(block) >= 1 << 16
    cols = SPEEDUPS.scan_events(block, 0, len(block))
    expected = msgspec.json.decode(b"[" + block.rstrip(b",\n") + b"]", type=list[_parse.TypedEvent])
    assert not cols[10]  # every line taken
    ts = struct.unpack(f"<{len(texts)}d", cols[2])
    assert [struct.pack("<d", t) for t in ts] == [struct.pack("<d", e.ts) for e in expected]


@pytest.mark.parametrize("processes", [0, 3, 40])
def test_ranks_by_pid_are_the_dicts_map(processes: int) -> None:
    """Each row's rank by pid: a pass per process when there are few, ``Series.map``
    past 16; both as ``Series.map`` gives them (NaN where a pid has no rank)."""
    pid = np.arange(200, dtype=np.int64) % 50
    by_pid = {p: 100 + p for p in range(0, 2 * processes, 2)}
    by_pid[2**70] = 1  # a pid no row can have
    expected = pd.Series(pid).map(by_pid).to_numpy(dtype=float)
    np.testing.assert_array_equal(_events._ranks(pid, by_pid), expected)
