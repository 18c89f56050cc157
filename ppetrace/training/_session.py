"""What surrounds one ``fit``, ``validate`` or ``test`` call of a Trainer.

The trace file (``trace_path``, and the names of later calls' files), the
profilers' setup and teardown, the progress bar and the final flush. Each
function takes the Trainer as ``self``. In distributed training each rank
writes its own file (``trace.ranks/rank<R>.json``), explicit collectives are
traced, only rank 0 draws a progress bar, and rank 0 merges the rank files
into ``trace_path`` once the call ends (``_distributed``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .. import tracing
from ..integrations import _precedence
from ..integrations._detail import (
    DEFAULT_MAX_TRACE_BYTES,
    TRACE_PART_BYTES,
    StepDetail,
    detail_metadata,
)
from ..integrations.dataloader import settle_workers, stop_workers, workers_mark
from ..integrations.distributed import trace_collectives
from ._progress import ProgressBar, progress_wanted
from ._run import Run, TrainerView, run_cleanups

__all__ = ["attach_trace_exporter", "next_trace_path", "session", "trace_file_first"]

_log = logging.getLogger("ppetrace")
#: Trainer calls (fit, validate, test) running now; while it is not 0 the global hooks of
#: ``ppetrace.instrument()`` stand aside, so that nothing is traced twice.
running = 0
# The hooks of an instrument() started before this module was imported read this module
# through _precedence.session: without it they would trace the Trainer's steps again.
_precedence.session[0] = sys.modules[__name__]
# Trainer -> the exporter trace_file_first attached for the session that follows
_attached: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def trace_file_first(self: TrainerView, call: str) -> Iterator[None]:
    """Attach the call's trace exporter before the block, which already traces (the
    module's move to its device), so its spans reach the file; :func:`session` takes the
    exporter over. If the block raises, the exporter is detached and closed."""
    if self.trace_path is None:
        yield
        return
    exporter = attach_trace_exporter(self, call)
    self.trace_exporter = exporter
    try:
        yield
    except BaseException:
        tracing.remove_exporter(exporter)
        if getattr(self, "_dist", None) is not None:  # no merge: this rank's file is all
            self.last_trace_path = exporter.path
        raise
    _attached[self] = exporter


@contextlib.contextmanager
def session(
    self: TrainerView, call: str, run: Run | None, total: int | None = None
) -> Iterator[None]:
    """Trace exporter, profilers and progress bar around a run; flush at the end.

    ``call`` (``"fit"``, ``"validate"`` or ``"test"``) names the trace file of
    every call after the first (:func:`next_trace_path`).
    """
    global running
    cleanups: list[Callable[[], None]] = []
    running += 1
    dist = getattr(self, "_dist", None)
    exporter = None
    mark = workers_mark()  # the DataLoader iterators made after it are this run's
    try:
        early = _attached.pop(self, None)
        if early is not None or self.trace_path is not None:
            self.trace_exporter = early or attach_trace_exporter(self, call)
            exporter = self.trace_exporter
            cleanups.append(lambda: tracing.remove_exporter(exporter))
            if run is not None:
                run.detail = StepDetail.create(exporter, *_detail_of(self), _notifier(self))
        cleanups.insert(0, tracing.flush)
        cleanups.insert(0, settle_workers)  # before it: persistent DataLoader workers send
        if dist is not None:  # the user's explicit collectives, as dist.<name> spans
            collectives = contextlib.ExitStack()
            collectives.enter_context(trace_collectives())
            cleanups.append(collectives.close)
        if run is not None:
            for prof in self.profilers:
                prof.setup(self)
                cleanups.insert(0, prof.teardown)
            if progress_wanted(self.progress, self.progress_stream) and (
                dist is None or dist.rank == 0
            ):
                run.progress = ProgressBar(
                    total,
                    stream=self.progress_stream,
                    initial=self._batches_seen,
                    initial_step=self.global_step,
                )
                bar = self._progress_bar = run.progress

                def close_bar() -> None:
                    self._progress_bar = None
                    bar.close(self._batches_seen, self.global_step, run.last_loss)

                cleanups.insert(0, close_bar)
        yield
    except BaseException:
        try:
            stop_workers(mark)  # the traceback keeps them: their workers' spans come as they exit
        finally:  # (a Ctrl-C while they shut down still closes everything)
            run_cleanups(cleanups, failing=True)
        if dist is not None and exporter is not None:  # no merge: this rank's file is all
            self.last_trace_path = exporter.path
        raise
    else:
        run_cleanups(cleanups, failing=False)
        merged = self.last_trace_path
        # rank 0 merges every rank's file; with too many ranks, none: this rank's file
        if dist is not None and exporter is not None and merged is not None:
            self.last_trace_path = merged if dist.finish_trace(merged) else exporter.path
    finally:
        running -= 1


def _detail_of(self: Any) -> tuple[Any, int]:
    """The Trainer's ``trace_detail`` and ``max_trace_bytes``."""
    return (
        getattr(self, "trace_detail", "auto"),
        getattr(self, "max_trace_bytes", DEFAULT_MAX_TRACE_BYTES),
    )


def next_trace_path(self: TrainerView, call: str) -> Path:
    """The file for this call: ``trace_path`` unless this Trainer already wrote it, else
    ``<stem>.<call><suffix>`` (``<stem>.<call><n><suffix>`` for the n-th such call,
    n >= 2), never a file this Trainer wrote before."""
    assert self.trace_path is not None
    path = Path(self.trace_path)
    count = self._trace_calls.get(call, 0) + 1
    self._trace_calls[call] = count
    written = {p.absolute() for p in self.trace_paths}
    if path.absolute() not in written:
        return path
    name = path.name
    suffix = ".json.gz" if name.endswith(".json.gz") else path.suffix
    stem = name[: len(name) - len(suffix)] if suffix else name
    while True:
        candidate = path.with_name(f"{stem}.{call}{'' if count == 1 else count}{suffix}")
        if candidate.absolute() not in written:
            return candidate
        count += 1


def attach_trace_exporter(self: TrainerView, call: str) -> Any:
    """A Chrome trace exporter for this call's file (:func:`next_trace_path`), recording
    the environment (:func:`ppetrace.tracing.capture_environment`) in its ``otherData``,
    added to the recorder's exporters."""
    try:
        from exporters.chrome import ChromeTraceExporter
    except ImportError as exc:
        raise RuntimeError(
            f"Expected exporters.ChromeTraceExporter for trace_path={str(self.trace_path)!r}, "
            f"but it cannot be imported ({exc}). Install ppetrace with its exporters package."
        ) from exc
    path = next_trace_path(self, call)
    environment = tracing.capture_environment(device=getattr(self, "device", None))
    detail = detail_metadata(*_detail_of(self))
    dist = getattr(self, "_dist", None)
    if dist is None:
        exporter = ChromeTraceExporter(
            path,
            metadata={"environment": environment, "ppetrace.detail": detail},
            max_part_bytes=TRACE_PART_BYTES,
        )
    else:  # this rank's file, on rank 0's clock; rank 0 merges them into path at the end
        options = dist.trace_options()
        options["metadata"]["environment"] = environment
        options["metadata"]["ppetrace.detail"] = detail
        exporter = ChromeTraceExporter(dist.rank_path(path), **options)
        self.trace_paths.append(dist.rank_path(path))
    self.last_trace_path = path
    self.trace_paths.append(path)
    _log.info("ppetrace: writing the %s trace to %s", call, exporter.path)
    tracing.add_exporter(exporter)
    return exporter


def _notifier(trainer: Any) -> Callable[[str], None]:
    """Where the switch notice goes: stderr, above the progress bar when one is drawn."""
    out = getattr(trainer, "print", None)
    if out is None:
        return lambda line: print(line, file=sys.stderr, flush=True)
    return lambda line: out(line, file=sys.stderr)
