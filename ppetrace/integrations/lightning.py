"""``LightningProfiler``: Lightning's profiler actions as ppetrace spans.

Use it as ``lightning.Trainer(profiler=LightningProfiler(trace_path="trace.json"))``.
Every action Lightning profiles (``start(action)``/``stop(action)``) becomes a span; the
actions that mean the same as a ppetrace hook take its event name, so that the step
report, ``compare`` and the Chrome trace read a Lightning run like a Trainer run:

==============================================  ==========================
Lightning action                                ppetrace event
==============================================  ==========================
``run_training_batch``                          ``trainer.step``
``[Strategy|LightningModule]<X>.training_step``  ``module.train_step``
``[Strategy|LightningModule]<X>.backward``       ``trainer.backward``
``[LightningModule]<X>.optimizer_step``,        ``trainer.optimizer_step``
``[Strategy]<X>.optimizer_step``,
``optimizer_step`` (manual optimization)
``[<loop>].train_dataloader_next``              ``trainer.fetch_batch``
==============================================  ==========================

Every span keeps the Lightning action in the attribute ``lightning.action``; every other
action is a span under its Lightning name. Lightning's validation loop (from its first
hook inside the loop, ``on_validation_model_eval``, to the strategy's
``on_validation_end``) is wrapped in a ``trainer.validation`` span, so that it is left out
of step time as the Trainer's is. Lightning runs ``training_step`` and ``backward`` inside
the optimizer step's closure, so ``trainer.optimizer_step`` contains them at accumulation
boundaries. An exception that leaves an action is the run's ``run_error``.

Each action is recorded when it ends (:mod:`._record`), with ids handed out when it
starts, so Lightning's spans nest among themselves by id; the OpenTelemetry context is
left alone, which keeps an action about as cheap as Lightning's simple profiler's. Spans
that user code records inside an action are nested under it by time in the exporters.
Lightning calls the profiler from the thread that runs its loop.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lightning.pytorch.profilers import Profiler

from exporters._spans import BY_TIME, NESTING

from .. import tracing
from ..tracing._recorder import RECORDER, _error_text
from . import _precedence
from ._detail import (
    DEFAULT_MAX_TRACE_BYTES,
    TRACE_PART_BYTES,
    StepDetail,
    _who,
    check_detail,
    detail_metadata,
)
from ._ranks import check_trace_path, profiler_device, rank_now, stage_path, this_rank_path
from ._record import RowBuffer, SpanRow, current_parent, next_ids
from .dataloader import settle_workers, stop_workers, trace_loaders, workers_mark
from .distributed import rank_traces

_tuple_new = tuple.__new__

__all__ = ["LightningProfiler", "ppetrace_event"]

_log = logging.getLogger("ppetrace")
_perf_ns = time.perf_counter_ns
STEP = "trainer.step"
OPTIMIZER_STEP = "trainer.optimizer_step"
VALIDATION = "trainer.validation"
_EXACT = {
    "run_training_batch": STEP,
    "optimizer_step": OPTIMIZER_STEP,
}
_SUFFIXES = {
    ".training_step": "module.train_step",
    ".backward": "trainer.backward",
    ".optimizer_step": OPTIMIZER_STEP,
}
_OWNERS = ("[Strategy]", "[LightningModule]")


def _notice(line: str) -> None:
    """The one-line notice of the switch to windows, above Lightning's progress bar."""
    try:
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)
    except ImportError:
        print(line, file=sys.stderr, flush=True)


_PROFILER_METHODS = ("setup", "step_begin", "step_end", "teardown")
# what an action does besides its span (0: nothing)
_STEP, _OPTIMIZER, _EPOCH, _VAL_START, _VAL_END = 1, 2, 3, 4, 5
#: the hooks that Lightning's evaluation loop runs first (``on_run_start``, once it knows it
#: has batches to run; ``on_validation_model_zero_grad`` comes before that check, and a
#: loop without batches would leave a span open)
_VAL_FIRST = (".on_validation_model_eval", ".on_validation_start")
#: ``ppetrace.stage`` of every action in a Lightning stage that does not train: its spans
#: are no training time for the report and ``compare`` (fit's validation has its own span)
_STAGE_LABELS = {"validate": "val", "test": "test", "predict": "predict"}


def _classify(action: str, stage: str | None = None) -> tuple[str, int, dict[str, Any]]:
    """(event name, kind, the attributes of its spans) of a Lightning action, computed once
    per stage (``stage``: the ``ppetrace.stage`` of a stage that does not train). The
    attributes are shared by all of its spans: nothing writes to them (a CudaTimer
    copies the attributes of the spans it times)."""
    event = ppetrace_event(action)
    if event == STEP:
        kind = _STEP
    elif event == OPTIMIZER_STEP:
        kind = _OPTIMIZER
    elif action == "run_training_epoch":
        kind = _EPOCH
    elif action.endswith(_VAL_FIRST):  # the first of them opens the validation
        kind = _VAL_START
    elif action.startswith("[Strategy]") and action.endswith(".on_validation_end"):
        kind = _VAL_END
    else:
        kind = 0
    if stage is not None:
        return event, kind, {"lightning.action": action, "ppetrace.stage": stage}
    return event, kind, {"lightning.action": action}


def ppetrace_event(action: str) -> str:
    """The ppetrace event name of a Lightning action (the action itself when none applies)."""
    name = _EXACT.get(action)
    if name is not None:
        return name
    if action.endswith(".train_dataloader_next"):
        return "trainer.fetch_batch"
    if action.startswith(_OWNERS):
        for suffix, event in _SUFFIXES.items():
            if action.endswith(suffix):
                return event
    return action


class _Action:
    """What :meth:`LightningProfiler.profile` returns for one action: ``start`` on entry,
    ``stop`` on exit, without the base class's generator and ``contextlib`` wrapper per
    call. It holds no state of a call: one serves every call of its action."""

    __slots__ = ("_start", "_stop", "_name", "_raised")

    def __init__(self, profiler: Any, name: str) -> None:
        self._start, self._stop, self._name = profiler.start, profiler.stop, name
        self._raised = profiler.raised

    def __enter__(self) -> str:
        self._start(self._name)
        return self._name

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        self._stop(self._name)  # Lightning tears nothing down on an exception: say it here
        if exc is not None and not isinstance(exc, (StopIteration, GeneratorExit)):
            self._raised(exc)


def _nothing() -> None:
    pass


def _tuner_exit(exc: BaseException) -> bool:
    return type(exc).__name__ == "_TunerExitException"  # Lightning's end of a tuner's run


_UNENDED = "the stage ended without Lightning's end of a stage: an error that left no action"


class LightningProfiler(Profiler):
    """A Lightning ``Profiler`` that records every action as a ppetrace span.

    - ``trace_path``: write a Chrome trace. The first stage Lightning runs with this profiler
      (``fit``, ``validate``, ``test``, ``predict``) writes ``trace_path``; later ones write
      beside it (``trace.test.json``, ``trace.fit2.json``), as ppetrace's Trainer does. Under
      torchrun each rank writes ``trace.ranks/rank<R>.json`` (``distributedInfo``, rank 0's
      trace id and clock) and rank 0 merges them into the stage's file when the stage ends
      well. Without it, spans go to whatever ``ppetrace.configure`` set up.
    - ``dirpath`` and ``filename``: as for Lightning's own profilers. Without ``trace_path``,
      both together put the trace in ``<dirpath>/<filename>.json``, and Lightning writes the
      summary, which names the trace and the command that reports on it, to
      ``<dirpath>/<stage>-<filename>.txt``. A ``filename`` alone writes no trace (its summary
      file, in the log directory, says how to get one).
    - ``profilers``: ``ppetrace.profilers`` objects (``CudaTimer``, ``Pyinstrument``,
      ``TorchProfiler``...), stepped around each training batch. A ``CudaTimer`` times the
      spans of device work (``trainer.step``, ``module.train_step``, ``trainer.backward``,
      ``trainer.optimizer_step``).
    - ``device``: what the profilers read as the device (default ``"cuda"`` when CUDA is
      available, else ``"cpu"``).
    - ``report``: :meth:`summary` (which Lightning prints at the end of each stage) renders
      the step report of the trace (read back with pandas: about 0.1 s). Off by default: the
      summary then names the trace and the ``ppetrace report`` command.
    - ``warmup_steps``: left out of the step report.
    - ``trace_detail`` and ``max_trace_bytes``: as for ``ppetrace.Trainer`` (README, "Long
      runs"): every span in full until the trace holds ``max_trace_bytes``, then 1 training
      batch in 1,000 in full and the others summarised; ``"all"`` keeps every span, a
      ``ppetrace.Schedule`` uses its windows from the start.

    A stage that raises writes its trace, with ``run_error`` (a failed run to ``compare``),
    as the error leaves Lightning's outermost action, once its loaders' workers are shut
    down (their spans come as they exit). An error that leaves no action (a validation
    batch's fetch) ends its stage with ``run_error`` at the next stage or at the profiler's
    collection. While set up, ``instrument()``'s hooks stand aside.
    """

    def __init__(
        self,
        trace_path: str | os.PathLike[str] | None = None,
        *,
        profilers: Iterable[Any] = (),
        device: str | None = None,
        report: bool = False,
        warmup_steps: int = 1,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        trace_detail: Any = "auto",
        max_trace_bytes: int = DEFAULT_MAX_TRACE_BYTES,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self._given_dirpath = dirpath
        self._active = False  # first: teardown (also from __del__) reads it
        self._raised: BaseException | None = None  # the exception run_error names
        self._untrace_loaders: Callable[[], None] = _nothing
        #: ``(trace_detail, max_trace_bytes)``: which steps the trace keeps in full
        self.detail = check_detail(trace_detail, max_trace_bytes)
        check_trace_path(trace_path)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(
                f"Expected a non-negative int for warmup_steps, but received {warmup_steps!r}."
            )
        self.profilers = list(profilers)
        for i, prof in enumerate(self.profilers):
            missing = [m for m in _PROFILER_METHODS if not callable(getattr(prof, m, None))]
            if missing:
                raise TypeError(
                    "Expected profilers with setup(trainer), step_begin(step), step_end(step) "
                    f"and teardown(), but profiler {i} ({type(prof).__name__}) lacks "
                    f"{', '.join(missing)}."
                )
        device = profiler_device(device)
        self.trace_path = None if trace_path is None else Path(trace_path)
        self.report = bool(report)
        self.warmup_steps = warmup_steps
        #: what profilers read as ``trainer.runtime``
        self.runtime = types.SimpleNamespace(device_spec=device)
        #: the ChromeTraceExporter of the current or last stage, or None
        self.trace_exporter: Any = None
        #: the trace file of the current or last stage, and all of them in order
        self.last_trace_path: Path | None = None
        self.trace_paths: list[Path] = []
        #: optimizer steps done (``ppetrace.step``), training epochs started, batches stepped
        self.global_step = 0
        self.epoch = -1
        self.batches = 0
        self._timer = next((p for p in self.profilers if callable(getattr(p, "wrap", None))), None)
        # open spans: (action, event, start, trace id, span id, parent id, attrs, pair)
        self._stack: list[tuple[Any, ...]] = []
        self._rows: RowBuffer | None = None
        self._step_detail: StepDetail | None = None
        self._ids: Any = None
        self._actions: dict[str, tuple[str, int, dict[str, Any]]] = {}
        self._batch_in_epoch = 0
        self._opt_depth = 0
        self._in_validation = False
        self._stage_label: str | None = None
        self._active = False
        self._calls: dict[str, int] = {}
        self._warned = False
        self._profiled: dict[str, _Action] = {}
        #: under torchrun: this stage's RankTraces and merged file, and the gloo group
        #: (made once: every rank makes it at the same point, in setup)
        self._rank_traces: Any = None
        self._merged: Path | None = None
        self._rank_group: tuple[Any, str] | None = None
        self._merging = False  # inside describe(): the one teardown that may merge

    # -- Lightning's Profiler interface ---------------------------------------------------

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        """Start of a Lightning stage: open the trace file and set the profilers up."""
        if self._active:  # the last stage never ended (an error no action saw): it ends now
            self._unended()
            self.teardown(None)
        super().setup(stage, local_rank=local_rank, log_dir=log_dir)
        self._active, self._raised = True, None
        _precedence.drivers[0] += 1
        # Lightning's loaders' workers trace here; the mark: its iterators, for stop_workers
        self._untrace_loaders, self._workers_mark = trace_loaders(), workers_mark()
        self._rows = RowBuffer()  # on the thread that runs Lightning's loop
        self._ids = next_ids()
        name = str(getattr(stage, "value", stage) or "fit")
        self._stage_label = _STAGE_LABELS.get(name)
        self._actions = {}  # classified anew: the stage is in their attributes
        if self.trace_path is None and self.filename and self._given_dirpath is not None:
            # Lightning's profilers write under dirpath when given a filename, so does the
            # trace (its summary goes to Lightning's text file beside it); not in the logger's
            # folder: a file there before the logger starts makes Lightning warn of deletion.
            self.trace_path = Path(self._given_dirpath) / f"{self.filename}.json"
            check_trace_path(self.trace_path)
        if self.trace_path is not None:
            from exporters.chrome import ChromeTraceExporter

            merged = stage_path(self.trace_path, name, self._calls, self.trace_paths)
            path = this_rank_path(merged)
            path.parent.mkdir(parents=True, exist_ok=True)
            options: dict[str, Any] = {"max_part_bytes": TRACE_PART_BYTES}
            # under torchrun, with the strategy's process group up (Lightning starts it
            # before the profiler): rank 0's trace id and clock, merged at the stage's end
            self._rank_traces = None
            if rank_now() is not None:
                try:  # telemetry never breaks training: a plain rank file without it
                    self._rank_traces = rank_traces(self._rank_group)
                    if self._rank_traces is not None:
                        self._rank_group = (self._rank_traces.group, self._rank_traces.backend)
                        options.update(self._rank_traces.exporter_options())
                except Exception:
                    _log.exception("ppetrace: aligning the ranks' traces failed; not merged")
                    self._rank_traces = None
                    options = {"max_part_bytes": TRACE_PART_BYTES}
            self._merged = merged if self._rank_traces is not None else None
            options["metadata"] = {
                **options.get("metadata", {}),
                "ppetrace.detail": detail_metadata(*self.detail),
                NESTING: BY_TIME,  # spans recorded after the fact: readers nest them by time
                "ppetrace.stage": name,  # merge refuses rank files of different stages
                # what it ran on, as the Trainer and instrument() record it (report, compare)
                "environment": tracing.capture_environment(device=self.runtime.device_spec),
            }
            self.trace_exporter = ChromeTraceExporter(path, **options)
            self.last_trace_path = path
            self.trace_paths.append(path)
            self._step_detail = StepDetail.create(self.trace_exporter, *self.detail, _notice)
            tracing.add_exporter(self.trace_exporter)
        for prof in self.profilers:
            prof.setup(self)

    def profile(self, action_name: str) -> Any:
        """A context manager around the action ``action_name``: :meth:`start` on entry (it
        gives the action name, as Lightning's does), :meth:`stop` on exit, also on an error."""
        action = self._profiled.get(action_name)
        if action is None:
            action = self._profiled[action_name] = _Action(self, action_name)
        return action

    def start(self, action_name: str) -> None:
        """Begin the span of ``action_name`` (its ppetrace name when it has one)."""
        if not self._active:
            return
        known = self._actions.get(action_name)
        if known is None:
            known = self._actions[action_name] = _classify(action_name, self._stage_label)
        event, kind, attrs = known
        if kind:
            if kind == _STEP:
                self._begin_step()
                attrs = {
                    "lightning.action": action_name,
                    "ppetrace.step": self.global_step,
                    "ppetrace.epoch": self.epoch,
                    "ppetrace.batch_idx": self._batch_in_epoch,
                    "ppetrace.stage": "train",
                }
            elif kind == _OPTIMIZER:
                self._opt_depth += 1
            elif kind == _EPOCH:
                self.epoch += 1
                self._batch_in_epoch = 0
            elif kind == _VAL_START and not self._in_validation:
                val_attrs = {"ppetrace.step": self.global_step, "ppetrace.stage": "val"}
                self._open(None, VALIDATION, val_attrs)
                self._in_validation = True
        if self._timer is not None:
            self._open(action_name, event, attrs)
            if kind == _STEP and self._step_detail is not None:
                self._summarise(self._stack[-1][2])
            return
        # _open without a timer, inline: this runs for every action
        stack = self._stack
        if stack:
            top = stack[-1]
            trace_id, parent_id = top[3], top[4]
        else:
            trace_id, parent_id = current_parent()
        span_id = next(self._ids)
        start = _perf_ns()
        stack.append((action_name, event, start, trace_id, span_id, parent_id, attrs, None))
        if kind == _STEP and self._step_detail is not None:
            self._summarise(start)

    def raised(self, exc: BaseException) -> None:
        """An exception left an action: ``run_error``, once; the outermost: the stage ends.
        No failure: ``sys.exit(0)``, and the exception that ends a Lightning tuner's run."""
        if (isinstance(exc, SystemExit) and exc.code in (None, 0)) or _tuner_exit(exc):
            return
        exporter = self.trace_exporter
        if exc is not self._raised and exporter is not None:
            self._raised = exc
            exporter.add_final_metadata(run_error=_who() + _error_text(exc))
        if not self._stack and self._active:
            try:
                stop_workers(self._workers_mark)  # the workers send their spans as they exit
            finally:
                self.teardown(self._stage)

    def _unended(self) -> None:
        """``run_error`` for a stage left without Lightning's end (``describe``): _UNENDED."""
        if self._active and self._raised is None and self.trace_exporter is not None:
            self.trace_exporter.add_final_metadata(run_error=_who() + _UNENDED)

    def __del__(self) -> None:  # Lightning's teardown after an error that no action saw
        if getattr(self, "_raised", True) is None:  # (set up: __init__ ran)
            self._unended()
        super().__del__()

    def _summarise(self, start: int) -> None:
        """The training batch that starts at ``start`` (perf_counter ns): publish it to the
        trace exporter when the detail policy summarises it."""
        detail, rows = self._step_detail, self._rows
        if detail is not None and detail.armed and rows is not None and detail.due(self.batches):
            detail.summarise_at(start + RECORDER.offset_ns, rows.tid)

    def stop(self, action_name: str) -> None:
        """End the span of ``action_name`` (and, out of order, any begun after it)."""
        stack = self._stack
        if stack and stack[-1][0] == action_name:  # the usual case: the innermost one
            # _close_top and RowBuffer.record, inline: this runs for every action
            _, event, start, trace_id, span_id, parent_id, attrs, pair = stack.pop()
            end = _perf_ns()
            if pair is not None:
                pair.__exit__(None, None, None)
            rows = self._rows
            rec = RECORDER
            if rows is not None and rec.enabled:
                if rows.pid != rec.pid:
                    rows.refresh()
                records = rows.records
                offset = rec.offset_ns
                records.append(
                    _tuple_new(
                        SpanRow,
                        (
                            event,
                            span_id,
                            parent_id,
                            trace_id,
                            start + offset,
                            end + offset,
                            rows.tid,
                            attrs,
                            "UNSET",
                            "",
                        ),
                    )
                )
                if len(records) >= rec.capacity:
                    rec.on_full(records)
        elif not self._active or not self._close_to(action_name):
            return  # started before setup, or already closed
        kind = self._actions[action_name][1]
        if kind:
            if kind == _STEP:
                self._end_step()
            elif kind == _OPTIMIZER:
                self._opt_depth -= 1
                if self._opt_depth == 0:
                    self.global_step += 1
            elif kind == _VAL_END and self._in_validation:
                self._in_validation = False
                if stack and stack[-1][0] is None:  # the trainer.validation around the loop
                    self._close_top()

    def _close_to(self, action_name: str) -> bool:
        """Close ``action_name`` and the spans opened after it; False when it is not open."""
        stack = self._stack
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] == action_name:
                break
        else:
            return False
        if not self._warned:
            self._warned = True
            _log.warning(
                "ppetrace: Lightning stopped %r before the actions started inside it; their "
                "spans end with it.",
                action_name,
            )
        while len(stack) > i:
            self._close_top()
        return True

    def summary(self) -> str:
        """Where the trace is and how to report on it; with ``report=True``, the step report
        of the trace written so far. Without a trace, how to get one when Lightning writes
        the summary to a file (``filename``), else empty."""
        exporter = self.trace_exporter
        if exporter is None or self.last_trace_path is None:
            if self.filename:  # Lightning writes this to its file: never an empty one
                return (
                    "ppetrace: no trace was written. Pass LightningProfiler(trace_path=...), "
                    "or dirpath= with filename=, to write one.\n"
                )
            return ""
        path = self.last_trace_path
        if not self.report and self._merged is not None and self._rank_traces is not None:
            return (  # merged at the teardown after this summary, if all goes well
                f"ppetrace: this rank's Lightning actions are traced in {path}; at the end of "
                f"the stage rank 0 merges the ranks' files into {self._merged}. Print the "
                f"step report with: ppetrace report {self._merged} --warmup {self.warmup_steps}\n"
            )
        if not self.report:
            if self._stage_label is not None:  # no training steps: the warmup means nothing
                return (
                    f"ppetrace: Lightning's actions are traced in {path} (a stage that does "
                    f"not train: the report has no steps, its actions are in the validation "
                    f"table); print the report with: ppetrace report {path}\n"
                )
            return (
                f"ppetrace: Lightning's actions are traced in {path}; print the step report "
                f"with: ppetrace report {path} --warmup {self.warmup_steps}\n"
            )
        try:
            import exporters

            tracing.flush()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", exporters.TraceTruncatedWarning)
                frame = exporters.read_chrome_trace(self.last_trace_path)
            if not len(frame):
                return ""
            report = exporters.step_report(frame, warmup_steps=self.warmup_steps)
            return exporters.render(report, "table")
        except Exception as exc:  # a summary never breaks the run
            _log.warning("ppetrace: no step report for the Lightning run: %s", exc)
            return ""

    def teardown(self, stage: str | None) -> None:
        """End of a stage: close open spans, tear the profilers down, write the trace."""
        try:
            if self._active:
                self._active = False
                _precedence.drivers[0] = max(0, _precedence.drivers[0] - 1)
                errors: list[BaseException] = []
                while self._stack:
                    try:
                        self._close_top()
                    except Exception as exc:
                        errors.append(exc)
                self._in_validation = False
                self._opt_depth = 0
                if self._rows is not None:
                    self._rows.close()
                    self._rows = None
                self._step_detail = None
                for prof in reversed(self.profilers):
                    try:
                        prof.teardown()
                    except Exception as exc:
                        errors.append(exc)
                settle_workers()
                self._untrace_loaders()
                if self.trace_exporter is not None:
                    tracing.remove_exporter(self.trace_exporter)
                else:
                    tracing.flush()
                self._merge_ranks()
                for error in errors:
                    _log.error("ppetrace: LightningProfiler teardown: %r", error)
        finally:
            super().teardown(stage)

    # -- internals -----------------------------------------------------------------------

    def describe(self) -> None:
        """Lightning's end of a stage that ended well (every rank at the same point): the
        summary, then :meth:`teardown`, which may merge the ranks' files."""
        self._merging = True
        try:
            super().describe()
        finally:
            self._merging = False

    def _merge_ranks(self) -> None:
        """Under torchrun, in the teardown that :meth:`describe` runs (a stage that ended
        well; one after an exception never merges: the other ranks may be elsewhere, and a
        collective would wait): measure the clock again, rank 0 merges (as the Trainer)."""
        traces, merged, self._rank_traces = self._rank_traces, self._merged, None
        if traces is None or merged is None or not self._merging or sys.exc_info()[0]:
            return
        try:
            if traces.finish(merged):
                self.last_trace_path = merged
                self.trace_paths.append(merged)
        except Exception:
            _log.exception("ppetrace: merging the rank traces into %s failed", merged)

    def _open(self, action: str | None, event: str, attrs: dict[str, Any]) -> None:
        """Begin a span: its id now (the spans begun inside it are its children), its row
        when it ends. The OpenTelemetry context is left alone, which keeps an action
        about as cheap as Lightning's simple profiler's; spans your code records inside
        an action are nested under it by time in the exporters."""
        stack = self._stack
        if stack:
            top = stack[-1]
            trace_id, parent_id = top[3], top[4]
        else:
            trace_id, parent_id = current_parent()
        start = _perf_ns()
        pair = None
        timer = self._timer
        if timer is not None and event in timer.spans:
            attrs = dict(attrs)  # the timer writes the device time into it
            pair = timer.wrap(event, attrs)
            if pair is not None:
                RECORDER.hooked[id(attrs)] = attrs  # copied when the row is taken
                pair.begin(start, None)
        stack.append((action, event, start, trace_id, next(self._ids), parent_id, attrs, pair))

    def _close_top(self) -> None:
        _, event, start, trace_id, span_id, parent_id, attrs, pair = self._stack.pop()
        end = _perf_ns()
        if pair is not None:
            pair.__exit__(None, None, None)
        rows = self._rows
        if rows is not None:
            rows.record(event, start, end, (trace_id, parent_id), attrs, span_id)

    def _begin_step(self) -> None:
        for prof in self.profilers:
            try:
                prof.step_begin(self.batches)
            except Exception:
                _log.exception("ppetrace: profiler %r failed at step_begin", prof)

    def _end_step(self) -> None:
        for prof in self.profilers:
            try:
                prof.step_end(self.batches)
            except Exception:
                _log.exception("ppetrace: profiler %r failed at step_end", prof)
        self.batches += 1
        self._batch_in_epoch += 1
