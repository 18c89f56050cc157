"""One rank of the 2-process torchrun run that the distributed tests share (see the
``torchrun_run`` fixture in tests/conftest.py). Writes ``result_rank<R>.json`` and trace
folders into the output folder given as its argument; the tests read them.

Test-only clock skew: rank 1 moves its span clock 5 ms ahead (``SKEW_NS``) before
anything is traced, through the recorder's own anchor (``RECORDER.offset_ns`` and
``apply()``); the clock sync must measure it back. Rank 1 also busy-waits
``BUSY_S`` in every forward of phase C (yielding the core while it spins, so that
on a small machine rank 0 is not starved): a straggler the report must name.

The barriers: gloo's is a dissemination barrier, so the rank that arrives last
leaves first and the other one message later; the exits of one barrier differ by
that one-way latency, in the direction of the arrival order, whatever the clocks.
The ranks therefore arrive last by turns (the other sleeps 1 ms first), so that
over the barriers the protocol's +-latency cancels and what remains of the median
exit difference is the clock alignment.

Phases (every rank runs them in the same order):
A. a plain MLP with dropout under DDP, 2 epochs, validation, checkpoints, a trace;
B. the same run cut at global step 4 (an exception), resumed from the step-3 checkpoint;
C. 24 steps with an explicit all_reduce per step, rank 1 slow, then 40 barriers, a trace;
D. a ModuleInterface, the same wrapped in DDP by the user, a delira network;
E. gradient accumulation: the gradients after each backward;
F. a rank file that rank 0 cannot see (as without a shared filesystem: rank 0's
   ``os.path.isfile`` says no for rank 1's private folder) is sent over the group;
G. a loader without ``len()`` and an odd batch count with ``grad_accumulation=2``: the
   last group steps alone, after ppetrace's own gradient all-reduce, with a trace;
H. the clock measured by pings (``sync_clock(same_host=False)``), as on two hosts.

Phases A (checkpoints) and B (a cut run) also write traces: ppetrace's own collectives
(the checkpoint barrier) must not be among them, and a cut run names its rank's file.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ppetrace
from ppetrace.integrations.distributed import sync_clock
from ppetrace.tracing._recorder import RECORDER
from ppetrace.training import _distributed

SKEW_NS = 5_000_000
BUSY_S = 0.010
BARRIERS = 40
RANK = int(os.environ["RANK"])
OUT = Path(sys.argv[1])
if RANK == 1:  # before any span: the whole of this rank's trace runs 5 ms ahead
    RECORDER.offset_ns += SKEW_NS
    RECORDER.apply()

torch.set_num_threads(1)
results: dict[str, Any] = {"rank": RANK}
saves = {"n": 0}
_save = _distributed.save_atomic
started: list[Any] = []  # the Trainer of the latest plain_fit, also when its fit raises


def counting_save(*args: Any, **kwargs: Any) -> Any:
    saves["n"] += 1
    return _save(*args, **kwargs)


_distributed.save_atomic = counting_save  # type: ignore[assignment]


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def indexed(n: int, seed: int) -> TensorDataset:
    """Column 0 of the inputs is the sample's index (the model ignores it)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 9, generator=g)
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    return TensorDataset(x, torch.randint(0, 3, (n,), generator=g))


class Seen(torch.nn.Module):
    """An MLP with dropout that records which samples it trained on, per epoch."""

    def __init__(self, busy_s: float = 0.0) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3)
        )
        self.busy_s = busy_s
        self.epochs: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.epochs:
            self.epochs[-1].extend(int(i) for i in x[:, 0].tolist())
        if self.busy_s:  # spin, ceding the core to any other process that wants it (on a
            until = time.perf_counter() + self.busy_s  # 2-core machine rank 0 must run)
            while time.perf_counter() < until:
                os.sched_yield()
        return self.net(x[:, 1:])


class Watch(ppetrace.CallbackInterface):
    def __init__(self, model: Seen, crash_at: int | None = None, barrier: bool = False) -> None:
        self.model = model
        self.crash_at = crash_at
        self.barrier = barrier
        self.val_rows: list[int] = []
        self.val_digest: list[str] = []
        self.epoch_rows: list[int] = []

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        self.model.epochs.append([])

    def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
        if self.barrier:
            dist.all_reduce(torch.ones(4))  # 16 bytes
        if self.crash_at is not None and global_step == self.crash_at:
            raise RuntimeError("crash on purpose")

    def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
        self.epoch_rows.append(int(outputs[1].shape[0]))
        if self.barrier:  # the ranks arrive last by turns (see the module doc)
            for i in range(BARRIERS):
                if i % 2 == RANK:
                    time.sleep(0.001)
                dist.barrier()

    def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str = "default") -> None:
        preds = outputs[1]
        self.val_rows.append(int(preds.shape[0]))
        self.val_digest.append(hashlib.sha256(preds.numpy().tobytes()).hexdigest())


def plain_fit(phase: str, *, epochs: int = 2, crash_at: int | None = None, **fit: Any) -> Any:
    random.seed(0)  # as seed_everything does: each call's rank files still get their own id
    torch.manual_seed(0)  # the same initial weights (DDP also broadcasts rank 0's)
    model = Seen()
    torch.manual_seed(100 + RANK)  # each rank its own dropout stream
    watch = Watch(model, crash_at=crash_at)
    trainer = ppetrace.Trainer(
        max_epochs=epochs,
        progress=False,
        checkpoint_dir=OUT / f"{phase}_ckpt",
        checkpoint_every_n_steps=3 if crash_at is not None else None,
        trace_path=OUT / phase / "trace.json" if phase in ("A", "B") else None,
        callbacks=[watch],
    )
    started[:] = [trainer]
    trainer.fit(
        model,
        DataLoader(indexed(64, 1), batch_size=8, shuffle=True),
        DataLoader(indexed(20, 2), batch_size=8),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=F.cross_entropy,
        **fit,
    )
    return trainer, model, watch


# -- A: the uninterrupted run -------------------------------------------------------------
saves["n"] = 0
trainer, model, watch = plain_fit("A")
results["A"] = {
    "digest": digest(model),
    "seen": model.epochs,
    "saves": saves["n"],
    "val_rows": watch.val_rows,
    "val_digest": watch.val_digest,
    "epoch_rows": watch.epoch_rows,
    "last_trace_path": str(trainer.last_trace_path),
    "trace_paths": [str(p) for p in trainer.trace_paths],
    "backend": trainer._dist.backend if trainer._dist else None,
    "python_random": random.random(),  # the same on every rank: ppetrace draws none
}

# -- B: cut at step 5, resumed from the checkpoint of step 3 ----------------------------
try:
    plain_fit("B", crash_at=4)
except RuntimeError as exc:
    results["B_crash"] = str(exc)
    results["B_crash_trace"] = str(started[0].last_trace_path)
_, resumed, _ = plain_fit("B2", resume_from=OUT / "B_ckpt" / "last.pt")
ckpt = torch.load(OUT / "B_ckpt" / "last.pt", weights_only=True)
results["B"] = {
    "digest": digest(resumed),
    "checkpoint_step": ckpt["trainer"]["global_step"],
    "checkpoint_ranks": len(ckpt["ranks"]),
}

# -- C: clocks and a straggler ------------------------------------------------------------
torch.manual_seed(0)
slow = Seen(busy_s=BUSY_S if RANK == 1 else 0.0)
ppetrace.Trainer(
    max_epochs=1,
    progress=False,
    val_every_n_epochs=None,
    trace_path=OUT / "C" / "trace.json",
    callbacks=[Watch(slow, barrier=True)],
).fit(
    slow,
    DataLoader(indexed(96, 3), batch_size=2),
    optimizer=torch.optim.SGD(slow.parameters(), lr=0.01),
    loss_fn=F.cross_entropy,
)


# -- D: a ModuleInterface (also wrapped by the user) and a delira network ---------------
class Marlin(ppetrace.ModuleInterface):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(9, 3)
        self.data = indexed(64, 4)
        self.log: dict[str, Any] = {"train_samplers": [], "val_samplers": []}

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int) -> Any:
        self.log["estimate"] = estimated_global_steps_per_epoch
        return [torch.optim.SGD(self.parameters(), lr=0.1)], []

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> Any:
        self.log["train_samplers"].append(sampler.__name__)
        return DataLoader(self.data, batch_size=batch_size, sampler=sampler(self.data))

    def get_val_dataloaders(self, sampler: Any, batch_size: int) -> Any:
        self.log["val_samplers"].append(sampler.__name__)
        return DataLoader(self.data, batch_size=batch_size, sampler=sampler(self.data))

    def train_step(self, global_step: int, batch: Any, device: Any) -> Any:
        return F.cross_entropy(self.lin(batch[0]), batch[1])

    def val_step(self, global_step: int, batch: Any, device: Any) -> Any:
        return self.lin(batch[0])


marlin = Marlin()
ppetrace.Trainer(progress=False).fit(marlin, batch_size=8)
user = Marlin()
ppetrace.Trainer(progress=False).fit(
    torch.nn.parallel.DistributedDataParallel(user), batch_size=8, val_batch_size=8
)


class Net(ppetrace.AbstractPyTorchNetwork):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(9, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.lin(x)}


net = Net()
ppetrace.Trainer(progress=False, val_every_n_epochs=None).fit(
    net,
    DataLoader(indexed(64, 5), batch_size=8, shuffle=True),
    optimizer={"default": torch.optim.SGD(net.parameters(), lr=0.1)},
    loss_fn={"ce": torch.nn.CrossEntropyLoss()},
)
results["D"] = {
    "marlin": digest(marlin),
    "marlin_log": marlin.log,
    "user_ddp": digest(user),
    "network": digest(net),
}


# -- E: accumulation under no_sync ----------------------------------------------------------
class Grads(ppetrace.CallbackInterface):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.sums: list[float] = []

    def on_end_backward(self, global_step: int, loss: torch.Tensor) -> None:
        grad = next(self.model.parameters()).grad
        assert grad is not None
        self.sums.append(float(grad.double().sum()))


torch.manual_seed(0)
acc = torch.nn.Linear(9, 3)
grads = Grads(acc)
ppetrace.Trainer(
    progress=False, grad_accumulation=2, val_every_n_epochs=None, callbacks=[grads]
).fit(
    acc,
    DataLoader(indexed(32, 6), batch_size=4),
    optimizer=torch.optim.SGD(acc.parameters(), lr=0.1),
    loss_fn=F.cross_entropy,
)
results["E"] = {"grad_sums": grads.sums, "digest": digest(acc)}


# -- F: collecting a rank file rank 0 cannot see --------------------------------------------
group = _distributed.Distributed.resolve("auto", "cpu")
assert group is not None
merged = OUT / "F" / "trace.json"
own = (OUT / "F1private" / "rank1.json") if RANK == 1 else merged.parent / "trace.ranks/rank0.json"
own.parent.mkdir(parents=True, exist_ok=True)
own.write_bytes(f"rank {RANK} ".encode() * (1000 + RANK))
seen = os.path.isfile
if RANK == 0:  # rank 1's private folder is not on rank 0's filesystem
    os.path.isfile = lambda p: "F1private" not in str(p) and seen(p)  # type: ignore[assignment]
files = group.traces._collect(own, merged)
os.path.isfile = seen  # type: ignore[assignment]
results["F"] = {"files": [str(f) for f in files]}


# -- G: the partial last group of a loader without len() ---------------------------------
class Batches:
    """5 batches of this rank's own data and no ``len()``: with ``grad_accumulation=2``
    the Trainer learns that the last group is partial only when the loader runs out."""

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(70 + RANK)
        for _ in range(5):
            yield torch.randn(4, 9, generator=g), torch.randint(0, 3, (4,), generator=g)


torch.manual_seed(0)
partial = torch.nn.Linear(9, 3)
trainer = ppetrace.Trainer(
    progress=False,
    grad_accumulation=2,
    val_every_n_epochs=None,
    trace_path=OUT / "G" / "trace.json",
)
trainer.fit(
    partial,
    Batches(),
    optimizer=torch.optim.SGD(partial.parameters(), lr=0.5),
    loss_fn=F.cross_entropy,
)
results["G"] = {"digest": digest(partial), "steps": trainer.global_step}

# -- H: the clock measured by pings, though both ranks share this host's clock -------------
pinged = sync_clock(same_host=False)
results["H"] = {"offset_ns": pinged.offset_ns, "error_ns": pinged.error_ns, "rounds": pinged.rounds}

(OUT / f"result_rank{RANK}.json").write_text(json.dumps(results))
dist.barrier()
dist.destroy_process_group()
