"""Summarised steps in the Chrome writer (ChromeTraceExporter.summarise_step): the
aggregates on the step rows equal what the same rows give written in full."""

from __future__ import annotations

import json
import random
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from exporters import STEP_LEVEL_EVENTS, ChromeTraceExporter, SpanBatch, SpanRow, read_chrome_trace
from exporters.chrome import _detail

T0 = 1_700_000_000_000_000_000
TRACE = 0xABC
PID = 4242
MAIN, OTHER = 11, 12
HOOKS = (
    "runtime.train_pre_step",
    "module.train_step",
    "trainer.backward",
    "trainer.optimizer_step",
)


class Run:
    """Rows of a training run on thread MAIN with exact times, in the order they end."""

    def __init__(self) -> None:
        self.rows: list[SpanRow] = []
        self.steps: list[int] = []  # the start of each step
        self._id = 100
        self.t = T0 + 1_000

    def span(
        self,
        name: str,
        start: int,
        end: int,
        parent: int,
        *,
        tid: int = MAIN,
        status: str = "UNSET",
    ) -> int:
        self._id += 1
        error = "ValueError: boom" if status == "ERROR" else ""
        row = SpanRow(name, self._id, parent, TRACE, start, end, tid, {"k": 1}, status, error)
        self.rows.append(row)
        return self._id

    def step(self, i: int, *, extra: str | None = None, error_hook: bool = False) -> int:
        """fetch, then a step of 4 hooks (backward with a child callback, optimizer with
        two calls of one event); ``extra`` adds one more hook (a new name)."""
        t = self.t
        self.span("trainer.fetch_batch", t, t + 50, 1)
        s = t + 60 + i  # durations vary by step
        rows_before = len(self.rows)
        pre = self.span("runtime.train_pre_step", s + 1, s + 11, 0)
        fwd = self.span("module.train_step", s + 12, s + 112 + i, 0)
        cb = self.span("callback.on_end_backward", s + 130, s + 140, 0)
        bwd = self.span("trainer.backward", s + 120, s + 160, 0)
        o1 = self.span("trainer.optimizer_step", s + 161, s + 171, 0)
        o2 = self.span("trainer.optimizer_step", s + 172, s + 180, 0)
        last = s + 181
        kids = [pre, fwd, bwd, o1, o2]
        if extra is not None:
            kids.append(self.span(extra, s + 181, s + 190, 0))
            last = s + 191
        if error_hook:
            kids.append(self.span("runtime.train_post_step", s + 191, s + 195, 0, status="ERROR"))
            last = s + 196
        step_id = self.span("trainer.step", s, last + 5, 1)
        # parents: the hooks under the step, the callback under backward
        fixed = []
        for r in self.rows[rows_before:]:
            if r.span_id in kids:
                r = r._replace(parent_id=step_id)
            elif r.span_id == cb:
                r = r._replace(parent_id=bwd)
            fixed.append(r)
        self.rows[rows_before:] = fixed
        self.steps.append(s)
        self.t = last + 10
        return s

    def batch(self, rows: list[SpanRow] | None = None) -> SpanBatch:
        return SpanBatch(list(self.rows if rows is None else rows), {"service.name": "t"}, PID)


@pytest.fixture(autouse=True, params=["columns", "loop"])
def _path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test on both paths: the column-wise one (_fold) and the loop alone."""
    monkeypatch.setattr(_detail, "FAST", request.param == "columns")


def _write(path: Path, batches: list[SpanBatch], summarise: list[int], **kw: Any) -> Any:
    exporter = ChromeTraceExporter(path, **kw)
    for start in summarise:
        exporter.summarise_step(MAIN, start, pid=PID)
    for b in batches:
        exporter.export_batch(b)
    exporter.shutdown()
    assert exporter.errors == 0 and exporter.spans_lost == 0
    return exporter


def _aggregates(frame: pd.DataFrame) -> tuple[dict[str, list[int]], int]:
    """Per event name on MAIN: [total, self, count] from the rows plus the aggregates of
    the summarised step rows (read with the names list in force); and how many
    summarised steps there are."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    names: list[str] = []
    summarised = 0
    main = frame[frame["tid"] == MAIN].sort_values("start_ns")
    for d in main.to_dict("records"):
        name = d["name"]
        out[name][0] += int(d["dur_ns"])
        out[name][1] += int(d["self_ns"])
        out[name][2] += 1
        hooks = d.get(_detail.HOOKS)
        if name != "trainer.step" or not isinstance(hooks, str):
            continue
        summarised += 1
        # the step's own self time: its duration less the self time of every span in it
        # (the aggregates'), as a reader computes it (spans nest perfectly)
        out[name][1] -= int(d["dur_ns"])
        step_self = int(d["dur_ns"])
        given = d.get(_detail.HOOK_NAMES)
        if isinstance(given, str):
            new = given.split(";")
            assert new[: len(names)] == names  # a new list extends the old one
            names = new
        for hook, entry in zip(names, hooks.split(";"), strict=False):
            if not entry:
                continue
            parts = [int(x) for x in entry.split("/")]
            total = parts[0]
            own = parts[1] if len(parts) > 1 else total
            count = parts[2] if len(parts) > 2 else 1
            out[hook][0] += total
            out[hook][1] += own
            out[hook][2] += count
            step_self -= own
        out["trainer.step"][1] += step_self
    return dict(out), summarised


def _read(path: Path) -> pd.DataFrame:
    return read_chrome_trace(path)


def test_step_level_events_are_exported() -> None:
    assert {"trainer.step", "trainer.fetch_batch", "trainer.epoch", "trainer.run"} <= set(
        STEP_LEVEL_EVENTS
    )
    assert not STEP_LEVEL_EVENTS & set(HOOKS)


def test_aggregates_equal_the_rows_written_in_full(tmp_path: Path) -> None:
    run = Run()
    for i in range(12):
        run.step(i)
    # batches cut in the middle of steps: a step's rows arrive over two batches
    rows = run.rows
    batches = [run.batch(rows[i : i + 7]) for i in range(0, len(rows), 7)]
    full = _write(tmp_path / "full.json", batches, [])
    chosen = [s for i, s in enumerate(run.steps) if i % 4 != 3]  # every 4th step detailed
    summ = _write(tmp_path / "summ.json", batches, chosen)
    a, b = _read(full.path), _read(summ.path)
    want, none = _aggregates(a)
    got, summarised = _aggregates(b)
    assert none == 0 and summarised == len(chosen) == summ.steps_summarised
    assert got == want
    # the summarised steps' hook rows are not in the file; the detailed steps' are
    hooks = b[b["name"].isin(HOOKS)]
    assert len(hooks) == 3 * 5  # 3 detailed steps of 5 hook rows
    assert summ.spans_summarised == len(chosen) * 6  # 5 hooks + the callback each
    assert len(b) == len(a) - summ.spans_summarised
    assert summ.bytes_written == sum(p.stat().st_size for p in summ.parts)
    assert summ.bytes_written < full.bytes_written


def test_the_attributes_have_the_contract_format(tmp_path: Path) -> None:
    run = Run()
    s = run.step(0)
    exporter = _write(tmp_path / "t.json", [run.batch()], [s])
    frame = _read(exporter.path)
    step = frame[frame["name"] == "trainer.step"].iloc[0]
    assert step[_detail.HOOK_NAMES] == (
        "runtime.train_pre_step;module.train_step;callback.on_end_backward;"
        "trainer.backward;trainer.optimizer_step"
    )
    # pre 10 (self = total: one number); forward 100; callback 10; backward 40, self 30;
    # the optimizer twice: 10 + 8 = 18, self 18, count 2
    assert step[_detail.HOOKS] == "10;100;10;40/30;18/18/2"
    assert step["k"] == 1  # the row's own attributes are kept


def test_error_rows_and_step_level_rows_inside_a_step_are_written_in_full(
    tmp_path: Path,
) -> None:
    run = Run()
    s = run.step(0, error_hook=True)
    # a fetch inside the step (as under instrument()) is step level: written in full
    run.span("trainer.fetch_batch", s + 2, s + 3, 0)
    exporter = _write(tmp_path / "t.json", [run.batch()], [s])
    frame = _read(exporter.path)
    assert list(frame.loc[frame["status"] == "ERROR", "name"]) == ["runtime.train_post_step"]
    assert (frame["name"] == "trainer.fetch_batch").sum() == 2
    assert exporter.spans_summarised == 6


def test_other_threads_are_untouched(tmp_path: Path) -> None:
    run = Run()
    s = run.step(0)
    # a data thread's spans during the step
    run.span("data.load", s + 5, s + 50, 0, tid=OTHER)
    run.span("module.train_step", s + 60, s + 70, 0, tid=OTHER)
    exporter = _write(tmp_path / "t.json", [run.batch()], [s])
    frame = _read(exporter.path)
    assert sorted(frame.loc[frame["tid"] == OTHER, "name"]) == ["data.load", "module.train_step"]


def _names_written(frame: pd.DataFrame) -> list[bool]:
    steps = frame[(frame["name"] == "trainer.step")].sort_values("start_ns")
    col = steps[_detail.HOOK_NAMES] if _detail.HOOK_NAMES in steps else pd.Series(dtype=object)
    return [isinstance(v, str) for v in col]


def test_the_names_list_is_written_when_the_contract_says(tmp_path: Path) -> None:
    run = Run()
    for i in range(7):
        run.step(i, extra="user.new" if i == 5 else None)
    detailed = {2}
    chosen = [s for i, s in enumerate(run.steps) if i not in detailed]
    exporter = _write(tmp_path / "t.json", [run.batch()], chosen)
    frame = _read(exporter.path)
    summarised = frame[(frame["name"] == "trainer.step")].sort_values("start_ns")
    has_hooks = [isinstance(v, str) for v in summarised[_detail.HOOKS]]
    assert has_hooks == [True, True, False, True, True, True, True]
    # the first summarised step, the first after a detailed step, a new name (step 5)
    assert _names_written(frame) == [True, False, False, True, False, True, False]
    names = summarised[_detail.HOOK_NAMES].dropna().tolist()
    assert names[-1] == names[0] + ";user.new"


def test_each_part_has_the_names_list(tmp_path: Path) -> None:
    run = Run()
    for i in range(60):
        run.step(i)
    rows = run.rows
    batches = [run.batch(rows[i : i + 40]) for i in range(0, len(rows), 40)]
    exporter = _write(
        tmp_path / "t.json", batches, run.steps, max_part_bytes=3_000, _min_part_bytes=1
    )
    assert len(exporter.parts) > 2
    for part in exporter.parts:
        frame = read_chrome_trace(part, parts=False)
        steps = frame[frame["name"] == "trainer.step"].sort_values("start_ns")
        if len(steps):
            assert isinstance(steps.iloc[0][_detail.HOOK_NAMES], str), part
    want, _ = _aggregates(_read(_write(tmp_path / "f.json", batches, []).path))
    got, n = _aggregates(_read(exporter.path))
    assert got == want and n == 60


def test_each_part_of_a_merge_has_the_names_list(tmp_path: Path) -> None:
    """``merge --max-part-bytes`` keeps the writer's promise: each part gives the names list
    on each thread's first summarised step, so a part read alone reads whole."""
    from exporters import merge_traces
    from exporters._aggregates import parse_aggregates

    run = Run()
    for i in range(60):
        run.step(i)
    exporter = _write(tmp_path / "t.json", [run.batch()], run.steps)  # one list, at the start
    merged = merge_traces(
        tmp_path / "m.json", [exporter.path], max_part_bytes=3_000, _min_part_bytes=1
    )
    assert len(merged.parts) > 2
    summarised = 0
    for part in merged.parts:
        frame = read_chrome_trace(part, parts=False)
        aggregates = parse_aggregates(frame)
        assert not len(aggregates.unknown), part
        summarised += len(aggregates.summarised)
        steps = frame[frame["name"] == "trainer.step"].sort_values("start_ns")
        if len(steps):
            assert isinstance(steps.iloc[0][_detail.HOOK_NAMES], str), part
    assert summarised == 60
    want, _ = _aggregates(_read(exporter.path))
    got, n = _aggregates(_read(tmp_path / "m.json"))
    assert got == want and n == 60


def test_a_step_whose_row_never_comes_gives_its_rows_back(tmp_path: Path) -> None:
    run = Run()
    lost = run.step(0)
    kept = run.step(1)
    # step 0's row never reaches the exporter (as if it was never recorded)
    rows = [r for r in run.rows if not (r.name == "trainer.step" and r.start_ns == lost)]
    full = _write(tmp_path / "full.json", [run.batch(rows)], [])
    exporter = _write(tmp_path / "t.json", [run.batch(rows)], [lost, kept])
    a, b = _read(full.path), _read(exporter.path)
    # step 0's hooks are written in full; step 1 is summarised; nothing is lost
    assert _aggregates(a)[0] == _aggregates(b)[0]
    assert exporter.steps_summarised == 1 and exporter.spans_summarised == 6
    assert exporter._detail.held() == 0


def test_rows_held_at_shutdown_are_written(tmp_path: Path) -> None:
    run = Run()
    s = run.step(0)
    rows = [r for r in run.rows if r.name != "trainer.step"]  # the step is still open
    exporter = _write(tmp_path / "t.json", [run.batch(rows)], [s])
    frame = _read(exporter.path)
    assert len(frame) == len(rows)
    final = _final(exporter.path)
    assert final["steps_summarised"] == 0 and final["spans_summarised"] == 0


def test_an_interval_holds_a_bounded_number_of_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_detail, "MAX_HELD", 3)
    run = Run()
    s = run.step(0)
    exporter = _write(tmp_path / "t.json", [run.batch()], [s])
    frame = _read(exporter.path)
    assert len(frame) == len(run.rows)  # past the bound the step is written in full
    step = frame[frame["name"] == "trainer.step"].iloc[0]
    assert not isinstance(step.get(_detail.HOOKS), str)
    assert exporter.steps_summarised == 0


def _final(path: Path) -> dict[str, Any]:
    events = json.loads(path.read_text())["traceEvents"]
    final = [e for e in events if e.get("name") == "ppetrace.final"]
    assert len(final) == 1 and events[-1] is final[0]
    return dict(final[0]["args"])


def test_the_final_counts_close_the_file(tmp_path: Path) -> None:
    run = Run()
    for i in range(3):
        run.step(i)
    exporter = ChromeTraceExporter(tmp_path / "t.json")
    for s in run.steps[:2]:
        exporter.summarise_step(MAIN, s, pid=PID)
    exporter.add_final_metadata(switched_at_step=0)
    exporter.export_batch(run.batch())
    assert exporter.force_flush()
    # before shutdown the file has no final counts (a killed run claims none)
    text = exporter.path.read_text()
    assert "ppetrace.final" not in text
    exporter.shutdown()
    assert _final(exporter.path) == {
        "steps_summarised": 2,
        "spans_summarised": 12,
        "parts": 1,
        "switched_at_step": 0,
    }


def test_no_final_event_without_summarised_steps(tmp_path: Path) -> None:
    run = Run()
    run.step(0)
    exporter = _write(tmp_path / "t.json", [run.batch()], [])
    assert "ppetrace.final" not in exporter.path.read_text()


def test_summarise_step_is_thread_safe_against_the_writer(tmp_path: Path) -> None:
    """The training thread publishes while the writer writes: every step is summarised."""
    run = Run()
    for i in range(400):
        run.step(i % 50)
    exporter = ChromeTraceExporter(tmp_path / "t.json")
    per_step = len(run.rows) // 400
    ready = threading.Event()

    def publish() -> None:
        for k, s in enumerate(run.steps):
            exporter.summarise_step(MAIN, s, pid=PID)
            if k == 10:
                ready.set()

    t = threading.Thread(target=publish)
    t.start()
    ready.wait()
    # each step's rows are exported after its start was published (as in a real run)
    for k in range(400):
        while len(exporter._detail._lanes[(PID, MAIN)].starts) + exporter.steps_summarised <= k:
            pass  # the publisher is behind: wait for it (it never blocks)
        exporter.export_batch(run.batch(run.rows[k * per_step : (k + 1) * per_step]))
    t.join()
    exporter.shutdown()
    assert exporter.steps_summarised == 400 and exporter.spans_summarised == 400 * 6


def _random_run(rng: random.Random) -> tuple[list[SpanRow], list[int]]:
    """Steps of random shape: 0-6 hooks, some nested, some ERROR, a fetch inside some
    steps, a span that ends after its step; their rows in end order, and the starts."""
    rows: list[SpanRow] = []
    starts: list[int] = []
    ids = iter(range(1_000, 10**9))
    t = T0
    for _ in range(rng.randint(5, 40)):
        t += rng.randint(10, 100)
        rows.append(SpanRow("trainer.fetch_batch", next(ids), 1, TRACE, t, t + 20, MAIN, {}))
        s = t + 30
        step_id = next(ids)
        t = s + 1
        for _h in range(rng.randint(0, 6)):
            name = rng.choice((*HOOKS, "user.a;b", "callback.x"))
            a, b = t, t + rng.randint(0, 50)
            hid = next(ids)
            if rng.random() < 0.3:  # a child
                c0 = a + rng.randint(0, max(0, b - a))
                c1 = c0 + rng.randint(0, max(0, b - c0))
                status = "ERROR" if rng.random() < 0.2 else "UNSET"
                child = "trainer.fetch_batch" if rng.random() < 0.2 else "callback.c"
                rows.append(SpanRow(child, next(ids), hid, TRACE, c0, c1, MAIN, {}, status))
            rows.append(SpanRow(name, hid, step_id, TRACE, a, b, MAIN, {}))
            t = b + 1
        end = t + 5
        rows.append(SpanRow("trainer.step", step_id, 1, TRACE, s, end, MAIN, {"i": len(starts)}))
        if rng.random() < 0.2:  # recorded in the step's time but ends after it
            rows.append(SpanRow("user.late", next(ids), 0, TRACE, end - 2, end + 3, MAIN, {}))
        starts.append(s)
        t = end + 10
    return rows, starts


def _through(rows: list[SpanRow], starts: list[int], cuts: list[int], detailed: set[int]) -> Any:
    f = _detail.DetailFilter()
    for i, s in enumerate(starts):
        if i not in detailed:
            f.publish(PID, MAIN, s)
    written: list[Any] = []
    for lo, hi in zip([0, *cuts], [*cuts, len(rows)], strict=True):
        out, summaries = f.take(PID, rows[lo:hi])
        f.finish(out, summaries, 0)
        written.extend(out)
    for more in f.flush_held().values():
        written.extend(more)
    key = sorted(
        (r.start_ns, r.end_ns, r.name, tuple(sorted(r.attributes.items()))) for r in written
    )
    return key, f.spans_summarised, f.steps_summarised, f.held()


def test_the_column_path_equals_the_loop_on_random_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(19)
    taken = []
    real = _detail.take_lane_fast

    def counted(*args: Any) -> bool:
        taken.append(real(*args))
        return taken[-1]

    monkeypatch.setattr(_detail, "take_lane_fast", counted)
    for _ in range(60):
        rows, starts = _random_run(rng)
        cuts = sorted(rng.sample(range(1, len(rows)), k=min(len(rows) - 1, rng.randint(0, 6))))
        detailed = {i for i in range(len(starts)) if rng.random() < 0.25}
        monkeypatch.setattr(_detail, "FAST", True)
        fast = _through(rows, starts, cuts, detailed)
        monkeypatch.setattr(_detail, "FAST", False)
        loop = _through(rows, starts, cuts, detailed)
        assert fast == loop
        assert fast[1] > 0 or len(detailed) == len(starts) or not rows
    if _detail._speedups is not None:  # the C path took most batches itself
        assert taken.count(True) > 100


def test_steps_that_touch_close_their_own_intervals(tmp_path: Path) -> None:
    """Without a DataLoader a step starts where the one before ends, and instrument()
    records the step and its last optimizer step after the fact, both ending at one
    instant, the step's row first. Steps 0 and 2 are summarised, 1 is in full."""
    rows: list[SpanRow] = []
    ids = iter(range(500, 10**6))
    starts = [T0 + 1_000 + k * 100 for k in range(3)]
    for k, s in enumerate(starts):
        end = s + 100  # = the next step's start
        fwd = SpanRow("module.forward", next(ids), 0, TRACE, s + 10, s + 40, MAIN, {})
        opt = SpanRow("trainer.optimizer_step", next(ids), 0, TRACE, s + 60, end, MAIN, {})
        step = SpanRow("trainer.step", next(ids), 0, TRACE, s, end, MAIN, {"k": k})
        rows += [fwd, step, opt]
    exporter = _write(tmp_path / "t.json", [SpanBatch(rows, {}, PID)], [starts[0], starts[2]])
    frame = _read(exporter.path)
    steps = frame[frame["name"] == "trainer.step"].sort_values("start_ns")
    assert [isinstance(h, str) for h in steps[_detail.HOOKS]] == [True, False, True]
    assert list(steps[_detail.HOOKS])[::2] == ["30;40", "30;40"]
    assert (frame["name"] == "module.forward").sum() == 1  # step 1's, in full
    assert exporter.spans_summarised == 4


def test_any_event_name_is_summarised_and_read_back_as_it_was(tmp_path: Path) -> None:
    from exporters import step_report

    odd = "user/augment;crop 100%;%3B"
    run = Run()
    for i in range(3):
        run.step(i, extra=odd)
    exporter = _write(tmp_path / "t.json", [run.batch()], run.steps)
    frame = _read(exporter.path)
    assert odd not in set(frame["name"])  # folded, not written in full
    assert exporter.spans_summarised == 3 * 7
    events = step_report(frame, warmup_steps=0).events.set_index("event")
    assert events.loc[odd, "count"] == 3 and events.loc[odd, "total_ns"] == 3 * 9


def test_a_span_written_in_full_under_a_folded_hook_stays_in_its_step(tmp_path: Path) -> None:
    """An ERROR span is written in full; its parent hook is folded into the step's
    aggregates, so the reader places it by time under the step."""
    from exporters import step_report

    run = Run()
    for i in range(3):
        run.step(i)
        cb = next(r for r in reversed(run.rows) if r.name == "callback.on_end_backward")
        at = run.rows.index(cb)
        run.rows[at] = cb._replace(status="ERROR", error="ValueError: boom")
    exporter = _write(tmp_path / "t.json", [run.batch()], run.steps)
    frame = _read(exporter.path)
    errors = frame[frame["name"] == "callback.on_end_backward"]
    assert len(errors) == 3
    report = step_report(frame, warmup_steps=1)
    events = report.events.set_index("event")
    assert events.loc["callback.on_end_backward", "count"] == 2  # the warmup step's left out


def test_a_merged_trace_keeps_the_common_detail_policy(tmp_path: Path) -> None:
    from exporters import load_chrome_trace, merge_traces

    policy = {"policy": "auto", "max_trace_bytes": 5, "schedule": None}
    paths = []
    for i, pid in enumerate((PID, PID + 1)):
        run = Run()
        run.step(0)
        path = tmp_path / f"rank{i}.json"
        exporter = ChromeTraceExporter(path, metadata={"ppetrace.detail": policy})
        exporter.export_batch(SpanBatch(run.rows, {}, pid))
        exporter.shutdown()
        paths.append(path)
    merge_traces(tmp_path / "merged.json", paths)
    assert load_chrome_trace(tmp_path / "merged.json").metadata["ppetrace.detail"] == policy


def test_on_bytes_calls_back_once_when_the_trace_reaches_the_limit(tmp_path: Path) -> None:
    run = Run()
    for i in range(3):
        run.step(i)
    exporter = ChromeTraceExporter(tmp_path / "alarm.json")
    rang: list[int] = []
    exporter.on_bytes(1 << 60, lambda: rang.append(-1))  # replaced by the next alarm
    exporter.on_bytes(1, lambda: rang.append(exporter.bytes_written))
    assert rang == []  # nothing written yet
    exporter.export_batch(SpanBatch(run.rows[:4], {"service.name": "t"}, pid=PID))
    assert len(rang) == 1 and rang[0] >= 1
    exporter.export_batch(SpanBatch(run.rows[4:], {"service.name": "t"}, pid=PID))
    assert len(rang) == 1  # once
    later: list[str] = []
    exporter.on_bytes(exporter.bytes_written, lambda: later.append("now"))
    assert later == ["now"]  # reached already: at once
    exporter.shutdown()
