"""The C and pure-Python exporters agree on generated batches, byte for byte (issue 18).

Batches mix every kind of value an attribute can hold: extreme int64 times, -0.0,
NaN, ints beyond int64 and beyond str()'s digit limit, str subclasses (one with a
raising __hash__), tuples, objects whose repr or str raises, keys that are not
strings; rows in any order, attribute dicts shared by several rows (as the Trainer
shares one per step), errors, batches cut into several parts. The events and frames
that each path builds must be equal.

Values of str, int and float subclasses are drawn as :class:`Make` markers and built
in the test (:func:`_realize`): hypothesis may splice a value it drew into another
draw of a str, int or float, and a subclass there breaks it (a KeyError on the
subclass inside hypothesis, whenever the source's constants change its draws).
"""

from __future__ import annotations

import enum
import json
import math
import random
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Make:
    """A value of a str, int or float subclass, built only in the test (module doc)."""

    kind: type
    arg: Any

    def build(self) -> Any:
        return self.kind(self.arg)


def _real(value: Any) -> Any:
    return value.build() if isinstance(value, Make) else value


def _realize(rows: list[SpanRow]) -> list[SpanRow]:
    """The rows with every :class:`Make` in their attributes built; rows that shared one
    attribute mapping still share one."""
    built: dict[int, Any] = {}
    out = []
    for r in rows:
        attrs = r.attributes
        if id(attrs) not in built:
            built[id(attrs)] = type(attrs)({_real(k): _real(v) for k, v in attrs.items()})
        out.append(r._replace(attributes=built[id(attrs)]))
    return out


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
    # around the C encoder's plain-ASCII path: 0x1f, 0x20, 0x7e and 0x7f, '"' and '\\'
    st.text(alphabet=st.characters(max_codepoint=0x80), max_size=8),
    st.sampled_from(["\x1f", " ~", "\x7f", "1;2/3", "", "a\\", '"']),
)
ODD = st.one_of(
    st.builds(Make, st.just(Sub), st.text(max_size=4)),
    st.builds(Make, st.just(NoHash), st.text(max_size=4)),
    st.builds(Make, st.just(BadRepr), st.floats(allow_nan=False)),
    st.builds(NoStr),
    st.just(Make(Color, 1)),
    st.just(10**5000),
    st.tuples(PLAIN, PLAIN),
    st.lists(PLAIN, max_size=3),
)
KEYS = st.one_of(
    st.sampled_from(["a", "b", "c", "status", "span_id", "ppetrace.step", "é"]),
    st.text(max_size=4),
)
ODD_KEYS = st.one_of(
    KEYS, st.integers(0, 3), st.builds(Make, st.just(Sub), st.sampled_from(["a", "z"]))
)
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
    # rows that share one key order (the C encoder's cached path), rows that do not, and
    # rows that share their attribute objects themselves, in runs and interleaved
    return st.one_of(
        st.lists(row, min_size=1, max_size=25),
        st.tuples(shared, st.lists(row, min_size=1, max_size=25)).map(
            lambda t: [r._replace(attributes=dict(t[0])) for r in t[1]]
        ),
        st.tuples(
            st.lists(_attrs(values, keys), min_size=1, max_size=3),
            st.lists(st.tuples(row, st.integers(0, 2)), min_size=1, max_size=25),
        ).map(lambda t: [r._replace(attributes=t[0][i % len(t[0])]) for r, i in t[1]]),
    )


def _parts(
    rows: list[SpanRow], origin: int, *, pure: bool, first: bool = True
) -> list[tuple[bytes, int]]:
    saved = _encode._speedups
    if pure:
        _encode._speedups = None
    try:
        return list(_encode._encode_columns(_Encoder(), rows, 1, origin, first))  # type: ignore[arg-type]
    finally:
        _encode._speedups = saved


def _encode_both(rows: list[SpanRow], origin: int) -> tuple[bytes, bytes]:
    fast = b"".join(d for d, _ in _parts(rows, origin, pure=False))
    slow = b"".join(d for d, _ in _parts(rows, origin, pure=True))
    return fast, slow


@SETTINGS
@given(rows=_rows(st.one_of(PLAIN, ODD), ODD_KEYS), origin=st.one_of(INT64, st.just(-(2**63) - 1)))
def test_c_and_python_chrome_events_agree_on_generated_batches(
    rows: list[SpanRow], origin: int
) -> None:
    rows = _realize(rows)
    fast, slow = _encode_both(rows, origin)
    assert fast == slow
    events = json.loads("[" + fast.decode("ascii") + "]")  # valid JSON, ASCII only
    assert len(events) == len(rows)


@settings(SETTINGS, max_examples=50)
@given(rows=_rows(PLAIN, KEYS), part_rows=st.integers(1, 6), first=st.booleans(), origin=INT64)
def test_c_and_python_cut_a_batch_into_the_same_parts(
    rows: list[SpanRow], part_rows: int, first: bool, origin: int
) -> None:
    saved = _encode._PART_ROWS
    _encode._PART_ROWS = part_rows
    try:
        fast = _parts(rows, origin, pure=False, first=first)
        slow = _parts(rows, origin, pure=True, first=first)
    finally:
        _encode._PART_ROWS = saved
    assert fast == slow
    n = len(rows)
    assert [c for _, c in fast] == [min(part_rows, n - lo) for lo in range(0, n, part_rows)]
    assert fast[0][0].startswith(b"\n{" if first else b",\n{")
    assert all(data.startswith(b",\n{") for data, _ in fast[1:])


def _steps(steps: int, *, ties: bool) -> list[SpanRow]:
    """Rows as the Trainer hands them over: each step's children, then its own row (it
    ends last), all sharing the step's attributes; with ties, children that start at
    the same ns (and two with the same start and end), and every 7th step an error."""
    rows = []
    base = 1_800_000_000_000_000_000
    for k in range(steps):
        attrs = FrozenAttributes({"ppetrace.step": k, "ppetrace.stage": "train", "f": k / 4})
        start = base + k * 10_000
        for j in range(4):
            at = start + (100 * (j // 2) if ties else 100 * j)
            end = at + (50 if ties and j >= 2 else 50 + j)
            rows.append(SpanRow(f"module.k{j}", 4 * k + j + 1, 1 << 60, 7, at, end, 9, attrs))
        error = "" if k % 7 else f"RuntimeError: step {k}\n"
        status = "ERROR" if error else "UNSET"
        rows.append(
            SpanRow("trainer.step", 1 << 60, 0, 7, start, start + 900, 9, attrs, status, error)
        )
    return rows


@pytest.mark.parametrize(
    ("order", "ties"), [("ended", False), ("ended", True), ("shuffled", True), ("reversed", True)]
)
def test_c_and_python_order_large_batches_alike(order: str, ties: bool) -> None:
    """Batches large enough that C formats them without the GIL, in the order spans end
    (each step's row late: the insertion sort), shuffled and reversed (its fallback);
    rows of equal start and end keep the batch's order on both paths."""
    rows = _steps(120, ties=ties)
    if order == "shuffled":
        random.Random(7).shuffle(rows)
    elif order == "reversed":
        rows.reverse()
    fast, slow = _encode_both(rows, 1_800_000_000_000_000_000)
    assert fast == slow
    events = json.loads("[" + fast.decode("ascii") + "]")
    assert len(events) == len(rows) == 600
    keys = [(e["ts"], -e["dur"]) for e in events]
    assert keys == sorted(keys)  # start, then longest first
    assert sum(e.get("args", {}).get("error", "").startswith("RuntimeError") for e in events) == 18
    assert events[0]["name"] == "trainer.step" and events[0]["attrs"]["ppetrace.step"] == 0


@settings(SETTINGS, max_examples=50)
@given(
    tids=st.lists(
        st.one_of(st.integers(-3, 3), st.integers(), st.booleans(), st.just(2**70), st.none()),
        max_size=12,
    )
)
def test_c_and_python_find_the_same_distinct_thread_ids(tids: list[Any]) -> None:
    rows = [SpanRow("e", 1, 0, 7, 0, 1, t, {}) for t in tids]
    expected = list(dict.fromkeys(tids))
    found = _encode.distinct_tids(rows)
    assert found == expected and list(map(type, found)) == list(map(type, expected))
    in_c = SPEEDUPS.distinct_ints(rows, 6)
    assert (in_c is None) == any(type(t) is not int for t in tids)
    if in_c is not None:
        assert in_c == expected


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


def test_a_str_key_and_an_equal_str_subclass_key_sort_alike_on_both_paths() -> None:
    """The batch's key set keeps one of 'a' and Sub('a') (they are equal): the one met
    first in the rows' written order. C's fallback once took the rows in the order they
    came, and wrote the keys of the second row in another order (found by the fuzz test)."""
    rows = [
        SpanRow("trainer.step", 1, 0, 7, 0, 0, 0, {}),
        SpanRow("trainer.step", 2, 0, 7, 0, -1, 0, {"": False, Sub("a"): False}),
        SpanRow("trainer.step", 3, 0, 7, 0, 0, 0, {"a": None, 0: None}),
    ]
    fast, slow = _encode_both(rows, 0)
    assert fast == slow
    assert fast.endswith(b'"attrs":{"":false,"a":false}}')  # written last: it ends first
