"""A 2-rank DDP run of the MLP on CPU: ppetrace's Trainer with traces against a hand-written
DDP loop doing the same.

Budget (issue 15): the traced Trainer <= 1.10x the hand loop.

``python benchmarks/bench_ddp.py [--steps 200] [--rounds 7] [--json out.json]`` starts
``torchrun --standalone --nproc_per_node 2`` on itself (gloo, loopback, one torch thread
per rank). Every rank builds the same MLP (784-256-10, batch 64, SGD, cross-entropy) and
the same data, then runs ``rounds`` rounds of both variants, the order alternating:

- ``hand``: ``DistributedDataParallel``, a ``DataLoader`` with a ``DistributedSampler``
  (``set_epoch`` each epoch), forward, loss, backward, ``opt.step()``,
  ``opt.zero_grad(set_to_none=True)``;
- ``ppetrace``: ``ppetrace.Trainer(trace_path=...)`` on a plain ``DataLoader(shuffle=True)``
  (which the Trainer re-creates with a DistributedSampler), every hook a span, each rank
  writing its trace file, the clock measured at start and end, rank 0 merging the files.

The timed region of a variant is everything from building it (DDP wrapper, Trainer)
to the end of its last step (for the Trainer: the end of ``fit``, rank 0's merge
included), on each rank between two barriers; a round's time is the slower rank's.
The figure is the median over rounds of the paired ratio ppetrace / hand, with a
bootstrap 95% interval. The machine is shared: the lead re-measures on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUDGET = 1.10


def _worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import ppetrace

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    steps, batch = args.steps, 64
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(steps * batch * world, 784, generator=g),
        torch.randint(0, 10, (steps * batch * world,), generator=g),
    )

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
        )

    def hand(tmp: Path) -> None:
        ddp = DistributedDataParallel(model())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        sampler = DistributedSampler(data, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=batch, sampler=sampler)
        sampler.set_epoch(0)
        for x, y in loader:
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def traced(tmp: Path) -> None:
        m = model()
        ppetrace.Trainer(
            max_epochs=1, progress=False, val_every_n_epochs=None, trace_path=tmp / "trace.json"
        ).fit(
            m,
            DataLoader(data, batch_size=batch, shuffle=True),
            optimizer=torch.optim.SGD(m.parameters(), lr=0.01),
            loss_fn=F.cross_entropy,
        )

    variants = {"hand": hand, "ppetrace": traced}
    times: dict[str, list[float]] = {k: [] for k in variants}
    shared = Path(args.out).parent / "ddp-traces"  # the launcher's temporary folder
    for r in range(args.rounds + 1):  # round 0 warms up, untimed
        order = list(variants) if r % 2 else list(reversed(variants))
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            variants[name](shared / f"{name}{r}")
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if r:
                times[name].append(float(elapsed))
    if rank == 0:
        hand_t, traced_t = np.array(times["hand"]), np.array(times["ppetrace"])
        ratios = traced_t / hand_t
        rng = np.random.default_rng(0)
        picks = rng.integers(0, len(ratios), (2000, len(ratios)))
        lo, hi = np.percentile(np.median(ratios[picks], axis=1), [2.5, 97.5])
        result = {
            "ranks": world,
            "steps_per_rank": steps,
            "rounds": args.rounds,
            "hand_ms_per_step": float(np.median(hand_t)) / steps * 1e3,
            "ppetrace_ms_per_step": float(np.median(traced_t)) / steps * 1e3,
            "ratio_paired_median": float(np.median(ratios)),
            "ratio_ci95": [float(lo), float(hi)],
            "ratios": ratios.tolist(),
            "budget": BUDGET,
            "pass": float(np.median(ratios)) <= BUDGET,
            "load_average": os.getloadavg(),
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per rank and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", "2", __file__, "--worker", "--out", str(out),
            "--steps", str(args.steps), "--rounds", str(args.rounds),
        ]  # fmt: skip
        subprocess.run(command, env=env, check=True)
        result = json.loads(out.read_text())
    lo, hi = result["ratio_ci95"]
    print(
        f"2-rank DDP, MLP 784-256-10, batch 64, {result['steps_per_rank']} steps per rank, "
        f"{result['rounds']} rounds (gloo, CPU, 1 thread per rank)"
    )
    print(
        f"  hand DDP loop        : {result['hand_ms_per_step']:.3f} ms/step (median round)\n"
        f"  ppetrace.Trainer+trace: {result['ppetrace_ms_per_step']:.3f} ms/step (median round)\n"
        f"  ratio (paired median): {result['ratio_paired_median']:.3f}x "
        f"(95% CI {lo:.3f}-{hi:.3f}), budget <= {BUDGET:.2f}x: "
        f"{'PASS' if result['pass'] else 'FAIL'}\n"
        f"  load average: {result['load_average']}"
    )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
