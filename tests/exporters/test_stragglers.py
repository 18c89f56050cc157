"""Multi-rank traces: the merged file of a torchrun run, the per-rank report and stragglers."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from exporters import (
    ChromeTraceExporter,
    group_runs,
    load_chrome_trace,
    read_chrome_trace,
    render,
    render_csv,
    spans_to_frame,
    step_report,
    summarize_run,
)
from exporters.chrome._ranks import read_header
from ppetrace.cli import main

RunBuilder = Any


# -- the merged trace of the torchrun run ------------------------------------------------


def test_the_merged_trace_has_one_track_per_rank_and_the_rank_files_distributed_info(
    torchrun_run: Path,
) -> None:
    folder = torchrun_run / "A" / "trace.ranks"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.json", "rank1.json"]
    headers = [read_header(folder / f"rank{r}.json") for r in (0, 1)]
    assert [h.distributed_info for h in headers] == [  # type: ignore[union-attr]
        {"rank": r, "world_size": 2, "backend": "gloo"} for r in (0, 1)
    ]
    trace = load_chrome_trace(torchrun_run / "A" / "trace.json")
    names = [e["args"]["name"] for e in trace.events if e.get("name") == "process_name"]
    assert len(names) == 2 and "rank 0" in names[0] and "rank 1" in names[1]
    sort = {e["pid"]: e["args"]["sort_index"] for e in trace.events
            if e.get("name") == "process_sort_index"}  # fmt: skip
    assert sorted(sort.values()) == [0, 1]
    meta = trace.metadata
    assert meta["ranks"] == [0, 1] and meta["world_size"] == 2
    # one run, one trace id: every rank recorded into rank 0's
    assert (
        meta["trace_id"] == headers[0].other_data["trace_id"] == headers[1].other_data["trace_id"]
    )  # type: ignore[union-attr]
    assert "distributedInfo" not in json.loads((torchrun_run / "A" / "trace.json").read_text())


def test_read_chrome_trace_and_step_report_give_per_rank_rows(torchrun_run: Path) -> None:
    frame = read_chrome_trace(torchrun_run / "A" / "trace.json")
    assert sorted(frame["rank"].dropna().unique().tolist()) == [0, 1]
    report = step_report(frame)
    assert report.ranks is not None
    assert report.ranks.table["rank"].tolist() == [0, 1]
    assert report.ranks.table["steps"].tolist() == [7, 7]  # 2 epochs x 4 steps, 1 warmup
    assert sorted(report.steps["rank"].unique().tolist()) == [0, 1]


def test_the_report_names_the_rank_made_slow_on_purpose(
    torchrun_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = step_report(read_chrome_trace(torchrun_run / "C" / "trace.json"))
    assert report.ranks is not None and report.ranks.straggler == 1
    slow = report.ranks.table.set_index("rank").loc[1]
    assert slow["slowest"] > 12  # of 23 steps
    assert slow["lead_mean_ns"] > 5_000_000  # it busy-waits 10 ms per step
    out, err = io.StringIO(), io.StringIO()
    assert main(["report", str(torchrun_run / "C" / "trace.json")], stdout=out, stderr=err) == 0
    assert "Straggler: rank 1 arrived last at trainer.backward" in out.getvalue()


def test_the_rank_files_of_two_calls_of_one_job_are_two_runs(
    torchrun_run: Path, tmp_path: Path
) -> None:
    """Calls A and B of one torchrun job share the trace id; their rank files carry each
    call's own run id, so rank 0 of one and rank 1 of the other never merge into a run
    that never ran together (before: merged, and a false straggler), and a folder of all
    four is two runs (before: four). The worker seeds Python's random module alike before
    each call, as seed_everything does: the run id comes from the OS, and ppetrace draws
    nothing from that module (before, the calls got one id, and rank 0's numbers moved)."""
    from exporters import TraceError, merge_traces

    files = {
        (call, r): torchrun_run / call / "trace.ranks" / f"rank{r}.json"
        for call in ("A", "B")
        for r in (0, 1)
    }
    other = {key: read_header(p).other_data for key, p in files.items()}  # type: ignore[union-attr]
    assert len({o["trace_id"] for o in other.values()}) == 1  # one job, one trace id
    run_ids = {call: {other[call, r]["run_id"] for r in (0, 1)} for call in ("A", "B")}
    assert all(len(ids) == 1 for ids in run_ids.values()) and run_ids["A"] != run_ids["B"]
    assert load_chrome_trace(torchrun_run / "A" / "trace.json").metadata["run_id"] in run_ids["A"]
    with pytest.raises(TraceError, match="come from different calls of one job"):
        merge_traces(tmp_path / "mixed.json", [files["A", 0], files["B", 1]])
    runs = group_runs([read_chrome_trace(p) for p in files.values()])
    assert sorted(sorted(run["rank"].unique().tolist()) for run in runs) == [[0, 1], [0, 1]]
    r0, r1 = (json.loads((torchrun_run / f"result_rank{r}.json").read_text()) for r in (0, 1))
    assert r0["A"]["python_random"] == r1["A"]["python_random"]


def test_compare_counts_a_folder_of_rank_files_as_one_run(torchrun_run: Path) -> None:
    folder = torchrun_run / "C" / "trace.ranks"
    frames = [read_chrome_trace(p) for p in sorted(folder.iterdir())]
    (run,) = group_runs(frames)
    assert sorted(run["rank"].unique().tolist()) == [0, 1]
    out, err = io.StringIO(), io.StringIO()
    code = main(["compare", str(folder), str(folder), "--format", "json"], stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    rows = {r["event"]: r for r in json.loads(out.getvalue())["events"]}
    assert rows["trainer.step"]["base_runs"] == 1  # two rank files, one run
    merged = str(torchrun_run / "C" / "trace.json")
    out, err = io.StringIO(), io.StringIO()
    code = main(["compare", merged, merged, "--rank", "1", "--format", "json"],
                stdout=out, stderr=err)  # fmt: skip
    assert code == 0, err.getvalue()
    rows = {r["event"]: r for r in json.loads(out.getvalue())["events"]}
    # rank 1 alone: its 24 steps less the warmup one, and its forwards, 10 ms slower
    # than rank 0's, at their own median
    frame = read_chrome_trace(merged)
    mine = frame[(frame["rank"] == 1) & (frame["name"] == "module.train_step")]
    expected = float(mine.sort_values("start_ns")["dur_ns"].iloc[1:].median())
    assert rows["module.train_step"]["base_n"] == rows["trainer.step"]["base_n"] == 23
    assert rows["module.train_step"]["base_median_ns"] == pytest.approx(expected)
    assert expected > 5_000_000  # rank 0's are far shorter: not a median of both
    out, err = io.StringIO(), io.StringIO()
    code = main(["compare", merged, merged, "--rank", "5"], stdout=out, stderr=err)
    assert code == 2
    assert "Expected spans of rank 5" in err.getvalue() and "ranks 0, 1" in err.getvalue()


# -- the straggler rule on exact, synthetic spans ----------------------------------------


def _two_ranks(
    run_builder: Callable[..., RunBuilder], late: Callable[[int], tuple[int, int]]
) -> Any:
    """Two data-parallel ranks of 21 steps; ``late(i)`` gives each rank's fetch time at
    step i. As under DDP, the rank that fetched faster waits for the other inside its step,
    so both start every step together; each arrives at trainer.backward (10 ns into its
    step) after its own fetch."""
    fetch = [late(i) for i in range(21)]
    ranks = [run_builder(pid=100 + r, rank=r) for r in (0, 1)]
    for r, rb in enumerate(ranks):
        steps = [1_000_000 + max(f) - f[r] for f in fetch]
        rb.training(steps, fetch_ns=[f[r] for f in fetch], backward_ns=1_000)
    return spans_to_frame([rb.batch() for rb in ranks])


def test_a_rank_late_at_every_step_is_a_straggler(run_builder: Callable[..., RunBuilder]) -> None:
    frame = _two_ranks(run_builder, lambda i: (10_000, 200_000))  # rank 1 fetches 190 µs longer
    report = step_report(frame)
    assert report.ranks is not None
    assert report.ranks.straggler == 1 and report.ranks.matched_steps == 20
    steps = report.ranks.steps
    assert (steps["slowest_rank"] == 1).all()
    # arrival: the start of trainer.backward, 190 µs later on rank 1 at every step
    assert steps["spread_ns"].tolist() == [190_000] * 20
    assert steps["lead_ns"].tolist() == [190_000] * 20
    assert "Straggler: rank 1" in render(report)
    assert render_csv(report, table="ranks").splitlines()[0].startswith("rank,steps,mean_ns")


def test_taking_turns_is_not_a_straggler(run_builder: Callable[..., RunBuilder]) -> None:
    # each rank is late at every other step: the same spread, but nobody holds the others up
    frame = _two_ranks(run_builder, lambda i: (10_000, 200_000) if i % 2 else (200_000, 10_000))
    report = step_report(frame)
    assert report.ranks is not None and report.ranks.straggler is None
    assert report.ranks.verdict.startswith("No straggler")


def test_a_small_lead_or_a_chance_majority_is_not_a_straggler(
    run_builder: Callable[..., RunBuilder],
) -> None:
    # rank 1 last at every step, but by 1 µs on a 1 ms step (below the 5% margin)
    frame = _two_ranks(run_builder, lambda i: (10_000, 11_000))
    report = step_report(frame)
    assert report.ranks is not None and report.ranks.straggler is None
    assert step_report(frame, straggler_margin=0.0).ranks.straggler == 1  # type: ignore[union-attr]
    # last at 13 of 20 steps: more than half, but within what chance gives (p ~ 0.13)
    frame = _two_ranks(run_builder, lambda i: (10_000, 200_000) if i < 14 else (200_000, 10_000))
    report = step_report(frame)
    assert report.ranks is not None and report.ranks.straggler is None
    with pytest.raises(ValueError, match=r"Expected a share of the step such as 0\.05"):
        step_report(frame, straggler_margin=-1)


def test_one_rank_gets_no_rank_table(run_builder: Callable[..., RunBuilder]) -> None:
    rb = run_builder()
    rb.training([1_000] * 4)
    assert step_report(spans_to_frame([rb.batch()])).ranks is None


def test_summarize_run_keeps_one_rank(run_builder: Callable[..., RunBuilder]) -> None:
    frame = _two_ranks(run_builder, lambda i: (10_000, 200_000))
    both = summarize_run(frame)
    one = summarize_run(frame, rank=1)
    assert both.events["trainer.fetch_batch"].n == 40 and one.events["trainer.fetch_batch"].n == 20
    assert one.events["trainer.fetch_batch"].median_ns == 200_000
    with pytest.raises(
        ValueError, match=r"Expected spans of rank 5 in the run, but it has ranks 0, 1"
    ):
        summarize_run(frame, rank=5)


def test_group_runs_joins_rank_files_only(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    paths = []
    for name, rank, pid in (("a", 0, 7), ("b", 1, 7), ("c", 0, 7)):
        rb = run_builder(pid=pid, rank=rank)
        rb.training([1_000] * 3)
        exporter = ChromeTraceExporter(tmp_path / f"{name}.json")
        exporter.export_batch(rb.batch())
        exporter.shutdown()
        paths.append(tmp_path / f"{name}.json")
    frames = [read_chrome_trace(p) for p in paths]
    # a and b: ranks 0 and 1 of one trace id -> one run, the shared pid moved apart
    (run,) = group_runs(frames[:2])
    assert sorted(run["pid"].unique().tolist()) == [7, 8] and len(run) == 2 * len(frames[0])
    assert sorted(run["rank"].unique().tolist()) == [0, 1]
    # with c, rank 0 twice in one trace id (two fits of one process): three runs
    assert len(group_runs(frames)) == 3
