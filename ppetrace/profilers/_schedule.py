"""Which training steps the heavy profilers record: :class:`Schedule`.

The semantics are those of ``torch.profiler.schedule``: skip ``skip_first``
steps, then run cycles ("windows") of ``wait`` idle steps, ``warmup`` steps
where a profiler runs but its results are thrown away, and ``active`` steps
that are recorded; the last active step of a window is the one where the
window's results are saved. ``repeat`` cycles are run (``0``: forever).

A schedule is a pure function of the step number (the number of training
batches completed before the step, over the whole run), so a run resumed at
step ``k`` continues exactly the plan of the run it resumes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

__all__ = ["ProfilerAction", "Schedule"]


class ProfilerAction(enum.Enum):
    """What a profiler does during one step (the names of ``torch.profiler.ProfilerAction``)."""

    NONE = 0
    WARMUP = 1
    RECORD = 2
    RECORD_AND_SAVE = 3

    @property
    def records(self) -> bool:
        """True for ``RECORD`` and ``RECORD_AND_SAVE``."""
        return self is ProfilerAction.RECORD or self is ProfilerAction.RECORD_AND_SAVE


def check_schedule(schedule: Any) -> None:
    """Raise ``TypeError`` unless ``schedule`` is a :class:`Schedule` or None."""
    if schedule is not None and not isinstance(schedule, Schedule):
        raise TypeError(
            "Expected a ppetrace.profilers.Schedule or None for schedule, but received "
            f"{type(schedule).__name__}."
        )


def _check_count(name: str, value: Any, *, minimum: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"Expected a {kind} int for {name} ({meaning}), but received {value!r}.")
    return value


class Schedule:
    """The plan of profiled steps: ``skip_first``, then windows of ``wait``/``warmup``/``active``.

    ``action(step)`` says what a profiler does during ``step``; it depends on
    nothing but ``step``, so it is resume-aware by construction. All
    arguments are keyword-only ints: ``wait``, ``warmup``, ``skip_first`` and
    ``repeat`` at least 0 (``repeat=0`` repeats forever), ``active`` at
    least 1.
    """

    __slots__ = ("wait", "warmup", "active", "repeat", "skip_first", "_cycle")

    def __init__(
        self,
        *,
        wait: int = 0,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        skip_first: int = 0,
    ) -> None:
        self.wait = _check_count("wait", wait, minimum=0, meaning="idle steps in each window")
        self.warmup = _check_count(
            "warmup", warmup, minimum=0, meaning="warm-up steps in each window"
        )
        self.active = _check_count(
            "active", active, minimum=1, meaning="recorded steps in each window"
        )
        self.repeat = _check_count(
            "repeat", repeat, minimum=0, meaning="number of windows, 0 for no limit"
        )
        self.skip_first = _check_count(
            "skip_first", skip_first, minimum=0, meaning="steps skipped before the first window"
        )
        self._cycle = self.wait + self.warmup + self.active

    def __repr__(self) -> str:
        return (
            f"Schedule(wait={self.wait}, warmup={self.warmup}, active={self.active}, "
            f"repeat={self.repeat}, skip_first={self.skip_first})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[int, int, int, int, int]:
        return (self.wait, self.warmup, self.active, self.repeat, self.skip_first)

    @staticmethod
    def _check_step(step: Any) -> int:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(
                f"Expected a non-negative int step number (training batches completed before "
                f"this one), but received {step!r}."
            )
        return step

    def window(self, step: int) -> int | None:
        """The zero-based index of the window (cycle) that ``step`` belongs to, or None
        before ``skip_first`` and after the last window."""
        step = self._check_step(step)
        if step < self.skip_first:
            return None
        index = (step - self.skip_first) // self._cycle
        if self.repeat and index >= self.repeat:
            return None
        return index

    def action(self, step: int) -> ProfilerAction:
        """What a profiler does during ``step`` (see :class:`ProfilerAction`)."""
        step = self._check_step(step)
        if step < self.skip_first:
            return ProfilerAction.NONE
        rel = step - self.skip_first
        if self.repeat and rel // self._cycle >= self.repeat:
            return ProfilerAction.NONE
        mod = rel % self._cycle
        if mod < self.wait:
            return ProfilerAction.NONE
        if mod < self.wait + self.warmup:
            return ProfilerAction.WARMUP
        if mod < self._cycle - 1:
            return ProfilerAction.RECORD
        return ProfilerAction.RECORD_AND_SAVE

    __call__ = action

    def next_step(self, step: int, *, warmup: bool = True) -> int | None:
        """The first step at or after ``step`` whose action is not ``NONE`` (or, with
        ``warmup=False``, that records); None when no window is left."""
        step = self._check_step(step)
        s = max(step, self.skip_first)
        rel = s - self.skip_first
        index, mod = divmod(rel, self._cycle)
        if self.repeat and index >= self.repeat:
            return None
        first = self.wait if warmup else self.wait + self.warmup
        if mod < first:
            s += first - mod
        return s

    def window_steps(self, index: int) -> range:
        """The recorded (active) steps of window ``index``."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"Expected a non-negative int window index, but received {index!r}.")
        if self.repeat and index >= self.repeat:
            raise ValueError(
                f"Expected a window index below repeat={self.repeat}, but received {index}."
            )
        start = self.skip_first + index * self._cycle + self.wait + self.warmup
        return range(start, start + self.active)

    def to_torch(self, offset: int = 0) -> Callable[[int], Any]:
        """This plan as a ``torch.profiler`` schedule callable, for a profiler whose step 0
        is this schedule's step ``offset``."""
        from torch.profiler import ProfilerAction as TorchAction

        table = {
            ProfilerAction.NONE: TorchAction.NONE,
            ProfilerAction.WARMUP: TorchAction.WARMUP,
            ProfilerAction.RECORD: TorchAction.RECORD,
            ProfilerAction.RECORD_AND_SAVE: TorchAction.RECORD_AND_SAVE,
        }
        action = self.action

        def torch_schedule(step: int) -> Any:
            return table[action(offset + step)]

        return torch_schedule
