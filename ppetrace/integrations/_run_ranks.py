"""``ppetrace run`` under torchrun: one trace per rank, on rank 0's clock, merged by rank 0.

A script run by ``ppetrace run`` creates its process group itself, after the
rank's trace file is opened. :class:`RankRun` therefore wraps
``torch.distributed.init_process_group`` and ``destroy_process_group`` while
the script runs:

- once the script's ``init_process_group`` returns (every rank calls it), every
  rank takes rank 0's trace id (the spans recorded from then on carry it) and
  measures its clock against rank 0 (:func:`.distributed.sync_clock`, over a
  gloo group: the default one, or one made for it);
- at the end, when the script destroys the default group, or when it ends with
  exit code 0 with the group alive, every rank records its open step and its
  pending validation, closes its file, measures the clock again, records both
  measurements, the offset and rank 0's trace id in its file's ``otherData``,
  and rank 0 merges the rank files into the trace path as given, as the Trainer
  does (:class:`.distributed.RankTraces`).

A script that fails (an exception, a non-zero exit, a signal) leaves the rank
files unmerged: the other ranks may be inside a collective of their own, which a
merge would meet out of order. The files carry ``distributedInfo`` (``rank``,
``world_size``, from torchrun's environment) from the start; the backend, known
only once the group exists, goes into ``otherData`` at the end.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from .. import tracing
from ..tracing._recorder import RECORDER
from ._join import RankJoinError
from .distributed import ClockSync, RankTraces, rank_traces

__all__ = ["RankRun"]

_log = logging.getLogger("ppetrace")


class RankRun:
    """The distributed part of one ``ppetrace run`` under torchrun (module doc).

    ``handle`` is the run's :class:`~._instrument.Instrumentation` (its
    ``trace_exporter`` writes this rank's file); ``merged`` the trace path as given."""

    def __init__(self, handle: Any, merged: Path) -> None:
        self.handle = handle
        self.merged = merged
        self.traces: RankTraces | None = None
        self._start: ClockSync | None = None
        self.finished = False
        #: whether rank 0 merged the rank files into ``merged``
        self.merged_written = False
        self._saved: list[tuple[str, Any, Any]] = []

    # -- the wrappers ------------------------------------------------------------------

    def install(self) -> None:
        """Wrap ``init_process_group`` and ``destroy_process_group`` of torch.distributed."""
        import torch.distributed as dist

        if not dist.is_available():
            return
        for name, make in (
            ("init_process_group", self._init),
            ("destroy_process_group", self._destroy),
        ):
            orig = getattr(dist, name)
            wrapper = make(orig)
            self._saved.append((name, orig, wrapper))
            setattr(dist, name, wrapper)

    def uninstall(self) -> None:
        """Put the originals back (a replacement made by someone else stays)."""
        import torch.distributed as dist

        for name, orig, wrapper in reversed(self._saved):
            if getattr(dist, name) is wrapper:
                setattr(dist, name, orig)
        self._saved.clear()

    def _init(self, orig: Any) -> Any:
        run = self

        @functools.wraps(orig)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            result = orig(*args, **kwargs)
            if run.traces is None:
                try:
                    run.started()
                except RankJoinError as exc:  # a rank not under ppetrace run: no merge
                    _log.warning(
                        "ppetrace: %s This rank's trace is written alone, not merged.", exc
                    )
                except Exception:
                    _log.exception("ppetrace: measuring the clocks of the ranks failed")
            return result

        return init_process_group

    def _destroy(self, orig: Any) -> Any:
        run = self

        @functools.wraps(orig)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            group = args[0] if args else kwargs.get("group")
            if group is None:  # the default group: the last moment the ranks can talk
                run.finish()
            return orig(*args, **kwargs)

        return destroy_process_group

    # -- start and end -----------------------------------------------------------------

    def started(self) -> None:
        """Right after the script's ``init_process_group``: rank 0's trace id on every
        rank, and the first clock measurement."""
        traces = rank_traces()
        if traces is None:  # (no group: torch.distributed is not available)
            return
        self._start = traces.measure_start()
        self.traces = traces

    def finish(self) -> None:
        """Close this rank's file, record the clock fields in it, and let rank 0 merge
        (collective; once). Nothing when the group never started. A failure is logged,
        not raised: the script's own work is done."""
        import torch.distributed as dist

        if self.finished or self.traces is None or not dist.is_initialized():
            return
        self.finished = True
        try:
            self._finish(self.traces)
        except Exception:
            _log.exception("ppetrace: merging the rank traces into %s failed", self.merged)

    def _finish(self, traces: RankTraces) -> None:
        from exporters.chrome._split import update_run_other_data

        exporter = self.handle.trace_exporter
        if exporter is None:
            return
        try:  # the open step and the pending validation belong in the file
            self.handle.end_steps()
        except Exception:
            _log.exception("ppetrace: ending the open step failed")
        tracing.remove_exporter(exporter)  # the file is complete: spans after it are not in it
        self.handle.trace_exporter = None
        start = self._start
        update_run_other_data(  # every part of this rank's file
            exporter.path,
            {
                "trace_id": f"{RECORDER.trace_id:032x}",
                "clock_offset_ns": 0 if start is None else start.offset_ns,
                "clock_error_ns": 0 if start is None else start.error_ns,
                "backend": traces.backend,
            },
        )
        self.merged_written = traces.finish(self.merged)
