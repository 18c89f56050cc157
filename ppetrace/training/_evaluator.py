"""The Evaluator: validation and test loops under ``torch.no_grad()``, traced.

For each named loader, in order::

    evaluator.run                      (ppetrace.loader = the name)
      evaluator.loader_start           iter(loader): the workers' start
      each batch: evaluator.fetch_batch, the wait on the loader, then evaluator.step
        runtime.eval_pre_step(evaluator, module, batch_idx, batch)
        runtime.convert_batch(batch)
        module.val_step / module.test_step
        runtime.eval_post_step(evaluator, module, batch_idx, batch, outs)
      evaluator.loader_end             the iterator let go: the workers' shutdown
    callback.on_end_val_epoch(global_step, *outputs, key=name)   (validation only)

``eval_post_step`` receives the batch that ``eval_pre_step`` received (before
``convert_batch``), as in ppe; each placed part of the module gets the
``eval_*`` hooks of its own runtime (``_placement``). ``max_batches`` caps
the batches of each loader (PyMarlin's ``max_val_steps_per_epoch``).
The module is in eval mode during the loop and gets its previous mode back
afterwards. Outputs are collated (detached, on the CPU, concatenated on dim 0,
bounded by ``max_collated_bytes``) when they are returned or a callback
overrides ``on_end_val_epoch``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..interfaces.module_interface import Stage
from ..runtime._base import BaseRuntime
from ..runtime._hooks import PROFILER_FLAGS, StepHooks, reusable
from ..runtime._registry import make_runtime
from ..tracing import FrozenAttributes
from ..tracing._recorder import trace
from ._adapters import Adapter, Loaders, NetworkAdapter, len_or_none, make_adapter
from ._callbacks import CallbackList
from ._collate import DEFAULT_MAX_COLLATED_BYTES, OutputCollector
from ._optim import check_positive_int
from ._placement import Placements, place

__all__ = ["Evaluator"]

_END = object()


class Evaluator:
    """Runs a module over named validation or test loaders, one ``evaluator.step`` span per batch.

    Args:
        module: a :class:`~ppetrace.ModuleInterface`, an
            :class:`~ppetrace.AbstractPyTorchNetwork` or a plain ``nn.Module``
            (whose batches are ``(inputs, targets)`` pairs or input tensors).
        loaders: one loader or a dict of named loaders; ``None`` asks a
            ModuleInterface for its own (``get_val_dataloaders`` or
            ``get_test_dataloaders``).
        device: a device string or a runtime instance; the module is moved
            with :func:`ppetrace.to` (unless parts of it were placed already,
            see ``_placement``).
        stage: ``Stage.VAL`` (default) or ``Stage.TEST``.
        loss_fn: for a plain module, adds the loss as the first output; for a
            network, the losses dict its closure computes.
        metrics: a network's metrics dict.
        callbacks: callbacks besides the module itself; ``on_end_val_epoch``
            runs once per loader during validation.
        max_collated_bytes: the bound on the outputs kept per loader.
        batch_size: the batch size a ModuleInterface builds its loaders with.
        max_batches: run at most this many batches of each loader (``None``: all).

    Runtime hooks see it as ppe's evaluator: ``evaluator.models`` is
    ``{"main": module}``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        loaders: Any = None,
        *,
        device: str | torch.device | BaseRuntime = "cpu",
        stage: Stage | str = Stage.VAL,
        loss_fn: Any = None,
        metrics: Any = None,
        callbacks: Iterable[object] = (),
        max_collated_bytes: int = DEFAULT_MAX_COLLATED_BYTES,
        batch_size: int = 32,
        max_batches: int | None = None,
    ) -> None:
        stage = _eval_stage(stage)
        check_positive_int("max_batches", max_batches, allow_none=True)
        key = "val_loaders" if stage is Stage.VAL else "test_loaders"
        adapter = make_adapter(
            module, loss_fn=loss_fn, metrics=metrics, batch_size=batch_size, **{key: loaders}
        )
        runtime = make_runtime(device)
        adapter.module, placements = place(adapter.module, runtime)
        callbacks_ = _callbacks_for(adapter, callbacks)
        self._setup(adapter, runtime, stage, callbacks_, max_collated_bytes, placements)
        self.max_batches = max_batches

    @classmethod
    def _for_run(
        cls,
        adapter: Adapter,
        runtime: BaseRuntime,
        stage: Stage,
        callbacks: CallbackList,
        max_collated_bytes: int,
        placements: Placements,
        max_batches: int | None = None,
    ) -> Evaluator:
        """An Evaluator sharing a Trainer's adapter, runtime and callbacks (module placed)."""
        self = cls.__new__(cls)
        self._setup(adapter, runtime, stage, callbacks, max_collated_bytes, placements)
        self.max_batches = max_batches
        return self

    def _setup(
        self,
        adapter: Adapter,
        runtime: BaseRuntime,
        stage: Stage,
        callbacks: CallbackList,
        max_collated_bytes: int,
        placements: Placements,
    ) -> None:
        self.adapter = adapter
        self.runtime = runtime
        if isinstance(adapter, NetworkAdapter):
            adapter.use_runtime(runtime)
        self.stage = stage
        self.callbacks = callbacks
        self.max_collated_bytes = max_collated_bytes
        #: the placed parts of the module, each with its runtime (``_placement``)
        self.placements = placements
        self._hooks = StepHooks(runtime, placements, "eval_pre_step", "eval_post_step")
        self._step_event = "module.val_step" if stage is Stage.VAL else "module.test_step"
        self._val_hook = stage is Stage.VAL and callbacks.wants("on_end_val_epoch")
        #: opens the ``evaluator.step`` spans; a profiler may replace it with a drop-in for
        #: ``ppetrace.trace`` (e.g. to add device time)
        self.open_span: Callable[[str, Any], AbstractContextManager[Any]] = trace
        #: joins every rank's collated outputs of a loader (distributed training), or None
        self.gather: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None

    @property
    def module(self) -> torch.nn.Module:
        """The module being evaluated (as moved by the runtime)."""
        return self.adapter.module

    @property
    def models(self) -> dict[str, torch.nn.Module]:
        """``{"main": module}``, as ppe's ``Evaluator.models``."""
        return {"main": self.adapter.module}

    def loaders(self) -> Loaders:
        """The named loaders this Evaluator runs over."""
        if self.stage is Stage.VAL:
            return self.adapter.val_loaders()
        return self.adapter.test_loaders()

    def run(
        self, *, global_step: int = 0, epoch: int | None = None, collect: bool = True
    ) -> dict[str, tuple[Any, ...]]:
        """Run every loader and return ``{name: collated outputs}``.

        ``collect=False`` collates only when a callback needs the outputs and
        then returns empty tuples. Raises ``ValueError`` when there is no loader.
        """
        loaders = self.loaders()
        if not loaders:
            raise ValueError(
                f"Expected at least one {self.stage.label} loader for {self.adapter.name}, but "
                "received none. Pass loaders=DataLoader(...) (or a dict of named loaders)."
            )
        return self.run_loaders(loaders, global_step=global_step, epoch=epoch, collect=collect)

    def run_loaders(
        self,
        loaders: Loaders,
        *,
        global_step: int = 0,
        epoch: int | None = None,
        collect: bool = True,
    ) -> dict[str, tuple[Any, ...]]:
        """Like :meth:`run`, over the given named loaders."""
        module = self.adapter.module
        was_training = module.training
        module.eval()
        results: dict[str, tuple[Any, ...]] = {}
        keep = collect or self._val_hook
        with self.adapter.active(None):  # a network's moves go through this runtime
            try:
                for name, loader in loaders.items():
                    attrs = {
                        "ppetrace.epoch": epoch,
                        "ppetrace.step": global_step,
                        "ppetrace.stage": self.stage.label,
                        **self.runtime.span_attributes,
                        "ppetrace.loader": name,
                    }
                    outputs = self._run_one(name, loader, attrs, global_step, epoch, keep)
                    if keep and self.gather is not None:
                        outputs = self.gather(outputs)
                    results[name] = outputs if collect else ()
                    if self._val_hook:
                        self.callbacks.call(
                            "on_end_val_epoch", attrs, global_step, *outputs, key=name
                        )
            finally:
                module.train(was_training)
        return results

    def _run_one(
        self,
        name: str,
        loader: Iterable[Any],
        attrs: dict[str, Any],
        global_step: int,
        epoch: int | None,
        keep: bool,
    ) -> tuple[Any, ...]:
        # the span holds the loop's set-up too: no time of a validation goes unnamed
        with trace("evaluator.run", attrs), torch.no_grad():
            adapter, runtime, stage = self.adapter, self.runtime, self.stage
            device = runtime.device_spec
            label = stage.label
            collector = (
                OutputCollector(self.max_collated_bytes, what=f"{label} loader {name!r}")
                if keep
                else None
            )
            autocast = runtime.autocast_context if runtime.autocast_enabled else None
            rt_attrs = runtime.span_attributes
            step_event = self._step_event
            open_span = self.open_span
            eval_step = adapter.eval_step
            hooks, flags = self._hooks, PROFILER_FLAGS
            # one span object per event, entered again batch after batch (see training._loop)
            plain, ranged = hooks.reused(False), hooks.reused(True)
            step_open, eval_open = reusable(open_span, "evaluator.step"), trace(step_event)
            fetch_open = trace("evaluator.fetch_batch")
            # each step's mapping: a copy of this one with its batch index (see training._loop)
            template = {
                "ppetrace.epoch": epoch,
                "ppetrace.step": global_step,
                "ppetrace.batch_idx": 0,
                "ppetrace.stage": label,
                "ppetrace.device": rt_attrs["ppetrace.device"],
                "ppetrace.runtime": rt_attrs["ppetrace.runtime"],
                "ppetrace.loader": name,
            }
            from ..integrations.dataloader import trace_workers, tracked

            # as in training: iter(loader) (the workers' start), each wait on the loader and
            # letting the iterator go (the workers' shutdown) are spans of their own, and
            # the loop stops at the loader's length without a fetch that finds the end
            with trace("evaluator.loader_start", attrs):
                it: Iterator[Any] = tracked(iter(trace_workers(loader)))
            n = len_or_none(loader)
            if self.max_batches is not None:
                n = self.max_batches if n is None else min(n, self.max_batches)
            batch_idx = -1
            while n is None or batch_idx + 1 < n:
                batch_idx += 1
                # one immutable mapping for every span of the step (shared, not copied)
                own = template.copy()
                own["ppetrace.batch_idx"] = batch_idx
                step_attrs = FrozenAttributes(own)
                with fetch_open.again(step_attrs):
                    batch = next(it, _END)
                if batch is _END:
                    break
                pre, convert_open, convert, post = ranged if flags._is_profiler_enabled else plain
                with step_open.again(step_attrs):
                    for open_hook, sub, fn in pre:
                        if fn is None:  # the span of a no-op hook: nothing to enter
                            open_hook.mark(step_attrs)
                        else:
                            with open_hook.again(step_attrs):
                                fn(self, sub, batch_idx, batch)
                    with convert_open.again(step_attrs):
                        moved = convert(batch)
                    with eval_open.again(step_attrs):
                        if autocast is None:
                            outs, raw = eval_step(stage, global_step, moved, device, step_attrs)
                        else:
                            with autocast():
                                outs, raw = eval_step(stage, global_step, moved, device, step_attrs)
                    if collector is not None:
                        collector.add(outs)
                    for open_hook, sub, fn in post:
                        if fn is None:  # the span of a no-op hook: nothing to enter
                            open_hook.mark(step_attrs)
                        else:
                            with open_hook.again(step_attrs):
                                fn(self, sub, batch_idx, batch, raw)
            with trace("evaluator.loader_end", attrs):
                del it  # the last reference: a DataLoader's workers shut down here
        return collector.collated() if collector is not None else ()


def _eval_stage(stage: Stage | str) -> Stage:
    try:
        value: Stage | None = Stage(stage)
    except ValueError:
        value = None
    if value is None or value is Stage.TRAIN:
        raise ValueError(
            f"Expected Stage.VAL or Stage.TEST (or 'val'/'test') for stage, but received {stage!r}."
        )
    return value


def _callbacks_for(adapter: Adapter, callbacks: Iterable[object]) -> CallbackList:
    own = adapter.callback
    return CallbackList(([own] if own is not None else []) + list(callbacks))
