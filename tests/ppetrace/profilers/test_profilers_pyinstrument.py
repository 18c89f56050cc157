"""Pyinstrument: the sampled-stack track on the spans' clock, its files and top_functions."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from profiler_harness import run_steps

import ppetrace
from exporters.chrome import ChromeTraceExporter, load_chrome_trace
from ppetrace.profilers import Pyinstrument, Schedule
from ppetrace.profilers._base import PYTHON_TID
from ppetrace.profilers._pyinstrument import TOP_FUNCTION_COLUMNS, stack_events


def _id(func: str, file: str = "/src/m.py", line: int = 1, at: int | None = None) -> str:
    ident = f"{func}\x00{file}\x00{line}"
    return ident if at is None else f"{ident}\x01l{at}"


THREAD = "MainThread\x00<thread>\x00123"


def test_stack_events_nest_merge_shared_prefixes_and_use_the_anchor() -> None:
    a, b, c = _id("main"), _id("step", line=10), _id("inner", line=20)
    records = [
        ([THREAD, _id("main", at=5), b, c], 0.001),  # 0..1000 ns: main > step > inner
        ([THREAD, a, _id("step", line=10, at=12)], 0.002),  # 1000..3000: main > step
        ([THREAD, a], 0.0015),  # 3000..4500, floored to 3000..4000: main
        ([THREAD, a, c], 0.0004),  # 4500..4900: floored away (under a µs)
    ]
    anchor = 1_000_000_000_000
    events = stack_events(
        [(list(s), dt * 1e-3) for s, dt in records],  # scale: dt in ms -> µs granularity
        anchor,
        start_ns=anchor,
        end_ns=anchor + 10_000,
    )
    got = [(e["name"], e["ts_ns"] - anchor, e["dur_ns"]) for e in events]
    # "line" attributes (\x01l5) do not split a frame; the thread frame is dropped
    assert got == [("main", 0, 4000), ("step", 0, 3000), ("inner", 0, 1000)]
    assert {e["tid"] for e in events} == {PYTHON_TID}
    assert events[0]["args"] == {"file": "/src/m.py", "line": 1}
    assert {e["ph"] for e in events} == {"X"}


def test_stack_events_are_clipped_to_the_window_and_split_at_a_changed_frame() -> None:
    anchor = 5_000
    records = [
        ([_id("f"), _id("g")], 2e-6),  # 5000..7000, clipped to start at 6000
        ([_id("f"), _id("h")], 2e-6),  # 7000..9000, clipped to end at 8000
    ]
    events = stack_events(records, anchor, start_ns=6_000, end_ns=8_000)
    got = sorted((e["name"], e["ts_ns"], e["dur_ns"]) for e in events)
    assert got == [("f", 6_000, 2_000), ("g", 6_000, 1_000), ("h", 7_000, 1_000)]


def test_touching_frames_still_touch_once_a_viewer_adds_ts_and_dur_in_floats(
    tmp_path: Path,
) -> None:
    """ts + dur of a frame, in float64 as viewers add them, never passes the start of the
    frame that follows it (speedscope saw 543438.1410000001 against 543438.141)."""
    origin = 1_700_000_000_000_000_000
    anchor = origin + 543_438_140_999  # a sample boundary at an odd nanosecond
    dts = [0.001000333, 0.000999667, 0.0010001, 0.0029999, 0.000333, 0.0017]
    funcs = ["f", "g", "f", "h", "g", "f"]
    records = [
        ([_id("main"), _id(f, line=i)], dt)
        for i, (dt, f) in enumerate(zip(dts, funcs, strict=True))
    ]
    events = stack_events(records, anchor, start_ns=anchor, end_ns=anchor + 10**9)
    assert all(e["ts_ns"] % 1000 == 0 and e["dur_ns"] % 1000 == 0 for e in events)
    exporter = ChromeTraceExporter(tmp_path / "t.json")
    exporter._origin_ns = origin  # the origin a run's first span would give
    exporter.add_events(events)
    exporter.shutdown()
    written = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]]
    frames = sorted(
        ((e["ts"], e["ts"] + e["dur"]) for e in written if e.get("ph") == "X"),
        key=lambda f: (f[0], -f[1]),  # a parent before its first child
    )
    leaves = frames[1:]  # under "main"
    assert len(leaves) == 6
    for (_, end), (start, _) in itertools.pairwise(leaves):
        assert end <= start  # touching, not overlapping, in floating point
    assert frames[0][0] == leaves[0][0] and frames[0][1] == leaves[-1][1]


# -- a real run, driven like the Trainer drives its profilers ------------------------------


def _leaf(i: int) -> int:
    return i * i


def busy_python_work(_: int) -> int:
    total = 0
    for i in range(40_000):
        total += _leaf(i)
    return total


def _spans(events: list[dict[str, Any]], name: str) -> list[tuple[int, int]]:
    return [
        (round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000))
        for e in events
        if e.get("ph") == "X" and e.get("name") == name and "span_id" in e
    ]


def test_samples_land_inside_the_step_spans_with_files_and_top_functions(
    exporter: ChromeTraceExporter, tmp_path: Path
) -> None:
    prof = Pyinstrument(
        interval=0.0002,
        schedule=Schedule(skip_first=1, wait=0, warmup=1, active=2),
        output_dir=tmp_path / "prof",
    )
    run_steps([prof], range(5), busy_python_work, exporter)
    ppetrace.shutdown()
    trace = load_chrome_trace(exporter.path)
    events = trace.events

    # one window: steps 2-3 (step 0 skipped, step 1 warm-up), complete
    assert [(w.first_step, w.last_step, w.complete) for w in prof.windows] == [(2, 3, True)]
    window = prof.windows[0]
    assert window.info["samples"] > 0

    # the track is named, and its events are on the spans' clock
    names = {
        e["tid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    assert names[PYTHON_TID] == "python (sampled)"
    py = [e for e in events if e.get("tid") == PYTHON_TID and e.get("ph") == "X"]
    assert py, "no sampled stacks in the trace"
    steps = _spans(events, "trainer.step")
    assert len(steps) == 5
    busy = [e for e in py if e["name"] == "busy_python_work"]
    assert busy, "the step's function is not on the sampled track"
    for e in busy:
        # a sample is taken while busy_python_work runs: its instant (the event's end)
        # lies inside the trainer.step span that ran it, on steps 2-3 only
        end = round((e["ts"] + e["dur"]) * 1000)
        inside = [i for i, (s, t) in enumerate(steps) if s <= end <= t]
        assert inside and inside[0] in (2, 3), (end, steps)
    for e in py:  # nothing outside the window
        start = round(e["ts"] * 1000) + trace.origin_ns
        assert window.start_ns <= start <= window.end_ns
    intervals = sorted((round(e["ts"] * 1000), -round(e["dur"] * 1000)) for e in py)
    open_ends: list[int] = []  # the track nests: no event straddles another's end
    for start, neg_dur in intervals:
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        assert not open_ends or start - neg_dur <= open_ends[-1]
        open_ends.append(start - neg_dur)
    leaf = [e for e in py if e["name"] == "_leaf"]
    assert all(e["args"]["file"] == __file__ for e in leaf)

    # the files of the window
    html = Path(window.files["html"])
    speedscope = Path(window.files["speedscope"])
    assert html.name == "pyinstrument_steps2-3.html" and html.parent == tmp_path / "prof"
    assert "busy_python_work" in html.read_text(encoding="utf-8")
    doc = json.loads(speedscope.read_text(encoding="utf-8"))
    assert doc["$schema"].startswith("https://www.speedscope.app/")
    assert "busy_python_work" in {f["name"] for f in doc["shared"]["frames"]}

    # top functions: _leaf/busy_python_work carry the self time of the sampled steps
    top = prof.top_functions()
    assert list(top.columns) == list(TOP_FUNCTION_COLUMNS)
    assert top["self_ns"].is_monotonic_decreasing
    assert set(top["function"].head(3)) & {"_leaf", "busy_python_work"}
    row = top[top["function"] == "busy_python_work"].iloc[0]
    assert row["file"] == __file__ and row["total_ns"] >= row["self_ns"]
    assert top["self_share"].sum() <= 1.0 + 1e-9
    assert len(prof.top_functions(1)) == 1


def test_default_output_dir_is_beside_the_trace(
    exporter: ChromeTraceExporter, tmp_path: Path
) -> None:
    prof = Pyinstrument(schedule=Schedule(warmup=0, active=1), speedscope=False)
    run_steps([prof], range(2), busy_python_work, exporter)
    assert prof.windows[0].files["html"] == tmp_path / "trace_profiles" / (
        "pyinstrument_steps0-0.html"
    )
    assert "speedscope" not in prof.windows[0].files


def test_outside_the_windows_nothing_is_sampled(
    exporter: ChromeTraceExporter, tmp_path: Path
) -> None:
    prof = Pyinstrument(schedule=Schedule(skip_first=10**9), output_dir=tmp_path)
    run_steps([prof], range(3), busy_python_work, exporter)
    ppetrace.shutdown()
    events = load_chrome_trace(exporter.path).events
    assert prof.windows == []
    assert not [e for e in events if e.get("tid") == PYTHON_TID]
    assert list(tmp_path.glob("*.html")) == []
    assert prof.top_functions().empty


@pytest.mark.parametrize("bad", [0, -0.1, float("nan"), True, "1ms"])
def test_invalid_interval_is_rejected(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"Expected a positive number of seconds for interval"):
        Pyinstrument(interval=bad)


def test_invalid_top_n_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"Expected a positive int or None for n, but .* 0\."):
        Pyinstrument().top_functions(0)


def test_the_top_functions_table_is_stored_in_the_trace_and_shown_by_the_report(
    exporter: ChromeTraceExporter, tmp_path: Path
) -> None:
    from exporters import read_chrome_trace, render, step_report

    prof = Pyinstrument(
        interval=0.0002, schedule=Schedule(warmup=0, active=3), output_dir=tmp_path, top=5
    )
    run_steps([prof], range(4), busy_python_work, exporter)
    ppetrace.shutdown()
    expected = prof.top_functions(5)
    assert not expected.empty
    report = step_report(read_chrome_trace(exporter.path), warmup_steps=0)
    stored = report.tables["top_functions"]
    assert list(stored.columns) == list(TOP_FUNCTION_COLUMNS)
    assert stored["function"].tolist() == expected["function"].tolist()
    assert stored["self_ns"].tolist() == expected["self_ns"].tolist()
    assert "top_functions" in render(report, "table")
    with pytest.raises(ValueError, match="Expected a positive int for top, but received 0"):
        Pyinstrument(top=0)


def test_a_window_too_short_to_sample_says_so(
    exporter: ChromeTraceExporter, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prof = Pyinstrument(interval=3600.0, schedule=Schedule(warmup=0, active=2), output_dir=tmp_path)
    with caplog.at_level("WARNING", logger="ppetrace"):
        run_steps([prof], range(2), lambda step: None, exporter)
    assert prof.windows[0].info["samples"] == 0
    assert "pyinstrument took no samples in steps 0-1" in caplog.text
    assert "at its interval of 3.6e+06 ms" in caplog.text and "smaller interval" in caplog.text
