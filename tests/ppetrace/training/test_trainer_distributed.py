"""Training under torchrun: DDP, samplers, rank-0 checkpoints, gathered outputs.

The torchrun tests read what one 2-process run of ``ddp_worker.py`` wrote (the
``torchrun_run`` fixture); the others check the pieces in this process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ppetrace
from exporters import read_chrome_trace
from ppetrace.training._distributed import (
    Distributed,
    ShardSampler,
    _join,
    check_mode,
    distributed_loader,
    set_epoch,
)


def results(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]


# -- in a 2-process torchrun run ------------------------------------------------------------


def test_ddp_fit_leaves_the_same_parameters_on_every_rank(torchrun_run: Path) -> None:
    r0, r1 = results(torchrun_run)
    assert r0["A"]["backend"] == "gloo"  # the Trainer started the group from torchrun's env
    for phase, key in (("A", "digest"), ("D", "network"), ("D", "marlin"), ("E", "digest")):
        assert r0[phase][key] == r1[phase][key], (phase, key)


def test_each_rank_trains_on_its_own_half_and_in_a_new_order_each_epoch(torchrun_run: Path) -> None:
    r0, r1 = results(torchrun_run)
    seen0, seen1 = r0["A"]["seen"], r1["A"]["seen"]
    assert len(seen0) == len(seen1) == 2
    for epoch in range(2):
        a, b = seen0[epoch], seen1[epoch]
        assert len(a) == len(b) == 32
        assert not set(a) & set(b)  # disjoint halves...
        assert set(a) | set(b) == set(range(64))  # ...of the whole dataset
    for seen in (seen0, seen1):
        assert seen[0] != seen[1]  # set_epoch: another shuffle in epoch 1


def test_one_checkpoint_by_rank_0_and_a_bit_identical_resume_on_every_rank(
    torchrun_run: Path,
) -> None:
    r0, r1 = results(torchrun_run)
    assert sorted(p.name for p in (torchrun_run / "A_ckpt").iterdir()) == ["last.pt"]
    assert (r0["A"]["saves"], r1["A"]["saves"]) == (2, 0)  # one write per epoch, rank 0 only
    assert r0["B_crash"] == r1["B_crash"] == "crash on purpose"
    assert r0["B"]["checkpoint_step"] == 3  # mid-epoch: 4 steps per epoch and rank
    assert r0["B"]["checkpoint_ranks"] == 2  # every rank's RNG states
    # cut at step 4, resumed from step 3: the same weights as the uninterrupted run
    assert r0["B"]["digest"] == r0["A"]["digest"]
    assert r1["B"]["digest"] == r1["A"]["digest"]


def test_validation_and_epoch_outputs_are_gathered_from_every_rank(torchrun_run: Path) -> None:
    r0, r1 = results(torchrun_run)
    # 20 validation samples, 10 per rank; each rank's callback sees all 20, the same ones
    assert r0["A"]["val_rows"] == r1["A"]["val_rows"] == [20, 20]
    assert r0["A"]["val_digest"] == r1["A"]["val_digest"]
    assert r0["A"]["epoch_rows"] == r1["A"]["epoch_rows"] == [64, 64]


def test_module_interfaces_get_distributed_samplers_and_pymarlins_estimate(
    torchrun_run: Path,
) -> None:
    r0, r1 = results(torchrun_run)
    log = r0["D"]["marlin_log"]
    assert log["train_samplers"][0] == "DistributedSampler"
    assert log["val_samplers"] == ["ShardSampler"]
    # PyMarlin: len(loader with SequentialSampler) // (world size * accumulation) + 1
    assert log["estimate"] == 64 // 8 // 2 + 1
    # fit(DDP(module_interface)) trains like fit(module_interface)
    assert r0["D"]["user_ddp"] == r0["D"]["marlin"] == r1["D"]["user_ddp"]


def test_batches_that_do_not_step_skip_the_gradient_all_reduce(torchrun_run: Path) -> None:
    sums0, sums1 = (r["E"]["grad_sums"] for r in results(torchrun_run))
    assert len(sums0) == len(sums1) == 4  # 32 samples, 16 per rank, batches of 4
    assert sums0[0] != sums1[0] and sums0[2] != sums1[2]  # no_sync: each rank's own
    assert sums0[1] == sums1[1] and sums0[3] == sums1[3]  # the boundary: averaged


def test_rank_0_receives_the_files_it_cannot_see(torchrun_run: Path) -> None:
    r0, _ = results(torchrun_run)
    files = [Path(f) for f in r0["F"]["files"]]
    assert files == [torchrun_run / "F" / "trace.ranks" / f"rank{r}.json" for r in (0, 1)]
    # rank 1's file lay in a folder rank 0 was told it cannot see: it came over the group
    assert files[1].read_bytes() == (torchrun_run / "F1private" / "rank1.json").read_bytes()
    assert files[1].read_bytes() == b"rank 1 " * 1001


def test_ppetraces_own_collectives_are_not_traced_as_the_users(torchrun_run: Path) -> None:
    # A: a checkpoint per epoch (gather_object and a barrier), B: one every 3 steps, G: the
    # gradient all-reduce before a partial group; none of them is the user's dist.* call
    for phase in ("A", "G"):
        names = read_chrome_trace(torchrun_run / phase / "trace.json")["name"]
        assert not names.str.startswith("dist.").any(), (phase, names.unique())
    for rank in (0, 1):
        names = read_chrome_trace(torchrun_run / "B" / "trace.ranks" / f"rank{rank}.json")["name"]
        assert (names == "trainer.step").any() and not names.str.startswith("dist.").any()


def test_a_failed_call_names_the_rank_file_as_its_last_trace(torchrun_run: Path) -> None:
    for rank, result in enumerate(results(torchrun_run)):
        written = torchrun_run / "B" / "trace.ranks" / f"rank{rank}.json"
        assert result["B_crash_trace"] == str(written) and written.is_file()
    assert not (torchrun_run / "B" / "trace.json").exists()  # no merge after a failure


def test_a_partial_last_group_is_averaged_over_the_ranks_before_it_steps(
    torchrun_run: Path,
) -> None:
    r0, r1 = results(torchrun_run)
    # 5 batches, groups of 2: two full groups and one partial group, each one step; each
    # rank had its own data, so without the all-reduce the last step would differ
    assert r0["G"]["steps"] == r1["G"]["steps"] == 3
    assert r0["G"]["digest"] == r1["G"]["digest"]


# -- the pieces, in this process --------------------------------------------------------


def test_distributed_accepts_auto_or_none_only() -> None:
    assert check_mode("auto") == "auto" and check_mode(None) is None
    with pytest.raises(
        ValueError, match=r"Expected 'auto' or None for distributed, but received 'ddp'"
    ):
        ppetrace.Trainer(distributed="ddp")  # type: ignore[arg-type]


def test_without_torchrun_auto_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert Distributed.resolve("auto", "cpu") is None
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # alone: nothing to distribute
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert Distributed.resolve("auto", "cpu") is None
    assert not torch.distributed.is_initialized()


def test_shard_sampler_splits_contiguously_without_padding() -> None:
    shards = [list(ShardSampler(range(10), 3, r)) for r in range(3)]
    assert shards == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    assert [len(ShardSampler(range(2), 3, r)) for r in range(3)] == [0, 1, 1]


def _data(n: int = 12) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32), torch.zeros(n))


def test_default_samplers_are_replaced_and_the_loader_otherwise_kept() -> None:
    collate = torch.utils.data.default_collate
    loader = DataLoader(_data(), batch_size=4, shuffle=True, drop_last=True, collate_fn=collate)
    new = distributed_loader(loader, train=True, rank=1, world_size=2)
    assert isinstance(new.sampler, DistributedSampler) and new.sampler.shuffle
    assert (new.sampler.rank, new.sampler.num_replicas) == (1, 2)
    assert (new.batch_size, new.drop_last, new.collate_fn) == (4, True, collate)
    plain = distributed_loader(DataLoader(_data(), batch_size=4), train=True, rank=0, world_size=2)
    assert isinstance(plain.sampler, DistributedSampler) and not plain.sampler.shuffle
    evaluation = distributed_loader(
        DataLoader(_data(), batch_size=4), train=False, rank=1, world_size=2
    )
    assert [b[0].tolist() for b in evaluation] == [[6.0, 7.0, 8.0, 9.0], [10.0, 11.0]]
    already = DataLoader(_data(), sampler=DistributedSampler(_data(), 2, 0))
    assert distributed_loader(already, train=True, rank=0, world_size=2) is already
    assert distributed_loader([1, 2], train=True, rank=0, world_size=2) == [1, 2]


def test_loaders_that_cannot_be_rebuilt_are_refused_or_kept_with_a_warning() -> None:
    class Mine(DataLoader):  # type: ignore[type-arg]
        pass

    with pytest.raises(ValueError, match=r"received a subclass \(Mine\).*use_distributed_sampler"):
        distributed_loader(Mine(_data(), batch_size=4), train=True, rank=0, world_size=2)
    custom = DataLoader(_data(), sampler=list(range(12)))
    with pytest.warns(RuntimeWarning, match="has its own sampler"):
        assert distributed_loader(custom, train=True, rank=0, world_size=2) is custom


def test_set_epoch_reaches_the_sampler() -> None:
    sampler = DistributedSampler(_data(), num_replicas=2, rank=0, shuffle=True)
    loader = DataLoader(_data(), sampler=sampler)
    first = list(sampler)
    set_epoch(loader, 3)
    assert sampler.epoch == 3 and list(sampler) != first
    set_epoch(DataLoader(_data(), sampler=RandomSampler(_data())), 1)  # no set_epoch: nothing


def test_gathered_outputs_join_in_rank_order() -> None:
    a = (torch.tensor([1.0, 2.0]), {"p": torch.tensor([[1.0]])}, ["x"])
    b = (torch.tensor([3.0]), {"p": torch.tensor([[2.0]])}, ["y", "z"])
    t, d, names = (_join([a[i], b[i]]) for i in range(3))
    assert t.tolist() == [1.0, 2.0, 3.0] and d["p"].tolist() == [[1.0], [2.0]]
    assert names == ["x", "y", "z"]
