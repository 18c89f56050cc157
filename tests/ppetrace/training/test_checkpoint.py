"""Checkpoints: exact resume, atomic writes, and clear errors for bad files."""

from __future__ import annotations

import errno
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import ppetrace
from ppetrace.training import _checkpoint
from ppetrace.training._checkpoint import (
    CheckpointError,
    capture_rng,
    load_checkpoint,
    loader_generators,
    restore_rng,
    save_atomic,
)


class NoisyData(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Augmentation noise from Python's and NumPy's RNGs, so both must be restored."""

    def __init__(self, n: int = 18) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = random.random() + float(np.random.rand())
        return self.x[i] + 0.01 * noise, self.y[i]


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )


class Crash(ppetrace.CallbackInterface):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
        if global_step == self.at_step:
            raise KeyboardInterrupt("simulated interruption")


def train(
    model_seed: int,
    ckpt: Path,
    *,
    every: int | None,
    use_generator: bool,
    crash_at: int | None = None,
    resume: bool = False,
) -> tuple[torch.nn.Module, ppetrace.Trainer]:
    model = make_model(model_seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(model_seed) if use_generator else None
    loader = DataLoader(NoisyData(), batch_size=4, shuffle=True, generator=gen)  # 5 batches
    trainer = ppetrace.Trainer(
        max_epochs=3,
        grad_accumulation=2,
        checkpoint_dir=ckpt,
        checkpoint_every_n_steps=every,
        callbacks=[Crash(crash_at)] if crash_at is not None else [],
        progress=False,
    )
    # the process-wide RNGs start from the same state in every run of a test
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    trainer.fit(
        model,
        loader,
        optimizer=opt,
        loss_fn=torch.nn.functional.cross_entropy,
        schedulers=[sched],
        resume_from=ckpt / "last.pt" if resume else None,
    )
    return model, trainer


@pytest.mark.parametrize(
    ("every", "crash_at", "use_generator"),
    [
        (2, 5, False),  # the last checkpoint is mid-epoch 1 (step 4, after 2 of its 5 batches)
        (2, 5, True),  # the same with a DataLoader generator
        (None, 5, False),  # only epoch-end checkpoints: resume at the start of epoch 1
    ],
)
def test_interrupted_then_resumed_run_is_bit_identical(
    tmp_path: Path, every: int | None, crash_at: int, use_generator: bool
) -> None:
    reference, ref_trainer = train(0, tmp_path / "ref", every=every, use_generator=use_generator)
    assert ref_trainer.global_step == 9  # 3 epochs x (2 full groups + 1 partial)

    with pytest.raises(KeyboardInterrupt):
        train(0, tmp_path / "run", every=every, use_generator=use_generator, crash_at=crash_at)
    written = load_checkpoint(tmp_path / "run" / "last.pt")["trainer"]
    if every is None:
        assert (written["epoch"], written["batch_in_epoch"], written["global_step"]) == (1, 0, 3)
    else:
        assert (written["epoch"], written["batch_in_epoch"], written["global_step"]) == (1, 2, 4)

    # a fresh process state: other initial weights, other RNG seeds; the checkpoint decides
    resumed, trainer = train(
        99, tmp_path / "run", every=every, use_generator=use_generator, resume=True
    )
    assert trainer.global_step == 9 and trainer.epoch == 3
    assert trainer.batches_seen == ref_trainer.batches_seen == 15
    for (name, a), b in zip(
        reference.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_resume_without_restoring_the_rng_would_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guard for the test above: the run really depends on the restored RNG states."""
    reference, _ = train(0, tmp_path / "ref", every=2, use_generator=False)
    with pytest.raises(KeyboardInterrupt):
        train(0, tmp_path / "run", every=2, use_generator=False, crash_at=5)
    monkeypatch.setattr("ppetrace.training._resume.restore_rng", lambda *args: None)
    resumed, _ = train(99, tmp_path / "run", every=2, use_generator=False, resume=True)
    assert not all(
        torch.equal(a, b) for a, b in zip(reference.parameters(), resumed.parameters(), strict=True)
    )


def test_checkpoint_holds_model_optimizer_scheduler_rng_and_counters(tmp_path: Path) -> None:
    model, trainer = train(0, tmp_path, every=None, use_generator=True)
    state = load_checkpoint(tmp_path / "last.pt")
    assert state["format"] == "ppetrace.checkpoint" and state["version"] == 1
    for key, value in model.state_dict().items():
        assert torch.equal(state["module"][key], value)
    optimization = state["optimization"]
    assert optimization["optimizers"][0]["state"][0]["step"] == 9
    assert optimization["schedulers"][0]["last_epoch"] == 9
    assert optimization["scaler"] is None
    assert state["trainer"] | {"epoch_rng": None} == {
        "epoch": 3,
        "global_step": 9,
        "batch_in_epoch": 0,
        "batches_seen": 15,
        "epoch_rng": None,
    }
    assert set(state["rng"]) >= {"torch", "python", "numpy", "generators"}
    assert len(state["rng"]["generators"]) == 1
    assert trainer.checkpoint_path == tmp_path / "last.pt"


def test_rng_capture_and_restore_round_trip() -> None:
    gen = torch.Generator().manual_seed(5)
    state = capture_rng([gen])
    first = (torch.rand(3), random.random(), float(np.random.rand()), torch.rand(2, generator=gen))
    restore_rng(state, [gen])
    again = (torch.rand(3), random.random(), float(np.random.rand()), torch.rand(2, generator=gen))
    assert torch.equal(first[0], again[0]) and torch.equal(first[3], again[3])
    assert first[1:3] == again[1:3]
    with pytest.raises(CheckpointError, match=r"Expected 1 DataLoader generator\(s\)"):
        restore_rng(state, [])


def test_loader_generators_are_found_once() -> None:
    gen = torch.Generator()
    loader = DataLoader(NoisyData(), batch_size=2, shuffle=True, generator=gen)
    assert loader_generators(loader) == [gen]
    assert loader_generators(DataLoader(NoisyData(), batch_size=2)) == []


def test_a_full_disk_names_the_file_and_the_cause_and_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train(0, tmp_path, every=None, use_generator=False)
    target = tmp_path / "last.pt"
    before = target.read_bytes()

    def torn_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError) as caught:
        train(0, tmp_path, every=None, use_generator=False)
    assert caught.value.errno == errno.ENOSPC
    assert re.search(
        rf"Could not write the checkpoint '{re.escape(str(target))}': No space left on device "
        r"\(errno 28\)\. The previous checkpoint there is intact and the temporary file was "
        r"removed; free some space",
        str(caught.value),
    ), str(caught.value)
    assert target.read_bytes() == before
    assert load_checkpoint(target)["trainer"]["global_step"] == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # no temporary file left


def test_the_temporary_file_is_created_exclusively_never_through_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    target = tmp_path / "ckpt" / "last.pt"
    target.parent.mkdir()
    planted = target.with_name(".last.pt.tmp-planted")
    planted.symlink_to(victim)
    names = iter([planted, target.with_name(".last.pt.tmp-fresh")])
    monkeypatch.setattr(_checkpoint, "_temp_name", lambda _target: next(names))
    save_atomic({"a": torch.ones(2)}, target)
    assert victim.read_text() == "keep me"  # the link was not followed
    assert planted.is_symlink()  # nor removed: it is not one of ours
    assert torch.equal(torch.load(target, weights_only=True)["a"], torch.ones(2))


def test_orphaned_temporary_files_of_killed_writes_are_removed_by_the_next_write(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = int(done.stdout)  # a process that has exited
    target = tmp_path / "last.pt"
    orphan = tmp_path / f".last.pt.tmp-{dead}-0a1b2c"
    orphan.write_bytes(b"half a checkpoint")
    alive = tmp_path / f".last.pt.tmp-{os.getppid()}-3d4e5f"  # a write still running
    alive.write_bytes(b"in progress")
    other = tmp_path / f".other.pt.tmp-{dead}-000000"  # another file's: not ours to remove
    other.write_bytes(b"x")
    save_atomic({"a": torch.zeros(1)}, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["last.pt", alive.name, other.name])


def test_save_atomic_replaces_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "x.pt"
    save_atomic({"a": torch.ones(2)}, path)
    save_atomic({"a": torch.zeros(2)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.zeros(2))
    assert [p.name for p in path.parent.iterdir()] == ["x.pt"]


def _fit_resuming(path: Path) -> torch.nn.Module:
    model = make_model(0)
    trainer = ppetrace.Trainer(progress=False)
    trainer.fit(
        model,
        DataLoader(NoisyData(), batch_size=4),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=torch.nn.functional.cross_entropy,
        resume_from=path,
    )
    return model


def test_missing_resume_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pt"
    with pytest.raises(
        FileNotFoundError,
        match=(
            r"^Expected a checkpoint file at resume_from='.*nope\.pt', but it does not exist\. "
            r"Pass the path of a checkpoint written by the Trainer \(checkpoint_dir/last\.pt\), "
            r"or start without resume_from\.$"
        ),
    ):
        _fit_resuming(missing)


def test_a_directory_as_resume_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError,
        match=(
            r"^Expected a checkpoint file at resume_from='.*', but it is a directory\. Pass the "
            r"path of the checkpoint file itself \(checkpoint_dir/last\.pt\)\.$"
        ),
    ):
        load_checkpoint(tmp_path)


def test_a_checkpoint_without_rng_states_names_the_file_and_the_entry(tmp_path: Path) -> None:
    train(0, tmp_path, every=None, use_generator=False)
    state = torch.load(tmp_path / "last.pt", weights_only=True)
    del state["rng"]
    incomplete = tmp_path / "no_rng.pt"
    torch.save(state, incomplete)
    with pytest.raises(
        CheckpointError,
        match=(
            r"^Expected the entries 'module', 'optimization', 'trainer', 'rng' in the checkpoint "
            r"'.*no_rng\.pt', but 'rng' is missing\. Resume from a checkpoint written by "
            r"ppetrace\.Trainer \(checkpoint_dir/last\.pt\), or start without resume_from\.$"
        ),
    ):
        _fit_resuming(incomplete)


def test_corrupt_resume_file_is_named_with_the_reason(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"this is not a zip archive")
    with pytest.raises(
        CheckpointError,
        match=r"Could not read the checkpoint '.*bad\.pt': .*The file is corrupt, truncated",
    ):
        _fit_resuming(bad)


def test_a_corrupt_pickle_gives_its_cause_without_torchs_weights_only_advice(
    tmp_path: Path,
) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")  # a pickle stream, not a zip: the weights-only unpickler fails
    with pytest.raises(CheckpointError) as caught:
        _fit_resuming(bad)
    message = str(caught.value)
    assert re.fullmatch(
        r"Could not read the checkpoint '.*bad\.pt': Unsupported operand \d+\. The file is "
        r"corrupt, truncated or not a torch checkpoint; resume from another checkpoint or "
        r"start without resume_from\.",
        message,
    ), message
    assert "weights_only" not in message and "\n" not in message


def test_truncated_checkpoint_is_reported_as_corrupt(tmp_path: Path) -> None:
    train(0, tmp_path, every=None, use_generator=False)
    full = (tmp_path / "last.pt").read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(full[: len(full) // 2])
    with pytest.raises(CheckpointError, match=r"Could not read the checkpoint '.*cut\.pt'"):
        _fit_resuming(cut)


def test_a_torch_file_that_is_not_a_checkpoint_is_rejected(tmp_path: Path) -> None:
    other = tmp_path / "weights.pt"
    torch.save({"weight": torch.ones(2)}, other)
    with pytest.raises(
        CheckpointError, match=r"Expected a ppetrace checkpoint in '.*weights\.pt', but it holds"
    ):
        _fit_resuming(other)


def test_a_checkpoint_of_another_model_does_not_fit(tmp_path: Path) -> None:
    train(0, tmp_path, every=None, use_generator=False)
    model = torch.nn.Linear(6, 3)
    trainer = ppetrace.Trainer(progress=False)
    with pytest.raises(CheckpointError, match=r"does not fit this run: RuntimeError: .*"):
        trainer.fit(
            model,
            DataLoader(NoisyData(), batch_size=4),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=torch.nn.functional.cross_entropy,
            resume_from=tmp_path / "last.pt",
        )
