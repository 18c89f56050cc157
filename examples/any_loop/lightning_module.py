"""A Lightning module, profiled two ways: ``ppetrace run`` with no code change, or
``LightningProfiler`` passed to the Lightning Trainer.

    ppetrace run examples/any_loop/lightning_module.py      # global hooks, no code change
    python examples/any_loop/lightning_module.py --profiler # Lightning's own actions

Under ``ppetrace run`` the global hooks trace Lightning's DataLoader fetches,
module calls, backward and optimizer steps like any loop. With ``--profiler``
Lightning reports its own actions to ``ppetrace.integrations.lightning.LightningProfiler``,
which names them as ppetrace's Trainer does (``run_training_batch`` is
``trainer.step``, ...), writes ``--trace`` and prints where it is. When both are on
(``ppetrace run ... --profiler``), the profiler takes precedence and the global
hooks stand aside, so nothing is traced twice. The data is generated here.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def synthetic(samples: int, features: int = 32, classes: int = 4, seed: int = 0) -> TensorDataset:
    """Gaussian inputs (drawn with ``seed``) labelled by one fixed random linear teacher."""
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(samples, features, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


class Classifier(L.LightningModule):
    """A small MLP classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_accuracy", (self(x).argmax(dim=1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Fit; return Lightning's logged metrics."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--profiler", action="store_true", help="use LightningProfiler")
    parser.add_argument("--trace", default="lightning_trace.json", help="with --profiler")
    args = parser.parse_args(argv)

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    profiler = None
    if args.profiler:
        from ppetrace.integrations.lightning import LightningProfiler

        profiler = LightningProfiler(args.trace)
    torch.manual_seed(0)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        profiler=profiler,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        Classifier(),
        DataLoader(synthetic(args.samples), batch_size=64, shuffle=True),
        DataLoader(synthetic(args.samples // 4, seed=1), batch_size=256),
    )
    metrics = {k: float(v) for k, v in trainer.logged_metrics.items()}
    print(f"val accuracy {metrics.get('val_accuracy', float('nan')):.3f}")
    return metrics


if __name__ == "__main__":
    main()
    sys.exit(0)
