"""What one ``fit`` shares between the Trainer's loop methods, and the profiler contract.

:class:`Run` holds the adapter, runtime, optimization, callbacks, evaluator and
output collectors of one ``fit``; :class:`StepProfiler` is what the Trainer
drives around each training batch.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

import torch

from ..interfaces.module_interface import Stage
from ..profilers import SpanWrapper
from ..runtime._base import BaseRuntime
from ..tracing._recorder import trace
from ._adapters import Adapter
from ._callbacks import CallbackList
from ._collate import OutputCollector, to_host
from ._evaluator import Evaluator
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

    def update_state(self, state: Mapping[str, Any]) -> None: ...


def batch_size(batch: Any) -> int | None:
    """The leading dimension of the batch's first tensor, if it has one."""
    first = batch
    kind = type(batch)
    if kind is tuple or kind is list:
        first = batch[0] if batch else None
    elif kind is dict:
        first = next(iter(batch.values()), None)
    if isinstance(first, torch.Tensor) and first.ndim:
        return int(first.shape[0])
    return None


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def len_or_none(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


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
    ) -> None:
        self.trainer = trainer
        self.adapter = adapter
        self.runtime = runtime
        self.optim = optim
        self.callbacks = callbacks
        #: the placed parts of the module, each with its runtime (``_placement``)
        self.placements = placements
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
        self.attrs: dict[str, Any] = {}
        self.divisor = 1
        self.last_loss: Any = None
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

    @contextlib.contextmanager
    def network_backward(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        """``scale_loss`` inside a network's closure: the ``trainer.backward`` span.

        The closure runs inside the forward's autocast; the backward does not.
        """
        attrs = self.attrs
        runtime = self.runtime
        no_autocast = (
            torch.autocast(runtime.device_type, enabled=False)
            if runtime.autocast_enabled
            else contextlib.nullcontext()
        )
        with self.open_span("trainer.backward", attrs), no_autocast:
            divided, scaled = self.optim.scaled(loss, self.divisor)
            yield scaled
            self.last_loss = loss
            if self.wants_end_backward:
                self.callbacks.call("on_end_backward", attrs, self.trainer.global_step, divided)


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
