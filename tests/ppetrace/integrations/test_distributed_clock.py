"""Clocks aligned to rank 0, and explicit collectives traced, in a 2-process torchrun run.

``ddp_worker.py`` moves rank 1's span clock 5 ms ahead (test-only, through the
recorder's anchor) before it traces anything; the clock sync must measure it
back within the error bound it records, and the merge must undo it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import ppetrace
from exporters import load_chrome_trace, read_chrome_trace
from exporters.chrome._ranks import read_header
from ppetrace.integrations.distributed import (
    rank_trace_path,
    sync_clock,
    trace_collectives,
    untraced,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
SKEW_NS = 5_000_000  # ddp_worker.SKEW_NS


#: how far two processes' epoch anchors (``time_ns() - perf_counter_ns()``, read once at
#: start) may disagree on one host: the two reads of each are not simultaneous (a context
#: switch between them, or the wall clock stepped between the two starts); well below
#: the 5 ms skew
ANCHOR_JITTER_NS = 1_000_000


def test_on_one_host_the_skew_is_the_anchors_difference_exactly(torchrun_run: Path) -> None:
    h0 = read_header(torchrun_run / "C" / "trace.ranks" / "rank0.json")
    h1 = read_header(torchrun_run / "C" / "trace.ranks" / "rank1.json")
    assert h0 is not None and h1 is not None
    assert h0.other_data["clock_offset_ns"] == 0 and h0.other_data["clock_error_ns"] == 0
    offset, error = h1.other_data["clock_offset_ns"], h1.other_data["clock_error_ns"]
    # both ranks read this host's monotonic clock: no ping, no error bound to blur it
    assert error == 0
    assert abs(offset - -SKEW_NS) <= ANCHOR_JITTER_NS  # rank 1 runs 5 ms ahead: add -5 ms
    start, end = (h1.other_data["clock_sync"][k] for k in ("start", "end"))
    assert start["offset_ns"] == offset and start["rounds"] == 0
    assert end["offset_ns"] == offset and end["error_ns"] == 0 and end["rounds"] == 0
    assert end["at_ns"] > start["at_ns"]
    assert h1.distributed_info == {"rank": 1, "world_size": 2, "backend": "gloo"}


def test_pings_measure_the_skew_back_within_their_bound(torchrun_run: Path) -> None:
    # sync_clock(same_host=False): what ranks on two hosts do
    pinged = json.loads((torchrun_run / "result_rank1.json").read_text())["H"]
    assert pinged["rounds"] == 16 and 0 < pinged["error_ns"] < SKEW_NS
    assert abs(pinged["offset_ns"] - -SKEW_NS) <= pinged["error_ns"] + ANCHOR_JITTER_NS
    rank0 = json.loads((torchrun_run / "result_rank0.json").read_text())["H"]
    assert (rank0["offset_ns"], rank0["error_ns"]) == (0, 0)


def test_after_the_merge_the_ranks_leave_each_barrier_together(torchrun_run: Path) -> None:
    """Causality, which load cannot break: no rank leaves a barrier before the other one
    entered it, within the clock error (rank 1's uncorrected 5 ms would break it). Then the
    median over 40 barriers of (rank 1's exit - rank 0's) lies within twice the bound (a
    core taken away between a barrier and its span's end moves single exits, and by turns
    the ranks may fail to arrive last); in rank 1's own file, the skew is still there."""
    # the clock error (0 on one host) plus room for the anchors' jitter (µs in practice);
    # and for the median, gloo's one-way latency, which the alternating arrivals cancel
    # only on the whole
    error = (
        250_000
        + read_header(  # type: ignore[union-attr]
            torchrun_run / "C" / "trace.ranks" / "rank1.json"
        ).other_data["clock_error_ns"]
    )
    latency = 1_000_000
    assert 2 * error + latency < SKEW_NS / 2  # the bounds below cannot take the skew in
    merged = read_chrome_trace(torchrun_run / "C" / "trace.json")
    barriers = merged[merged["name"] == "dist.barrier"].sort_values("start_ns")
    starts, exits = (
        [barriers.loc[barriers["rank"] == r, col].to_numpy() for r in (0, 1)]
        for col in ("start_ns", "end_ns")
    )
    assert len(exits[0]) == len(exits[1]) == 40
    assert (starts[1] - exits[0]).max() <= error  # rank 0 left after rank 1 entered
    assert (starts[0] - exits[1]).max() <= error  # and the other way round
    assert abs(float(np.median(exits[1] - exits[0]))) <= 2 * error + latency
    own = read_chrome_trace(torchrun_run / "C" / "trace.ranks" / "rank1.json")
    own_exits = own.loc[own["name"] == "dist.barrier", "end_ns"].sort_values().to_numpy()
    assert abs(float(np.median(own_exits - exits[0])) - SKEW_NS) <= 2 * error + latency


def test_explicit_collectives_are_spans_with_their_byte_counts(torchrun_run: Path) -> None:
    merged = read_chrome_trace(torchrun_run / "C" / "trace.json")
    reduces = merged[merged["name"] == "dist.all_reduce"]
    assert sorted(reduces.groupby("rank").size().tolist()) == [24, 24]
    assert set(reduces["ppetrace.bytes"]) == {16}  # torch.ones(4), float32
    assert set(merged.loc[merged["name"] == "dist.barrier", "ppetrace.bytes"]) == {0}
    cats = {e["cat"] for e in load_chrome_trace(torchrun_run / "C" / "trace.json").events
            if e.get("name") == "dist.barrier"}  # fmt: skip
    assert cats == {"dist"}


def test_rank_trace_path_keeps_the_merged_file_out_of_the_rank_folder() -> None:
    assert rank_trace_path("runs/trace.json", 3) == Path("runs/trace.ranks/rank3.json")
    assert rank_trace_path("t.fit2.json.gz", 0) == Path("t.fit2.ranks/rank0.json")


@pytest.fixture
def group() -> Iterator[None]:
    """A one-process gloo group in this process."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_collectives_are_traced_inside_the_block_and_restored_after(
    group: None, span_exporter: object
) -> None:
    original = dist.all_reduce
    with trace_collectives(), trace_collectives():  # nests
        assert dist.all_reduce is not original
        dist.all_reduce(torch.ones(3, dtype=torch.float64))
        dist.broadcast(torch.ones(2), src=0)
        dist.all_gather([torch.zeros(5)], torch.ones(5))
        work = dist.all_reduce(torch.ones(1), async_op=True)
        work.wait()
        dist.barrier()
        untraced("barrier")()  # ppetrace's own call: no span
        assert untraced("all_reduce") is original
    assert dist.all_reduce is original
    dist.all_reduce(torch.ones(1))  # not traced any more
    ppetrace.flush()
    spans = [
        (s.name, {k: v for k, v in (s.attributes or {}).items() if k.startswith("ppetrace.")})
        for s in span_exporter.get_finished_spans()  # type: ignore[attr-defined]
    ]
    assert spans == [
        ("dist.all_reduce", {"ppetrace.bytes": 24}),
        ("dist.broadcast", {"ppetrace.bytes": 8}),
        ("dist.all_gather", {"ppetrace.bytes": 20}),
        ("dist.all_reduce", {"ppetrace.bytes": 4, "ppetrace.async_op": True}),
        ("dist.barrier", {"ppetrace.bytes": 0}),
    ]


def test_a_rank_alone_has_no_offset(group: None) -> None:
    ticks = iter(range(100, 200))
    sync = sync_clock(rounds=3, clock=lambda: next(ticks))
    assert (sync.offset_ns, sync.error_ns, sync.rounds) == (0, 0, 3)
    with pytest.raises(
        ValueError, match=r"Expected a positive int for rounds, but received 0\. Pass 1 or more"
    ):
        sync_clock(rounds=0)
