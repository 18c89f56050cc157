"""The Trainer on a real CUDA device: float16 AMP with a GradScaler, movement, exact resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ppetrace

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def dataset(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 4, (n,), generator=g))


class Probe(ppetrace.ModuleInterface):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(64, 4)
        )
        self.seen: list[tuple[str, torch.dtype]] = []

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int) -> Any:
        return [torch.optim.Adam(self.parameters(), lr=1e-3)], []

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> Any:
        ds = dataset()
        return DataLoader(ds, batch_size=batch_size, sampler=sampler(ds))

    def get_val_dataloaders(self, sampler: Any, batch_size: int) -> Any:
        return None

    def train_step(self, global_step: int, batch: Any, device: Any) -> Any:
        x, y = batch
        logits = self.body(x)
        self.seen.append((x.device.type, logits.dtype))
        return F.cross_entropy(logits.float(), y)

    def val_step(self, global_step: int, batch: Any, device: Any) -> Any:
        return self.body(batch[0])


def test_amp_on_cuda_uses_float16_and_a_grad_scaler(tmp_path: Path) -> None:
    probe = Probe()
    trainer = ppetrace.Trainer(
        device="cuda", amp=True, max_epochs=2, checkpoint_dir=tmp_path, progress=False
    )
    trainer.fit(probe, batch_size=16)
    assert trainer.runtime is not None
    scaler = trainer.runtime.grad_scaler
    assert isinstance(scaler, torch.amp.GradScaler)
    assert set(probe.seen) == {("cuda", torch.float16)}
    assert next(probe.parameters()).device.type == "cuda"
    state = torch.load(tmp_path / "last.pt", weights_only=True)
    assert state["optimization"]["scaler"]["scale"] == scaler.get_scale()
    assert "cuda" in state["rng"]


def test_resume_on_cuda_is_bit_identical(tmp_path: Path) -> None:
    def run(seed: int, resume: bool, crash: int | None) -> torch.nn.Module:
        torch.manual_seed(seed)
        probe = Probe()

        class Crash(ppetrace.CallbackInterface):
            def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
                if global_step == crash:
                    raise KeyboardInterrupt

        trainer = ppetrace.Trainer(
            device="cuda",
            amp=True,
            max_epochs=2,
            checkpoint_dir=tmp_path / ("ref" if crash is None and not resume else "run"),
            checkpoint_every_n_steps=2,
            callbacks=[Crash()],
            progress=False,
        )
        torch.manual_seed(7)
        torch.cuda.manual_seed_all(7)
        trainer.fit(
            probe,
            batch_size=16,
            resume_from=tmp_path / "run" / "last.pt" if resume else None,
        )
        return probe

    reference = run(0, resume=False, crash=None)
    with pytest.raises(KeyboardInterrupt):
        run(0, resume=False, crash=5)
    resumed = run(1, resume=True, crash=None)
    for a, b in zip(reference.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
