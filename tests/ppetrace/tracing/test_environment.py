"""capture_environment: one record of what a run ran on, for a trace's otherData."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ppetrace
from exporters import read_chrome_trace
from ppetrace.tracing import ENVIRONMENT_FIELDS, capture_environment
from ppetrace.tracing._environment import refresh_environment


def test_the_record_has_every_field_and_reads_torch_when_it_is_imported() -> None:
    env = capture_environment(device="cpu")
    assert tuple(env) == ENVIRONMENT_FIELDS
    assert env["torch"] == torch.__version__
    assert env["torch_threads"] == torch.get_num_threads()
    assert env["device"] == "cpu" and env["ppetrace"] == ppetrace.__version__
    assert isinstance(env["cpu_count"], int) and env["cpu_count"] >= 1
    assert env["python"] == ".".join(map(str, sys.version_info[:3]))
    assert json.loads(json.dumps(env)) == env
    assert capture_environment()["device"] is None
    # a CUDA device is named as given (with the GPU's name once CUDA is initialized)
    assert capture_environment(device=torch.device("cuda", 1))["device"].startswith("cuda:1")


def test_a_refresh_reads_what_a_script_changes_and_keeps_the_machines_fields() -> None:
    before = torch.get_num_threads()
    env = {**capture_environment(device="cpu"), "cpu_count": 977, "extra": "kept"}
    try:
        torch.set_num_threads(1 if before != 1 else 2)
        fresh = refresh_environment(env, device="cpu")
    finally:
        torch.set_num_threads(before)
    assert tuple(fresh) == (*ENVIRONMENT_FIELDS, "extra")
    assert fresh["torch_threads"] == (1 if before != 1 else 2)  # read again
    assert fresh["cpu_count"] == 977 and fresh["extra"] == "kept"  # not read again
    assert env["torch_threads"] == before  # the record given is not changed


def test_it_never_imports_torch() -> None:
    script = textwrap.dedent(
        """
        import json, sys
        from ppetrace.tracing import capture_environment
        env = capture_environment(device="cpu")
        print(json.dumps([env["torch"], env["torch_threads"], "torch" in sys.modules]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [None, None, False]


def test_a_trainers_trace_records_the_environment(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g))
    net = torch.nn.Linear(8, 4)
    trainer = ppetrace.Trainer(max_epochs=1, trace_path=tmp_path / "t.json", progress=False)
    trainer.fit(
        net,
        DataLoader(data, batch_size=8),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss_fn=F.cross_entropy,
    )
    env = read_chrome_trace(tmp_path / "t.json").attrs["metadata"]["environment"]
    assert env == capture_environment(device=trainer.device)
    assert env["torch_threads"] == torch.get_num_threads() and env["torch"] == torch.__version__


def test_cpu_count_is_the_affinity_within_the_cgroup_quota(tmp_path: Path) -> None:
    import os

    from ppetrace.tracing._environment import _cpu_count

    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert _cpu_count(str(tmp_path)) == mine  # no cgroup files: the affinity
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert _cpu_count(str(tmp_path)) == mine  # no quota
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: one, rounded up
    assert _cpu_count(str(tmp_path)) == 1
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert _cpu_count(str(v1)) == 1
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert _cpu_count(str(v1)) == mine
