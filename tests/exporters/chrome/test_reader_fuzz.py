"""Any file given to the reader gives a frame or a TraceError naming the file, never another error.

Generated documents put every kind of JSON value where a trace has its fields
(unhashable pids, pids past int64, a step of 1.5, NaN times, deep nesting, ids
that are not hex...), in both of ppetrace's layouts and other tools' layouts,
whole, cut off, gzipped or with a BOM. The CLI turns each TraceError into one
line (exit code 2).
"""

from __future__ import annotations

import gzip
import io
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporters import TraceError, load_chrome_trace, read_chrome_trace
from ppetrace.cli import main

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1.5, 0.5, 1e20, -0.0, 9.3e15]),
    st.text(max_size=8),
    st.sampled_from(["X", "M", "B", "E", "0000000000000001", "ffffffffffffffff", "zz"]),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
_HEX = st.integers(min_value=0, max_value=2**64 - 1).map(lambda i: f"{i:016x}")


@st.composite
def _event(draw: st.DrawFn) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": draw(st.sampled_from(["X", "X", "X", "M", "B", "E", "i"]))}
    fields = {
        "name": st.one_of(
            st.sampled_from(["trainer.step", "process_name", "ppetrace.table"]), _VALUES
        ),
        "pid": st.one_of(st.integers(0, 9), _VALUES),
        "tid": st.one_of(st.integers(0, 9), _VALUES),
        "ts": st.one_of(st.floats(-1e6, 1e6), _VALUES),
        "dur": st.one_of(st.floats(0, 1e6), _VALUES),
        "span_id": st.one_of(_HEX, _VALUES),
        "parent_id": st.one_of(_HEX, _VALUES),
        "status": st.one_of(st.just("UNSET"), _VALUES),
        "attrs": st.one_of(
            st.dictionaries(
                st.sampled_from(["ppetrace.step", "ppetrace.epoch", "ppetrace.rank", "k"]),
                _VALUES,
                max_size=3,
            ),
            _VALUES,
        ),
        "args": st.one_of(
            st.dictionaries(
                st.sampled_from(["span_id", "parent_id", "name", "error", "ppetrace.step"]),
                _VALUES,
                max_size=3,
            ),
            _VALUES,
        ),
    }
    for key, strategy in fields.items():
        if draw(st.booleans()):
            event[key] = draw(strategy)
    return event


@st.composite
def _document(draw: st.DrawFn) -> bytes:
    events = draw(st.lists(_event(), max_size=8))
    other = draw(
        st.dictionaries(
            st.sampled_from(["origin_ns", "clock_offset_ns", "pid", "rank", "trace_id"]),
            _VALUES,
            max_size=3,
        )
    )
    layout = draw(st.sampled_from(["lines", "lines", "object", "array", "nested"]))
    if layout == "lines":  # ppetrace's own layout: one event per line
        head = json.dumps({"displayTimeUnit": "ns", "otherData": other})[:-1]
        body = ",\n".join(json.dumps(e) for e in events)
        text = head + ',"traceEvents":[\n' + body + "\n]}\n"
    elif layout == "object":
        text = json.dumps({"otherData": other, "traceEvents": events})
    elif layout == "array":
        text = json.dumps(events)
    else:  # deeper than any parser recurses
        depth = draw(st.integers(1_000, 5_000))
        text = '{"traceEvents":[{"ph":"X","args":' + "[" * depth + "]" * depth + "}]}"
    data = text.encode("utf-8", "surrogatepass")
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    if cut is not None:
        data = data[:cut]
    if draw(st.booleans()):
        data = b"\xef\xbb\xbf" + data
    if draw(st.integers(0, 4)) == 0:
        buf = io.BytesIO()
        with gzip.GzipFile(fileobj=buf, mode="wb") as f:
            f.write(data)
        data = buf.getvalue()
        cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
        if cut is not None:
            data = data[:cut]
    return data


def _reads_or_names_the_file(path: Path) -> None:
    for reader in (read_chrome_trace, load_chrome_trace):
        try:
            result = reader(path)
        except TraceError as exc:
            assert str(path) in str(exc), str(exc)
            continue
        if reader is read_chrome_trace:
            assert isinstance(result, pd.DataFrame)
            assert (result["dur_ns"] >= 0).all()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=_document())
def test_any_document_reads_or_raises_a_trace_error_naming_the_file(
    tmp_path: Path, data: bytes
) -> None:
    path = tmp_path / "fuzz.json"
    path.write_bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # truncation warnings: tested elsewhere
        _reads_or_names_the_file(path)


@pytest.mark.parametrize(
    ("event", "other"),
    [
        ({"pid": [1, 2], "tid": [3]}, {}),  # unhashable pid and tid
        ({"pid": 2**63, "tid": 1}, {}),  # past int64
        ({"attrs": {"ppetrace.step": 1.5}}, {}),
        ({"attrs": {"ppetrace.step": 1e300}}, {}),
        ({"ts": math.nan}, {}),
        ({}, {"origin_ns": 2**70}),
        ({"span_id": "-1"}, {}),
    ],
)
def test_the_cases_a_fuzz_run_found_raise_no_other_error(
    tmp_path: Path, event: dict[str, Any], other: dict[str, Any]
) -> None:
    base = {"ph": "X", "name": "s", "pid": 1, "tid": 1, "ts": 1.0, "dur": 2.0}
    base.update(span_id="0000000000000001", parent_id="0000000000000000", status="UNSET")
    path = tmp_path / "case.json"
    path.write_text(json.dumps({"otherData": other, "traceEvents": [{**base, **event}]}))
    _reads_or_names_the_file(path)
    out, err = io.StringIO(), io.StringIO()
    code = main(["report", str(path)], stdout=out, stderr=err)
    assert code in (0, 2)
    if code == 2:
        assert err.getvalue().count("\n") == 1 and str(path) in err.getvalue()
        assert "Traceback" not in err.getvalue()
