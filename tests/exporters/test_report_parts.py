"""Where a step's time goes: parts from self times, share summing to 100%, validation apart,
the threads hint and short file paths, against injected durations."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pytest

from exporters import render_json, render_table, spans_to_frame, step_report
from exporters.report import STEP_PARTS, short_path

RunBuilder = Any
PARTS = ["data_wait_ns", "forward_ns", "backward_ns", "optimizer_ns", "other_ns"]


def _trainer_layout(rb: RunBuilder, steps: list[int], *, validation_at: int | None = None) -> None:
    """The Trainer's tree: fetch, then step > (train_step > closure, backward > user,
    optimizer_step, a callback on another thread); validation with its own closures."""
    epoch = rb.span("trainer.epoch", 0, 10_000_000)
    t = 100
    for i, dur in enumerate(steps):
        rb.span("trainer.fetch_batch", t, t + 200, epoch)
        t += 200
        step = rb.span("trainer.step", t, t + dur, epoch, {"ppetrace.step": i})
        rb.span("runtime.convert_batch", t + 10, t + 30, step)  # other
        train = rb.span("module.train_step", t + 40, t + 40 + dur // 4, step)
        rb.span("network.closure", t + 50, t + 50 + dur // 8, train)  # forward, nested
        bw = rb.span("trainer.backward", t + 40 + dur // 4, t + 40 + dur // 2, step)
        rb.span("user.hook", t + 60 + dur // 4, t + 70 + dur // 4, bw)  # backward by parent
        rb.span("trainer.optimizer_step", t + 40 + dur // 2, t + 40 + 3 * dur // 4, step)
        rb.span("worker.decode", t, t + dur, step, tid=99)  # another thread: in no part
        t += dur + 50
        if i == validation_at:
            val = rb.span("trainer.validation", t, t + 5_000, epoch)
            for k in range(2):
                vs = rb.span("module.val_step", t + 10 + 2_000 * k, t + 1_900 + 2_000 * k, val)
                rb.span("network.closure", t + 20 + 2_000 * k, t + 1_020 + 2_000 * k, vs)
            t += 5_000 + 50


def _report(rb: RunBuilder, **environment: Any) -> Any:
    frame = spans_to_frame(rb.batch())
    if environment:
        frame.attrs["metadata"] = {"environment": environment}
    return step_report(frame, warmup_steps=0)


def test_the_parts_are_self_times_by_the_documented_table_and_add_up_to_the_step(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rb = run_builder()
    _trainer_layout(rb, [8_000, 16_000, 4_000])
    steps = _report(rb).steps
    d = np.array([8_000, 16_000, 4_000])
    assert list(steps["data_wait_ns"]) == [200] * 3
    assert list(steps["forward_ns"]) == list(d // 4)  # train_step with its closure
    assert list(steps["backward_ns"]) == list(d // 2 - d // 4)  # with the user span
    assert list(steps["optimizer_ns"]) == list(3 * d // 4 - d // 2)
    # other: the step's own time, convert_batch, and 50 ns of loop time after the first
    own = d - (3 * d // 4 - 0)
    assert list(steps["other_ns"]) == list(own + np.array([0, 50, 50]))
    assert (steps["wall_ns"] == steps[PARTS].sum(axis=1)).all()
    assert {STEP_PARTS[n] for n in ("module.forward", "runtime.execute")} == {"forward"}


def test_share_is_self_time_over_step_time_and_sums_to_one_with_validation_apart(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rb = run_builder()
    _trainer_layout(rb, [8_000, 8_000, 8_000, 8_000], validation_at=1)
    report = _report(rb)
    events = report.events.set_index("event")
    wall = report.steps["wall_ns"].sum()
    # network.closure: 4 training calls here, the 2 validation calls in their own table
    assert events.loc["network.closure", "count"] == 4
    assert events.loc["module.train_step", "share"] == pytest.approx(4 * (2_000 - 1_000) / wall)
    assert events.loc["module.train_step", "total_ns"] == 4 * 2_000  # inclusive, its own column
    assert np.isnan(events.loc["worker.decode", "share"])  # parallel, on another thread
    assert events["share"].sum() == pytest.approx(1.0)
    # the validation run between steps 1 and 2 is not step time either
    assert list(report.steps["wall_ns"]) == [
        8_200,
        8_250,
        8_300,
        8_250,
    ]  # 50 ns before and after it
    val = report.validation.set_index("event")
    assert val.loc["network.closure", "count"] == 2
    assert val.loc["trainer.validation", "self_ns"] == 5_000 - 2 * 1_890
    assert val["share"].sum() == pytest.approx(1.0)
    assert "module.val_step" not in events.index
    text = render_table(report)
    assert "Validation and test events" in text and "inclusive" in text
    assert report.spans == len(spans_to_frame(rb.batch()))


def _bimodal(rb: RunBuilder, steps: Sequence[int] = (1_000,) * 6 + (10_000,) * 4) -> None:
    t = 0
    for i, dur in enumerate(steps):
        rb.span("trainer.step", t, t + dur, 0, {"ppetrace.step": i})
        t += dur


@pytest.mark.parametrize(
    ("threads", "cpus", "hint"),
    [(2, 2, True), (4, 2, True), (1, 1, False), (2, 4, False), (None, 2, False)],
)
def test_the_threads_hint_needs_bimodal_steps_and_threads_filling_the_cpus(
    run_builder: Callable[..., RunBuilder], threads: int | None, cpus: int, hint: bool
) -> None:
    rb = run_builder()
    _bimodal(rb)
    report = _report(rb, torch_threads=threads, cpu_count=cpus, device="cpu")
    text = render_table(report)
    assert ("Hint: step times are bimodal (p90/p50 = 10.0, p50/p10 = 1.0)" in text) is hint
    assert (report.threads_hint is not None) is hint
    if threads is not None:
        assert f"Device: cpu, torch threads: {threads}, CPUs available: {cpus}" in text
    # the slow mode is the majority (p50 108, p90 112, the fast mode 4): bimodal too
    slow = run_builder()
    _bimodal(slow, (108_000,) * 4 + (112_000, 110_000, 108_000) + (4_000,) * 4)
    slow_hint = _report(slow, torch_threads=threads, cpu_count=cpus).threads_hint
    assert (slow_hint is not None and "p50/p10 = 27.0" in slow_hint) is hint
    even = run_builder()
    for i in range(10):
        even.span("trainer.step", i * 1_000, (i + 1) * 1_000, 0, {"ppetrace.step": i})
    assert _report(even, torch_threads=4, cpu_count=2).threads_hint is None


def test_top_functions_files_are_shown_inside_their_package(
    run_builder: Callable[..., RunBuilder],
) -> None:
    assert short_path("/usr/lib/python3/dist-packages/torch/nn/linear.py") == "torch/nn/linear.py"
    assert short_path("/x/.venv/lib/python3.11/site-packages/a/b.py") == "a/b.py"
    assert short_path("/usr/lib/python3.11/json/decoder.py") == "json/decoder.py"
    assert short_path("/home/me/work/proj/src/train.py") == "…/proj/src/train.py"
    assert short_path("train.py") == "train.py"
    rb = run_builder()
    _bimodal(rb)
    frame = spans_to_frame(rb.batch())
    frame.attrs["tables"] = {
        "top_functions": {
            "columns": ["function", "file", "line", "self_ns"],
            "rows": [["forward", "/v/lib/python3.12/site-packages/torch/nn/mod.py", 3, 10]],
        }
    }
    report = step_report(frame, warmup_steps=0)
    text = render_table(report)
    assert "torch/nn/mod.py" in text and "/v/lib" not in text
    doc = render_json(report)  # the data keeps the full path
    assert "/v/lib/python3.12/site-packages/torch/nn/mod.py" in doc
    assert isinstance(report.tables["top_functions"], pd.DataFrame)
