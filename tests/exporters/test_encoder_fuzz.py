"""The C and pure-Python exporters agree on generated batches, byte for byte (issue 18).

Batches mix every kind of value an attribute can hold: extreme int64 times, -0.0,
NaN, ints beyond int64 and beyond str()'s digit limit, str subclasses (one with a
raising __hash__), tuples, objects whose repr or str raises, keys that are not
strings. The events and frames that each path builds must be equal.
"""

from __future__ import annotations

import enum
import json
import math
from typing import Any

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporters import SpanRow, spans_to_frame
from exporters import frame as frame_module
from exporters._accel import SPEEDUPS
from exporters._pandas import STRING_DTYPE
from exporters._spans import FrozenAttributes
from exporters.chrome import _encode
from exporters.chrome._writer import ChromeTraceExporter

pytestmark = pytest.mark.skipif(SPEEDUPS is None, reason="exporters._speedups not built")

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
SETTINGS = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Sub(str):
    """A str subclass: the C encoder hands it to Python."""


class NoHash(str):
    """A str subclass whose __hash__ raises: the pure path's value cache failed on it."""

    def __hash__(self) -> int:
        raise ValueError("no hash")


class BadRepr(float):
    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    __str__ = __repr__


class NoStr:
    def __str__(self) -> str:
        raise RuntimeError("no str")

    __repr__ = __str__


class Color(enum.IntEnum):
    RED = 1


class _Encoder:
    """What _encode_columns needs of a ChromeTraceExporter, without a file."""

    _prefix = ChromeTraceExporter._prefix

    def __init__(self) -> None:
        self._prefixes: dict[int, dict[str, str]] = {}
        self._strs: dict[str, str] = {}
        self._heads: dict[Any, str] = {}
        self._strings: dict[str, str] = {}
        self._values: dict[Any, dict[Any, str]] = {}


PLAIN = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    INT64,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.5, -1.5]),
    st.text(max_size=8),
    st.sampled_from(["a", "b", "é", "\ud800", 'q"\\']),
)
ODD = st.one_of(
    st.builds(Sub, st.text(max_size=4)),
    st.builds(NoHash, st.text(max_size=4)),
    st.builds(BadRepr, st.floats(allow_nan=False)),
    st.builds(NoStr),
    st.just(Color.RED),
    st.just(10**5000),
    st.tuples(PLAIN, PLAIN),
    st.lists(PLAIN, max_size=3),
)
KEYS = st.one_of(
    st.sampled_from(["a", "b", "c", "status", "span_id", "ppetrace.step", "é"]),
    st.text(max_size=4),
)
ODD_KEYS = st.one_of(KEYS, st.integers(0, 3), st.builds(Sub, st.sampled_from(["a", "z"])))
# the frame's standard columns (ppetrace.step ...) take whole numbers only: not fuzzed here
FRAME_KEYS = st.one_of(st.sampled_from(["a", "b", "c", "status", "é"]), st.text(max_size=4))


def _attrs(values: Any, keys: Any) -> Any:
    mapping = st.dictionaries(keys, values, max_size=6)
    return st.one_of(mapping, mapping.map(FrozenAttributes), st.just({}))


def _rows(values: Any, keys: Any) -> Any:
    row = st.builds(
        SpanRow,
        st.sampled_from(["trainer.step", "module.x", "user é", 'q"']),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**128 - 1),
        INT64,
        INT64,
        st.integers(-(2**31), 2**31),
        _attrs(values, keys),
        st.sampled_from(["UNSET", "OK", "ERROR"]),
        st.sampled_from(["", "E: x\ny", "é"]),
    )
    shared = st.dictionaries(keys, values, max_size=4)
    # rows that share one key order (the C encoder's cached path) and rows that do not
    return st.one_of(
        st.lists(row, min_size=1, max_size=25),
        st.tuples(shared, st.lists(row, min_size=1, max_size=25)).map(
            lambda t: [r._replace(attributes=dict(t[0])) for r in t[1]]
        ),
    )


def _encode_both(rows: list[SpanRow], origin: int) -> tuple[bytes, bytes]:
    fast = b"".join(d for d, _ in _encode._encode_columns(_Encoder(), rows, 1, origin, True))  # type: ignore[arg-type]
    saved = _encode._speedups
    _encode._speedups = None
    try:
        slow = b"".join(d for d, _ in _encode._encode_columns(_Encoder(), rows, 1, origin, True))  # type: ignore[arg-type]
    finally:
        _encode._speedups = saved
    return fast, slow


@SETTINGS
@given(rows=_rows(st.one_of(PLAIN, ODD), ODD_KEYS), origin=st.one_of(INT64, st.just(-(2**63) - 1)))
def test_c_and_python_chrome_events_agree_on_generated_batches(
    rows: list[SpanRow], origin: int
) -> None:
    fast, slow = _encode_both(rows, origin)
    assert fast == slow
    events = json.loads("[" + fast.decode("ascii") + "]")  # valid JSON, ASCII only
    assert len(events) == len(rows)


@settings(SETTINGS, max_examples=50)
@given(rows=_rows(PLAIN, FRAME_KEYS))
def test_c_and_python_frames_agree_on_generated_batches(rows: list[SpanRow]) -> None:
    fast = spans_to_frame(rows)
    saved = frame_module._speedups
    frame_module._speedups = None
    try:
        slow = spans_to_frame(rows)
    finally:
        frame_module._speedups = saved
    pd.testing.assert_frame_equal(fast, slow)


def test_negative_zero_and_zero_stay_apart_on_both_paths() -> None:
    """The pure path's value cache merged -0.0 into 0.0 (-0.0 == 0.0)."""
    rows = [
        SpanRow("e", i + 1, 0, 7, 10 * i, 10 * i + 5, 1, {"z": z})
        for i, z in enumerate([0.0, -0.0, 0.0, -0.0])
    ]
    fast, slow = _encode_both(rows, 0)
    assert fast == slow
    assert [json.loads(e)["attrs"]["z"] for e in fast.decode().strip().split(",\n")] == [0.0] * 4
    assert fast.count(b'"z":-0.0') == 2 and fast.count(b'"z":0.0') == 2


def test_a_str_subclass_with_a_raising_hash_is_encoded_on_both_paths() -> None:
    """C encoded it; the pure path's cache raised, and the whole batch was lost."""
    rows = [SpanRow("e", i + 1, 0, 7, i, i + 5, 1, {"s": NoHash(f"v{i}")}) for i in range(3)]
    fast, slow = _encode_both(rows, 0)
    assert fast == slow
    assert b'"s":"v0"' in fast and b'"s":"v2"' in fast


def test_unencodable_values_are_named_by_their_type_on_both_paths() -> None:
    rows = [
        SpanRow("e", 1, 0, 7, 0, 5, 1, {"huge": 10**5000, "bad": BadRepr(1.0), "obj": NoStr()}),
        SpanRow("e", 2, 0, 7, 1, 5, 1, {NoStr(): 1, "t": (BadRepr(2.0), 3)}),
    ]
    fast, slow = _encode_both(rows, 0)
    assert fast == slow
    first, second = (json.loads(e)["attrs"] for e in fast.decode().strip().split(",\n"))
    assert first["huge"] == "<unencodable: int>" and first["bad"] == "<unencodable: BadRepr>"
    assert first["obj"] == "<unencodable: NoStr>"
    assert second["<unencodable: NoStr>"] == 1 and second["t"] == ["<unencodable: BadRepr>", 3]


def test_frozen_attributes_take_the_c_paths() -> None:
    """A FrozenAttributes row is a dict to the C encoders (no fallback to Python)."""
    rows = [FrozenAttributes({"a": 1, "s": "x"}), {"a": 2, "s": "y"}]
    table = SPEEDUPS.attr_table(rows)
    assert table is not None and table[0] == ["a", "s"]
    strings = SPEEDUPS.encode_attrs(rows, {}, {}, _encode._head_of, _encode._encode_value)
    assert strings == [',"a":1,"s":"x"', ',"a":2,"s":"y"']
    frame = spans_to_frame([SpanRow("e", 1, 0, 7, 0, 5, 1, rows[0])])
    assert frame["s"].dtype == (object if STRING_DTYPE is None else STRING_DTYPE)
    assert not math.isnan(frame["a"].iloc[0])
