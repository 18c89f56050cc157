"""Every track in one trace: hook spans, Python stacks, torch ops, counters, device time.

    python examples/all_tracks.py [--out all_tracks] [--tiny] [--device cuda]

Trains an MLP on synthetic data with ``ppetrace.Trainer`` and all of ppetrace's
deep profilers on one schedule (skip 2 steps, warm up 1, record 3). The
result, in ``--out``:

- ``trace.json``: the Chrome trace. Open it in https://ui.perfetto.dev: the
  training thread has the hook spans; beside it, "python (sampled)" has
  pyinstrument's stacks, "torch ops: ..." has the operators (and, on GPU,
  "torch GPU ..." the kernels), "cuda device time" the device time of the
  step spans (on GPU), and the counter tracks CPU %, RSS and CUDA memory.
- ``trace_profiles/``: each window's pyinstrument HTML page and speedscope
  file and the Kineto trace.

It prints the step report, which includes the ``top_functions`` table that
Pyinstrument stored in the trace.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ppetrace
from exporters import load_chrome_trace, read_chrome_trace, render, step_report
from ppetrace.profilers import CudaTimer, Pyinstrument, Schedule, SystemCounters, TorchProfiler


def synthetic_classification(samples: int, features: int, classes: int = 10) -> TensorDataset:
    """Gaussian inputs labelled by a fixed random linear teacher."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=gen)
    y = (x @ torch.randn(features, classes, generator=gen)).argmax(dim=1)
    return TensorDataset(x, y)


def track_names(path: Path) -> list[str]:
    """The thread tracks of a Chrome trace, and one ``counter: <name>`` per counter."""
    events = load_chrome_trace(path).events
    threads = [
        str(e["args"]["name"])
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    ]
    counters = sorted({str(e["name"]) for e in events if e.get("ph") == "C"})
    return threads + [f"counter: {c}" for c in counters]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="all_tracks", help="output directory")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and few steps")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    features, hidden, samples = (16, 32, 8 * 16) if args.tiny else (784, 256, 64 * 40)
    batch = 16 if args.tiny else 64
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    schedule = Schedule(skip_first=2, wait=0, warmup=1, active=3)
    pyinstrument = Pyinstrument(interval=0.0005, schedule=schedule, top=10)
    profilers = [
        pyinstrument,
        TorchProfiler(schedule=schedule, record_shapes=True),
        CudaTimer(),  # device time of every step span on CUDA; off on CPU
        SystemCounters(schedule=schedule),
    ]
    trace_path = out / "trace.json"
    trainer = ppetrace.Trainer(
        device=args.device,
        max_epochs=1,
        val_every_n_epochs=None,
        progress=False,
        trace_path=trace_path,
        profilers=profilers,
    )
    trainer.fit(
        model,
        DataLoader(synthetic_classification(samples, features), batch_size=batch),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss_fn=nn.functional.cross_entropy,
    )

    report = step_report(read_chrome_trace(trace_path), warmup_steps=1)
    # the top_functions table is stored in the trace by Pyinstrument: the report shows it
    print(render(report, "table"))
    print("Tracks in the trace:")
    for name in track_names(trace_path):
        print(f"  {name}")
    files = sorted(p for p in out.rglob("*") if p.is_file())
    print("Files:")
    for path in files:
        print(f"  {path}")
    print(
        f"\nOpen {trace_path} in Perfetto UI (https://ui.perfetto.dev) or speedscope (https://www.speedscope.app)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
