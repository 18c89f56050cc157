"""Process counters beside the spans: :class:`SystemCounters`.

Counters are sampled at step boundaries (``step_begin``/``step_end``, all
steps or the recorded steps of a schedule) or, with ``interval``, by a
low-rate sampler thread that runs only between ``setup`` and ``teardown``
(importing ppetrace starts no thread). Each sample is timed on the spans'
clock and becomes Chrome ``C`` counter events (one counter track per
counter) and a row of :meth:`SystemCounters.counters_frame`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..tracing._recorder import RECORDER
from ._base import Profiler, sink_of
from ._schedule import Schedule, check_schedule

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["SystemCounters", "default_counters"]

_log = logging.getLogger("ppetrace")
_perf_ns = time.perf_counter_ns
_NEVER = 1 << 62


def default_counters(device: Any = None) -> dict[str, Callable[[], float]]:
    """``cpu_percent`` (this process, since the previous sample; may exceed 100 on several
    cores) and ``rss_bytes`` from psutil, plus ``cuda_allocated_bytes`` and
    ``cuda_reserved_bytes`` when ``device`` is a CUDA device."""
    import psutil

    proc = psutil.Process()
    proc.cpu_percent(None)  # the first call only starts the measurement
    counters: dict[str, Callable[[], float]] = {
        "cpu_percent": lambda: float(proc.cpu_percent(None)),
        "rss_bytes": lambda: float(proc.memory_info().rss),
    }
    if device is not None and str(device).startswith("cuda"):
        import torch

        dev = torch.device(device)
        counters["cuda_allocated_bytes"] = lambda: float(torch.cuda.memory_allocated(dev))
        counters["cuda_reserved_bytes"] = lambda: float(torch.cuda.memory_reserved(dev))
    return counters


class SystemCounters(Profiler):
    """Sample process counters and add them to the trace and to a frame.

    - ``interval``: seconds between samples of a sampler thread (started in
      ``setup``, stopped in ``teardown``); None (default) samples at
      ``step_begin`` and ``step_end`` instead.
    - ``schedule``: with step sampling, sample only the recorded steps of this
      schedule; None samples every step (a few µs per step).
    - ``counters``: ``name -> callable returning a number``; None uses
      :func:`default_counters` for the trainer's device.
    - ``max_samples``: samples kept for :meth:`counters_frame` (oldest dropped).
    - ``emit_every``: samples batched into one ``add_events`` call.
    """

    def __init__(
        self,
        *,
        interval: float | None = None,
        schedule: Schedule | None = None,
        counters: Mapping[str, Callable[[], float]] | None = None,
        max_samples: int = 1_000_000,
        emit_every: int = 256,
    ) -> None:
        if interval is not None and (
            isinstance(interval, bool)
            or not isinstance(interval, (int, float))
            or not interval > 0
            or interval != interval
        ):
            raise ValueError(
                "Expected a positive number of seconds or None for interval, but received "
                f"{interval!r}."
            )
        check_schedule(schedule)
        if counters is not None:
            if not isinstance(counters, Mapping) or not counters:
                raise ValueError(
                    "Expected a non-empty mapping of counter name to callable for counters, "
                    f"but received {counters!r}."
                )
            for name, fn in counters.items():
                if not isinstance(name, str) or not name or not callable(fn):
                    raise ValueError(
                        "Expected counters to map non-empty names to callables, but "
                        f"{name!r} maps to {fn!r}."
                    )
        for label, value in (("max_samples", max_samples), ("emit_every", emit_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Expected a positive int for {label}, but received {value!r}.")
        self.interval = None if interval is None else float(interval)
        self.schedule = schedule
        self.max_samples = max_samples
        self.emit_every = emit_every
        self._given = None if counters is None else dict(counters)
        self.counters: dict[str, Callable[[], float]] = dict(counters or {})
        self._samples: collections.deque[tuple[int, int, tuple[float, ...]]] = collections.deque(
            maxlen=max_samples
        )
        self._pending: list[tuple[int, tuple[float, ...]]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._step = -1
        self._wake = 0  # the first step that step sampling may sample
        self._names: tuple[str, ...] = tuple(self.counters)

    def __repr__(self) -> str:
        return f"SystemCounters(interval={self.interval!r}, schedule={self.schedule!r})"

    # -- the Trainer's hooks -------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        """Choose the counters, take a first sample and start the sampler thread (if any)."""
        self.sink = sink_of(trainer)
        if self._given is None:
            device = getattr(getattr(trainer, "runtime", None), "device_spec", None)
            self.counters = default_counters(device)
        self._names = tuple(self.counters)
        self._step = -1
        self._wake = 0 if self.interval is None else _NEVER
        self.sample()
        if self.interval is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="ppetrace-counters", daemon=True)
            self._thread.start()

    def step_begin(self, step: int) -> None:
        """Sample (step sampling, on a recorded step); one comparison on other steps."""
        self._step = step
        if step >= self._wake and self._recorded(step):
            self.sample()

    def step_end(self, step: int) -> None:
        """Sample (step sampling, on a recorded step); add a full batch of samples to the trace."""
        if step >= self._wake and self._recorded(step):
            self.sample()
        if len(self._pending) >= self.emit_every:
            self._emit_pending()

    def _recorded(self, step: int) -> bool:
        """Whether step sampling samples ``step``; moves ``_wake`` to the next such step."""
        schedule = self.schedule
        if schedule is None or schedule.action(step).records:
            return True
        nxt = schedule.next_step(step + 1, warmup=False)
        self._wake = _NEVER if nxt is None else nxt
        return False

    def teardown(self) -> None:
        """Stop the sampler thread, take a last sample and add every pending sample."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()
        self.sample()
        self._emit_pending()

    # -- sampling ---------------------------------------------------------------------

    def _run(self) -> None:
        stop = self._stop
        interval = self.interval or 1.0
        while not stop.wait(interval):
            self.sample()

    def sample(self) -> None:
        """Read every counter now; a counter that raises is logged and recorded as NaN."""
        t = _perf_ns() + RECORDER.offset_ns
        values = []
        for name, fn in self.counters.items():
            try:
                values.append(float(fn()))
            except Exception:
                self.errors += 1
                _log.exception("ppetrace: the counter %r failed", name)
                values.append(float("nan"))
        row = tuple(values)
        with self._lock:
            self._samples.append((t, self._step, row))
            self._pending.append((t, row))

    def _emit_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending or self.sink is None:
            return
        names = self._names
        events: list[dict[str, Any]] = []
        for t, row in pending:
            for name, value in zip(names, row, strict=True):
                if value == value:  # NaN is no value
                    events.append({"ph": "C", "name": name, "ts_ns": t, "args": {name: value}})
        self.emit(events)

    def counters_frame(self) -> pd.DataFrame:
        """One row per sample: ``time_ns`` (epoch ns, the spans' clock), ``step`` (the step
        being run or last run; <NA> before the first) and one float column per counter."""
        import numpy as np
        import pandas as pd

        with self._lock:
            samples = list(self._samples)
        names = self._names
        data: dict[str, Any] = {
            "time_ns": np.array([s[0] for s in samples], dtype=np.int64),
            "step": pd.array([s[1] if s[1] >= 0 else None for s in samples], dtype="Int64"),
        }
        for i, name in enumerate(names):
            data[name] = np.array([s[2][i] for s in samples], dtype=np.float64)
        return pd.DataFrame(data)
