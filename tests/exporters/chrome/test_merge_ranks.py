"""Rank files: distributedInfo and clock fields in the header, updated in place, merged from a
folder in rank order, on one clock (a drift between two clock measurements corrected)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from exporters import ChromeTraceExporter, TraceError, load_chrome_trace, merge_traces
from exporters import read_chrome_trace as read
from exporters.chrome._merge import _Drift
from exporters.chrome._ranks import read_header, trace_files, update_other_data

RunBuilder = Any


def _rank_file(
    path: Path,
    rb: RunBuilder,
    rank: int,
    *,
    offset: int = 0,
    origin: int | None = None,
    sync: dict[str, Any] | None = None,
    reserve: int = 256,
) -> Path:
    exporter = ChromeTraceExporter(
        path,
        clock_offset_ns=offset,
        origin_ns=origin,
        distributed_info={"rank": rank, "world_size": 2, "backend": "gloo"},
        header_reserve=reserve,
        metadata={"clock_sync": sync} if sync else None,
    )
    exporter.export_batch(rb.batch())
    exporter.shutdown()
    return path


def _ranks(run_builder: Callable[..., RunBuilder], folder: Path, **kw: Any) -> list[Path]:
    folder.mkdir()
    paths = []
    for rank in (1, 0):  # written out of order: the merge orders them
        rb = run_builder(pid=300 + rank, rank=rank)
        rb.training([1_000, 2_000, 3_000])
        paths.append(_rank_file(folder / f"r{rank}.json", rb, rank, **kw))
    return paths


def test_the_header_carries_distributed_info_and_room_that_an_update_fills_in_place(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder()
    rb.training([1_000])
    path = _rank_file(tmp_path / "rank0.json", rb, 0, origin=rb.T0 - 5_000_000_123)
    doc = json.loads(path.read_text())
    assert doc["distributedInfo"] == {"rank": 0, "world_size": 2, "backend": "gloo"}
    assert doc["otherData"]["origin_ns"] == rb.T0 - 5_000_000_123  # as given, not floored
    size = path.stat().st_size
    header = read_header(path)
    assert header is not None and header.room == 256 and header.rank == 0
    update_other_data(path, {"clock_sync": {"end": {"offset_ns": -7}}})
    assert path.stat().st_size == size  # rewritten in place
    assert json.loads(path.read_text())["otherData"]["clock_sync"] == {"end": {"offset_ns": -7}}
    frame = read(path)
    assert frame["start_ns"].min() == rb.T0  # the events are untouched (trainer.run at T0)
    update_other_data(path, {"big": "x" * 1_000})  # no room left: the file is rewritten
    assert json.loads(path.read_text())["otherData"]["big"] == "x" * 1_000
    assert len(read(path)) == len(frame)


def test_updates_of_gzip_files_and_refusals(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder()
    rb.training([1_000])
    gz = _rank_file(tmp_path / "rank0.json.gz", rb, 0)
    update_other_data(gz, {"clock_error_ns": 5})
    assert json.loads(gzip.decompress(gz.read_bytes()))["otherData"]["clock_error_ns"] == 5
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"traceEvents": []}')
    assert read_header(foreign) is None
    with pytest.raises(TraceError, match="Expected a trace file written by ChromeTraceExporter"):
        update_other_data(foreign, {"a": 1})


def test_a_folder_merges_in_rank_order_and_as_text_when_nothing_changes(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    _ranks(run_builder, tmp_path / "ranks")
    assert [p.name for p in trace_files(tmp_path / "ranks")] == ["r0.json", "r1.json"]
    out = tmp_path / "merged.json"
    merged = merge_traces(out, [tmp_path / "ranks"])
    assert merged.event_count == len(load_chrome_trace(out).events)  # type: ignore[attr-defined]
    meta = merged.metadata
    assert meta["ranks"] == [0, 1] and meta["world_size"] == 2
    assert [Path(s["path"]).name for s in meta["merged_from"]] == ["r0.json", "r1.json"]
    frame = read(out)
    for rank in (0, 1):
        mine = read(tmp_path / "ranks" / f"r{rank}.json")
        got = frame[frame["rank"] == rank].sort_values("start_ns")
        assert got["start_ns"].tolist() == sorted(mine["start_ns"].tolist())
    # rank 1's events were copied as written: its lines appear unchanged in the output
    line = (tmp_path / "ranks" / "r1.json").read_text().splitlines()[4].rstrip(",")
    assert line in out.read_text()
    with pytest.raises(TraceError, match="Expected trace files"):
        (tmp_path / "empty").mkdir()
        merge_traces(tmp_path / "x.json", [tmp_path / "empty"])


def test_edited_lines_match_a_full_parse(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    """Shifted times and a remapped pid, edited as text, give what re-encoding gives."""
    rb = run_builder(pid=300, rank=1)
    rb.training([1_000, 2_001, 3_999], fetch_ns=[7, 8, 9])
    a = _rank_file(tmp_path / "a.json", rb, 1, offset=-1_234_567)
    rb0 = run_builder(pid=300, rank=0)
    rb0.training([5_000])
    b = _rank_file(tmp_path / "b.json", rb0, 0)
    frame = read(merge_traces(tmp_path / "m.json", [a, b]).path)
    moved = frame[frame["rank"] == 1]
    assert set(moved["pid"]) == {301}  # the pid rank 0 holds is remapped
    own = read(a)
    assert sorted(moved["start_ns"]) == sorted(own["start_ns"] - 1_234_567)
    assert sorted(moved["dur_ns"]) == sorted(own["dur_ns"])


def test_a_drift_beyond_the_errors_is_corrected_linearly(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder(pid=11, rank=1)
    rb.span("trainer.step", 0, 10, 0, {"ppetrace.step": 0})
    rb.span("trainer.step", 1_000_000_000, 1_000_000_010, 0, {"ppetrace.step": 1})
    t0 = rb.T0
    # -1 ms at t0, -3 ms a second later (errors of 10 µs): 2 ms more per second
    sync = {
        "start": {"offset_ns": -1_000_000, "error_ns": 10_000, "at_ns": t0},
        "end": {"offset_ns": -3_000_000, "error_ns": 10_000, "at_ns": t0 + 1_000_000_000},
    }
    path = _rank_file(tmp_path / "r1.json", rb, 1, offset=-1_000_000, sync=sync)
    frame = read(merge_traces(tmp_path / "m.json", [path]).path).sort_values("start_ns")
    assert frame["start_ns"].tolist() == [t0 - 1_000_000, t0 + 1_000_000_000 - 3_000_000]
    # within the errors, one constant offset: the middle of what both bounds allow
    # (-1.01 ... -0.99 ms and -1.025 ... -1.005 ms leave -1.01 ... -1.005 ms)
    sync["end"]["offset_ns"] = -1_015_000
    path = _rank_file(tmp_path / "r1b.json", rb, 1, offset=-1_000_000, sync=sync)
    frame = read(merge_traces(tmp_path / "m2.json", [path]).path).sort_values("start_ns")
    assert frame["start_ns"].tolist() == [t0 - 1_007_500, t0 + 1_000_000_000 - 1_007_500]
    (source,) = load_chrome_trace(tmp_path / "m2.json").metadata["merged_from"]
    assert source["clock_offset_ns"] == -1_000_000 and source["clock_correction_ns"] == -7_500
    # a loose start (1.1 ms, as at a group's start-up) and a tight end: the end wins
    sync["start"]["error_ns"], sync["end"]["error_ns"] = 1_100_000, 40_000
    sync["start"]["offset_ns"], sync["end"]["offset_ns"] = -1_000_000, 0
    path = _rank_file(tmp_path / "r1c.json", rb, 1, offset=-1_000_000, sync=sync)
    frame = read(merge_traces(tmp_path / "m3.json", [path]).path).sort_values("start_ns")
    assert frame["start_ns"].tolist() == [t0, t0 + 1_000_000_000]  # -0.04 ... 0.04 ms: 0
    # equal measurements: nothing to correct
    sync["end"] = dict(sync["start"], at_ns=t0 + 1_000_000_000)
    path = _rank_file(tmp_path / "r1d.json", rb, 1, offset=-1_000_000, sync=sync)
    frame = read(merge_traces(tmp_path / "m4.json", [path]).path).sort_values("start_ns")
    assert frame["start_ns"].tolist() == [t0 - 1_000_000, t0 + 1_000_000_000 - 1_000_000]
    assert _Drift(10, 0.5).extra(14) == 2 and _Drift(10, 0.0, -7).extra(99) == -7


def test_rank_files_that_cannot_be_one_run_are_refused(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    def rank_file(name: str, rank: int, trace_id: str, stage: str | None = None) -> Path:
        rb = run_builder(pid=300 + rank, rank=rank)
        rb.training([1_000, 2_000])
        metadata = {"trace_id": trace_id}
        if stage is not None:  # a LightningProfiler stage's file
            metadata["ppetrace.stage"] = stage
        exporter = ChromeTraceExporter(
            tmp_path / name,
            distributed_info={"rank": rank, "world_size": 2, "backend": "gloo"},
            metadata=metadata,
        )
        exporter.export_batch(rb.batch())
        exporter.shutdown()
        return tmp_path / name

    a0, a1 = rank_file("a0.json", 0, "a" * 32), rank_file("a1.json", 1, "a" * 32)
    b1 = rank_file("b1.json", 1, "b" * 32)
    with pytest.raises(TraceError, match=r"Expected the rank files of one run \(one trace id\)"):
        merge_traces(tmp_path / "mixed.json", [a0, b1])
    with pytest.raises(TraceError, match=r"Expected each rank once, but rank 1 is in"):
        merge_traces(tmp_path / "twice.json", [a0, a1, rank_file("c1.json", 1, "a" * 32)])
    merged = merge_traces(tmp_path / "run.json", [a0, a1])  # one run: merged
    assert merged.metadata["ranks"] == [0, 1]
    # a merged trace counts with its ranks: not again with one of its rank files
    with pytest.raises(TraceError, match=r"Expected each rank once, but rank 0 is in"):
        merge_traces(tmp_path / "again.json", [tmp_path / "run.json", a0])
    # one run's fit and test stages (LightningProfiler): one trace id, two timelines
    fit0, test1 = (
        rank_file("f0.json", 0, "a" * 32, "fit"),
        rank_file("t1.json", 1, "a" * 32, "test"),
    )
    with pytest.raises(TraceError, match=r"from different Lightning stages \(fit, test\)"):
        merge_traces(tmp_path / "stages.json", [fit0, test1])
    fit1 = rank_file("f1.json", 1, "a" * 32, "fit")
    assert merge_traces(tmp_path / "fit.json", [fit0, fit1]).metadata["ppetrace.stage"] == "fit"


def test_the_merged_trace_carries_the_lowest_ranks_environment(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    folder = tmp_path / "ranks"
    folder.mkdir()
    for rank in (1, 0):
        rb = run_builder(pid=300 + rank, rank=rank)
        rb.training([1_000, 2_000, 3_000])
        exporter = ChromeTraceExporter(
            folder / f"r{rank}.json",
            distributed_info={"rank": rank, "world_size": 2, "backend": "gloo"},
            metadata={"environment": {"device": f"cpu{rank}", "torch_threads": 1}},
        )
        exporter.export_batch(rb.batch())
        exporter.shutdown()
    merged = merge_traces(tmp_path / "merged.json", [folder])
    # the report's Device line and compare's environment check read the top level
    assert merged.metadata["environment"]["device"] == "cpu0"
    assert read(tmp_path / "merged.json").attrs["metadata"]["environment"]["device"] == "cpu0"
    envs = [s["otherData"]["environment"]["device"] for s in merged.metadata["merged_from"]]
    assert envs == ["cpu0", "cpu1"]
