"""``ppetrace.instrument()``: trace any PyTorch loop through global hooks, no code changes.

One instrumentation at a time: it patches process-wide state (see
:mod:`._hooks`), so a second ``instrument()`` while one is active raises.
``close()`` (or leaving the ``with`` block) ends the open step, tears the
profilers down, removes every hook and patch, restores the originals exactly
and writes the trace file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import traceback
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from exporters._spans import BY_TIME, NESTING

from .. import tracing
from ..tracing._environment import refresh_environment
from ..tracing._recorder import RECORDER, _error_text, trace
from ._detail import (
    DEFAULT_MAX_TRACE_BYTES,
    TRACE_PART_BYTES,
    StepDetail,
    _who,
    check_detail,
    detail_metadata,
)
from ._hooks import Hooks
from ._ranks import check_trace_path, profiler_device, rank_info, rank_trace_path
from ._stepper import StepTracker
from .dataloader import settle_workers, stop_workers, workers_mark
from .distributed import HEADER_RESERVE

__all__ = ["Instrumentation", "active", "instrument"]

_log = logging.getLogger("ppetrace")
_lock = threading.Lock()
_active: list[Instrumentation] = []
_PROFILER_METHODS = ("setup", "step_begin", "step_end", "teardown")


def active() -> Instrumentation | None:
    """The instrumentation that is active now, if any."""
    return _active[0] if _active else None


class Instrumentation:
    """The handle of an active :func:`instrument`: a context manager, and :meth:`close`.

    Profilers see it as their trainer: ``trace_exporter`` (the Chrome trace
    exporter of ``trace_path``, or None) and ``runtime.device_spec``.
    """

    def __init__(
        self,
        *,
        trace_path: str | os.PathLike[str] | None,
        module_depth: int,
        profilers: list[Any],
        device: str,
    ) -> None:
        self.trace_path = None if trace_path is None else Path(trace_path)
        self.module_depth = module_depth
        self.profilers = profilers
        #: what profilers read as ``trainer.runtime``
        self.runtime = types.SimpleNamespace(device_spec=device)
        #: the ChromeTraceExporter writing ``trace_path``, or None
        self.trace_exporter: Any = None
        #: ChromeTraceExporter options beyond the path (a rank's file under torchrun)
        self.exporter_options: dict[str, Any] = {}
        #: ``(trace_detail, max_trace_bytes)`` (see :func:`instrument`)
        self.detail: tuple[Any, int] = ("auto", DEFAULT_MAX_TRACE_BYTES)
        self.closed = False
        self._workers_mark = workers_mark()  # the loaders iterated after it are this run's
        self._environment: dict[str, Any] = {}  # captured when the trace file opens
        timer = next((p for p in profilers if _is_span_wrapper(p)), None)
        self._tracker = StepTracker(profilers, timer)
        self._hooks = Hooks(
            self._tracker,
            module_depth=module_depth,
            span=timer.span if timer is not None else trace,
        )
        # where instrument() was called (for the error of a second one): the frames now,
        # their source lines read only if that error comes (format_stack reads them: ~0.1 ms)
        caller = sys._getframe(2)
        self._stack = [
            (f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
            for f in (caller.f_back, caller)
            if f is not None
        ]

    @property
    def where(self) -> str:
        """Where :func:`instrument` was called: the two innermost frames, as a traceback
        shows them."""
        frames = [traceback.FrameSummary(*frame, lookup_line=False) for frame in self._stack]
        return "".join(traceback.format_list(frames)).rstrip()

    @property
    def global_step(self) -> int:
        """Optimizer steps done so far (``ppetrace.step``)."""
        return self._tracker.global_step

    @property
    def epoch(self) -> int:
        """Training epochs completed so far: DataLoader iterators that trained and ran out,
        or that the loop left early and then asked the same loader for a new iterator."""
        return self._tracker.epoch

    @property
    def steps(self) -> int:
        """``trainer.step`` spans recorded so far."""
        return self._tracker.steps

    def _refresh_environment(self) -> None:
        """Before each drain until the trace's header is written: take the fields of the
        environment that a script changes again (``refresh_environment``; the machine's
        fields, which cost file reads, stay as captured at the start). ``ppetrace run``
        starts instrument() before the script sets its threads (``torch.set_num_threads``),
        and the trace must say what the steps ran with."""
        exporter = self.trace_exporter
        if exporter is None or exporter.bytes_written:
            with contextlib.suppress(ValueError):
                RECORDER.before_flush.remove(self._refresh_environment)
            return
        with contextlib.suppress(RuntimeError):  # the header was written meanwhile
            exporter.update_metadata(
                environment=refresh_environment(self._environment, device=self.runtime.device_spec)
            )

    def _start(self) -> None:
        started: list[Any] = []
        try:
            if self.trace_path is not None:
                from exporters.chrome import ChromeTraceExporter

                options = dict(self.exporter_options)
                # what it ran on, as the Trainer records it (report, compare --strict-env)
                environment = tracing.capture_environment(device=self.runtime.device_spec)
                self._environment = environment
                options["metadata"] = {
                    "environment": environment,
                    "ppetrace.detail": detail_metadata(*self.detail),
                    NESTING: BY_TIME,  # spans recorded after the fact: readers nest them by time
                    **options.get("metadata", {}),
                }
                self.trace_exporter = ChromeTraceExporter(self.trace_path, **options)
                RECORDER.before_flush.append(self._refresh_environment)
                self._tracker.detail = StepDetail.create(self.trace_exporter, *self.detail, _notice)
                tracing.add_exporter(self.trace_exporter)
            for prof in self.profilers:
                prof.setup(self)
                started.append(prof)
            self._hooks.install()
        except BaseException:
            self._hooks.uninstall()
            for prof in reversed(started):
                _quietly(prof.teardown)
            if self.trace_exporter is not None:
                tracing.remove_exporter(self.trace_exporter)
            raise

    def end_steps(self, error: BaseException | None = None) -> None:
        """Record what the steps hold open now: each thread's open step (at its last
        optimizer step, or now) and the validation after the last step. Under torchrun
        ``ppetrace run`` calls it before it closes the rank's file; :meth:`close` does it
        too (a second call finds nothing open). ``error``: as for :meth:`close`."""
        self._tracker.close(None if error is None else _error_text(error))

    def close(self, error: BaseException | None = None, *, exit_code: int = 0) -> None:
        """End the open step, tear the profilers down, remove every hook and patch (the
        originals come back exactly) and write the trace. Closing twice does nothing.
        ``error``: the exception that ended the loop (the ``with`` block passes it): the
        step it broke off is recorded with ERROR status and the exception's text.
        ``exit_code``: the process's exit code (``ppetrace run`` passes the script's).
        A run that ``error``, a non-zero ``exit_code`` or a training thread that died
        ended is recorded as failed: the trace's closing ``ppetrace.final`` event gets
        ``run_error``, which ``exporters.run_failure`` (and so ``ppetrace compare``)
        reads."""
        with _lock:
            if self.closed:
                return
            self.closed = True
            if self in _active:
                _active.remove(self)
        errors: list[BaseException] = []
        for step in (
            lambda: self.end_steps(error),
            lambda: self._record_outcome(error, exit_code),
            self._hooks.uninstall,
            self._tracker.release,
        ):
            try:
                step()
            except Exception as exc:
                errors.append(exc)
        for prof in reversed(self.profilers):
            try:
                prof.teardown()
            except Exception as exc:
                errors.append(exc)
        try:
            if exit_code:  # the process ends (ppetrace run): the traceback keeps iterators,
                stop_workers(self._workers_mark)  # whose workers send their spans as they exit
        finally:  # (a Ctrl-C while they shut down still writes the trace)
            try:
                settle_workers()
                if self.trace_exporter is not None:
                    tracing.remove_exporter(self.trace_exporter)
                else:
                    tracing.flush()
            except Exception as exc:
                errors.append(exc)
        with contextlib.suppress(ValueError):  # the environment's hook, if never written
            RECORDER.before_flush.remove(self._refresh_environment)
        if errors:
            raise errors[0]

    def _record_outcome(self, error: BaseException | None, exit_code: int) -> None:
        """``run_error`` in the trace's closing event when the run failed (see :meth:`close`)."""
        exporter = self.trace_exporter
        if exporter is None or not hasattr(exporter, "add_final_metadata"):
            return
        if error is not None:
            text = _error_text(error)
        elif exit_code:
            text = f"the process exited with code {exit_code}"
        elif died := self._tracker.thread_errors():
            more = f" (and {len(died) - 1} more)" if len(died) > 1 else ""
            text = f"a training thread died: {died[0]}{more}"
        else:
            return
        exporter.add_final_metadata(run_error=_who() + text)  # "rank R: " under torchrun

    def __enter__(self) -> Instrumentation:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        # sys.exit() and a generator closed are no failure of the step (as in ppetrace run);
        # sys.exit() with a code other than 0 is a failed run all the same
        if isinstance(exc, SystemExit):
            self.close(None, exit_code=_exit_status(exc.code))
        else:
            self.close(None if isinstance(exc, GeneratorExit) else exc)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "active"
        return f"<ppetrace.Instrumentation {state} trace_path={self.trace_path!s}>"


def instrument(
    *,
    trace_path: str | os.PathLike[str] | None = None,
    module_depth: int = 1,
    profilers: Iterable[Any] = (),
    device: str | None = None,
    trace_detail: Any = "auto",
    max_trace_bytes: int = DEFAULT_MAX_TRACE_BYTES,
) -> Instrumentation:
    """Trace any PyTorch training or inference loop, without changing its code.

    Use ``with ppetrace.instrument(trace_path="trace.json"): ...`` or keep the
    handle and call ``handle.close()``. While it is active:

    - every DataLoader iterator's ``__next__`` is a ``trainer.fetch_batch`` span, but
      the one that finds the end (the workers' shutdown), ``trainer.loader_end``;
      ``DataLoader.__iter__`` (the workers' start) is ``trainer.loader_start``;
    - each module call at depth <= ``module_depth`` (1: the outermost only; 0: none,
      though forwards still tell training from evaluation) is a ``module.forward`` span,
      ``ppetrace.module`` = class name or dotted path (a call inside backward, activation
      checkpointing's recomputation, is the backward's);
    - ``torch.autograd.backward`` (which ``Tensor.backward`` calls) is ``trainer.backward``,
      and so is ``torch.autograd.grad`` (which alone makes no batch a training step);
    - ``Optimizer.step`` is ``trainer.optimizer_step`` (torch's global optimizer hooks);
    - each batch that trains becomes a ``trainer.step``, as in ``ppetrace.Trainer``
      (README, "What a step covers"); forward calls under ``no_grad`` outside a
      training step get ``ppetrace.stage = "val"``.

    ``trace_path`` writes a Chrome trace (closed by :meth:`Instrumentation.close`), with
    the environment (:func:`ppetrace.tracing.capture_environment`) in its ``otherData``;
    without it the spans go to whatever :func:`ppetrace.configure` set up. Under
    torchrun (``RANK`` and ``WORLD_SIZE`` set, a world of two or more) each rank
    writes its own file, ``trace.json`` -> ``trace.ranks/rank<R>.json``
    (``handle.trace_path``).
    ``profilers`` are ``ppetrace.profilers`` objects (``Pyinstrument``,
    ``TorchProfiler``, ``CudaTimer``, ...), stepped per batch handed over with
    gradients enabled on this thread; ``device`` is what they read as the
    device (default ``"cuda"`` when CUDA is available, else ``"cpu"``).
    ``trace_detail`` (``"auto"``, ``"all"`` or a ``ppetrace.Schedule``) and
    ``max_trace_bytes`` choose the steps the trace keeps in full, as the
    Trainer's options of those names do (the one-line notice goes to stderr);
    the file is written in parts of 256 MiB (``trace.1.json``, ...) but under
    torchrun.

    While a ``ppetrace.Trainer`` call or a ``LightningProfiler`` traces the loop,
    the hooks stand aside. Only one instrumentation can be active: a second call
    raises ``RuntimeError``.
    """
    if isinstance(module_depth, bool) or not isinstance(module_depth, int) or module_depth < 0:
        raise ValueError(
            "Expected a non-negative int for module_depth (1: the outermost module calls, 0: "
            f"none), but received {module_depth!r}."
        )
    trace_detail, max_trace_bytes = check_detail(trace_detail, max_trace_bytes)
    check_trace_path(trace_path)
    ranks = rank_info() if trace_path is not None else None
    if trace_path is not None and ranks is not None:
        # under torchrun: one file per rank, not one file for all
        trace_path = rank_trace_path(trace_path, ranks.rank)
    profs = list(profilers)
    for i, prof in enumerate(profs):
        missing = [m for m in _PROFILER_METHODS if not callable(getattr(prof, m, None))]
        if missing:
            raise TypeError(
                "Expected profilers with setup(trainer), step_begin(step), step_end(step) and "
                f"teardown(), but profiler {i} ({type(prof).__name__}) lacks {', '.join(missing)}."
            )
    device = profiler_device(device)
    with _lock:
        if _active:
            raise RuntimeError(
                "Expected no other active ppetrace.instrument(), but one is active already "
                f"({_active[0]!r}, started at:\n{_active[0].where}\n). Close it first "
                "(handle.close() or the end of its with block); under `ppetrace run` the "
                "script is instrumented already, so remove its own instrument() call."
            )
        handle = Instrumentation(
            trace_path=trace_path, module_depth=module_depth, profilers=profs, device=device
        )
        handle.detail = (trace_detail, max_trace_bytes)
        handle.exporter_options = {"max_part_bytes": TRACE_PART_BYTES}
        if ranks is not None:  # HTA's distributedInfo; room for the clock fields at the end
            handle.exporter_options.update(
                distributed_info={"rank": ranks.rank, "world_size": ranks.world_size},
                header_reserve=HEADER_RESERVE,
            )
        _active.append(handle)
    try:
        handle._start()
    except BaseException:
        with _lock:
            _active.remove(handle)
        raise
    return handle


def _notice(line: str) -> None:
    """The one-line notice of the switch to windows (``trace_detail="auto"``)."""
    print(line, file=sys.stderr, flush=True)


def _is_span_wrapper(prof: Any) -> bool:
    """A profiler that opens spans itself (``CudaTimer``: ``span`` and ``wrap``)."""
    return callable(getattr(prof, "span", None)) and callable(getattr(prof, "wrap", None))


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception:
        _log.exception("ppetrace: %r failed while instrument() gave up", fn)


def _exit_status(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives a process: 0 for None, the int, else 1."""
    if code is None:
        return 0
    return code & 0xFF if isinstance(code, int) else 1  # as the OS keeps it: 256 is 0
