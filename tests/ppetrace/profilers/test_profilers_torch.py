"""TorchProfiler: Kineto clock alignment, event conversion, and a merged CPU run."""

from __future__ import annotations

import decimal
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from profiler_harness import run_steps

import ppetrace
from exporters.chrome import ChromeTraceExporter, load_chrome_trace
from ppetrace.profilers import Schedule, TorchProfiler, TraceAlignmentError
from ppetrace.profilers._base import TORCH_TID_BASE
from ppetrace.profilers._torch import (
    ClockAlignment,
    ClockMarker,
    KinetoTracks,
    align_kineto,
    kineto_base_ns,
    kineto_events,
    load_kineto,
)

# -- alignment on synthetic Kineto documents --------------------------------------------


def _marker_event(name: str, ts: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": ts}


def test_the_tightest_marker_bracket_gives_the_offset_with_base_time() -> None:
    base = 1_790_000_000_000_000_000
    doc = {
        "baseTimeNanoseconds": base,
        "traceEvents": [
            _marker_event("ppetrace.clock_sync#0", decimal.Decimal("100.000")),
            _marker_event("ppetrace.clock_sync#1", decimal.Decimal("200.500")),
        ],
    }
    # Kineto ns of the markers: base + 100_000 and base + 200_500.
    # marker 0's host bracket is wide (8 µs), marker 1's tight (2 µs): marker 1 wins.
    host = 2_000_000_000_000_000_000
    markers = [
        ClockMarker("ppetrace.clock_sync#0", host, host + 8_000),
        ClockMarker("ppetrace.clock_sync#1", host + 100_000, host + 102_000),
    ]
    got = align_kineto(doc, markers)
    assert got == ClockAlignment(
        offset_ns=(host + 101_000) - (base + 200_500), error_ns=1_000, method="marker"
    )


def test_base_time_in_other_data_and_absent_base_time() -> None:
    events = [_marker_event("m", 7)]
    marker = [ClockMarker("m", 50_000, 50_000)]
    in_other = {"otherData": {"baseTimeNanoseconds": "1000"}, "traceEvents": events}
    assert kineto_base_ns(in_other) == 1000
    assert align_kineto(in_other, marker).offset_ns == 50_000 - (1000 + 7000)
    absent = {"traceEvents": events}  # ts are absolute on Kineto's clock
    assert kineto_base_ns(absent) is None
    assert align_kineto(absent, marker) == ClockAlignment(50_000 - 7000, 0, "marker")


def test_without_markers_base_time_is_read_as_epoch_and_without_either_it_fails() -> None:
    with_base = {"baseTimeNanoseconds": 5, "traceEvents": [_marker_event("other", 1)]}
    assert align_kineto(with_base, []) == ClockAlignment(0, None, "baseTimeNanoseconds")
    with pytest.raises(
        TraceAlignmentError,
        match=r"Expected clock-sync markers \(ppetrace.clock_sync#N events\) or "
        r"baseTimeNanoseconds in the Kineto trace to put it on the spans' clock, but it has "
        r"neither\.",
    ):
        align_kineto({"traceEvents": []}, [ClockMarker("m", 0, 1)])


def _meta(name: str, pid: int, tid: int, label: str) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {"name": label}}


def test_kineto_events_are_moved_renamed_and_put_on_torch_tracks(tmp_path: Path) -> None:
    me = os.getpid()
    doc_text = json.dumps(
        {
            "baseTimeNanoseconds": 1_000_000_000,
            "traceEvents": [
                _meta("process_name", me, 0, "py"),
                _meta("thread_name", me, 9, "t9"),
                _meta("process_name", 0, 0, "GPU 0"),
                _meta("thread_name", 0, 7, "stream 7"),
                {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": me, "tid": 9,
                 "ts": 1.5, "dur": 2.25, "args": {"External id": 3, "flops": 2.5}},
                {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": me,
                 "tid": 9, "ts": 1, "dur": 10},
                {"ph": "X", "cat": "user_annotation", "name": "ppetrace.clock_sync#0", "pid": me,
                 "tid": 9, "ts": 1, "dur": 0.1},
                {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 3.001,
                 "dur": 1},
                {"ph": "f", "id": 3, "pid": 0, "tid": 7, "ts": 3.001, "cat": "ac2g",
                 "name": "ac2g", "bp": "e"},
                {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
                 "tid": "PyTorch Profiler", "ts": 0, "dur": 20},
                {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": 20},
            ],
        }
    )  # fmt: skip
    path = tmp_path / "k.json"
    path.write_text(doc_text.replace("1.5,", "1.5000000001,"))  # more digits than a float keeps
    doc = load_kineto(path)
    tracks = KinetoTracks()
    events = kineto_events(doc, ClockAlignment(500, 0, "marker"), tracks, step_offset=10)
    by_name = {e["name"]: e for e in events}
    assert set(by_name) == {"aten::mm", "ProfilerStep#11", "gemm", "ac2g"}
    mm = by_name["aten::mm"]
    # epoch ns = base + ts (ns, exact) + offset
    assert mm["ts_ns"] == 1_000_000_000 + 1_500 + 500  # 1.5000000001 µs -> 1500 ns
    assert mm["dur_ns"] == 2_250
    assert mm["args"] == {"External id": 3, "flops": 2.5}
    assert isinstance(mm["args"]["flops"], float)
    assert by_name["gemm"]["ts_ns"] == 1_000_000_000 + 3_001 + 500
    assert "dur_ns" not in by_name["ac2g"] and by_name["ac2g"]["bp"] == "e"
    assert all("pid" not in e and "ts" not in e for e in events)
    assert tracks.names == {
        TORCH_TID_BASE: "torch ops: t9",
        TORCH_TID_BASE + 1: "torch GPU 0 / stream 7",
    }
    assert mm["tid"] == by_name["ProfilerStep#11"]["tid"] == TORCH_TID_BASE
    assert by_name["gemm"]["tid"] == by_name["ac2g"]["tid"] == TORCH_TID_BASE + 1
    # the same Kineto thread keeps its track in a later window
    again = kineto_events(doc, ClockAlignment(0, 0, "marker"), tracks)
    assert {e["tid"] for e in again} == {TORCH_TID_BASE, TORCH_TID_BASE + 1}


def test_invalid_activities_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"Expected torch.profiler.ProfilerActivity values"):
        TorchProfiler(activities=["tpu"])
    with pytest.raises(ValueError, match=r"Expected at least one activity for activities"):
        TorchProfiler(activities=[])


# -- a real CPU run, driven like the Trainer drives its profilers --------------------------


def _train_step() -> Callable[[int], None]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 4)

    def work(_: int) -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return work


def test_aten_ops_fall_inside_the_step_span_that_ran_them(
    exporter: ChromeTraceExporter, tmp_path: Path
) -> None:
    prof = TorchProfiler(
        activities=["cpu"],
        schedule=Schedule(wait=1, warmup=1, active=2),
        output_dir=tmp_path / "prof",
    )
    run_steps([prof], range(5), _train_step(), exporter)
    ppetrace.shutdown()
    trace = load_chrome_trace(exporter.path)
    assert trace.metadata["service_name"] == "profilers-test"  # spans were written first

    # one window: warm-up step 1, recorded steps 2-3
    assert [(w.first_step, w.last_step, w.complete) for w in prof.windows] == [(1, 3, True)]
    window = prof.windows[0]
    assert window.info["alignment"] == "marker"
    error = window.info["alignment_error_ns"]
    kineto = load_kineto(window.files["kineto"])
    assert window.files["kineto"] == tmp_path / "prof" / "torch_steps2-3.json"
    assert any(str(e.get("name", "")).startswith("aten::") for e in kineto["traceEvents"])

    def ns(ts: float) -> int:
        return round(ts * 1000)

    steps = [
        (ns(e["ts"]), ns(e["ts"] + e["dur"]), e["attrs"]["ppetrace.batch_idx"])
        for e in trace.events
        if e.get("ph") == "X" and e.get("name") == "trainer.step" and "span_id" in e
    ]
    assert len(steps) == 5
    aten = [
        e for e in trace.events if e.get("ph") == "X" and str(e.get("name")).startswith("aten::")
    ]
    assert aten, "no operator events were merged"
    assert all(e["tid"] >= TORCH_TID_BASE for e in aten)
    ran_in = set()
    for e in aten:
        start, end = ns(e["ts"]), ns(e["ts"] + e["dur"])
        owners = [b for s, t, b in steps if s - error <= start and end <= t + error]
        assert len(owners) == 1, (e["name"], start, end, steps)
        ran_in.add(owners[0])
    assert ran_in == {2, 3}  # only the recorded steps, not the warm-up step 1
    # each recorded step ran the whole training step: forward, backward and optimizer ops
    for b in (2, 3):
        s, t = next((s, t) for s, t, bb in steps if bb == b)
        names = {e["name"] for e in aten if s - error <= ns(e["ts"]) <= t + error}
        assert {"aten::linear", "aten::mse_loss"} <= names

    # ProfilerStep markers carry the run's step numbers; clock-sync markers are gone
    names = {e.get("name") for e in trace.events}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names
    assert not any(str(n).startswith("ppetrace.clock_sync") for n in names)
    tracks = {
        e["args"]["name"]
        for e in trace.events
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e["tid"] >= TORCH_TID_BASE
    }
    assert any(t.startswith("torch ops: ") for t in tracks)


def test_a_window_cut_short_is_still_merged_and_temporary_traces_are_removed(
    exporter: ChromeTraceExporter, tmp_path: Path
) -> None:
    prof = TorchProfiler(
        activities=["cpu"],
        schedule=Schedule(warmup=0, active=10),
        output_dir=tmp_path / "prof",
        keep_traces=False,
    )
    run_steps([prof], range(2), _train_step(), exporter)
    ppetrace.shutdown()
    assert [(w.first_step, w.last_step, w.complete) for w in prof.windows] == [(0, 1, False)]
    assert prof.windows[0].info["events"] > 0
    assert "kineto" not in prof.windows[0].files
    assert not (tmp_path / "prof").exists()
    events = load_chrome_trace(exporter.path).events
    assert [e for e in events if str(e.get("name")).startswith("aten::")]
