"""merge_traces: one timeline from per-rank files, with pids kept and clock offsets applied."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from exporters import ChromeTraceExporter, load_chrome_trace, merge_traces, read_chrome_trace

RunBuilder = Any  # the builder from conftest.py's run_builder fixture


def _trace(path: Path, rb: RunBuilder, offset: int = 0) -> Path:
    exporter = ChromeTraceExporter(path, clock_offset_ns=offset)
    exporter.export_batch(rb.batch())
    exporter.shutdown()
    return path


@pytest.mark.parametrize("out_name", ["merged.json", "merged.json.gz"])
def test_merge_keeps_processes_apart_and_applies_clock_offsets(
    tmp_path: Path, run_builder: Callable[..., RunBuilder], out_name: str
) -> None:
    rank0, rank1 = run_builder(pid=100, rank=0), run_builder(pid=100, rank=1, tid=12)
    rank0.training([1_000, 2_000])
    rank1.span("trainer.step", 3_000_000_123, 3_000_001_000, 0, {"ppetrace.step": 0})
    a = _trace(tmp_path / "rank0.json", rank0)
    b = _trace(tmp_path / "rank1.json", rank1, offset=-2_000_000_000)  # its clock runs 2 s ahead
    out = tmp_path / out_name
    merged = merge_traces(out, [a, b])

    frame = read_chrome_trace(out)
    assert sorted(set(frame["pid"])) == [100, 101]  # the same pid twice: one remapped
    assert len(frame) == len(rank0.rows) + 1
    step1 = frame[frame["pid"] == 101].iloc[0]
    assert step1["start_ns"] == rank1.T0 + 3_000_000_123 - 2_000_000_000  # exact, offset applied
    assert step1["dur_ns"] == 877 and step1["rank"] == 1 and step1["tid"] == 12
    original = read_chrome_trace(a).set_index("span_id")
    kept = frame[frame["pid"] == 100].set_index("span_id")
    assert (kept["start_ns"] == original.loc[kept.index, "start_ns"]).all()
    assert (kept["rank"] == 0).all()

    names = {e["pid"]: e["args"]["name"] for e in merged.events if e.get("name") == "process_name"}
    # the remapped process says which file it came from
    assert names == {100: "tests rank 0", 101: "tests rank 1 [rank1.json]"}  # viewers add the pid
    other = load_chrome_trace(out).metadata
    assert [m["path"] for m in other["merged_from"]] == [str(a), str(b)]
    assert other["merged_from"][1]["pids"] == {"100": 101}
    assert other["merged_from"][1]["clock_offset_ns"] == -2_000_000_000
    assert other["processes"]["101"]["rank"] == 1
    assert other["clock_offset_ns"] == 0
    if out_name.endswith(".gz"):
        assert out.read_bytes()[:2] == b"\x1f\x8b"


def test_merge_names_processes_of_foreign_traces(tmp_path: Path) -> None:
    foreign = tmp_path / "kineto.json"
    foreign.write_text(
        json.dumps(
            {
                "traceEvents": [
                    {"ph": "X", "name": "aten::mm", "pid": 7, "tid": 1, "ts": 5.5, "dur": 2.25},
                ]
            }
        )
    )
    out = tmp_path / "m.json"
    merge_traces(out, [foreign])
    trace = load_chrome_trace(out)
    labels = [e["args"]["name"] for e in trace.events if e.get("name") == "process_name"]
    assert labels == ["kineto.json"]  # viewers add the pid
    (x,) = [e for e in trace.events if e["ph"] == "X"]
    assert x["ts"] == 5.5 and x["dur"] == 2.25


def test_merge_refuses_no_inputs_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Expected at least one trace file to merge, but recei"):
        merge_traces(tmp_path / "m.json", [])
    with pytest.raises(FileNotFoundError, match="Expected a trace file at"):
        merge_traces(tmp_path / "m.json", [tmp_path / "nope.json"])


def test_merge_refuses_to_write_over_an_input_and_leaves_it_whole(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder(pid=100, rank=0)
    rb.training([1_000, 2_000])
    a = _trace(tmp_path / "a.json", rb)
    before = a.read_bytes()
    _trace(tmp_path / "b.json", run_builder(pid=200, rank=1))
    for inputs in ([a], [tmp_path / "b.json", a], [tmp_path]):  # a itself, or in its folder
        with pytest.raises(ValueError, match="would overwrite the"):
            merge_traces(a, inputs)
        assert a.read_bytes() == before


def test_merging_into_a_folder_twice_leaves_the_output_out_of_the_inputs(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    for rank in (0, 1):
        rb = run_builder(pid=100 + rank, rank=rank)
        rb.training([1_000])
        _trace(runs / f"rank{rank}.json", rb)
    out = runs / "merged.json"
    first = read_chrome_trace(merge_traces(out, [runs]).path)
    second = read_chrome_trace(merge_traces(out, [runs]).path)  # merged.json is not an input
    assert len(second) == len(first) and sorted(set(second["pid"])) == [100, 101]


def test_merge_refuses_a_trace_given_twice(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder(pid=100, rank=0)
    rb.training([1_000])
    a = _trace(tmp_path / "a.json", rb)
    with pytest.raises(ValueError, match="given more than once"):
        merge_traces(tmp_path / "out.json", [a, tmp_path / "." / "a.json"])
    assert not (tmp_path / "out.json").exists()
