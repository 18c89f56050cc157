"""The exporters' confirmed memory errors (issue 18), each run where a crash cannot take
the suite down: in a subprocess, under Python's debug allocator (freed memory is
overwritten, so a use after free shows), on the C path and on the pure-Python path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from exporters._accel import SPEEDUPS

IMPLEMENTATIONS = ["c", "python"]


def _run(code: str, implementation: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last."""
    env = dict(os.environ)
    # the debug allocator overwrites freed memory; the sanitizer job runs with malloc
    env["PYTHONMALLOC"] = os.environ.get("PYTHONMALLOC") or "debug"
    env.pop("PPETRACE_PURE_PYTHON", None)
    if implementation == "python":
        env["PPETRACE_PURE_PYTHON"] = "1"
    prelude = "from exporters._accel import SPEEDUPS as _SPEEDUPS\n"
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"exit code {proc.returncode} (a negative code is the signal that killed it)\n"
        + proc.stdout[-2000:]
        + proc.stderr[-4000:]
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = implementation if SPEEDUPS is not None else "python"
    assert result.pop("impl") == expected
    return result


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_value_whose_repr_changes_the_row_writes_no_freed_bytes(
    implementation: str, tmp_path: os.PathLike[str]
) -> None:
    """Confirmed case 2: the encoder used the row's values borrowed across the Python
    call that encodes another value; a float subclass whose __repr__ replaces a string
    of its own row made it write bytes of the freed string (or crash)."""
    result = _run(
        f"""
import json
from exporters import ChromeTraceExporter, SpanBatch, SpanRow

class Rewriting(float):
    def __repr__(self):
        for row in rows:
            row.attributes["b"] = "".join(["new-", "y" * 40])
        return float.__repr__(self)

rows = [
    SpanRow("e", i + 1, 0, 7, 1000 + i, 2000 + i, 1,
            {{"a": Rewriting(1.5), "b": "".join(["old-", str(i) * 40])}})
    for i in range(20)
]
path = {str(tmp_path)!r} + "/t.json"
exporter = ChromeTraceExporter(path)
exporter.export_batch(SpanBatch(rows, {{}}, 1, {{}}))
exporter.shutdown()
with open(path) as f:
    events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
print(json.dumps({{
    "impl": "python" if _SPEEDUPS is None else "c",
    "errors": exporter.errors,
    "a": sorted({{e["attrs"]["a"] for e in events}}),
    "b": [e["attrs"]["b"] for e in events],
}}))
""",
        implementation,
    )
    assert result["errors"] == 0
    assert result["a"] == [1.5]
    old = ["old-" + str(i) * 40 for i in range(20)]
    new = "new-" + "y" * 40
    # each value as it was or as it became: never bytes of a freed string
    assert len(result["b"]) == 20
    assert all(b in (old[i], new) for i, b in enumerate(result["b"])), result["b"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_key_whose_hash_replaces_its_value_builds_a_correct_frame(implementation: str) -> None:
    """Confirmed case 3: attr_table used a value borrowed across the key's __hash__,
    which replaced (and freed) that very value; the column came out with the kind of
    freed memory."""
    result = _run(
        """
import json
from exporters import SpanRow, spans_to_frame

class Key(str):
    armed = False
    def __hash__(self):
        if Key.armed:
            Key.armed = False
            target[self] = "".join(["replacement", "!" * 40])  # frees the old value
        return str.__hash__(self)

attrs = [{Key("k"): "".join(["value-", str(i) * 50])} for i in range(3)]
target = attrs[0]
rows = [SpanRow(f"e{i}", i + 1, 0, 7, 10 * i, 10 * i + 5, 1, a) for i, a in enumerate(attrs)]
kinds = None
if _SPEEDUPS is not None:  # the C table itself: None (typed per key), or the right kind
    Key.armed = True
    table = _SPEEDUPS.attr_table(attrs)
    kinds = None if table is None else [column[0] for column in table[1]]
    attrs[0][Key("k")] = "".join(["replacement", "!" * 40])
Key.armed = True
frame = spans_to_frame(rows)
print(json.dumps({
    "impl": "python" if _SPEEDUPS is None else "c",
    "kinds": kinds,
    "k": frame["k"].tolist(),
}))
""",
        implementation,
    )
    # the value was read after the key's __hash__ replaced it: a str, not freed memory
    assert result["kinds"] in (None, ["s"])
    assert result["k"] == ["replacement" + "!" * 40, "value-" + "1" * 50, "value-" + "2" * 50]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_row_whose_index_empties_the_batch_is_read_from_a_copy(
    implementation: str, tmp_path: os.PathLike[str]
) -> None:
    """Confirmed case 4: span_columns walked the batch's row list (export_batch hands it
    straight to C) while a start time's __index__ emptied it (and freed the rows)."""
    result = _run(
        f"""
import json
from exporters import ChromeTraceExporter, SpanBatch, SpanRow, spans_to_frame

class Start:
    # a start time (13) that empties the batch row list when C converts it
    def __index__(self):
        rows.clear()
        return 13
    def __lt__(self, other):
        return 13 < other
    def __gt__(self, other):
        return 13 > other

def make():
    out = [SpanRow("".join(["n", str(i) * 30]), i + 1, 0, 7, 10 + i, 20 + i, 1,
                   {{"a": "x" * i}}) for i in range(50)]
    out[3] = SpanRow("n3", 4, 0, 7, Start(), 23, 1, {{}})
    return out

rows = make()
frame_starts = spans_to_frame(rows)["start_ns"].tolist()
rows = make()
path = {str(tmp_path)!r} + "/t.json"
exporter = ChromeTraceExporter(path)
exporter.export_batch(SpanBatch(rows, {{}}, 1, {{}}))
exporter.shutdown()
with open(path) as f:
    names = [e["name"] for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
print(json.dumps({{
    "impl": "python" if _SPEEDUPS is None else "c",
    "frame_starts": frame_starts,
    "names": names,
    "errors": exporter.errors,
}}))
""",
        implementation,
    )
    assert result["frame_starts"] == [10 + i if i != 3 else 13 for i in range(50)]
    assert result["errors"] == 0
    assert len(result["names"]) == 50 and "n3" in result["names"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_extreme_int64_times_are_written_exactly(
    implementation: str, tmp_path: os.PathLike[str]
) -> None:
    """Confirmed case 6 (exporters): end - start overflowed int64 in C (undefined
    behaviour), writing "dur":-0.001 where the pure path wrote 0.000; both were wrong."""
    result = _run(
        """
import json
from exporters import ChromeTraceExporter, SpanRow
from exporters.chrome import _encode

lo, hi = -(2**63), 2**63 - 1
rows = [
    SpanRow("whole range", 1, 0, 7, lo, hi, 1, {}),
    SpanRow("backwards", 2, 0, 7, hi, lo, 1, {}),
    SpanRow("top", 3, 0, 7, hi - 5, hi, 1, {}),
]
exporter = ChromeTraceExporter(TMP + "/t.json")
out = {}
for origin in (lo, 0, hi):
    data = b"".join(d for d, _ in _encode._encode_columns(exporter, rows, 1, origin, True))
    events = json.loads("[" + data.decode() + "]")
    out[str(origin)] = [[e["name"], e["ts"], e["dur"]] for e in events]
exporter.shutdown()
# the event text, not the float json makes of it
text = data.decode()
print(json.dumps({
    "impl": "python" if _SPEEDUPS is None else "c",
    "whole_dur": '"dur":18446744073709551.615' in text,
    "ts_hi": '"ts":-18446744073709551.615' in text,
    "events": out,
}))
""".replace("TMP", repr(str(tmp_path))),
        implementation,
    )
    assert result["whole_dur"] and result["ts_hi"]
    events = result["events"]
    assert [e[0] for e in events["0"]] == ["whole range", "top", "backwards"]
    assert [e[2] for e in events["0"]] == [pytest.approx(1.8446744073709552e16), 0.005, 0.0]
