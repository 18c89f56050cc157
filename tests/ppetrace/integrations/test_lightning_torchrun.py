"""``LightningProfiler`` under torchrun: Lightning's DDP strategy (gloo, CPU) in two
processes; each rank's file carries ``distributedInfo``, rank 0's trace id and clock, and
rank 0 merges them at the end of each stage, as the Trainer does."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from exporters import load_chrome_trace, read_chrome_trace, step_report
from exporters.chrome._ranks import read_header
from ppetrace.cli import main

pytest.importorskip("lightning")

SCRIPT = """
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ppetrace.integrations.lightning import LightningProfiler


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
profiler = LightningProfiler(sys.argv[1])
trainer = L.Trainer(
    max_epochs=1, accelerator="cpu", devices=2, strategy="ddp", profiler=profiler,
    logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Module(), DataLoader(data, batch_size=8))  # 4 batches per rank
trainer.test(Module(), DataLoader(data, batch_size=8))
with open(f"{sys.argv[1]}.paths{trainer.global_rank}", "w") as f:  # (stderr interleaves)
    f.write(" ".join(str(p) for p in profiler.trace_paths))
"""


def test_each_rank_writes_its_file_on_rank_0s_clock_and_rank_0_merges_each_stage(
    tmp_path: Path, torchrun_two: Any
) -> None:
    script, trace = tmp_path / "fit.py", tmp_path / "out" / "trace.json"
    script.write_text(SCRIPT)
    torchrun_two(str(script), str(trace), timeout=240)
    out = trace.parent
    for rank in (0, 1):  # each rank names its own file and the merged ones
        assert Path(f"{trace}.paths{rank}").read_text() == (
            f"{out / 'trace.ranks' / f'rank{rank}.json'} {trace} "
            f"{out / 'trace.test.ranks' / f'rank{rank}.json'} {out / 'trace.test.json'}"
        )
    headers = [read_header(out / "trace.ranks" / f"rank{r}.json") for r in (0, 1)]
    trace_ids = set()
    for rank, h in enumerate(headers):
        assert h is not None and h.distributed_info == {
            "rank": rank,
            "world_size": 2,
            "backend": "gloo",
        }
        assert set(h.other_data["clock_sync"]) == {"reference_rank", "start", "end"}
        assert h.other_data["clock_error_ns"] == 0  # one host: the anchors' difference
        trace_ids.add(h.other_data["trace_id"])
    assert len(trace_ids) == 1  # one run
    merged = load_chrome_trace(trace)
    assert merged.metadata["ranks"] == [0, 1] and merged.metadata["trace_id"] in trace_ids
    frame = read_chrome_trace(trace)
    steps = frame[frame["name"] == "trainer.step"]
    assert steps.groupby("rank").size().to_dict() == {0: 4, 1: 4}
    report = step_report(frame, warmup_steps=1)
    assert report.ranks is not None and report.total_steps == 8
    # the rank folder is one run for compare (one trace id), as the merged file is
    stdout, stderr = io.StringIO(), io.StringIO()
    code = main(["compare", str(out / "trace.ranks"), str(trace)], stdout=stdout, stderr=stderr)
    assert code == 0 and "(1 run vs 1 run)" in stdout.getvalue(), stderr.getvalue()
    tested = read_chrome_trace(out / "trace.test.json")
    assert set(tested["rank"]) == {0, 1} and set(tested["stage"]) == {"test"}
