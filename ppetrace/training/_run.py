"""What one ``fit`` shares between the Trainer's loop methods, and the profiler contract.

:class:`Run` holds the adapter, runtime, optimization, callbacks, evaluator,
output collectors, per-batch runtime hooks and loss watch of one ``fit``;
:class:`StepProfiler` is what the Trainer drives around each training batch;
:func:`known_batch_sizes` and :func:`batch_size` give ``ppetrace.batch_size``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol, runtime_checkable

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from ..integrations._detail import StepDetail
from ..interfaces.module_interface import Stage
from ..profilers import SpanWrapper
from ..runtime._base import BaseRuntime
from ..runtime._convert import batch_size
from ..runtime._hooks import StepHooks
from ..tracing._recorder import trace
from ._adapters import Adapter, len_or_none
from ._callbacks import CallbackList
from ._collate import OutputCollector, to_host
from ._evaluator import Evaluator
from ._nonfinite import LossWatch, NonfiniteMode
from ._optim import Optimization
from ._placement import Placements
from ._progress import ProgressBar

__all__ = [
    "TRAIN",
    "Run",
    "StepProfiler",
    "TrainerView",
    "batch_size",
    "describe",
    "known_batch_sizes",
    "len_or_none",
    "run_cleanups",
]

_log = logging.getLogger("ppetrace")
TRAIN = Stage.TRAIN.label


@runtime_checkable
class StepProfiler(Protocol):
    """A profiler driven by the Trainer around each training batch.

    ``setup(trainer)`` runs at the start of ``fit`` (before the first epoch);
    ``step_begin(step)`` right before a batch's ``trainer.step`` span opens
    and ``step_end(step)`` right after it closes, where ``step`` counts the
    training batches completed before this one over the whole run (it
    continues after a resume); ``teardown()`` at the end of ``fit``, also
    when it raises.
    """

    def setup(self, trainer: Any) -> None: ...

    def step_begin(self, step: int) -> None: ...

    def step_end(self, step: int) -> None: ...

    def teardown(self) -> None: ...


class TrainerView(Protocol):
    """The Trainer as the loop's helpers (this module, ``_resume``, ``_session``) see it:
    the settings they read and the counters they update. :class:`~ppetrace.Trainer` is one."""

    epoch: int
    global_step: int
    max_steps: int | None
    profilers: list[StepProfiler]
    progress: bool
    progress_stream: IO[str] | None
    trace_path: str | os.PathLike[str] | None
    trace_exporter: Any
    last_trace_path: Path | None
    trace_paths: list[Path]
    _trace_calls: dict[str, int]
    _batch_in_epoch: int
    _batches_seen: int
    _epoch_rng: dict[str, Any] | None
    _progress_bar: Any

    def update_state(self, state: Mapping[str, Any]) -> None: ...


def known_batch_sizes(loader: Any) -> tuple[int, int, int] | None:
    """``(size, count, last)`` when ``loader``'s batch sizes are known before its batches
    arrive, else None.

    They are for a ``torch.utils.data.DataLoader`` with automatic batching
    (``batch_size`` set and its own ``BatchSampler``) over a dataset with a
    length: batches ``0 .. count-1`` hold ``size`` samples and a last one,
    if any, ``last`` (the remainder, unless ``drop_last``). The batch size
    is then the number of samples in the batch, whatever the collate
    function makes of them.
    """
    if not isinstance(loader, DataLoader):
        return None
    size = loader.batch_size
    sampler = loader.batch_sampler
    if (
        size is None
        or type(sampler) is not BatchSampler
        or sampler.batch_size != size
        or isinstance(loader.dataset, IterableDataset)
    ):
        return None
    try:
        samples = len(sampler.sampler)  # type: ignore[arg-type]
    except TypeError:
        return None
    return size, samples // size, 0 if sampler.drop_last else samples % size


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


class Run:
    """Everything one ``fit`` shares between the loop's methods."""

    def __init__(
        self,
        trainer: TrainerView,
        adapter: Adapter,
        runtime: BaseRuntime,
        optim: Optimization,
        callbacks: CallbackList,
        max_bytes: int,
        placements: Placements,
        nonfinite: NonfiniteMode = "warn",
    ) -> None:
        self.trainer = trainer
        self.adapter = adapter
        self.runtime = runtime
        self.optim = optim
        self.callbacks = callbacks
        #: the placed parts of the module, each with its runtime (``_placement``)
        self.placements = placements
        #: the per-batch runtime hooks, resolved once (``ppetrace.runtime._hooks``)
        self.hooks = StepHooks(runtime, placements, "train_pre_step", "train_post_step")
        #: finds the first non-finite loss (``_nonfinite``)
        self.watch = LossWatch(nonfinite)
        self.rt_attrs = runtime.span_attributes
        self.evaluator = Evaluator._for_run(
            adapter, runtime, Stage.VAL, callbacks, max_bytes, placements
        )
        self.group = (
            OutputCollector(max_bytes, what="on_end_train_step")
            if callbacks.wants("on_end_train_step")
            else None
        )
        self.epoch_outputs = (
            OutputCollector(max_bytes, what="on_end_train_epoch")
            if callbacks.wants("on_end_train_epoch")
            else None
        )
        self.collect = self.group is not None or self.epoch_outputs is not None
        self.wants_end_backward = callbacks.wants("on_end_backward")
        self.progress: ProgressBar | None = None
        self.stop = False
        #: the global step at which the current epoch began
        self.epoch_first_step = 0
        self.last_val_step = -1
        self.resume_rng: dict[str, Any] | None = None
        self.generators: list[torch.Generator] = []
        # current step, for a network's scale_loss
        self.attrs: Mapping[str, Any] = {}
        self.divisor = 1
        self.last_loss: Any = None
        #: which steps the trace keeps in full (``trace_detail``); None: every step
        self.detail: StepDetail | None = None
        #: opens the spans of device work (trainer.step, module.train_step, trainer.backward,
        #: trainer.optimizer_step); a profiler may replace it with a drop-in for ``trace``
        self.open_span: Callable[[str, Any], contextlib.AbstractContextManager[Any]] = trace
        for prof in trainer.profilers:
            if isinstance(prof, SpanWrapper):  # e.g. profilers.CudaTimer: device time
                self.open_span = self.evaluator.open_span = prof.span
                break

    def attrs_now(self) -> dict[str, Any]:
        """Span attributes for the current counters (epoch-level spans)."""
        t = self.trainer
        return {
            "ppetrace.epoch": t.epoch,
            "ppetrace.step": t.global_step,
            "ppetrace.stage": TRAIN,
            **self.rt_attrs,
        }

    def add_outputs(self, outs: tuple[Any, ...]) -> None:
        host = to_host(outs)
        if self.group is not None:
            self.group.add(host, on_host=True)
        if self.epoch_outputs is not None:
            self.epoch_outputs.add(host, on_host=True)

    def network_backward(self, loss: torch.Tensor) -> NetworkBackward:
        """``scale_loss`` inside a network's closure: the ``trainer.backward`` span
        (:class:`NetworkBackward`)."""
        return NetworkBackward(self, loss)


class NetworkBackward:
    """``with scale_loss(loss, ...) as scaled:`` inside a network's closure, under a fit.

    The block is the ``trainer.backward`` span; it yields the loss divided by
    the accumulation group and scaled by the GradScaler. The closure runs
    inside the forward's autocast; the backward does not. When the block
    succeeds, the loss becomes the run's last loss and ``on_end_backward``
    callbacks run inside the span; an exception ends the span with ERROR
    status and propagates unchanged.
    """

    __slots__ = ("_run", "_loss", "_span", "_no_autocast", "_divided")

    def __init__(self, run: Run, loss: torch.Tensor) -> None:
        self._run = run
        self._loss = loss
        self._no_autocast: Any = None

    def __enter__(self) -> torch.Tensor:
        run = self._run
        runtime = run.runtime
        span = self._span = run.open_span("trainer.backward", run.attrs)
        span.__enter__()
        try:
            if runtime.autocast_enabled:
                self._no_autocast = torch.autocast(runtime.device_type, enabled=False)
                self._no_autocast.__enter__()
            divided, scaled = run.optim.scaled(self._loss, run.divisor)
        except BaseException as exc:
            self._close(type(exc), exc, exc.__traceback__)
            raise
        self._divided = divided
        return scaled

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            run = self._run
            try:
                run.last_loss = self._loss
                if run.wants_end_backward:
                    run.callbacks.call(
                        "on_end_backward", run.attrs, run.trainer.global_step, self._divided
                    )
            except BaseException as err:
                self._close(type(err), err, err.__traceback__)
                raise
        self._close(exc_type, exc, tb)

    def _close(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._no_autocast is not None:
                self._no_autocast.__exit__(exc_type, exc, tb)
        finally:
            self._span.__exit__(exc_type, exc, tb)


def run_cleanups(steps: list[Callable[[], None]], failing: bool) -> None:
    """Run every cleanup step; errors are logged while an exception is in flight, else raised."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except Exception as exc:
            if failing:
                _log.exception("ppetrace: cleanup step %r failed during an exception", step)
            elif first is None:
                first = exc
    if first is not None:
        raise first
