"""Quickstart: train an MLP on synthetic data, print its loss and accuracy, write a Chrome
trace and print the step report.

    python examples/quickstart.py [--epochs 3] [--samples 4096] [--trace trace.json]

The data is generated here (a fixed random linear teacher labels Gaussian
inputs), so nothing is downloaded. Open the trace in Perfetto UI
(https://ui.perfetto.dev) or speedscope (https://www.speedscope.app).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ppetrace
from exporters import read_chrome_trace, render, step_report


def synthetic_classification(
    samples: int, features: int = 784, classes: int = 10, seed: int = 0
) -> TensorDataset:
    """Gaussian inputs (drawn from ``seed``) labelled by one fixed random linear teacher,
    the same for every ``seed``: a validation set from another seed has the same task."""
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(samples, features, generator=torch.Generator().manual_seed(seed))
    y = (x @ teacher).argmax(dim=1)
    return TensorDataset(x, y)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4096, help="training samples")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--trace", default="trace.json", help="where to write the Chrome trace")
    parser.add_argument("--format", default="table", choices=["table", "md", "csv", "json"])
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train = synthetic_classification(args.samples)
    val = synthetic_classification(max(args.samples // 4, args.batch_size), seed=1)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))

    trainer = ppetrace.Trainer(device="cpu", max_epochs=args.epochs, trace_path=args.trace)
    trainer.fit(
        model,
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        {"val": DataLoader(val, batch_size=256)},
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        loss_fn=nn.functional.cross_entropy,
    )

    model.eval()
    with torch.no_grad():
        for name, data in (("train", train), ("val", val)):
            x, y = data.tensors
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y).item()
            accuracy = (logits.argmax(dim=1) == y).float().mean().item()
            print(f"{name}: loss {loss:.3f}, accuracy {accuracy:.1%} (chance 10%)")
    print()

    report = step_report(read_chrome_trace(args.trace), warmup_steps=1)
    print(render(report, args.format))
    print(
        f"\nWrote {args.trace}: open it in Perfetto UI (https://ui.perfetto.dev) or speedscope (https://www.speedscope.app)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
