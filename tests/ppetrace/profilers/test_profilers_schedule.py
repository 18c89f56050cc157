"""Schedule: torch.profiler.schedule semantics, resume-awareness and validation."""

from __future__ import annotations

import pytest
import torch.profiler

from ppetrace.profilers import ProfilerAction, Schedule, ScheduledProfiler
from ppetrace.profilers._base import ProfileWindow

N, W, R, S = (
    ProfilerAction.NONE,
    ProfilerAction.WARMUP,
    ProfilerAction.RECORD,
    ProfilerAction.RECORD_AND_SAVE,
)


def test_actions_follow_skip_first_then_wait_warmup_active_cycles() -> None:
    s = Schedule(skip_first=2, wait=1, warmup=1, active=2, repeat=2)
    assert [s.action(i) for i in range(13)] == [N, N, N, W, R, S, N, W, R, S, N, N, N]
    assert [s.window(i) for i in (0, 2, 5, 6, 9, 10)] == [None, 0, 0, 1, 1, None]
    assert s.window_steps(0) == range(4, 6)
    assert s.window_steps(1) == range(8, 10)


def test_repeat_zero_runs_forever_and_active_one_saves_every_step() -> None:
    s = Schedule(wait=0, warmup=0, active=1, repeat=0)
    assert all(s.action(i) is S for i in (0, 1, 10**6))
    assert s.next_step(10**6) == 10**6


@pytest.mark.parametrize(
    "kwargs",
    [
        {"wait": 1, "warmup": 1, "active": 2, "repeat": 2, "skip_first": 3},
        {"wait": 0, "warmup": 0, "active": 3, "repeat": 0, "skip_first": 0},
        {"wait": 2, "warmup": 0, "active": 1, "repeat": 3, "skip_first": 1},
    ],
)
@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_actions_match_torch_profiler_schedule(kwargs: dict[str, int]) -> None:
    ours = Schedule(**kwargs)
    theirs = torch.profiler.schedule(**kwargs)
    torch_fn = ours.to_torch()
    for step in range(40):
        assert ours.action(step).name == theirs(step).name, step
        assert torch_fn(step) == theirs(step)


def test_to_torch_offset_maps_a_profilers_local_step_to_the_run_step() -> None:
    s = Schedule(skip_first=5, wait=0, warmup=1, active=2)
    local = s.to_torch(offset=5)
    assert [local(i).name for i in range(4)] == ["WARMUP", "RECORD", "RECORD_AND_SAVE", "NONE"]


def test_next_step_finds_the_next_window_with_or_without_warmup() -> None:
    s = Schedule(skip_first=3, wait=2, warmup=1, active=2, repeat=2)
    # steps: 0-2 skipped, 3-4 wait, 5 warmup, 6-7 active, 8-9 wait, 10 warmup, 11-12 active
    assert s.next_step(0) == 5
    assert s.next_step(0, warmup=False) == 6
    assert s.next_step(7) == 7
    assert s.next_step(8) == 10
    assert s.next_step(8, warmup=False) == 11
    assert s.next_step(13) is None
    for step in range(15):  # next_step agrees with action() everywhere
        expect = next((i for i in range(step, 20) if s.action(i) is not N), None)
        assert s.next_step(step) == expect


def test_resumed_run_continues_the_same_plan() -> None:
    """A schedule is a function of the step: a run resumed at step k gets the same actions."""
    s = Schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=3)
    full = [s.action(i) for i in range(20)]
    resumed = Schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=3)
    assert [resumed.action(i) for i in range(7, 20)] == full[7:]


class _Recorder(ScheduledProfiler):
    """A scheduled profiler that logs its window calls."""

    def __init__(self, schedule: Schedule, uses_warmup: bool = False) -> None:
        super().__init__(schedule)
        self.uses_warmup = uses_warmup  # type: ignore[misc]
        self.log: list[tuple[str, int]] = []

    def _begin_window(self, step: int, action: ProfilerAction) -> None:
        self.log.append(("begin", step))

    def _window_step_begin(self, step: int) -> None:
        self.log.append(("step_begin", step))

    def _window_step_end(self, step: int) -> None:
        self.log.append(("step_end", step))

    def _end_window(self, window: ProfileWindow) -> None:
        self.log.append(("end", window.last_step))


class _Trainer:
    trace_exporter = None


def _drive(prof: ScheduledProfiler, steps: range) -> None:
    prof.setup(_Trainer())
    for step in steps:
        prof.step_begin(step)
        prof.step_end(step)
    prof.teardown()


def test_scheduled_profiler_opens_windows_at_active_steps_only() -> None:
    prof = _Recorder(Schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=2))
    _drive(prof, range(12))
    # active steps: 3-4 and 7-8; warm-up steps (2, 6) do not open a sampler's window
    assert prof.log == [
        ("begin", 3),
        ("step_end", 3),
        ("step_begin", 4),
        ("end", 4),
        ("begin", 7),
        ("step_end", 7),
        ("step_begin", 8),
        ("end", 8),
    ]
    assert [(w.index, w.first_step, w.last_step, w.complete) for w in prof.windows] == [
        (0, 3, 4, True),
        (1, 7, 8, True),
    ]


def test_scheduled_profiler_with_warmup_opens_at_warmup_and_resumes_mid_window() -> None:
    schedule = Schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=2)
    prof = _Recorder(schedule, uses_warmup=True)
    _drive(prof, range(12))
    assert [(w.first_step, w.last_step) for w in prof.windows] == [(2, 4), (6, 8)]
    resumed = _Recorder(schedule, uses_warmup=True)
    _drive(resumed, range(4, 12))  # resumed at step 4: the rest of window 0, then window 1
    assert [(w.index, w.first_step, w.last_step) for w in resumed.windows] == [
        (0, 4, 4),
        (1, 6, 8),
    ]


def test_a_window_cut_short_by_the_end_of_fit_is_closed_incomplete() -> None:
    prof = _Recorder(Schedule(warmup=0, active=5))
    _drive(prof, range(2))
    assert prof.log[-1] == ("end", 1)
    assert [(w.first_step, w.last_step, w.complete) for w in prof.windows] == [(0, 1, False)]


def test_a_failing_profiler_is_logged_and_switched_off(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(_Recorder):
        def _begin_window(self, step: int, action: ProfilerAction) -> None:
            raise RuntimeError("boom")

    prof = Broken(Schedule(warmup=0, active=2, repeat=0))
    _drive(prof, range(6))  # does not raise
    assert prof.errors == 1
    assert prof.windows == []
    assert "off for the rest of the run" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"active": 0},
            r"Expected a positive int for active \(recorded steps in each window\), "
            r"but received 0\.",
        ),
        ({"wait": -1}, r"Expected a non-negative int for wait \(idle steps .*received -1\."),
        ({"warmup": 1.5}, r"Expected a non-negative int for warmup .*received 1\.5\."),
        ({"repeat": True}, r"Expected a non-negative int for repeat .*received True\."),
        ({"skip_first": "2"}, r"Expected a non-negative int for skip_first .*received '2'\."),
    ],
)
def test_invalid_arguments_are_rejected_with_a_sentence(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Schedule(**kwargs)  # type: ignore[arg-type]


def test_invalid_steps_and_schedule_types_are_rejected() -> None:
    s = Schedule()
    with pytest.raises(ValueError, match=r"Expected a non-negative int step number .* -1\."):
        s.action(-1)
    with pytest.raises(ValueError, match=r"Expected a window index below repeat=1, but .* 1\."):
        s.window_steps(1)
    with pytest.raises(TypeError, match=r"Expected a ppetrace.profilers.Schedule for schedule"):
        _Recorder(object())  # type: ignore[arg-type]


def test_schedules_compare_by_value() -> None:
    assert Schedule(active=2) == Schedule(active=2)
    assert Schedule(active=2) != Schedule(active=3)
    assert len({Schedule(), Schedule()}) == 1
    assert repr(Schedule(wait=2)) == (
        "Schedule(wait=2, warmup=1, active=3, repeat=1, skip_first=0)"
    )
