"""What the profiler tests share: a stand-in Trainer and a loop driven as the Trainer drives
its profilers (imported by the ``test_profilers_*`` modules)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import ppetrace


class FakeTrainer:
    """The attributes profilers read from ``ppetrace.Trainer`` in ``setup``."""

    def __init__(self, exporter: Any = None, device: str = "cpu") -> None:
        self.trace_exporter = exporter
        self.runtime = SimpleNamespace(device_spec=device)
        self.global_step = 0
        self.epoch = 0


def run_steps(
    profilers: Iterable[Any], steps: Iterable[int], work: Callable[[int], Any], exporter: Any
) -> None:
    """The Trainer's contract: setup, step_begin / trainer.step span / step_end, teardown."""
    profilers = list(profilers)
    trainer = FakeTrainer(exporter)
    for p in profilers:
        p.setup(trainer)
    try:
        for step in steps:
            with ppetrace.trace("trainer.fetch_batch", {"ppetrace.batch_idx": step}):
                pass
            for p in profilers:
                p.step_begin(step)
            with ppetrace.trace("trainer.step", {"ppetrace.batch_idx": step}):
                work(step)
            for p in profilers:
                p.step_end(step)
    finally:
        for p in profilers:
            p.teardown()
        ppetrace.flush()
