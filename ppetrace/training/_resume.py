"""Resuming a fit: a checkpoint's state restored, and the epoch continued where it stopped.

A checkpoint written mid-epoch holds the RNG states at the start of that
epoch and at the moment of writing. :func:`start_iteration` replays the
epoch's shuffle with the first and skips the batches already trained, then
restores the second, so the resumed run is bit-identical.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ._checkpoint import CheckpointError, capture_rng, loader_generators, restore_rng
from ._run import Run, TrainerView

__all__ = ["CHECKPOINT_ENTRIES", "begin_epoch", "restore", "start_iteration"]

#: The entries of a checkpoint that :meth:`Trainer.fit` restores.
CHECKPOINT_ENTRIES = ("module", "optimization", "trainer", "rng")
_END = object()


def restore(self: TrainerView, run: Run, checkpoint: dict[str, Any], path: Any) -> None:
    """Load a checkpoint's module, optimization and counters into this fit."""
    missing = [key for key in CHECKPOINT_ENTRIES if key not in checkpoint]
    if missing:
        raise CheckpointError(
            f"Expected the entries {', '.join(map(repr, CHECKPOINT_ENTRIES))} in the "
            f"checkpoint {str(path)!r}, but {', '.join(map(repr, missing))} "
            f"{'is' if len(missing) == 1 else 'are'} missing. Resume from a checkpoint "
            "written by ppetrace.Trainer (checkpoint_dir/last.pt), or start without "
            "resume_from."
        )
    try:
        run.adapter.update_state(checkpoint["module"])
        run.optim.load_state_dict(checkpoint["optimization"])
        self.update_state(checkpoint["trainer"])
    except (KeyError, RuntimeError, ValueError, TypeError) as exc:
        raise CheckpointError(
            f"The checkpoint {str(path)!r} does not fit this run: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}. Resume with the "
            f"module, optimizers and schedulers it was written with."
        ) from exc
    run.resume_rng = checkpoint["rng"]
    if self.max_steps is not None and self.global_step >= self.max_steps:
        run.stop = True


def start_iteration(self: TrainerView, run: Run, loader: Iterable[Any]) -> Iterator[Any]:
    """``iter(loader)``, reproducible: the RNG is snapshotted (or, on resume, restored)."""
    from ..integrations.dataloader import trace_workers, tracked  # workers' spans too

    trace_workers(loader)
    skip = self._batch_in_epoch
    if not skip:
        self._epoch_rng = capture_rng(run.generators)
        return tracked(iter(loader))
    if self._epoch_rng is None or run.resume_rng is None:
        raise CheckpointError(
            "Expected the RNG states of the interrupted epoch in the checkpoint, but they "
            "are missing. Resume from a checkpoint written by ppetrace.Trainer."
        )
    restore_rng(self._epoch_rng, run.generators)
    it = tracked(iter(loader))
    for done in range(skip):
        if next(it, _END) is _END:
            raise CheckpointError(
                f"Expected at least {skip} batches in epoch {self.epoch} to skip to where the "
                f"checkpoint was written, but the loader yielded {done}. Resume with the "
                "same training data."
            )
    restore_rng(run.resume_rng, run.generators)
    run.resume_rng = None
    return it


def begin_epoch(self: TrainerView, run: Run, loader: Iterable[Any]) -> None:
    """Find the loader's generators; a run resumed at an epoch boundary restores the RNG."""
    run.generators = loader_generators(loader)
    if run.resume_rng is not None and self._batch_in_epoch == 0:
        restore_rng(run.resume_rng, run.generators)
        run.resume_rng = None
