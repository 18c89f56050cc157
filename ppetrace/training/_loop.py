"""The training loop over one epoch's batches: the per-step hot path of the Trainer.

Each batch gives ``trainer.fetch_batch``, then ``trainer.step`` around the
runtime's ``train_pre_step`` and ``convert_batch``, ``module.train_step``,
``trainer.backward``, ``trainer.optimizer_step`` (at an accumulation
boundary) and ``train_post_step`` (README, "Hook order"). What a step costs
beyond its spans is kept small, because on a small model the spans and the
loop are all the overhead there is:

- one :class:`~ppetrace.tracing.FrozenAttributes` per step, shared by all
  of its spans (``trace`` keeps it instead of copying it); for a loader whose
  batch sizes are known in advance (:func:`~._run.known_batch_sizes`) that
  includes ``trainer.fetch_batch``, else the fetch gets its own;
- the runtime hooks are resolved once per fit (``ppetrace.runtime._hooks``):
  a hook that is ``BaseRuntime``'s no-op gets its span and no call (the span
  of an empty block, ``trace.mark``: nothing is entered);
- one span object per event, made when the epoch's batches start and entered
  again each step (``trace.again``: no object made and freed per block)
  wherever the span opener is ``ppetrace.trace`` itself;
- the batch size comes from the loader, not from each batch, where it can;
- counters, accumulation and the optional parts (profilers, progress bar,
  callbacks, step-based validation and checkpoints, the loss watch) cost a
  test each when unused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..runtime._hooks import PROFILER_FLAGS, reusable
from ..tracing import FrozenAttributes
from ..tracing._recorder import trace
from ._run import TRAIN, Run, batch_size, describe, known_batch_sizes, len_or_none
from ._setup import empty_loader

__all__ = ["bad_loss", "train_batches"]

_END = object()
_Tensor = torch.Tensor
EPOCH, STEP, BATCH_IDX = "ppetrace.epoch", "ppetrace.step", "ppetrace.batch_idx"
STAGE, DEVICE, RUNTIME = "ppetrace.stage", "ppetrace.device", "ppetrace.runtime"
BATCH_SIZE = "ppetrace.batch_size"


def train_batches(self: Any, run: Run, loader: Iterable[Any], it: Iterator[Any]) -> None:
    """Train on the batches of ``it`` (an iterator over ``loader``) until the epoch ends:
    the loader is exhausted, or ``max_steps`` or ``max_train_steps_per_epoch`` is
    reached. ``self`` is the Trainer."""
    n = len_or_none(loader)
    i = start = self._batch_in_epoch
    accum, epoch = self.grad_accumulation, self.epoch
    adapter, optim, callbacks, watch = run.adapter, run.optim, run.callbacks, run.watch
    device = run.runtime.device_spec
    dev, rt_name = run.rt_attrs[DEVICE], run.rt_attrs[RUNTIME]
    train_step, backward, optimizer_step = adapter.train_step, optim.backward, optim.stepper()
    # a batch that does not step accumulates without DDP's gradient all-reduce
    dist = self._dist
    quiet_step = train_step if dist is None else dist.unsynced(train_step, adapter.forward_module)
    check_loss = not adapter.backward_in_step
    autocast = run.runtime.autocast_context if run.runtime.autocast_enabled else None
    profilers, bar, open_span = self.profilers, run.progress, run.open_span
    hooks, flags, group, detail = run.hooks, PROFILER_FLAGS, run.group, run.detail
    plain, ranged = hooks.reused(False), hooks.reused(True)
    light = not profilers and open_span is trace  # summarised steps may be light steps
    fetch_open = trace("trainer.fetch_batch")
    step_open, train_open, backward_open, optimizer_open = (
        reusable(open_span, name)
        for name in (
            "trainer.step",
            "module.train_step",
            "trainer.backward",
            "trainer.optimizer_step",
        )
    )
    wants_end_backward, collect, every_step = run.wants_end_backward, run.collect, watch.every_step
    known = known_batch_sizes(loader)
    size, full, last = known if known is not None else (0, 0, 0)
    divisor = accum
    ended = False
    loss: Any = None
    done = self.global_step  # ppetrace.step of the last batch trained
    step_checks = (
        self.val_every_n_steps is not None
        or self.checkpoint_every_n_steps is not None
        or self.max_steps is not None
        or self.max_train_steps_per_epoch is not None
    )
    # each step's mapping is a copy of this one with its own step, index and size (a
    # dict copy and three stores cost less than building the dict anew)
    template = {EPOCH: epoch, STEP: 0, BATCH_IDX: 0, STAGE: TRAIN, DEVICE: dev, RUNTIME: rt_name}
    if known is not None:
        template[BATCH_SIZE] = size
    while n is None or i < n:
        gs = self.global_step
        step_attrs = template.copy()
        step_attrs[STEP] = gs
        step_attrs[BATCH_IDX] = i
        if known is not None and i >= full:
            step_attrs[BATCH_SIZE] = last
        attrs = FrozenAttributes(step_attrs)
        with fetch_open.again(attrs):
            batch = next(it, _END)
        if batch is _END:
            break
        if known is None:
            measured = batch_size(batch)
            if measured is not None:
                step_attrs[BATCH_SIZE] = measured
                attrs = FrozenAttributes(step_attrs)
        if accum == 1:
            boundary = True
        else:
            if i % accum == 0:
                divisor = accum if n is None else min(accum, n - i)
                run.divisor = divisor
            boundary = (i + 1) % accum == 0 or i + 1 == n
        seen = self._batches_seen
        if profilers:
            for prof in profilers:
                prof.step_begin(seen)
        # the runtime hooks, each span through its runtime's trace while a torch profiler records
        pre, convert_open, convert, post = ranged if flags._is_profiler_enabled else plain
        with step_open.again(attrs) as step_span:
            if (  # as aggregates (due: a stretch of them known, or asked)
                detail is not None
                and detail.armed
                and (detail.due_from <= seen < detail.due_below or detail.due(seen))
            ):
                detail.summarise(step_span, light and not flags._is_profiler_enabled)
            for open_hook, sub, fn in pre:
                if fn is None:  # the span of a no-op hook: nothing to enter
                    open_hook.mark(attrs)
                else:
                    with open_hook.again(attrs):
                        fn(self, sub, i, batch)
            with convert_open.again(attrs):
                moved = convert(batch)
            run.attrs = attrs
            step = train_step if boundary else quiet_step
            with train_open.again(attrs):
                if autocast is None:
                    loss, outs, raw = step(gs, moved, device, attrs)
                else:
                    with autocast():
                        loss, outs, raw = step(gs, moved, device, attrs)
            if check_loss:
                if (type(loss) is not _Tensor and not isinstance(loss, _Tensor)) or loss.ndim:
                    raise bad_loss(adapter, loss, gs, epoch, i)
                with backward_open.again(attrs):
                    divided = backward(loss, divisor)
                    if wants_end_backward:
                        callbacks.call("on_end_backward", attrs, gs, divided)
            else:
                loss = run.last_loss
            if collect:
                run.add_outputs(outs)
            if boundary:
                with optimizer_open.again(attrs):
                    optimizer_step()
                    self.global_step = gs + 1
                    if group is not None:
                        outputs = group.collated()
                        group.clear()
                        callbacks.call("on_end_train_step", attrs, gs + 1, *outputs)
            for open_hook, sub, fn in post:
                if fn is None:  # the span of a no-op hook: nothing to enter
                    open_hook.mark(attrs)
                else:
                    with open_hook.again(attrs):
                        fn(self, sub, i, batch, raw)
        if profilers:
            for prof in profilers:
                prof.step_end(seen)
        self._batches_seen = seen + 1
        i += 1
        self._batch_in_epoch = i
        done = gs
        if bar is not None and bar.update(seen + 1, self.global_step, loss):
            watch.observe(bar.loss_value, gs, epoch, i - 1)
        if every_step:
            watch.sample(loss, gs, epoch, i - 1)
            watch.poll()
            watch.check()
        if boundary and step_checks and self._after_optimizer_step(run):
            ended = True
            break
    run.last_loss = loss
    if i > start:
        watch.sample(loss, done, epoch, i - 1)  # the epoch's last loss (resolved at flush)
        watch.check()
    if ended:
        return
    if i == start and start == 0:
        raise empty_loader(adapter, epoch)
    if optim.pending:  # a partial last group of a loader without len()
        if dist is not None:
            dist.average_gradients(adapter.module)
        self._optimizer_step(run, run.attrs_now())
        self._after_optimizer_step(run)


def bad_loss(adapter: Any, loss: Any, gs: int, epoch: int, i: int) -> ValueError:
    """The error for a step whose loss is not a scalar tensor."""
    return ValueError(
        f"Expected {adapter.loss_source} to return a scalar loss tensor (or a tuple whose "
        f"first item is one), but at global step {gs} (epoch {epoch}, batch {i}) it returned "
        f"{describe(loss)}. Reduce the loss to a scalar, e.g. loss.mean()."
    )
