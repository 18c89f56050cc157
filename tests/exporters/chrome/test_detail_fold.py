"""The C fold of the detail filter (``_speedups.fold_lane`` through ``_fold.take_lane_fast``)
against its pure-Python twin (``DetailFilter._take_lane``): the same rows in the same
order, the same summaries, and the same lane state after every batch, on generated runs
that also take the paths where the C fold declines."""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest

from exporters import SpanRow
from exporters._accel import SPEEDUPS
from exporters._spans import FrozenAttributes
from exporters.chrome import _detail, _fold

pytestmark = pytest.mark.skipif(SPEEDUPS is None, reason="the C helpers are not built")

T0 = 1_700_000_000_000_000_000
PID = 7
MAIN, OTHER = 21, 22
NAMES = (
    "runtime.train_pre_step",
    "module.train_step",
    "trainer.backward",
    "trainer.optimizer_step",
    "user.a;b",
    "user.100%",
    "callback.x",
)


class _OddName(str):
    """A name that is a str subclass: the C fold leaves such a lane to the loop."""


def _run(rng: random.Random) -> tuple[list[SpanRow], list[int]]:
    """Rows of random steps on MAIN (some rows on OTHER), in end order per thread, and
    the step starts. Steps may touch, hold ERROR, step-level and late rows, nest hooks,
    have negative durations, or lose their step row; epochs may enclose them."""
    rows: list[SpanRow] = []
    starts: list[int] = []
    ids = iter(range(1_000, 10**9))
    t = T0
    epoch_start = t
    attrs: Any = {"ppetrace.step": 0}
    for k in range(rng.randint(3, 30)):
        t += rng.choice((0, 0, rng.randint(1, 100)))
        if rng.random() < 0.8:
            rows.append(SpanRow("trainer.fetch_batch", next(ids), 1, 9, t, t + 20, MAIN, attrs))
            t += 30
        s = t
        step_id = next(ids)
        attrs = {"ppetrace.step": k} if rng.random() < 0.9 else FrozenAttributes({"k": k})
        t = s + rng.choice((0, 1))
        for _h in range(rng.randint(0, 7)):
            name = rng.choice(NAMES)
            if rng.random() < 0.003:
                name = _OddName(name)
            a = t
            b = a + rng.randint(-3, 60)  # a negative duration now and then
            hid = next(ids)
            if rng.random() < 0.3:  # a child (a hook, an ERROR hook or a step-level row)
                c0 = a + rng.randint(0, max(0, b - a))
                c1 = c0 + rng.randint(0, max(0, b - c0))
                status = "ERROR" if rng.random() < 0.2 else "UNSET"
                child = rng.choice(("callback.c", "callback.c", "trainer.fetch_batch"))
                rows.append(SpanRow(child, next(ids), hid, 9, c0, c1, MAIN, {}, status))
            if rng.random() < 0.1:
                rows.append(SpanRow("data.load", next(ids), 0, 9, a, b, OTHER, {}))
            status = "ERROR" if rng.random() < 0.05 else rng.choice(("UNSET", "OK"))
            rows.append(SpanRow(name, hid, step_id, 9, a, b, MAIN, {}, status))
            t = max(a, b) + rng.choice((0, 1))
        end = t + rng.choice((0, 5))
        if rng.random() < 0.93:  # else the step row never comes
            rows.append(SpanRow("trainer.step", step_id, 1, 9, s, end, MAIN, attrs))
        if rng.random() < 0.15:  # recorded in the step's time but ends after it
            rows.append(SpanRow("user.late", next(ids), 0, 9, end - 2, end + 3, MAIN, {}))
        if rng.random() < 0.05:  # an epoch ends around the steps so far
            rows.append(SpanRow("trainer.epoch", next(ids), 0, 9, epoch_start, end + 1, MAIN, {}))
            epoch_start = end + 2
        starts.append(s)
        t = end + rng.choice((0, 0, 10))
    # the order the filter takes them in: by thread, end, the later start first
    rows.sort(key=lambda r: (r.tid, r.end_ns, -r.start_ns))
    if rng.random() < 0.3:  # several buffers: the batch is not in that order
        rng.shuffle(rows)
    return rows, starts


def _state(f: _detail.DetailFilter) -> list[Any]:
    out = []
    for key, lane in sorted(f._lanes.items()):
        cur = lane.cur
        out.append(
            (
                key,
                list(lane.starts),
                None if cur is None else (cur.start, list(cur.rows), list(cur.inner), cur.full),
                list(lane.names),
                dict(lane.index),
                lane.exact,
                lane.announce,
                lane.part,
                lane.listed,
                list(lane.light),
            )
        )
    return [out, f.spans_summarised, f.steps_summarised, f.light_lost]


def _through(
    monkeypatch: pytest.MonkeyPatch,
    fast: bool,
    rows: list[SpanRow],
    starts: list[int],
    cuts: list[int],
    detailed: set[int],
    parts: list[int],
) -> list[Any]:
    """Everything the filter gives and keeps, batch by batch."""
    monkeypatch.setattr(_detail, "FAST", fast)
    f = _detail.DetailFilter()
    for i, s in enumerate(starts):
        if i not in detailed:
            f.publish(PID, MAIN, s)
    f.publisher(PID, OTHER)  # a lane with nothing published
    return _batches(f, rows, cuts, parts)


def _batches(
    f: _detail.DetailFilter, rows: list[SpanRow], cuts: list[int], parts: list[int]
) -> list[Any]:
    """``rows`` through ``f`` in batches cut at ``cuts``: what it gives and keeps after
    each, then the rows it still held at the end."""
    trail: list[Any] = []
    for b, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, len(rows)], strict=True)):
        out, summaries = f.take(PID, rows[lo:hi])
        f.finish(out, summaries, parts[b % len(parts)])
        trail.append((out, summaries, _state(f)))
    trail.append(sorted(f.flush_held().items()))
    return trail


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[bool]:
    """What ``_detail.<name>`` (a C path of ``_fold``) returns, call by call, from now on."""
    results: list[bool] = []
    real = getattr(_fold, name)

    def counted(*args: Any) -> bool:
        results.append(real(*args))
        return results[-1]

    monkeypatch.setattr(_detail, name, counted)
    return results


def test_the_c_fold_equals_the_loop_on_generated_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(1919)
    results = _count_calls(monkeypatch, "take_lane_fast")
    summarised = 0
    for trial in range(300):
        rows, starts = _run(rng)
        if trial % 10 == 9:
            monkeypatch.setattr(_detail, "MAX_HELD", rng.randint(1, 6))
        else:
            monkeypatch.setattr(_detail, "MAX_HELD", 1 << 16)
        k = rng.randint(0, min(8, len(rows) - 1))
        cuts = sorted(rng.sample(range(1, len(rows)), k=k))
        detailed = {i for i in range(len(starts)) if rng.random() < 0.2}
        parts = [0] if rng.random() < 0.7 else [0, 0, 1, 2]
        fast = _through(monkeypatch, True, rows, starts, cuts, detailed, parts)
        loop = _through(monkeypatch, False, rows, starts, cuts, detailed, parts)
        assert fast == loop, f"trial {trial}"
        summarised += loop[-2][2][2]
    assert summarised > 2_000
    # the C fold took most lanes, and declined some (the loop's cases)
    assert results.count(True) > 600 and results.count(False) > 300


def _light_run(rng: random.Random) -> tuple[list[SpanRow], list[tuple[int, tuple[Any, ...]]]]:
    """Rows of random light steps on MAIN (the step level, a few ERROR rows and rows on
    OTHER), in end order, and each light step's (start, aggregates); some steps are
    detailed (hooks as rows, nothing published), some lose their step row."""
    rows: list[SpanRow] = []
    light: list[tuple[int, tuple[Any, ...]]] = []
    ids = iter(range(1_000, 10**9))
    t = T0
    for k in range(rng.randint(2, 25)):
        rows.append(SpanRow("trainer.fetch_batch", next(ids), 1, 9, t, t + 20, MAIN, {"f": k}))
        s = t + 30
        step_id = next(ids)
        end = s + rng.randint(50, 500)
        detailed = rng.random() < 0.2
        if detailed:
            name = rng.choice(NAMES)
            rows.append(SpanRow(name, next(ids), step_id, 9, s + 1, s + 20, MAIN, {}))
        else:
            picked = rng.sample(NAMES, rng.randint(0, len(NAMES)))
            agg: list[Any] = []
            for name in picked:
                count = rng.randint(1, 3)
                total = rng.randint(0, 200)
                agg += (name, total, rng.randint(0, total), count)
            light.append((s, tuple(agg)))
        if rng.random() < 0.1:  # an ERROR row in the step: written in full
            rows.append(SpanRow("user.e", next(ids), step_id, 9, s + 2, s + 9, MAIN, {}, "ERROR"))
        if rng.random() < 0.1:
            rows.append(SpanRow("data.load", next(ids), 0, 9, s, s + 3, OTHER, {}))
        if rng.random() < 0.92:  # else the step row never comes
            attrs: Any = {"ppetrace.step": k} if rng.random() < 0.95 else FrozenAttributes({})
            rows.append(SpanRow("trainer.step", step_id, 1, 9, s, end, MAIN, attrs))
        t = end + rng.choice((0, 10))
    rows.sort(key=lambda r: (r.tid, r.end_ns, -r.start_ns))
    if rng.random() < 0.2:  # several buffers: the batch is not in that order
        rng.shuffle(rows)
    return rows, light


def _light_through(
    monkeypatch: pytest.MonkeyPatch,
    fast: bool,
    rows: list[SpanRow],
    light: list[tuple[int, tuple[Any, ...]]],
    cuts: list[int],
    parts: list[int],
) -> list[Any]:
    monkeypatch.setattr(_detail, "FAST", fast)
    f = _detail.DetailFilter()
    publish = f.light_publisher(PID, MAIN)
    for start, agg in light:
        publish((start, agg))
    return [*_batches(f, rows, cuts, parts), _state(f)]


def test_the_c_light_lane_equals_the_loop_on_generated_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(2026)
    results = _count_calls(monkeypatch, "light_lane_fast")
    summarised = lost = 0
    for trial in range(300):
        rows, light = _light_run(rng)
        k = rng.randint(0, min(6, len(rows) - 1))
        cuts = sorted(rng.sample(range(1, len(rows)), k=k))
        parts = [0] if rng.random() < 0.7 else [0, 0, 1]
        fast = _light_through(monkeypatch, True, rows, light, cuts, parts)
        loop = _light_through(monkeypatch, False, rows, light, cuts, parts)
        assert fast == loop, f"trial {trial}"
        summarised += loop[-1][2]
        lost += loop[-1][3]
    assert summarised > 1_000 and lost > 0
    assert results.count(True) > 300 and results.count(False) > 20  # it declined some


def _lane_rows(n_steps: int) -> tuple[list[SpanRow], list[int]]:
    rows, starts = [], []
    for k in range(n_steps):
        s = T0 + k * 1_000
        rows.append(SpanRow("module.forward", 10 * k + 1, 10 * k + 2, 9, s + 5, s + 50, MAIN, {}))
        rows.append(SpanRow("trainer.step", 10 * k + 2, 1, 9, s, s + 100, MAIN, {"k": k}))
        starts.append(s)
    return rows, starts


@pytest.mark.parametrize(
    "change",
    ["orphan", "epoch", "unordered", "big id", "held", "odd attrs", "odd status", "overflow"],
)
def test_the_c_fold_declines_without_changing_anything(change: str) -> None:
    """Each case the C fold leaves to the loop: it returns False and the lane, the
    output and the counts are as they were."""
    rows, starts = _lane_rows(3)
    if change == "orphan":  # step 0's row never comes: step 1's row ends first
        del rows[1]
    elif change == "epoch":  # an epoch ends around step 0's start before its row
        rows.insert(1, SpanRow("trainer.epoch", 999, 0, 9, T0 - 5, T0 + 60, MAIN, {}))
    elif change == "unordered":
        rows[0], rows[1] = rows[1], rows[0]
    elif change == "big id":
        rows[0] = rows[0]._replace(span_id=1 << 64)
    elif change == "held":
        rows[0] = rows[0]._replace(start_ns=T0 + 1, end_ns=T0 + 2)
        rows.insert(1, rows[0]._replace(span_id=55, start_ns=T0 + 2, end_ns=T0 + 3))
    elif change == "odd attrs":  # a step row's attributes that are not a dict
        rows[1] = rows[1]._replace(attributes=_MappingOnly({"k": 0}))
    elif change == "odd status":
        rows[0] = rows[0]._replace(status=_OddName("UNSET"))
    elif change == "overflow":  # a duration beyond int64 (exact in the loop)
        rows[0] = rows[0]._replace(start_ns=-(1 << 63))
        rows[1] = rows[1]._replace(start_ns=-(1 << 63))
        starts[0] = -(1 << 63)
    f = _detail.DetailFilter()
    for s in starts:
        f.publish(PID, MAIN, s)
    lane = f._lanes[(PID, MAIN)]
    lane.names.append("x")
    lane.index["x"] = 0
    before = _state(f)
    out: list[Any] = ["earlier"]
    summaries: list[int] = []
    limit = 1 if change == "held" else 1 << 16
    try:
        _detail.MAX_HELD, saved = limit, _detail.MAX_HELD
        assert _fold.take_lane_fast(f, lane, rows, out, summaries) is False
    finally:
        _detail.MAX_HELD = saved
    assert out == ["earlier"] and summaries == [] and _state(f) == before


class _MappingOnly(dict[str, Any]):
    """A dict subclass that is not FrozenAttributes: copying it may run Python code."""

    def keys(self) -> Any:  # type: ignore[override]
        return list(super().keys())


def test_a_step_row_keeps_its_type_and_attributes() -> None:
    rows, starts = _lane_rows(2)
    f = _detail.DetailFilter()
    for s in starts:
        f.publish(PID, MAIN, s)
    out, summaries = f.take(PID, rows)
    f.finish(out, summaries, 0)
    assert [type(r) for r in out] == [SpanRow, SpanRow]
    assert [dict(r.attributes) for r in out] == [
        {"k": 0, _detail.HOOKS: "45", _detail.HOOK_NAMES: "module.forward"},
        {"k": 1, _detail.HOOKS: "45"},
    ]
    assert rows[1].attributes == {"k": 0}  # the row given is not changed


class _EvilKey(str):
    """A key whose comparison clears the list it was given (run by a lookup that
    collides with it)."""

    victim: ClassVar[list[Any]] = []

    def __hash__(self) -> int:
        return str.__hash__(self)

    def __eq__(self, other: object) -> bool:
        _EvilKey.victim.clear()
        return str.__eq__(self, other)

    __ne__ = str.__ne__


def test_the_c_fold_survives_collections_that_change_the_lane() -> None:
    """A collection during the fold (every allocation may run one) whose callback
    changes the lane's names, index and held rows: the fold declines or gives a
    result, and memory stays sound (the sanitizer job runs this under ASan)."""
    import gc

    rows, starts = _lane_rows(200)
    f = _detail.DetailFilter()
    for s in starts:
        f.publish(PID, MAIN, s)
    lane = f._lanes[(PID, MAIN)]
    calls = 0

    def meddle(phase: str, info: dict[str, Any]) -> None:
        nonlocal calls
        calls += 1
        if phase == "start" and calls % 97 == 0:
            lane.names.append(f"n{calls}")
            key = _EvilKey("module.forward")
            _EvilKey.victim = lane.names
            lane.index[key] = len(lane.names) - 1  # a key whose __eq__ runs Python code
            if lane.cur is not None:
                lane.cur.rows.clear()

    old = gc.get_threshold()
    taken = declined = 0
    gc.callbacks.append(meddle)
    gc.set_threshold(1)
    try:
        for lo in range(0, len(rows), 50):
            out: list[Any] = []
            summaries: list[int] = []
            if _fold.take_lane_fast(f, lane, rows[lo : lo + 50], out, summaries):
                taken += 1
                assert all(type(out[i]) is tuple and len(out[i]) == 4 for i in summaries)
                f.finish(out, summaries, 0)
                assert all(type(r) is SpanRow for r in out)
            else:  # the state it saw changed under it: start again from a sound one
                declined += 1
                lane.names, lane.index, lane.cur = [], {}, None
    finally:
        gc.callbacks.remove(meddle)
        gc.set_threshold(*old)
    assert calls > 10 and taken + declined == 8
