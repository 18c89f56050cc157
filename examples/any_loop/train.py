"""A plain PyTorch training loop, with no ppetrace in it: profile it with one command.

    ppetrace run examples/any_loop/train.py [--epochs 3] [--samples 4096]

``ppetrace run`` runs this file as ``__main__`` with global hooks on the
DataLoader, the modules, backward and the optimizer, writes a Chrome trace
(``ppetrace-train-<time>.json``; ``--trace PATH`` to choose) and prints the step
report when it ends. Run it with plain ``python`` and it trains the same, untraced.

The loop is what people write by hand: a DataLoader of generated data (a random
linear teacher labels Gaussian inputs; nothing is downloaded), forward, loss,
backward, ``opt.step()``, and an evaluation pass under ``torch.no_grad()`` after
each epoch, which the report keeps apart from the training steps.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def synthetic(samples: int, features: int = 784, classes: int = 10, seed: int = 0) -> TensorDataset:
    """Gaussian inputs (drawn with ``seed``) labelled by one fixed random linear teacher."""
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(samples, features, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def main(argv: Sequence[str] | None = None) -> float:
    """Train, evaluate after each epoch; return the last accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train = DataLoader(
        synthetic(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
    )
    val = DataLoader(synthetic(args.samples // 4, seed=1), batch_size=256)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    accuracy = 0.0
    for epoch in range(args.epochs):
        model.train()
        for x, y in train:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in val:
                correct += int((model(x).argmax(dim=1) == y).sum())
                total += len(y)
        accuracy = correct / total
        print(f"epoch {epoch}: loss {loss.item():.3f}, val accuracy {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    main()
    sys.exit(0)
