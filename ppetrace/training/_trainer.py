"""The Trainer: the training lifecycle, every hook inside its span.

The hook order is a contract (README: "Hook order")::

    trainer.run
      runtime.initialize_module(module, loader, optimizer)   (each placed part; see _placement)
      trainer.epoch                                    (each epoch)
        runtime.train_epoch_begin(module)
        callback.on_begin_train_epoch(global_step, epoch)
        trainer.loader_start                           iter(loader): RNG capture, workers' start
        trainer.fetch_batch                            (each batch: the wait on the loader)
        trainer.step
          runtime.train_pre_step(trainer, module, batch_idx, batch)
          runtime.convert_batch(batch)
          module.train_step(global_step, batch, device)
          trainer.backward
            callback.on_end_backward(global_step, loss)
          trainer.optimizer_step                       (at an accumulation boundary)
            callback.on_end_train_step(global_step, *outputs)
          runtime.train_post_step(trainer, module, batch_idx, batch, outs)   (the pre-step's batch)
        trainer.validation                             (when due; see Evaluator)
        trainer.checkpoint                             (every checkpoint_every_n_steps)
        trainer.loader_end                             the iterator let go: workers' shutdown
        trainer.validation                             (when due at the epoch end)
        runtime.train_epoch_end(module)
        callback.on_end_train_epoch(global_step, *outputs)
        trainer.checkpoint                             (when checkpoint_dir is set)
      runtime.train_cleanup(module)
      callback.on_end_train(global_step)

The pieces live in their own modules of :mod:`ppetrace.training`: the three
module kinds in ``_adapters``, accumulation/clipping/AMP/schedulers in
``_optim``, evaluation in ``_evaluator``, checkpoint files and RNG states in
``_checkpoint``, resuming in ``_resume``, what one fit shares in ``_run``,
the trace file, profilers and progress bar around a call in ``_session``,
the runtime, placement and optimization of a call in ``_setup``,
output collation in ``_collate``, the progress bar in ``_progress``,
module placement in ``_placement``, the per-batch loop in ``_loop`` and
non-finite losses in ``_nonfinite``.

Runtime hooks see the Trainer as ppe's hooks see ppe's trainer:
``trainer.iteration`` (batches completed over the run), ``trainer.epoch``,
``trainer.models`` (``{"main": module}``) and ``trainer.optimizers`` (by name).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any, Literal

import torch

from ..integrations._detail import DEFAULT_MAX_TRACE_BYTES, check_detail
from ..interfaces.module_interface import Stage
from ..profilers import Schedule
from ..runtime._base import BaseRuntime, call_hook
from ..tracing._recorder import RECORDER, span_attributes, trace
from ._adapters import make_adapter
from ._callbacks import CallbackList
from ._checkpoint import (
    FORMAT,
    VERSION,
    capture_rng,
    load_checkpoint,
    save_atomic,
)
from ._collate import DEFAULT_MAX_COLLATED_BYTES
from ._distributed import Distributed, check_mode, set_epoch
from ._loop import train_batches
from ._nonfinite import NonfiniteMode, check_nonfinite_mode
from ._optim import SchedulerInterval, check_clip, check_positive_int
from ._placement import call_module_hook
from ._resume import begin_epoch, restore, start_iteration
from ._run import Run, StepProfiler
from ._session import session, trace_file_first
from ._setup import check_device, check_trace_path, evaluator_for, prepare_fit

__all__ = ["CHECKPOINT_NAME", "StepProfiler", "Trainer"]

_log = logging.getLogger("ppetrace")
#: The name of the checkpoint file in ``checkpoint_dir``.
CHECKPOINT_NAME = "last.pt"


class Trainer:
    """Trains a module with every lifecycle hook traced as a span.

    Args:
        device: a device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``, any type
            registered in ``ppetrace.runtime_registry``) or a runtime
            instance. All movement of modules and batches goes through it.
        max_epochs: epochs to train.
        max_steps: stop after this many optimizer steps (the epoch still ends
            normally: validation, epoch hooks, checkpoint).
        grad_accumulation: batches per optimizer step; the loss is divided by
            the group size, and a partial last group still steps.
        clip_grad_norm: clip the total gradient norm to this value (> 0).
        val_every_n_epochs: validate at the end of every N-th epoch (None: never).
        val_every_n_steps: also validate after every N-th optimizer step.
        callbacks: :class:`~ppetrace.CallbackInterface` objects; the module
            itself comes first when it is one.
        checkpoint_dir: write ``<dir>/last.pt`` at the end of each epoch.
        checkpoint_every_n_steps: also write it after every N-th optimizer step.
        progress: show a progress bar (only when the stream is a terminal).
        progress_stream: where the bar draws (default ``sys.stderr``).
        trace_path: write a Chrome trace of the run here
            (``exporters.ChromeTraceExporter``). The first ``fit``,
            ``validate`` or ``test`` call of a Trainer writes ``trace_path``;
            each later call writes its own file next to it, named by the call
            and its count (``trace.validate.json``, ``trace.test.json``,
            ``trace.fit2.json``; ``.json.gz`` stays gzip), so no call
            overwrites a trace this Trainer wrote. :attr:`last_trace_path`
            is the file of the current or last call (under torchrun the merged
            file, or this rank's file when the call raised: nothing is merged
            then), :attr:`trace_paths` all of them in call order; each call
            logs its file at INFO level.
        profilers: :class:`StepProfiler` objects.
        amp: mixed precision: bf16 autocast on CPU, float16 autocast with a
            GradScaler on CUDA (runtime options ``autocast``/``grad_scaler``).
        runtime_options: options for the runtime built from ``device``.
        scheduler_interval: ``"step"`` (after each optimizer step) or ``"epoch"``.
        max_collated_bytes: the bound on the outputs kept for each callback
            hook that receives collated outputs (oldest steps dropped).
        max_train_steps_per_epoch: end each epoch after this many optimizer
            steps (PyMarlin's option of that name).
        max_val_steps_per_epoch: validate on at most this many batches of
            each validation loader (PyMarlin's option of that name).
        on_nonfinite_loss: ``"warn"`` (default): warn once, and set
            ``ppetrace.nonfinite_loss`` on the ``trainer.epoch`` span, when a
            non-finite loss is seen; ``"raise"``: also raise
            ``FloatingPointError`` there and check after every step. The loss is
            looked at only where it reaches the host anyway (no device sync in a
            step; see ``ppetrace.training._nonfinite``). Under DDP each rank
            checks its own loss: ``"raise"`` raises on the ranks that saw a
            non-finite one, and the others wait in their next collective until
            torchrun's agent stops them.
        distributed: ``"auto"``: under torchrun (or in an existing process
            group), train with DistributedDataParallel, distributed samplers,
            rank-0 checkpoints and per-rank traces merged by rank 0 (see
            ``_distributed``); ``None`` turns all of it off.
        use_distributed_sampler: re-create DataLoaders that have the default
            sampler with a DistributedSampler (training) or a ShardSampler
            (evaluation); ``False`` leaves the loaders as they are.
        gather_outputs: collated outputs of validation (``on_end_val_epoch``,
            ``validate``/``test`` results) and of ``on_end_train_epoch`` are
            gathered from every rank, in rank order; ``False`` keeps each
            rank's own.
        trace_detail: which training steps the trace keeps in full
            (``ppetrace.integrations._detail``): ``"auto"`` every step until the
            trace holds ``max_trace_bytes``, then 1 step in 1,000, printing one
            line when it switches; ``"all"`` every step; a
            :class:`~ppetrace.Schedule` its recorded steps from the start. The
            other steps keep their step-level spans, and each hook's count,
            total and self time as attributes of their ``trainer.step`` span
            (``exporters.ChromeTraceExporter``, "Summarised steps").
        max_trace_bytes: the trace size (bytes, every part) at which ``"auto"``
            switches (default about 1 GB). The trace file is written in parts of
            256 MiB (``trace.json``, ``trace.1.json``, ...), read as one run.
    """

    def __init__(
        self,
        *,
        device: str | torch.device | BaseRuntime = "cpu",
        max_epochs: int = 1,
        max_steps: int | None = None,
        grad_accumulation: int = 1,
        clip_grad_norm: float | None = None,
        val_every_n_epochs: int | None = 1,
        val_every_n_steps: int | None = None,
        callbacks: Iterable[object] = (),
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every_n_steps: int | None = None,
        progress: bool = True,
        progress_stream: IO[str] | None = None,
        trace_path: str | os.PathLike[str] | None = None,
        profilers: Iterable[StepProfiler] = (),
        amp: bool = False,
        runtime_options: Mapping[str, Any] | None = None,
        scheduler_interval: SchedulerInterval | Literal["step", "epoch"] = "step",
        max_collated_bytes: int = DEFAULT_MAX_COLLATED_BYTES,
        max_train_steps_per_epoch: int | None = None,
        max_val_steps_per_epoch: int | None = None,
        on_nonfinite_loss: NonfiniteMode | Literal["warn", "raise"] = "warn",
        distributed: Literal["auto"] | None = "auto",
        use_distributed_sampler: bool = True,
        gather_outputs: bool = True,
        trace_detail: Literal["auto", "all"] | Schedule = "auto",
        max_trace_bytes: int = DEFAULT_MAX_TRACE_BYTES,
    ) -> None:
        if not isinstance(device, (str, torch.device, BaseRuntime)):
            raise TypeError(
                "Expected a device string, a torch.device or a ppetrace runtime for device, but "
                f"received {type(device).__name__}."
            )
        check_device(device)
        check_trace_path(trace_path)
        self.on_nonfinite_loss = check_nonfinite_mode(on_nonfinite_loss)
        self.trace_detail, self.max_trace_bytes = check_detail(trace_detail, max_trace_bytes)
        check_positive_int("max_epochs", max_epochs)
        check_positive_int("max_steps", max_steps, allow_none=True)
        check_positive_int("grad_accumulation", grad_accumulation)
        check_positive_int("val_every_n_epochs", val_every_n_epochs, allow_none=True)
        check_positive_int("val_every_n_steps", val_every_n_steps, allow_none=True)
        check_positive_int("checkpoint_every_n_steps", checkpoint_every_n_steps, allow_none=True)
        check_positive_int("max_collated_bytes", max_collated_bytes)
        check_positive_int("max_train_steps_per_epoch", max_train_steps_per_epoch, allow_none=True)
        check_positive_int("max_val_steps_per_epoch", max_val_steps_per_epoch, allow_none=True)
        if checkpoint_every_n_steps is not None and checkpoint_dir is None:
            raise ValueError(
                "Expected a checkpoint_dir with checkpoint_every_n_steps="
                f"{checkpoint_every_n_steps}, but received checkpoint_dir=None. Pass "
                "checkpoint_dir='runs/ckpt'."
            )
        try:
            interval = SchedulerInterval(scheduler_interval)
        except ValueError:
            raise ValueError(
                "Expected 'step' or 'epoch' for scheduler_interval, but received "
                f"{scheduler_interval!r}."
            ) from None
        self.profilers = list(profilers)
        for i, prof in enumerate(self.profilers):
            if not isinstance(prof, StepProfiler):
                raise TypeError(
                    "Expected profilers with setup(trainer), step_begin(step), step_end(step) "
                    f"and teardown(), but profiler {i} is {type(prof).__name__}."
                )
        self.callbacks = list(callbacks)
        CallbackList(self.callbacks)  # validates them now
        self.device = device
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.grad_accumulation = grad_accumulation
        self.clip_grad_norm = check_clip(clip_grad_norm)
        self.val_every_n_epochs = val_every_n_epochs
        self.val_every_n_steps = val_every_n_steps
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.checkpoint_every_n_steps = checkpoint_every_n_steps
        self.progress = bool(progress)
        self.progress_stream = progress_stream
        self.trace_path = trace_path
        self.amp = bool(amp)
        self.runtime_options = dict(runtime_options) if runtime_options else None
        self.scheduler_interval = interval
        self.max_collated_bytes = max_collated_bytes
        self.max_train_steps_per_epoch = max_train_steps_per_epoch
        self.max_val_steps_per_epoch = max_val_steps_per_epoch
        self.distributed = check_mode(distributed)
        self.use_distributed_sampler = bool(use_distributed_sampler)
        self.gather_outputs = bool(gather_outputs)
        #: the process group of the current or last call (``distributed``), or None
        self._dist: Distributed | None = None
        #: the runtime of the current or last run
        self.runtime: BaseRuntime | None = None
        #: the ChromeTraceExporter of the current or last run (``trace_path``), or None
        self.trace_exporter: Any = None
        #: the trace file of the current or last call, or None (see ``trace_path``)
        self.last_trace_path: Path | None = None
        #: every trace file this Trainer wrote, in call order
        self.trace_paths: list[Path] = []
        self._trace_calls: dict[str, int] = {}
        #: optimizer steps completed
        self.global_step = 0
        #: the current epoch (zero-based); after a run, the number of epochs completed
        self.epoch = 0
        self._batch_in_epoch = 0
        self._batches_seen = 0
        self._epoch_rng: dict[str, Any] | None = None
        self._models: dict[str, torch.nn.Module] = {}
        self._optimizers: dict[str, Any] = {}
        #: the progress bar drawn now (inside fit with progress on a terminal), or None
        self._progress_bar: Any = None

    def print(
        self, *values: Any, sep: str = " ", end: str = "\n", file: IO[str] | None = None
    ) -> None:
        """``print(*values)`` for callbacks and training code: while the progress bar is
        drawn, the text goes above it (``tqdm.write``) instead of garbling it; otherwise
        it is a plain ``print`` (to ``file``, default ``sys.stdout``)."""
        bar = self._progress_bar
        if bar is None:
            print(*values, sep=sep, end=end, file=file)
        else:
            bar.write(sep.join(str(v) for v in values), file=file, end=end)

    # -- state -------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path | None:
        """Where checkpoints are written (``checkpoint_dir/last.pt``), or ``None``."""
        return None if self.checkpoint_dir is None else self.checkpoint_dir / CHECKPOINT_NAME

    @property
    def batches_seen(self) -> int:
        """Training batches completed over the run (continues after a resume)."""
        return self._batches_seen

    @property
    def iteration(self) -> int:
        """Training batches completed over the run, as ppe's ``trainer.iteration``: ``0``
        in the first batch's ``train_pre_step``."""
        return self._batches_seen

    @property
    def models(self) -> dict[str, torch.nn.Module]:
        """``{"main": module}`` of the current or last call, as ppe's ``trainer.models``."""
        return dict(self._models)

    @property
    def optimizers(self) -> dict[str, Any]:
        """The optimizers of the current or last fit by name, as ppe's
        ``trainer.optimizers``: ``{"main": opt}`` for one, a network's own names, else
        ``"0"``, ``"1"``, ..."""
        return dict(self._optimizers)

    def get_state(self) -> dict[str, Any]:
        """The Trainer's counters and the RNG state at the start of the current epoch."""
        return {
            "epoch": self.epoch,
            "global_step": self.global_step,
            "batch_in_epoch": self._batch_in_epoch,
            "batches_seen": self._batches_seen,
            "epoch_rng": self._epoch_rng,
        }

    def update_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`get_state`."""
        self.epoch = int(state["epoch"])
        self.global_step = int(state["global_step"])
        self._batch_in_epoch = int(state["batch_in_epoch"])
        self._batches_seen = int(state["batches_seen"])
        self._epoch_rng = state.get("epoch_rng")

    # -- entry points -------------------------------------------------------------

    def fit(
        self,
        module: torch.nn.Module,
        train_loader: Iterable[Any] | None = None,
        val_loaders: Any = None,
        *,
        optimizer: Any = None,
        loss_fn: Any = None,
        schedulers: Iterable[Any] = (),
        metrics: Mapping[str, Callable[..., Any]] | None = None,
        resume_from: str | os.PathLike[str] | None = None,
        batch_size: int = 32,
        val_batch_size: int | None = None,
        fold: int = 0,
    ) -> None:
        """Train ``module``.

        - A :class:`~ppetrace.ModuleInterface` supplies its loaders (built with
          ``batch_size``/``val_batch_size``), optimizers and schedulers;
          loaders passed here override its own.
        - An :class:`~ppetrace.AbstractPyTorchNetwork` takes ``optimizer`` and
          ``loss_fn`` as dicts (``{"default": opt}``), plus ``metrics``; its
          closure also receives ``fold`` and ``batch_nr``, as in delira.
        - A plain ``nn.Module`` needs ``optimizer``, ``loss_fn(preds, targets)``
          and a ``train_loader`` of ``(inputs, targets)`` batches.

        ``val_loaders`` is one loader or a dict of named loaders.
        ``resume_from`` continues from a checkpoint, mid-epoch if it was
        written there; a missing file raises ``FileNotFoundError``, one that
        cannot be read, is not a ppetrace checkpoint or does not fit this run
        raises :class:`~ppetrace.CheckpointError`, both naming the file. An
        exception ends every open span with ERROR status, flushes the spans
        and propagates unchanged.
        """
        adapter = make_adapter(
            module,
            train_loader=train_loader,
            val_loaders=val_loaders,
            optimizer=optimizer,
            loss_fn=loss_fn,
            schedulers=schedulers,
            metrics=metrics,
            batch_size=batch_size,
            val_batch_size=val_batch_size,
            fold=fold,
        )
        checkpoint = None if resume_from is None else load_checkpoint(resume_from)
        self._dist = Distributed.resolve(self.distributed, self.device)
        if checkpoint is not None and self._dist is not None:
            checkpoint = self._dist.own_state(checkpoint)
        with trace_file_first(self, "fit"):
            run, first_loader, n = prepare_fit(self, adapter)
        if checkpoint is not None:
            restore(self, run, checkpoint, resume_from)
        if n is not None and self.max_train_steps_per_epoch is not None:
            n = min(n, self.max_train_steps_per_epoch * self.grad_accumulation)
        watch = run.watch
        watch.install()
        try:
            with session(self, "fit", run, total=None if n is None else n * self.max_epochs):
                self._fit(run, first_loader)
        finally:
            watch.uninstall()
        watch.check()  # a flag resolved only by the session's final flush

    def _fit(self, run: Run, first_loader: Iterable[Any]) -> None:
        adapter = run.adapter
        attrs = run.attrs_now()
        with trace("trainer.run", attrs), adapter.active(run.network_backward):
            named = self._optimizers
            for name, sub, rt in run.placements:
                # as ppe's Handler._setup: the optimizer of that name, or the only one
                opt = named.get(name, next(iter(named.values())) if len(named) == 1 else None)
                call_hook(rt, "initialize_module", attrs, sub, first_loader, opt)
            # the first zero_grad of an optimizer sets up torch's profiling wrappers (about
            # 1.5 ms): a span of its own, not unaccounted time in the run
            with trace("trainer.zero_grad", attrs):
                run.optim.zero_grad()
            loader: Iterable[Any] | None = first_loader
            while self.epoch < self.max_epochs and not run.stop:
                self._run_epoch(run, loader if loader is not None else adapter.train_loader())
                loader = None
                # spans go on the flusher thread; the before-flush hooks run here (the loss
                # watch's flags in flight are resolved) and fit's end waits for delivery
                RECORDER.flush(wait=False)
                run.watch.check()
            attrs = run.attrs_now()
            call_module_hook(run.placements, "train_cleanup", attrs)
            run.callbacks.call("on_end_train", attrs, self.global_step)

    def validate(
        self,
        module: torch.nn.Module,
        loaders: Any = None,
        *,
        loss_fn: Any = None,
        metrics: Mapping[str, Callable[..., Any]] | None = None,
        batch_size: int = 32,
    ) -> dict[str, tuple[Any, ...]]:
        """Run validation once (``trainer.validation`` span) and return each loader's outputs.

        ``loaders``: one loader or a dict of named loaders (``None``: a
        ModuleInterface's ``get_val_dataloaders``). Returns ``{name: collated
        outputs}``; ``on_end_val_epoch`` callbacks run once per loader.
        ``max_val_steps_per_epoch`` caps the batches of each loader.
        """
        self._dist = Distributed.resolve(self.distributed, self.device)
        with trace_file_first(self, "validate"):
            evaluator = evaluator_for(
                self, module, Stage.VAL, loaders, loss_fn, metrics, batch_size
            )
        evaluator.max_batches = self.max_val_steps_per_epoch
        runtime, placements = evaluator.runtime, evaluator.placements
        with session(self, "validate", None):
            attrs = {"ppetrace.step": self.global_step, "ppetrace.stage": Stage.VAL.label}
            attrs.update(runtime.span_attributes)
            loaders_ = evaluator.loaders()
            if not loaders_:
                evaluator.run()  # raises the "no loader" error
            with trace("trainer.validation", attrs):
                call_module_hook(placements, "train_validation_begin", attrs)
                results = evaluator.run_loaders(loaders_, global_step=self.global_step)
                call_module_hook(placements, "train_validation_end", attrs)
        return results

    def test(
        self,
        module: torch.nn.Module,
        loaders: Any = None,
        *,
        loss_fn: Any = None,
        metrics: Mapping[str, Callable[..., Any]] | None = None,
        batch_size: int = 32,
    ) -> dict[str, tuple[Any, ...]]:
        """Run the test stage (``module.test_step`` per batch) and return each loader's outputs.

        ``loaders``: one loader or a dict of named loaders (``None``: a
        ModuleInterface's ``get_test_dataloaders``).
        """
        self._dist = Distributed.resolve(self.distributed, self.device)
        with trace_file_first(self, "test"):
            evaluator = evaluator_for(
                self, module, Stage.TEST, loaders, loss_fn, metrics, batch_size
            )
        with session(self, "test", None):
            return evaluator.run(global_step=self.global_step)

    # -- the loop ---------------------------------------------------------------------

    def _run_epoch(self, run: Run, loader: Iterable[Any]) -> None:
        begin_epoch(self, run, loader)
        # steps of this epoch already done before a resume (checkpoints are at boundaries)
        run.epoch_first_step = self.global_step - self._batch_in_epoch // self.grad_accumulation
        attrs = run.attrs_now()
        set_epoch(loader, self.epoch)  # DistributedSampler: this epoch's shuffle
        with trace("trainer.epoch", attrs) as span:
            run.watch.epoch_attrs = span_attributes(span)
            run.adapter.module.train()
            call_module_hook(run.placements, "train_epoch_begin", attrs)
            run.callbacks.call("on_begin_train_epoch", attrs, self.global_step, self.epoch)
            with trace("trainer.loader_start", attrs):
                it = start_iteration(self, run, loader)
            train_batches(self, run, loader, it)
            with trace("trainer.loader_end", attrs):
                del it  # the last reference: a DataLoader's workers shut down here
            self._end_epoch(run)

    def _optimizer_step(self, run: Run, attrs: Mapping[str, Any]) -> None:
        """The optimizer step of a partial last group (the loop steps inline)."""
        with run.open_span("trainer.optimizer_step", attrs):
            run.optim.step()
            self.global_step += 1
            group = run.group
            if group is not None:
                outputs = group.collated()
                group.clear()
                run.callbacks.call("on_end_train_step", attrs, self.global_step, *outputs)

    def _after_optimizer_step(self, run: Run) -> bool:
        """Step-based validation and checkpoints; ``True`` when the epoch ends here:
        ``max_steps`` (then training stops) or ``max_train_steps_per_epoch`` is reached."""
        gs = self.global_step
        if self.val_every_n_steps is not None and gs % self.val_every_n_steps == 0:
            self._validate(run)
        if self.checkpoint_every_n_steps is not None and gs % self.checkpoint_every_n_steps == 0:
            self._checkpoint(run)
        if self.max_steps is not None and gs >= self.max_steps:
            run.stop = True
            return True
        cap = self.max_train_steps_per_epoch
        return cap is not None and gs - run.epoch_first_step >= cap

    def _end_epoch(self, run: Run) -> None:
        if (
            self.val_every_n_epochs is not None
            and (self.epoch + 1) % self.val_every_n_epochs == 0
            and run.last_val_step != self.global_step
        ):
            self._validate(run)
        attrs = run.attrs_now()
        call_module_hook(run.placements, "train_epoch_end", attrs)
        collector = run.epoch_outputs
        if collector is not None:
            outputs = collector.collated()
            collector.clear()
            if self._dist is not None and self.gather_outputs:
                outputs = self._dist.gather(outputs)
            run.callbacks.call("on_end_train_epoch", attrs, self.global_step, *outputs)
        run.optim.end_epoch()
        self.epoch += 1
        self._batch_in_epoch = 0
        if self.checkpoint_dir is not None:
            self._checkpoint(run, epoch=self.epoch - 1)

    def _validate(self, run: Run) -> None:
        loaders = run.adapter.val_loaders()
        if not loaders:
            return
        attrs = run.attrs_now()
        with trace("trainer.validation", attrs):
            call_module_hook(run.placements, "train_validation_begin", attrs)
            run.evaluator.run_loaders(
                loaders, global_step=self.global_step, epoch=self.epoch, collect=False
            )
            call_module_hook(run.placements, "train_validation_end", attrs)
        run.last_val_step = self.global_step

    def _checkpoint(self, run: Run, *, epoch: int | None = None) -> None:
        path = self.checkpoint_path
        assert path is not None
        attrs = run.attrs_now()
        if epoch is not None:
            attrs["ppetrace.epoch"] = epoch
        with trace("trainer.checkpoint", attrs):
            state = {
                "format": FORMAT,
                "version": VERSION,
                "module": run.adapter.get_state(),
                "optimization": run.optim.state_dict(),
                "trainer": self.get_state(),
                "rng": capture_rng(run.generators),
            }
            if self._dist is None:
                save_atomic(state, path)
            else:  # rank 0 writes, with every rank's RNG states; all wait for it
                self._dist.save(state, path)
