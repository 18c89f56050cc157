"""A run written in parts (max_part_bytes): each part a whole trace, read back as one run."""

from __future__ import annotations

import gzip
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from exporters import (
    ChromeTraceExporter,
    SpanBatch,
    TraceTruncatedWarning,
    merge_traces,
    read_chrome_trace,
    trace_parts,
)
from exporters.chrome._split import part_path

PART_BYTES = 4_000  # about 13 spans: each batch of 20 below closes a part
ROWS_PER_BATCH = 20


def _batches(builder: Any, steps: int = 46) -> list[SpanBatch]:
    """7 batches of 20 spans (46 steps of 3 spans, an epoch and a run)."""
    builder.training([10_000 + i for i in range(steps)])
    rows = sorted(builder.rows, key=lambda r: r.start_ns)
    whole = builder.batch(rows)
    return [
        SpanBatch(rows[i : i + ROWS_PER_BATCH], whole.resource, whole.pid, whole.thread_names)
        for i in range(0, len(rows), ROWS_PER_BATCH)
    ]


def _write(path: Path, batches: list[SpanBatch], max_part_bytes: int | None) -> list[Path]:
    exporter = ChromeTraceExporter(path, max_part_bytes=max_part_bytes, _min_part_bytes=1)
    for i, batch in enumerate(batches):
        exporter.export_batch(batch)
        if i == 0:  # a track another component names (a device): later parts name it too
            gpu = {"ph": "M", "name": "thread_name", "tid": 99, "args": {"name": "gpu"}}
            exporter.add_events([gpu])
    exporter.shutdown()
    assert exporter.errors == 0 and exporter.spans_lost == 0
    return exporter.parts


def _load(path: Path) -> tuple[dict[str, Any], bytes]:
    data = (gzip.open if path.name.endswith(".gz") else open)(path, "rb").read()
    return json.loads(data), data


@pytest.mark.parametrize("name", ["trace.json", "trace.json.gz"])
def test_each_part_is_a_whole_trace_with_its_own_names(
    tmp_path: Path, run_builder: Callable[..., Any], name: str
) -> None:
    builder = run_builder()
    batches = _batches(builder)
    parts = _write(tmp_path / name, batches, PART_BYTES)
    stem, suffix = name.split(".", 1)
    assert parts == [tmp_path / name] + [
        tmp_path / f"{stem}.{i}.{suffix}" for i in range(1, len(parts))
    ]
    assert len(parts) == len(batches)  # every batch after the first starts a part
    assert trace_parts(tmp_path / name) == parts
    spans = 0
    for i, part in enumerate(parts):
        doc, data = _load(part)  # strict JSON on its own
        other = doc["otherData"]
        assert other["part"] == i and other["first_part"] == name
        assert other["trace_id"] == f"{builder.TRACE_ID:032x}"
        if i < len(parts) - 1:
            assert len(data) >= PART_BYTES
        names = {(e["name"], e.get("tid")) for e in doc["traceEvents"] if e["ph"] == "M"}
        assert {
            ("process_name", 0),
            ("process_sort_index", 0),
            ("thread_name", builder.tid),
        } <= names
        assert ("thread_name", 99) in names or i == 0
        assert len([e for e in doc["traceEvents"] if e["ph"] == "M"]) == len(names)
        spans += sum(e["ph"] == "X" for e in doc["traceEvents"])
    assert spans == len(builder.rows)


def test_reading_part_0_gives_the_frame_of_the_run_in_one_file(
    tmp_path: Path, run_builder: Callable[..., Any]
) -> None:
    builder = run_builder()
    batches = _batches(builder)
    parts = _write(tmp_path / "split" / "trace.json", batches, PART_BYTES)
    _write(tmp_path / "whole" / "trace.json", batches, None)
    assert trace_parts(tmp_path / "whole" / "trace.json") == [tmp_path / "whole" / "trace.json"]
    split = read_chrome_trace(parts[0])
    assert split.attrs["parts"] == [str(p) for p in parts]
    assert split.attrs["metadata"]["part"] == 0
    whole = read_chrome_trace(tmp_path / "whole" / "trace.json")
    assert {k: v for k, v in split.attrs["metadata"].items() if "part" not in k} == (
        whole.attrs["metadata"]
    )
    split.attrs, whole.attrs = {}, {}
    pd.testing.assert_frame_equal(split, whole)
    assert split["span_id"].is_unique and len(split) == len(builder.rows)
    parents = split.loc[split["parent_id"] != 0, "parent_id"]
    assert parents.isin(split["span_id"]).all()  # children in later parts find their parents
    # one part alone: asked for, or named
    alone = read_chrome_trace(parts[0], parts=False)
    assert len(alone) == ROWS_PER_BATCH and "parts" not in alone.attrs
    with pytest.warns(UserWarning, match=r"trace\.1\.json is part 1 of a run whose first"):
        second = read_chrome_trace(parts[1])  # a later part alone: the run's start is named
    assert len(second) == ROWS_PER_BATCH and second.attrs["metadata"]["part"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(read_chrome_trace(parts[1], parts=False)) == ROWS_PER_BATCH
    assert set(second["span_id"]).isdisjoint(alone["span_id"])


def test_parts_of_an_earlier_run_are_not_read(
    tmp_path: Path, run_builder: Callable[..., Any]
) -> None:
    path = tmp_path / "trace.json"
    old = _write(path, _batches(run_builder()), PART_BYTES)
    assert len(old) > 2
    later = run_builder()
    later.training([5_000] * 3, start=10**9)  # another run, written over the old one
    assert _write(path, [later.batch()], PART_BYTES) == [path]
    assert trace_parts(path) == [path]
    assert len(read_chrome_trace(path)) == len(later.rows)


def test_a_cut_off_last_part_is_read_with_a_warning(
    tmp_path: Path, run_builder: Callable[..., Any]
) -> None:
    builder = run_builder()
    parts = _write(tmp_path / "trace.json", _batches(builder), PART_BYTES)
    last = parts[-1]
    data = last.read_bytes()
    last.write_bytes(data[: len(data) * 2 // 3])  # a killed process
    with pytest.warns(TraceTruncatedWarning, match=r"trace\.\d+\.json is cut off"):
        frame = read_chrome_trace(parts[0])
    assert frame.attrs["truncated"] is True
    before = sum(len(read_chrome_trace(p, parts=False)) for p in parts[:-1])
    assert before < len(frame) < len(builder.rows)


def test_a_part_cut_off_before_the_last_is_named_as_such(
    tmp_path: Path, run_builder: Callable[..., Any]
) -> None:
    """Not "the process probably stopped early": the run went on in later parts. The
    warning says which part, that its spans are missing and that the step after the gap
    holds it."""
    builder = run_builder()
    parts = _write(tmp_path / "trace.json", _batches(builder), PART_BYTES)
    assert len(parts) >= 3
    middle = parts[1]
    data = middle.read_bytes()
    middle.write_bytes(data[: len(data) // 2])
    with pytest.warns(TraceTruncatedWarning) as caught:
        frame = read_chrome_trace(parts[0])
    (warning,) = [str(w.message) for w in caught]
    assert f"Part 1 of the {len(parts)} parts of the run, {middle}, is cut off" in warning
    assert "the spans it lost are missing" in warning and "probably stopped" not in warning
    assert frame.attrs["truncated"] is True
    later = sum(len(read_chrome_trace(p, parts=False)) for p in parts[2:])
    assert len(frame) > later + len(read_chrome_trace(parts[0], parts=False))


def test_merge_takes_a_run_in_parts_as_one_process(
    tmp_path: Path, run_builder: Callable[..., Any]
) -> None:
    builder = run_builder()
    folder = tmp_path / "runs"
    parts = _write(folder / "trace.json", _batches(builder), PART_BYTES)
    other = run_builder(pid=777, rank=1)
    other.training([3_000] * 2)
    with ChromeTraceExporter(folder / "other.json") as exporter:
        exporter.export_batch(other.batch())
    for source, inputs in (([parts[0]], 1), ([folder], 2), ([*parts, folder / "other.json"], 2)):
        merged = merge_traces(tmp_path / "merged.json", source)
        frame = read_chrome_trace(tmp_path / "merged.json")
        mine = frame[frame["pid"] == builder.pid]
        assert mine["span_id"].is_unique and len(mine) == len(builder.rows)
        assert merged.metadata["merged_from"][0]["parts"] == [str(p) for p in parts]
        assert len(merged.metadata["merged_from"]) == inputs
        pids = {builder.pid, other.pid} if inputs == 2 else {builder.pid}
        assert set(frame["pid"]) == pids


def test_max_part_bytes_is_checked(tmp_path: Path) -> None:
    never = tmp_path / "never.json"
    for bad in (1000, True, 1.5e9, "1G"):
        with pytest.raises(ValueError, match=r"max_part_bytes to be None or an int of at least"):
            ChromeTraceExporter(never, max_part_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_part_bytes to be None or an int of at least"):
        merge_traces(never, [never], max_part_bytes=1000)
    assert not never.exists()
    with ChromeTraceExporter(never, max_part_bytes=1 << 20) as exporter:  # the minimum
        assert exporter.parts == [never]


def test_a_large_batch_goes_on_in_the_next_part_between_events(
    tmp_path: Path, run_builder: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from exporters.chrome import _encode

    monkeypatch.setattr(_encode, "_PART_ROWS", 7)  # a batch is written 7 spans at a time
    builder = run_builder()
    builder.training([10_000] * 46)
    parts = _write(tmp_path / "trace.json", [builder.batch()], 1_000)
    spans = [sum(e["ph"] == "X" for e in _load(part)[0]["traceEvents"]) for part in parts]
    # 140 spans, 7 to a part; then the part that _write's add_events opened (names only)
    assert spans == [7] * 20 + [0]
    frame = read_chrome_trace(parts[0])
    assert sorted(frame["span_id"]) == sorted(r.span_id for r in builder.rows)


def test_a_part_that_cannot_be_opened_is_counted_and_the_parts_before_stay_whole(
    tmp_path: Path, run_builder: Callable[..., Any]
) -> None:
    builder = run_builder()
    batches = _batches(builder)
    (tmp_path / "trace.2.json").mkdir()  # the third part cannot be created
    exporter = ChromeTraceExporter(
        tmp_path / "trace.json", max_part_bytes=PART_BYTES, _min_part_bytes=1
    )
    for batch in batches:
        exporter.export_batch(batch)
    exporter.shutdown()
    assert exporter.errors == 1 and "trace.2.json" not in str(exporter.parts)
    assert exporter.spans_lost == len(builder.rows) - 2 * ROWS_PER_BATCH
    assert exporter.last_error is not None and "IsADirectoryError" in exporter.last_error
    for part in exporter.parts:
        _load(part)  # closed, strict JSON
    frame = read_chrome_trace(tmp_path / "trace.json")
    assert len(frame) == 2 * ROWS_PER_BATCH and frame.attrs["truncated"] is False


def test_every_part_keeps_the_header_room_and_gets_the_values(
    tmp_path: Path, run_builder: Callable[..., Any]
) -> None:
    from exporters.chrome._split import update_run_other_data

    builder = run_builder()
    path = tmp_path / "trace.json"
    exporter = ChromeTraceExporter(
        path, max_part_bytes=PART_BYTES, header_reserve=512, _min_part_bytes=1
    )
    for batch in _batches(builder):
        exporter.export_batch(batch)
    exporter.shutdown()
    parts = exporter.parts
    assert len(parts) >= 3
    sizes = [p.stat().st_size for p in parts]
    update_run_other_data(path, {"clock_sync": {"end": {"offset_ns": -7}}})
    assert [p.stat().st_size for p in parts] == sizes  # in place: the room was there
    for i, part in enumerate(parts):
        other = _load(part)[0]["otherData"]
        assert other["clock_sync"] == {"end": {"offset_ns": -7}}
        assert (other["part"], other["first_part"]) == (i, "trace.json")
    assert trace_parts(path) == parts  # the updated headers still make one run
    frame = read_chrome_trace(path)
    assert sorted(frame["span_id"]) == sorted(r.span_id for r in builder.rows)


@pytest.mark.parametrize("name", ["merged.json", "merged.json.gz"])
def test_a_merge_is_written_in_parts_that_read_as_the_whole(
    tmp_path: Path, run_builder: Callable[..., Any], name: str
) -> None:
    folder = tmp_path / "ranks"
    folder.mkdir()
    builders = []
    for rank in range(2):
        builder = run_builder(pid=100 + rank, rank=rank)
        builder.training([10_000 + i for i in range(200)])
        with ChromeTraceExporter(folder / f"rank{rank}.json") as exporter:
            exporter.export_batch(builder.batch())
        builders.append(builder)
    whole = merge_traces(tmp_path / "whole.json", [folder])
    out = tmp_path / name
    earlier = merge_traces(out, [folder], max_part_bytes=PART_BYTES, _min_part_bytes=1)
    mine = part_path(out, len(earlier.parts))  # not a part: a merge leaves it alone
    mine.write_text("{}")
    merged = merge_traces(out, [folder], max_part_bytes=PART_BYTES * 4, _min_part_bytes=1)
    parts = [Path(p) for p in merged.parts]
    assert 3 <= len(parts) < len(earlier.parts) and trace_parts(out) == parts
    # the earlier merge's later parts are gone; the file that is no part of it is not
    assert not any(Path(p).exists() for p in earlier.parts[len(parts) :]) and mine.exists()
    for i, part in enumerate(parts):
        doc = _load(part)[0]  # each part a whole trace
        assert (doc["otherData"]["part"], doc["otherData"]["first_part"]) == (i, name)
        named = {e["pid"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
        spans = {e["pid"] for e in doc["traceEvents"] if e["ph"] == "X"}
        assert spans and spans <= named  # each part names the processes it shows
    frame = read_chrome_trace(out)
    reference = read_chrome_trace(tmp_path / "whole.json")
    assert len(frame) == len(reference) == sum(len(b.rows) for b in builders)
    columns = ["pid", "span_id", "start_ns", "dur_ns"]
    pd.testing.assert_frame_equal(
        frame[columns].sort_values("span_id").reset_index(drop=True),
        reference[columns].sort_values("span_id").reset_index(drop=True),
    )
    assert merged.event_count == whole.event_count


@pytest.mark.parametrize("lost", [1, -2])
def test_a_missing_part_is_said_and_makes_the_run_a_failed_one(
    tmp_path: Path, run_builder: Callable[..., Any], lost: int
) -> None:
    """A part deleted (or lost in a copy) while a later part of the run is there: the run
    is read up to the gap with a warning, and compare counts it as failed (before, it was
    read up to the gap without a word)."""
    from exporters import run_failure

    parts = _write(tmp_path / "trace.json", _batches(run_builder()), PART_BYTES)
    assert len(parts) > 3
    index = lost % len(parts)
    parts[index].unlink()
    with pytest.warns(TraceTruncatedWarning, match=f"Part {index} of the run .* is missing"):
        frame = read_chrome_trace(parts[0])
    assert frame.attrs["missing_part"] == index
    read = frame.attrs.get("parts", [str(parts[0])])  # (one file read: no "parts")
    assert read == [str(p) for p in parts[:index]]
    assert run_failure(frame) == (
        f"its trace's part {index} is missing (the parts after it were not read)"
    )
    whole = read_chrome_trace(parts[0], parts=False)  # one part alone, as asked: no gap
    assert "missing_part" not in whole.attrs and run_failure(whole) is None


def test_a_merge_of_a_run_with_a_missing_part_records_it_as_cut_off(
    tmp_path: Path, run_builder: Callable[..., Any]
) -> None:
    from exporters import run_failure

    parts = _write(tmp_path / "trace.json", _batches(run_builder()), PART_BYTES)
    parts[2].unlink()
    with pytest.warns(TraceTruncatedWarning, match="Part 2 of the run .* is missing"):
        merge_traces(tmp_path / "merged.json", [parts[0]])
    merged = read_chrome_trace(tmp_path / "merged.json")
    assert [m["truncated"] for m in merged.attrs["metadata"]["merged_from"]] == [True]
    assert run_failure(merged) == (
        f"its trace ({parts[0]}) was cut off (the process was killed, or still runs)"
    )
