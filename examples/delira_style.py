"""delira-style training: a ``ppetrace.AbstractPyTorchNetwork`` with a custom ``closure``.

    python examples/delira_style.py [--epochs 3] [--samples 2048] [--trace trace.json]

The loader yields delira's dict batches of NumPy arrays (``{"data": ...,
"label": ...}``); ``prepare_batch`` turns them into tensors on the device;
``closure`` computes the losses and metrics given as dicts and back-propagates
inside ``scale_loss``. Under the Trainer, with this one optimizer, the
``optimizer.step()`` and ``zero_grad()`` written in the closure are deferred to
its accumulation boundary (a closure that steps several optimizers, a GAN,
steps them in place, as delira does), and ``scale_loss`` applies the Trainer's
GradScaler (with ``--amp`` on CUDA). The data are synthetic (a noisy linear
regression).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ppetrace
from ppetrace import scale_loss


class Regression(Dataset[dict[str, np.ndarray]]):
    """``y = x @ w + noise`` as delira-style dict samples of NumPy arrays."""

    def __init__(self, samples: int, features: int = 16, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        w = np.random.default_rng(1234).normal(size=(features, 1)).astype(np.float32)
        self.x = rng.normal(size=(samples, features)).astype(np.float32)
        self.y = (self.x @ w + 0.1 * rng.normal(size=(samples, 1))).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"data": self.x[i], "label": self.y[i]}


class Regressor(ppetrace.AbstractPyTorchNetwork):
    """A two-layer MLP regressor; its init kwargs are recorded in ``init_kwargs``."""

    def __init__(self, features: int = 16, hidden: int = 32) -> None:
        super().__init__(features=features, hidden=hidden)
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @staticmethod
    def closure(
        model: ppetrace.AbstractPyTorchNetwork,
        data_dict: dict[str, Any],
        optimizers: Mapping[str, Any],
        losses: Mapping[str, Any],
        metrics: Mapping[str, Any] = {},
        fold: int = 0,
        **kwargs: Any,
    ) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
        with torch.enable_grad() if optimizers else torch.no_grad():
            preds = model(data_dict["data"])
            loss_vals = {key: fn(preds, data_dict["label"]) for key, fn in losses.items()}
            total = sum(loss_vals.values())
        if optimizers:
            optimizers["default"].zero_grad()
            with scale_loss(total, optimizers["default"]) as scaled:
                scaled.backward()
            optimizers["default"].step()
        with torch.no_grad():
            metric_vals = {key: fn(preds, data_dict["label"]) for key, fn in metrics.items()}
        detached = {key: value.detach() for key, value in loss_vals.items()}
        return metric_vals, detached, [preds.detach()]


class History(ppetrace.CallbackInterface):
    """Collects the validation error per epoch from the collated predictions."""

    def __init__(self, val: Regression, log: Callable[..., None] = print) -> None:
        self.log = log  # trainer.print: above the progress bar
        self.targets = torch.from_numpy(val.y)
        self.val_mse: list[float] = []

    def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str = "default") -> None:
        (preds,) = outputs
        mse = float(((preds - self.targets) ** 2).mean())
        self.val_mse.append(mse)
        self.log(f"step {global_step:5d}  val[{key}] mse {mse:.4f}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train; returns ``{"val_mse": [...per epoch], "init_kwargs": {...}}``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048, help="training samples")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--trace", default=None, help="write a Chrome trace here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train, val = Regression(args.samples, seed=0), Regression(max(args.samples // 4, 8), seed=1)
    net = Regressor()
    history = History(val)
    trainer = ppetrace.Trainer(
        device=args.device,
        max_epochs=args.epochs,
        amp=args.amp,
        scheduler_interval="epoch",
        callbacks=[history],
        trace_path=args.trace,
        progress=not args.no_progress,
    )
    history.log = trainer.print  # the callback prints above the progress bar
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    trainer.fit(
        net,
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(val, batch_size=256),
        optimizer={"default": optimizer},
        loss_fn={"mse": nn.functional.mse_loss},
        metrics={"mae": lambda p, t: (p - t).abs().mean()},
        schedulers=[torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)],
    )
    if args.trace:
        print(
            f"Wrote {args.trace}: open it in Perfetto UI (https://ui.perfetto.dev) or speedscope (https://www.speedscope.app)."
        )
    return {"val_mse": history.val_mse, "init_kwargs": net.init_kwargs}


if __name__ == "__main__":
    main()
    sys.exit(0)
