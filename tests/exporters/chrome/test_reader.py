"""The reader: the line-by-line fast path agrees with the whole-document path; BOM, gzip,
older files, repair of cut-off files, and errors that name the file."""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from exporters import (
    ChromeTraceExporter,
    TraceError,
    TraceTruncatedWarning,
    load_chrome_trace,
    merge_traces,
    read_chrome_trace,
    repair_chrome_trace,
)
from exporters.chrome import _events, _parse
from ppetrace.cli import main

RunBuilder = Any  # the builder from conftest.py's run_builder fixture


def _run(path: Path, rb: RunBuilder) -> Path:
    rb.training([1_000 + 7 * i for i in range(40)], batch_size=8)
    rb.span("user.fails", 10**9, 10**9 + 5, 0, {"k": [1, "a"]}, status="ERROR", error="E: bad")
    exporter = ChromeTraceExporter(path)
    rows = rb.batch().rows
    for i in range(0, len(rows), 16):
        exporter.export_batch(rb.batch(rows[i : i + 16]))
    exporter.add_events([{"ph": "X", "name": "kernel", "tid": 3, "ts": 1.0, "dur": 2.0}])
    exporter.shutdown()
    return path


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))


def test_the_line_reader_and_the_whole_document_reader_give_the_same_frame(
    tmp_path: Path, run_builder: Callable[..., RunBuilder], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _run(tmp_path / "t.json", run_builder())
    lines = read_chrome_trace(path)
    doc = json.loads(path.read_text())
    one_line = tmp_path / "one.json"  # another layout: the whole document is parsed
    one_line.write_text(json.dumps(doc))
    assert _parse.stream(one_line, _parse.Parsed()) is None
    _same(lines, read_chrome_trace(one_line))
    monkeypatch.setattr(_parse, "_BLOCK", 97)  # many blocks, cut anywhere in a line
    _same(lines, read_chrome_trace(path))
    assert len(lines) == 40 * 3 + 3  # the kernel (no span id) is no span
    failed = lines.set_index("name").loc["user.fails"]
    assert failed["status"] == "ERROR" and failed["error"] == "E: bad"
    assert failed["k"] == [1, "a"]
    assert lines[lines["name"] == "trainer.step"]["step"].tolist() == list(range(40))
    assert str(lines["step"].dtype) == "Int64"


def test_the_c_columns_and_the_python_columns_agree(
    tmp_path: Path, run_builder: Callable[..., RunBuilder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """_speedups.event_columns and its pure-Python twin (SpanColumns._add_x) give the
    same frame, also for ids in capitals, big pids and a chunk the C path hands back."""
    rb = run_builder(pid=2**40)
    path = _run(tmp_path / "t.json", rb)
    text = path.read_text().replace('"span_id":"0000', '"span_id":"0000'.upper())
    text = text.replace('"parent_id":"000000000000', '"parent_id":"000000000000'.upper())
    path.write_text(text.replace('"tid":11,', '"tid":-11,', 3))
    fast = read_chrome_trace(path)
    monkeypatch.setattr(_events, "_speedups", None)
    _same(fast, read_chrome_trace(path))
    assert (fast["tid"] == -11).sum() >= 2 and (fast["pid"] == 2**40).all()


def test_files_of_the_older_layout_read_as_before(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    """ids, status, error and attributes in args: what ppetrace wrote before."""
    path = _run(tmp_path / "t.json", run_builder())
    doc = json.loads(path.read_text())
    for e in doc["traceEvents"]:
        if "span_id" in e:
            args = {"span_id": e.pop("span_id"), "parent_id": e.pop("parent_id")}
            args.update(e.pop("attrs", {}))
            args["status"] = e.pop("status")
            args.update(e.pop("args", {}))
            e["args"] = args
    head = json.dumps({k: v for k, v in doc.items() if k != "traceEvents"})[:-1]
    old = tmp_path / "old.json"  # one event per line, as ppetrace wrote them
    old.write_text(
        head + ',"traceEvents":[\n' + ",\n".join(map(json.dumps, doc["traceEvents"])) + "\n]}\n"
    )
    _same(read_chrome_trace(path), read_chrome_trace(old))


def test_a_utf8_bom_is_accepted(tmp_path: Path, run_builder: Callable[..., RunBuilder]) -> None:
    path = _run(tmp_path / "t.json", run_builder())
    with_bom = tmp_path / "bom.json"
    with_bom.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    _same(read_chrome_trace(path), read_chrome_trace(with_bom))
    with_bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(json.loads(path.read_text())).encode())
    _same(read_chrome_trace(path), read_chrome_trace(with_bom))
    assert load_chrome_trace(with_bom).metadata["origin_ns"] > 0


def test_corrupt_gzip_is_called_corrupt_and_cut_gzip_is_read(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    plain = _run(tmp_path / "t.json", run_builder())
    data = gzip.compress(plain.read_bytes())
    bad = tmp_path / "bad.json.gz"
    broken = bytearray(data)
    for i in range(len(data) // 3, len(data) // 3 + 40):
        broken[i] ^= 0x5A
    bad.write_bytes(bytes(broken))
    with pytest.raises(TraceError, match=rf"^Expected gzip-compressed trace data in {bad}, but "):
        read_chrome_trace(bad)
    with pytest.raises(TraceError, match="the gzip data is corrupt"):
        load_chrome_trace(bad)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.warns(TraceTruncatedWarning, match=rf"`ppetrace repair {cut}`"):
        part = read_chrome_trace(cut)
    assert 0 < len(part) < len(read_chrome_trace(plain))


def test_top_level_keys_after_the_events_are_read(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(
        '{"traceEvents":[\n{"ph":"X","name":"a","pid":1,"tid":1,"ts":1,"dur":2},\n'
        '{"ph":"X","name":"b","pid":1,"tid":1,"ts":1.5,"dur":0.5}\n],\n'
        '"otherData":{"origin_ns":1000000000,"note":"late"}}\n'
    )
    frame = read_chrome_trace(path)
    assert frame.attrs["metadata"]["note"] == "late" and not frame.attrs["truncated"]
    assert frame["start_ns"].tolist() == [1_000_001_000, 1_000_001_500]
    assert frame["parent_id"].tolist() == [0, 1]  # nesting, without ids


def _cut(path: Path, keep: float) -> Path:
    data = path.read_bytes()
    out = path.with_name("cut.json")
    out.write_bytes(data[: int(len(data) * keep)])
    return out


def test_repair_closes_a_cut_off_file_as_strict_json(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    full = read_chrome_trace(_run(tmp_path / "t.json", run_builder()))
    cut = _cut(tmp_path / "t.json", 0.6)
    with pytest.warns(TraceTruncatedWarning):
        part = read_chrome_trace(cut)
    done = repair_chrome_trace(cut)
    assert done.path == tmp_path / "cut.repaired.json" and done.truncated
    doc = json.loads(done.path.read_text())  # strict JSON: no NaN, closed
    assert doc["otherData"] == full.attrs["metadata"]  # the object form, with otherData
    assert done.events == len(doc["traceEvents"])
    _same(read_chrome_trace(done.path), part)  # and no warning: it is whole now
    whole = repair_chrome_trace(tmp_path / "t.json", tmp_path / "copy.json")
    assert not whole.truncated
    assert whole.path.read_bytes() == (tmp_path / "t.json").read_bytes()
    # the mode a plain open() gives (the umask's), not mkstemp's 0600
    umask = os.umask(0)
    os.umask(umask)
    assert (done.path.stat().st_mode & 0o777) == 0o666 & ~umask


def test_repair_takes_other_layouts_gzip_and_works_in_place(tmp_path: Path) -> None:
    events = [{"ph": "X", "name": f"e{i}", "pid": 1, "tid": 1, "ts": i, "dur": 1} for i in range(5)]
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps(events)[:-30])
    done = repair_chrome_trace(arr, arr)  # in place
    assert done == (arr, 5, True)
    # an array stays an array; it ends with the event that says the run was cut off
    cut = {"ph": "M", "name": "ppetrace.cut", "pid": 0, "tid": 0, "args": {"source": str(arr)}}
    assert json.loads(arr.read_text()) == [*events[:4], cut]
    gz = tmp_path / "obj.json.gz"
    text = json.dumps({"otherData": {"x": math.nan}, "traceEvents": events})
    gz.write_bytes(gzip.compress(text.encode())[:-8])  # no trailer: the stream was cut
    done = repair_chrome_trace(gz)
    doc = json.loads(done.path.read_text())
    assert done.path.name == "obj.repaired.json" and doc["otherData"] == {"x": "NaN"}
    assert doc["traceEvents"][:-1] == events and done.truncated  # the gzip stream was cut
    assert doc["traceEvents"][-1]["name"] == "ppetrace.cut"
    (tmp_path / "nothing.json").write_text('{"traceEvents":')
    with pytest.raises(TraceError, match=r"nothing\.json"):
        repair_chrome_trace(tmp_path / "nothing.json")


def test_the_cli_repairs_and_says_what_it_did(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    _run(tmp_path / "t.json", run_builder())
    cut = _cut(tmp_path / "t.json", 0.5)
    out, err = io.StringIO(), io.StringIO()
    assert main(["repair", str(cut), str(tmp_path / "r.json")], stdout=out, stderr=err) == 0
    assert out.getvalue().startswith(f"Wrote {tmp_path / 'r.json'}: ")
    assert f"({cut} was cut off; closed after its last complete event)" in out.getvalue()
    json.loads((tmp_path / "r.json").read_text())
    assert main(["repair", str(tmp_path / "missing.json")], stdout=out, stderr=err) == 2
    assert "ppetrace repair: error: Expected a trace file at" in err.getvalue()
    # a complete trace: no copy beside it (it would count twice in a folder of runs)
    out = io.StringIO()
    assert main(["repair", str(tmp_path / "t.json")], stdout=out, stderr=err) == 0
    assert "(complete): nothing to repair" in out.getvalue()
    assert not (tmp_path / "t.repaired.json").exists()
    # a complete gzip trace is read to learn it (no end to look at): no copy either
    gz = tmp_path / "g.json.gz"
    gz.write_bytes(gzip.compress((tmp_path / "t.json").read_bytes()))
    out = io.StringIO()
    assert main(["repair", str(gz)], stdout=out, stderr=err) == 0
    assert "events (complete): nothing to repair" in out.getvalue()
    assert not (tmp_path / "g.repaired.json").exists()


_WRITER = """
import sys, time
from exporters import ChromeTraceExporter, SpanBatch, SpanRow
exporter = ChromeTraceExporter(sys.argv[1])
t, i = 1_700_000_000_000_000_000, 0
while True:
    rows = [SpanRow("trainer.step", i + k + 1, 0, 7, t + k * 1000, t + k * 1000 + 500, 1,
                    {"ppetrace.step": i + k}) for k in range(50)]
    exporter.export_batch(SpanBatch(rows, {"service.name": "killed"}, 99, {1: "main"}))
    i += 50; t += 50_000
    if i == 500:
        print("ready", flush=True)
    time.sleep(0.001)
"""


def killed_trace(tmp_path: Path) -> Path:
    """A trace whose writer was killed with SIGKILL in the middle of writing."""
    path = tmp_path / "killed.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return path


def test_a_sigkilled_writers_file_once_repaired_loads_with_json_load(tmp_path: Path) -> None:
    path = killed_trace(tmp_path)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())  # what a third-party viewer meets
    done = repair_chrome_trace(path)
    with open(done.path) as f:
        doc = json.load(f)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) >= 500 and done.truncated
    assert [e["attrs"]["ppetrace.step"] for e in spans] == list(range(len(spans)))


def test_merge_names_the_file_of_a_non_finite_time_or_offset(tmp_path: Path) -> None:
    good = {"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}
    nan_ts = tmp_path / "nan_ts.json"
    nan_ts.write_text(json.dumps({"traceEvents": [good, {**good, "ts": math.nan}]}))
    with pytest.raises(TraceError, match=r"finite event 'ts' values \(µs\) in .*nan_ts\.json"):
        merge_traces(tmp_path / "m.json", [nan_ts])
    nan_offset = tmp_path / "nan_offset.json"
    nan_offset.write_text(
        json.dumps({"otherData": {"clock_offset_ns": math.nan}, "traceEvents": [good]})
    )
    with pytest.raises(TraceError, match=r"clock_offset_ns in .*nan_offset\.json to be a whole"):
        merge_traces(tmp_path / "m.json", [nan_offset])


def test_the_garbage_collector_is_switched_back_on_after_a_read(tmp_path: Path) -> None:
    """The collector is paused while decoding (millions of objects, no cycles), and on
    again after a read, also one that fails."""
    import gc

    path = tmp_path / "t.json"
    path.write_text('{"traceEvents":[\n{"ph":"X","name":"a","ts":1,"dur":1}\n]}\n')
    read_chrome_trace(path)
    assert gc.isenabled()
    path.write_text('{"traceEvents":[\n{"ph":"X","name":"a","ts":1e99,"dur":1}\n]}\n')
    with pytest.raises(TraceError):
        read_chrome_trace(path)
    assert gc.isenabled()


def test_non_finite_float_attributes_read_back_as_floats(
    tmp_path: Path, run_builder: Callable[..., RunBuilder], monkeypatch: pytest.MonkeyPatch
) -> None:
    rb = run_builder()
    nan, inf = math.nan, math.inf
    for i, v in enumerate([1.5, nan, inf, -inf, 2]):
        start = 10**9 + 100 * i
        attrs = {
            "loss": v,
            "always": nan,  # no number beside it
            "pair": (1.0, v),
            "word": ["NaN", 3.0][i % 2],  # a string that only looks like one
            "flag": [True, v][i % 2],
        }
        rb.span("user.step", start, start + 50, 0, attrs)
    path = tmp_path / "t.json"
    with ChromeTraceExporter(path) as exporter:
        exporter.export_batch(rb.batch())
    assert json.loads(path.read_text())  # strict JSON: every parser takes it
    assert '"loss":{"ppetrace.float":"Infinity"}' in path.read_text()
    frame = read_chrome_trace(path)

    def same(got: list[Any], expected: list[Any]) -> bool:
        return [repr(g) for g in got] == [repr(e) for e in expected]

    assert str(frame["loss"].dtype) == "float64"
    assert same(frame["loss"].tolist(), [1.5, nan, inf, -inf, 2.0])
    assert str(frame["always"].dtype) == "float64" and frame["always"].isna().all()
    assert same(frame["pair"].tolist(), [[1.0, 1.5], [1.0, nan], [1.0, inf], [1.0, -inf], [1.0, 2]])
    assert frame["word"].tolist() == ["NaN", 3.0, "NaN", 3.0, "NaN"]  # kept
    assert same(frame["flag"].tolist(), [True, nan, True, -inf, True])
    monkeypatch.setattr(_events, "_speedups", None)  # the pure-Python columns agree
    _same(frame, read_chrome_trace(path))
