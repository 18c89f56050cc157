"""``ppetrace run`` under torchrun: rank files on rank 0's clock, one trace id, merged by rank 0.

One 2-process torchrun launch (gloo, loopback) of ``ppetrace run`` on a script that
starts its own process group, trains 2 epochs of 3 steps under DDP with a validation after
each, then one more step, and destroys the group.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from exporters import load_chrome_trace, read_chrome_trace
from exporters.chrome._ranks import read_header

SCRIPT = """
import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(dist.get_rank())
train = DataLoader(TensorDataset(torch.randn(6, 4, generator=g)), batch_size=2)
val = DataLoader(TensorDataset(torch.randn(4, 4, generator=g)), batch_size=2)
for _ in range(2):
    for (x,) in train:  # 3 steps
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # a validation per epoch, the last one pending at the end
        for (x,) in val:
            model.module(x)
for (x,) in itertools.islice(train, 1):  # a 7th step, still open at the end
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def test_ppetrace_run_under_torchrun_merges_the_ranks_on_one_clock(
    tmp_path: Path, torchrun_two: Any
) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    script, trace = tmp_path / "ddp.py", tmp_path / "out" / "trace.json"
    script.write_text(SCRIPT)
    err = torchrun_two("-m", "ppetrace", "run", "--trace", str(trace), str(script), timeout=180)
    assert err.count(f"ppetrace: merged the rank traces into {trace}") == 1  # rank 0 merged
    for rank in (0, 1):  # each rank says where its own file is
        assert (
            err.count(f"ppetrace: wrote {trace.parent / 'trace.ranks' / f'rank{rank}.json'}") == 1
        )
    assert err.count("ppetrace step report") == 1  # rank 0's, of the merged file
    headers = [read_header(trace.parent / "trace.ranks" / f"rank{r}.json") for r in (0, 1)]
    assert all(h is not None for h in headers)
    h0, h1 = headers
    assert h0 is not None and h1 is not None
    for rank, h in enumerate(headers):
        assert h is not None and h.distributed_info == {"rank": rank, "world_size": 2}
        sync = h.other_data["clock_sync"]
        # rank 1 shares this host's clock with rank 0: no pings (rounds 0), no error
        rounds = 16 if rank == 0 else 0
        assert sync["start"]["rounds"] == rounds and sync["end"]["at_ns"] > sync["start"]["at_ns"]
        assert h.other_data["clock_offset_ns"] == sync["start"]["offset_ns"]
        assert h.other_data["backend"] == "gloo"
    assert h0.other_data["clock_offset_ns"] == 0 and h1.other_data["clock_error_ns"] == 0
    merged = load_chrome_trace(trace)
    # one run, one trace id: rank 1 took rank 0's
    assert merged.metadata["trace_id"] == h0.other_data["trace_id"] == h1.other_data["trace_id"]
    assert merged.metadata["ranks"] == [0, 1] and merged.metadata["world_size"] == 2
    frame = read_chrome_trace(trace)
    # the last validation and the open 7th step are recorded when the group is destroyed,
    # before the rank file closes
    for name, count in (("trainer.step", 7), ("trainer.validation", 2)):
        spans = frame[frame["name"] == name]
        assert spans.groupby("rank").size().to_dict() == {0: count, 1: count}, name


ALIVE = """
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
{end}
"""


@pytest.mark.parametrize("end", ["", "raise ValueError('boom')"])
def test_a_group_alive_at_the_end_is_merged_and_a_failed_script_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """In this process: torchrun's variables, and a script whose group (of one process
    here) is still alive when it ends, or that raises."""
    import torch.distributed as dist

    from ppetrace.cli import main

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    script, trace = tmp_path / "alive.py", tmp_path / "trace.json"
    script.write_text(ALIVE.format(end=end))
    init, destroy = dist.init_process_group, dist.destroy_process_group
    err = io.StringIO()
    try:
        code = main(["run", "--no-report", "--trace", str(trace), str(script)], stderr=err)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert (dist.init_process_group, dist.destroy_process_group) == (init, destroy)  # restored
    mine = tmp_path / "trace.ranks" / "rank0.json"
    assert read_chrome_trace(mine)["name"].value_counts()["trainer.step"] == 2
    if end:  # the other ranks may be in a collective: no merge
        assert code == 1 and not trace.exists()
        assert "clock_sync" not in read_header(mine).other_data  # type: ignore[union-attr]
        return
    assert code == 0 and f"ppetrace: merged the rank traces into {trace}" in err.getvalue()
    assert read_chrome_trace(trace)["name"].value_counts()["trainer.step"] == 2
    assert read_header(mine).other_data["clock_sync"]["end"]["rounds"] == 16  # type: ignore[union-attr]


def test_a_rank_not_under_ppetrace_run_is_named_and_the_traced_rank_goes_on_alone(
    tmp_path: Path, torchrun_two: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 under ``ppetrace run``, rank 1 as plain python: rank 0 waited in the trace
    id's broadcast until gloo's 30-minute timeout. Now it names rank 1 after
    PPETRACE_RANK_JOIN_TIMEOUT and writes its own rank file, not merged."""
    script, trace = tmp_path / "ddp.py", tmp_path / "out" / "trace.json"
    script.write_text(SCRIPT)
    launcher = tmp_path / "rank0_traced.py"
    launcher.write_text(
        "import os, sys\n"
        f"script, trace = {str(script)!r}, {str(trace)!r}\n"
        "if os.environ['RANK'] == '0':\n"
        "    argv = [sys.executable, '-m', 'ppetrace', 'run', '--trace', trace, script]\n"
        "else:\n"
        "    argv = [sys.executable, script]\n"
        "os.execv(sys.executable, argv)\n"
    )
    monkeypatch.setenv("PPETRACE_RANK_JOIN_TIMEOUT", "3")
    err = torchrun_two(str(launcher), timeout=180)
    assert "but rank 1 did not reach ppetrace's trace id (ppetrace run) within 3 s" in err
    assert "This rank's trace is written alone, not merged." in err
    rank0 = trace.parent / "trace.ranks" / "rank0.json"
    assert rank0.is_file() and not trace.exists()
    frame = read_chrome_trace(rank0)
    assert (frame["name"] == "trainer.step").sum() == 7
