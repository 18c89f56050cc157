"""PyMarlin-style training: a ``ppetrace.ModuleInterface`` that owns its data and optimizers.

    python examples/pymarlin_style.py [--epochs 3] [--samples 4096] [--trace trace.json]

The module supplies its loaders (``get_train_dataloader``/``get_val_dataloaders``),
its optimizer and a warmup scheduler (``get_optimizers_schedulers``), its step
recipes, and it is its own callback: it averages the training loss per epoch
and measures accuracy on two named validation sets. The data are synthetic
(Gaussian blobs, one per class), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import ppetrace


def blobs(samples: int, features: int, classes: int, seed: int) -> TensorDataset:
    """Gaussian blobs around fixed class centres (the same centres for every seed)."""
    centres = torch.randn(classes, features, generator=torch.Generator().manual_seed(1234)) * 2
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (samples,), generator=gen)
    x = centres[y] + torch.randn(samples, features, generator=gen)
    return TensorDataset(x, y)


class BlobClassifier(ppetrace.ModuleInterface):
    """An MLP classifier that brings its own data, optimizer, scheduler and metrics."""

    def __init__(self, samples: int, features: int = 32, classes: int = 5, lr: float = 0.05):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, classes))
        self.lr = lr
        self.train_set = blobs(samples, features, classes, seed=0)
        val_samples = max(samples // 4, 8)
        x, y = blobs(val_samples, features, classes, seed=2).tensors
        self.val_sets = {
            "clean": blobs(val_samples, features, classes, seed=1),
            "shifted": TensorDataset(x + 0.5, y),  # a second, harder validation set
        }
        self.history: dict[str, list[Any]] = {"train_loss": [], "val_acc": []}
        #: prints above the progress bar once main() sets it to trainer.print
        self.log: Callable[..., None] = print

    # -- data and optimization ---------------------------------------------------

    def get_train_dataloader(self, sampler: type[Sampler[Any]], batch_size: int) -> DataLoader[Any]:
        return DataLoader(
            self.train_set,
            batch_size=batch_size,
            sampler=sampler(self.train_set),  # type: ignore[call-arg]
        )

    def get_val_dataloaders(
        self, sampler: type[Sampler[Any]], batch_size: int
    ) -> dict[str, DataLoader[Any]]:
        return {
            name: DataLoader(ds, batch_size=batch_size, sampler=sampler(ds))  # type: ignore[call-arg]
            for name, ds in self.val_sets.items()
        }

    def get_optimizers_schedulers(
        self, estimated_global_steps_per_epoch: int, epochs: int
    ) -> tuple[list[torch.optim.Optimizer], list[Any]]:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        warmup = max(1, estimated_global_steps_per_epoch // 2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
        return [opt], [sched]

    # -- steps ---------------------------------------------------------------------

    def train_step(self, global_step: int, batch: Any, device: Any) -> Any:
        x, y = batch
        logits = self.net(x)
        return nn.functional.cross_entropy(logits, y), logits

    def val_step(self, global_step: int, batch: Any, device: Any) -> Any:
        x, y = batch
        return self.net(x).argmax(dim=1), y

    # -- callbacks (the module is its own callback) --------------------------------

    def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
        losses = outputs[0]  # one loss per step, collated on dim 0
        self.history["train_loss"].append(float(losses.mean()))

    def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str = "default") -> None:
        preds, labels = outputs
        acc = float((preds == labels).float().mean())
        self.history["val_acc"].append((key, acc))
        self.log(f"step {global_step:5d}  val[{key}] accuracy {acc:.3f}")


def main(argv: Sequence[str] | None = None) -> dict[str, list[Any]]:
    """Train; returns the module's history (per-epoch train loss, per-loader accuracy)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4096, help="training samples")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--trace", default=None, help="write a Chrome trace here")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    module = BlobClassifier(args.samples)
    trainer = ppetrace.Trainer(
        device=args.device,
        max_epochs=args.epochs,
        grad_accumulation=2,
        clip_grad_norm=5.0,
        checkpoint_dir=args.checkpoint_dir,
        trace_path=args.trace,
        progress=not args.no_progress,
    )
    module.log = trainer.print  # callbacks print above the progress bar
    trainer.fit(module, batch_size=args.batch_size, val_batch_size=256)
    for epoch, loss in enumerate(module.history["train_loss"]):
        print(f"epoch {epoch}: mean train loss {loss:.4f}")
    if args.trace:
        print(
            f"Wrote {args.trace}: open it in Perfetto UI (https://ui.perfetto.dev) or speedscope (https://www.speedscope.app)."
        )
    return module.history


if __name__ == "__main__":
    main()
    sys.exit(0)
