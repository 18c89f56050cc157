"""SystemCounters: step-boundary and thread sampling, Chrome counter events and the frame."""

from __future__ import annotations

import itertools
import math
import threading
from typing import Any

import pytest
from profiler_harness import FakeTrainer

import ppetrace
from exporters.chrome import ChromeTraceExporter, load_chrome_trace
from ppetrace.profilers import Schedule, SystemCounters


def _drive(counters: SystemCounters, steps: range, exporter: Any = None) -> None:
    counters.setup(FakeTrainer(exporter))
    try:
        for step in steps:
            counters.step_begin(step)
            with ppetrace.trace("trainer.step", {"ppetrace.batch_idx": step}):
                pass
            counters.step_end(step)
    finally:
        counters.teardown()


def _counting() -> dict[str, Any]:
    """Deterministic counters: 'calls' counts up, 'mem' is ten times it."""
    n = itertools.count(1)
    last = [0]

    def calls() -> float:
        last[0] = next(n)
        return float(last[0])

    return {"calls": calls, "mem": lambda: 10.0 * last[0]}


def test_step_sampling_gives_counter_events_and_a_frame(exporter: ChromeTraceExporter) -> None:
    counters = SystemCounters(counters=_counting(), emit_every=3)
    _drive(counters, range(3), exporter)
    ppetrace.shutdown()
    frame = counters.counters_frame()
    # one sample at setup, two per step, one at teardown
    assert list(frame.columns) == ["time_ns", "step", "calls", "mem"]
    assert frame["calls"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert frame["mem"].tolist() == [10.0 * i for i in range(1, 9)]
    assert frame["step"].tolist()[1:7] == [0, 0, 1, 1, 2, 2]
    assert frame["step"].isna().tolist()[0]
    assert frame["time_ns"].is_monotonic_increasing

    trace = load_chrome_trace(exporter.path)
    cs = [e for e in trace.events if e.get("ph") == "C"]
    assert [e["args"]["calls"] for e in cs if e["name"] == "calls"] == frame["calls"].tolist()
    assert [e["args"]["mem"] for e in cs if e["name"] == "mem"] == frame["mem"].tolist()
    # on the spans' clock: the samples of step 1 bracket its trainer.step span
    times = [round(e["ts"] * 1000) + trace.origin_ns for e in cs if e["name"] == "calls"]
    assert times == frame["time_ns"].tolist()
    step1 = next(
        e
        for e in trace.events
        if e.get("name") == "trainer.step" and e["attrs"]["ppetrace.batch_idx"] == 1
    )
    start = round(step1["ts"] * 1000) + trace.origin_ns
    end = start + round(step1["dur"] * 1000)
    assert times[3] <= start and end <= times[4]


def test_with_a_schedule_only_recorded_steps_are_sampled() -> None:
    counters = SystemCounters(counters=_counting(), schedule=Schedule(warmup=1, active=1))
    _drive(counters, range(4))
    frame = counters.counters_frame()
    assert frame["step"].tolist()[1:3] == [1, 1]  # setup, step 1 begin/end, teardown
    assert len(frame) == 4


def test_default_counters_read_this_process() -> None:
    counters = SystemCounters()
    _drive(counters, range(2))
    frame = counters.counters_frame()
    assert {"cpu_percent", "rss_bytes"} <= set(frame.columns)
    assert "cuda_allocated_bytes" not in frame.columns  # a CPU run
    assert (frame["rss_bytes"] > 1e6).all()
    assert (frame["cpu_percent"] >= 0).all()


def test_the_sampler_thread_runs_only_between_setup_and_teardown() -> None:
    enough = threading.Event()
    calls = itertools.count(1)

    def probe() -> float:
        n = next(calls)
        if n >= 4:  # setup's sample + 3 from the thread
            enough.set()
        return float(n)

    def sampler_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "ppetrace-counters"]

    counters = SystemCounters(interval=0.001, counters={"n": probe})
    assert sampler_threads() == []  # nothing runs before setup
    counters.setup(FakeTrainer())
    try:
        assert len(sampler_threads()) == 1
        counters.step_begin(0)  # the thread samples; the steps do not
        counters.step_end(0)
        assert enough.wait(timeout=30), "the sampler thread took no samples"
    finally:
        counters.teardown()
    assert sampler_threads() == []
    values = counters.counters_frame()["n"].tolist()
    assert values == [float(i) for i in range(1, len(values) + 1)]
    assert len(values) >= 5  # setup, >= 3 from the thread, teardown


def test_a_failing_counter_is_nan_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> float:
        raise OSError("no /proc")

    counters = SystemCounters(counters={"ok": lambda: 1.0, "bad": broken})
    _drive(counters, range(1))
    frame = counters.counters_frame()
    assert frame["ok"].tolist() == [1.0] * 4
    assert all(math.isnan(v) for v in frame["bad"])
    assert counters.errors == 4
    assert "the counter 'bad' failed" in caplog.text


def test_max_samples_keeps_the_newest() -> None:
    counters = SystemCounters(counters=_counting(), max_samples=3)
    _drive(counters, range(3))
    assert counters.counters_frame()["calls"].tolist() == [6.0, 7.0, 8.0]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"interval": 0}, ValueError, r"Expected a positive number of seconds or None for "),
        ({"counters": {}}, ValueError, r"Expected a non-empty mapping of counter name"),
        ({"counters": {"x": 3}}, ValueError, r"Expected counters to map non-empty names to "),
        ({"max_samples": 0}, ValueError, r"Expected a positive int for max_samples, but "),
        ({"schedule": "always"}, TypeError, r"Expected a ppetrace.profilers.Schedule or None"),
    ],
)
def test_invalid_arguments_are_rejected(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        SystemCounters(**kwargs)
