"""The CI benchmark step: a short traced training run that writes a Chrome trace.

    python examples/ci/bench_step.py --out cand.json [--steps 200] [--warmup-steps 20]

It trains a 784-256-10 MLP on synthetic data (nothing is downloaded) with
``ppetrace.Trainer(trace_path=...)`` for a fixed number of steps, on one torch
thread so that runs on a CI machine are comparable, and prints the step report.
The trace records its environment (Python, torch, CPU, threads, device).

The workflow ``.github/workflows/ppetrace-bench.yml`` runs it for the base and
the head revision of a pull request, interleaved on one runner
(``examples/ci/ab_runs.py``), and compares the runs as runs::

    ppetrace compare runs/base runs/cand --warmup 20 --format md --output comment.md

``ppetrace compare`` exits with 1 on a gated regression (``trainer.step`` or ``step.wall``),
which fails the job; the Markdown becomes the pull request comment.
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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, but received {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark training, write the trace to ``--out``, print the report; return 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="trace.json", help="the Chrome trace to write")
    parser.add_argument("--steps", type=_positive, default=200, help="training steps")
    parser.add_argument("--batch-size", type=_positive, default=64)
    parser.add_argument("--hidden", type=_positive, default=256, help="hidden units of the MLP")
    parser.add_argument(
        "--warmup-steps", type=int, default=20, help="steps the printed report leaves out"
    )
    parser.add_argument("--threads", type=_positive, default=1, help="torch threads")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n = args.steps * args.batch_size
    x = torch.randn(n, 784)
    y = torch.randint(0, 10, (n,))
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size)
    model = nn.Sequential(nn.Linear(784, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))

    trainer = ppetrace.Trainer(
        device="cpu", max_epochs=1, val_every_n_epochs=None, progress=False, trace_path=args.out
    )
    trainer.fit(
        model,
        loader,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        loss_fn=nn.functional.cross_entropy,
    )
    warmup = min(max(args.warmup_steps, 0), args.steps - 1)
    print(render(step_report(read_chrome_trace(args.out), warmup_steps=warmup), top=10))
    print(f"\nWrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
