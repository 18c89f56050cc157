"""One step definition for every layout: the Trainer's sibling fetch, a fetch inside the
step, and steps recorded after the fact (``instrument()``) whose children are found by time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporters import _accel, spans_to_frame, step_report
from exporters._nesting import _enclosing, _enclosing_py, effective_parents
from exporters._steps import assign_steps, name_codes
from exporters.comparison import event_samples
from exporters.frame import (
    _depth,
    _depth_py,
    _inherit_masked,
    _inherit_masked_py,
    _parent_positions,
    _parent_positions_py,
)

RunBuilder = Any

# one timeline, three steps: a fetch of FETCH[i] ns, then WORK[i] ns of step work, GAP between
FETCH = [300, 400, 500]
WORK = [2_000, 3_000, 4_000]
GAP = 100


def _timeline() -> list[tuple[int, int, int]]:
    """(fetch start, fetch end = work start, work end) of each step."""
    t, out = 0, []
    for f, w in zip(FETCH, WORK, strict=True):
        t += GAP
        out.append((t, t + f, t + f + w))
        t += f + w
    return out


def _steps(rb: RunBuilder) -> pd.DataFrame:
    return step_report(spans_to_frame(rb.batch()), warmup_steps=0).steps


def test_a_fetch_before_the_step_and_a_fetch_inside_it_count_the_same_data_wait(
    run_builder: Callable[..., RunBuilder],
) -> None:
    sibling, child = run_builder(), run_builder()
    for i, (fs, fe, we) in enumerate(_timeline()):
        sibling.span("trainer.fetch_batch", fs, fe)  # the Trainer's layout
        sibling.span("trainer.step", fe, we, 0, {"ppetrace.step": i})
        sid = child.span("trainer.step", fs, we, 0, {"ppetrace.step": i})  # fetch inside
        child.span("trainer.fetch_batch", fs, fe, sid)
    a, b = _steps(sibling), _steps(child)
    assert list(a["data_wait_ns"]) == list(b["data_wait_ns"]) == FETCH
    assert list(a["compute_ns"]) == list(b["compute_ns"]) == WORK
    # the first step starts at its fetch; later ones at the previous step's end
    walls = [FETCH[0] + WORK[0]] + [GAP + f + w for f, w in zip(FETCH[1:], WORK[1:], strict=True)]
    assert list(a["wall_ns"]) == list(b["wall_ns"]) == walls
    assert list(b["between_ns"]) == [0, GAP, GAP]
    for steps in (a, b):
        parts = steps["data_wait_ns"] + steps["compute_ns"] + steps["between_ns"]
        assert (steps["wall_ns"] == parts).all()
        assert list(steps["other_ns"]) == list(steps["compute_ns"] + steps["between_ns"])


def test_every_fetch_between_two_steps_is_the_next_steps_data_wait(
    run_builder: Callable[..., RunBuilder],
) -> None:
    """Two loaders zipped (two fetches per step), and a fetch whose batch a ``break`` threw
    away (no step right after it): every fetch counts once, as data wait, none as time
    between steps or in no step at all."""
    rb = run_builder()
    rb.span("trainer.fetch_batch", 0, 300)  # loader a
    rb.span("trainer.fetch_batch", 300, 700)  # loader b
    rb.span("trainer.step", 700, 2_700, 0, {"ppetrace.step": 0})
    rb.span("trainer.fetch_batch", 2_800, 3_000)
    rb.span("trainer.fetch_batch", 3_000, 3_500)
    rb.span("trainer.step", 3_500, 5_500, 0, {"ppetrace.step": 1})
    rb.span("trainer.fetch_batch", 5_600, 6_100)  # its batch thrown away (a break)
    rb.span("trainer.loader_start", 9_000, 9_400)  # the next epoch
    rb.span("trainer.fetch_batch", 9_400, 9_600)
    rb.span("trainer.step", 9_600, 11_600, 0, {"ppetrace.step": 2})
    frame = spans_to_frame(rb.batch())
    steps = step_report(frame, warmup_steps=0).steps
    assert list(steps["data_wait_ns"]) == [700, 700, 700]
    assert list(steps["compute_ns"]) == [2_000, 2_000, 2_000]
    # the first step from its first fetch; the loader's start is not step time
    assert list(steps["wall_ns"]) == [2_700, 2_800, 11_600 - 5_500 - 400]
    assert list(steps["between_ns"]) == [0, 100, 5_700 - 700 - 2_000]
    owned = assign_steps(frame, 0).step_row[frame["name"].to_numpy() == "trainer.fetch_batch"]
    assert (owned >= 0).all()  # every fetch belongs to a step


def test_steps_recorded_after_the_fact_own_the_spans_inside_them_by_time(
    run_builder: Callable[..., RunBuilder],
) -> None:
    """instrument()'s layout: forward, backward and the optimizer step are recorded with the
    step's parent (here the root), the step itself only when it ends."""
    rb = run_builder()
    for i, (fs, fe, we) in enumerate(_timeline()):
        rb.span("trainer.fetch_batch", fs, fe)
        rb.span("module.forward", fe + 10, fe + 510, 0, {"ppetrace.module": "Net"})
        bw = rb.span("trainer.backward", fe + 600, fe + 1_100)
        rb.span("user.inside_backward", fe + 700, fe + 800, bw)
        rb.span("trainer.optimizer_step", we - 300, we)  # after the fact, too
        rb.span("trainer.step", fe, we, 0, {"ppetrace.step": i})
    frame = spans_to_frame(rb.batch())
    assignment = assign_steps(frame, 0)
    steps = assignment.steps
    names = frame["name"].to_numpy(dtype=object)
    step_of = dict(zip(steps.index, steps["step"], strict=True))
    for name in ("module.forward", "trainer.backward", "user.inside_backward"):
        rows = np.flatnonzero(names == name)
        assert [step_of[r] for r in assignment.step_row[rows]] == [0, 1, 2], name
    assert list(steps["data_wait_ns"]) == FETCH and list(steps["compute_ns"]) == WORK
    report = step_report(frame, warmup_steps=0)
    events = report.events.set_index("event")
    # self times with the parents found by time: the step less its three children
    assert events.loc["trainer.step", "self_ns"] == sum(WORK) - 3 * (500 + 500 + 300)
    assert events.loc["trainer.backward", "self_ns"] == 3 * (500 - 100)
    assert events.loc["module.forward", "share"] == 3 * 500 / report.steps["wall_ns"].sum()
    # the parts by the spans found by time: forward 500, backward 500 (with its child),
    # optimizer 300, the step's own time is other
    steps = report.steps
    assert list(steps["forward_ns"]) == [500] * 3 and list(steps["backward_ns"]) == [500] * 3
    assert list(steps["optimizer_ns"]) == [300] * 3
    own = [w - 1_300 for w in WORK]
    assert list(steps["other_ns"]) == [o + g for o, g in zip(own, [0, GAP, GAP], strict=True)]
    samples = event_samples(frame, warmup_steps=0)
    assert list(samples["module.forward"]) == [500.0] * 3  # one sample per step


def test_the_optimizer_step_recorded_after_the_fact_owns_a_closure_inside_it(
    run_builder: Callable[..., RunBuilder],
) -> None:
    """optimizer.step(closure): the closure's forward runs inside the optimizer step,
    which (like the step) is only recorded when it ends."""
    rb = run_builder()
    fwd = rb.span("module.forward", 200, 700)
    opt = rb.span("trainer.optimizer_step", 100, 900)
    step = rb.span("trainer.step", 50, 1_000)
    frame = spans_to_frame(rb.batch())
    ids = frame["span_id"].to_numpy(np.uint64)
    ppos = _parent_positions(ids, frame["parent_id"].to_numpy(np.uint64), frame["pid"].to_numpy())
    eff, changed = effective_parents(
        ppos,
        frame["parent_id"].to_numpy(np.uint64),
        frame["start_ns"].to_numpy(np.int64),
        frame["end_ns"].to_numpy(np.int64),
        frame["pid"].to_numpy(np.int64),
        frame["tid"].to_numpy(np.int64),
    )
    row = {int(s): i for i, s in enumerate(ids)}
    assert changed
    assert eff[row[fwd]] == row[opt] and eff[row[opt]] == row[step] and eff[row[step]] == -1
    events = step_report(frame, warmup_steps=0).events.set_index("event")
    assert events.loc["trainer.optimizer_step", "self_ns"] == 800 - 500
    assert events.loc["trainer.step", "self_ns"] == 950 - 800


def test_a_fetch_inside_an_after_the_fact_step_is_its_data_wait_once(
    run_builder: Callable[..., RunBuilder],
) -> None:
    """A loop that fetches its next batch inside the step, recorded after the fact: the
    fetch is found inside by time and counted once, next to a sibling fetch."""
    rb = run_builder()
    rb.span("trainer.fetch_batch", 0, 100)
    rb.span("trainer.fetch_batch", 400, 650)  # inside the step by time, a sibling by id
    rb.span("trainer.step", 100, 1_100, 0, {"ppetrace.step": 0})
    steps = _steps(rb)
    assert list(steps["data_wait_ns"]) == [100 + 250]
    assert list(steps["compute_ns"]) == [1_000 - 250]
    assert list(steps["wall_ns"]) == [1_100]


def test_nested_ids_are_left_as_they_are(run_builder: Callable[..., RunBuilder]) -> None:
    rb = run_builder()
    rb.training([1_000, 2_000, 3_000], fetch_ns=[10, 20, 30])
    frame = spans_to_frame(rb.batch())
    assert assign_steps(frame, 0).self_ns is None  # nothing was moved by time
    ppos = _parent_positions(
        frame["span_id"].to_numpy(np.uint64),
        frame["parent_id"].to_numpy(np.uint64),
        frame["pid"].to_numpy(),
    )
    eff, changed = effective_parents(
        ppos,
        frame["parent_id"].to_numpy(np.uint64),
        frame["start_ns"].to_numpy(np.int64),
        frame["end_ns"].to_numpy(np.int64),
        frame["pid"].to_numpy(np.int64),
        frame["tid"].to_numpy(np.int64),
    )
    assert not changed and (eff == ppos).all()


def test_spans_on_another_thread_are_not_nested_by_time(
    run_builder: Callable[..., RunBuilder],
) -> None:
    rb = run_builder()
    rb.span("trainer.step", 0, 1_000, 0, {"ppetrace.step": 0})
    rb.span("loader.worker", 100, 200, tid=99)  # a root on another thread, inside in time
    frame = spans_to_frame(rb.batch())
    assignment = assign_steps(frame, 0)
    names = list(frame["name"])
    assert assignment.step_row[names.index("loader.worker")] == -1
    assert assignment.self_ns is None


def test_an_after_the_fact_validation_keeps_its_fetches_from_the_next_step(
    run_builder: Callable[..., RunBuilder],
) -> None:
    """instrument() records validation between steps after the fact: its fetches are
    inside it by time, so the next step's data wait is its own fetch and the validation
    is left out of the step's wall time."""
    rb = run_builder()
    rb.span("trainer.fetch_batch", 0, 100)
    rb.span("trainer.step", 100, 1_100, 0, {"ppetrace.step": 0})
    rb.span("trainer.fetch_batch", 1_200, 1_300)  # validation batches
    rb.span("module.forward", 1_300, 1_800, 0, {"ppetrace.stage": "val"})
    rb.span("trainer.fetch_batch", 1_800, 1_850)
    rb.span("trainer.validation", 1_200, 1_850, 0, {"ppetrace.stage": "val"})
    rb.span("trainer.fetch_batch", 1_900, 1_970)
    rb.span("trainer.step", 1_970, 2_970, 0, {"ppetrace.step": 1})
    steps = _steps(rb)
    assert list(steps["data_wait_ns"]) == [100, 70]
    # step 1: 100 ns before the validation, 50 after it, its fetch and itself
    assert list(steps["wall_ns"]) == [1_100, 100 + 50 + 70 + 1_000]


def test_a_span_recorded_under_an_ancestor_goes_under_the_span_around_it(
    run_builder: Callable[..., RunBuilder],
) -> None:
    """LightningProfiler's layout: Lightning's actions nest by id among themselves, but a
    span the user's code records inside ``training_step`` has the root as its parent (the
    actions do not enter the context): it goes under the innermost action around it."""
    rb = run_builder()
    epoch = rb.span("run_training_epoch", 0, 10_000)
    rb.span("trainer.fetch_batch", 100, 300, epoch)
    step = rb.span("trainer.step", 300, 2_300, epoch, {"ppetrace.step": 0})
    train = rb.span("module.train_step", 400, 1_400, step)
    rb.span("user.loss", 500, 900)  # a root by id
    frame = spans_to_frame(rb.batch())
    assignment = assign_steps(frame, 0)
    names = list(frame["name"])
    assert assignment.step_row[names.index("user.loss")] == names.index("trainer.step")
    events = step_report(frame, warmup_steps=0).events.set_index("event")
    assert events.loc["module.train_step", "self_ns"] == 1_000 - 400
    assert train  # the ids are the builder's


def test_identical_intervals_never_put_a_span_under_its_own_child(
    run_builder: Callable[..., RunBuilder],
) -> None:
    """A clock too coarse to order a parent and its child (both 0 to 1,000 ns) leaves the
    ids as they are: no cycle."""
    rb = run_builder()
    rb.span("inner", 0, 1_000, 0x5000)  # first in the rows: it sorts before its parent
    rb.span("outer", 0, 1_000, span_id=0x5000)
    rb.span("trainer.step", 2_000, 3_000, 0, {"ppetrace.step": 0})
    frame = spans_to_frame(rb.batch())
    assert assign_steps(frame, 0).self_ns is None
    assert step_report(frame, warmup_steps=0).events.set_index("event").loc["outer", "self_ns"] == 0


_needs_c = pytest.mark.skipif(_accel.SPEEDUPS is None, reason="exporters._speedups is not built")
# few distinct values, so that ids repeat, parents are found and intervals tie
_SMALL = st.integers(min_value=0, max_value=12)


@_needs_c
@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.tuples(_SMALL, _SMALL, st.integers(0, 2)), min_size=1, max_size=40),
    wide=st.booleans(),
)
def test_c_parent_positions_match_the_pandas_twin(
    rows: list[tuple[int, int, int]], wide: bool
) -> None:
    """``_speedups.parent_positions`` against the pandas path: ids 0 (a root), absent
    parents, and ids that repeat (where C declines and pandas decides)."""
    high = 1 << 63 if wide else 0  # ids past int64 too; 0 stays the root's

    def ids(values: list[int]) -> np.ndarray:
        return np.array([v | high if v else 0 for v in values], dtype=np.uint64)

    sid, par = ids([r[0] for r in rows]), ids([r[1] for r in rows])
    pid = np.array([r[2] for r in rows], dtype=np.int64)
    expected = _parent_positions_py(sid, par, pid)
    np.testing.assert_array_equal(_parent_positions(sid, par, pid), expected)
    out = np.empty(len(sid), dtype=np.int64)
    assert _accel.SPEEDUPS.parent_positions(sid, par, out) == (len(set(sid.tolist())) == len(sid))


@_needs_c
@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.tuples(_SMALL, _SMALL, st.integers(0, 2)), min_size=1, max_size=40))
def test_c_enclosing_spans_match_the_numpy_twin(rows: list[tuple[int, int, int]]) -> None:
    """``_speedups.enclosing_sorted`` (a stack) against pointer jumping in numpy, on
    intervals that tie, nest and cross, over a few threads."""
    start = np.array([r[0] for r in rows], dtype=np.int64)
    end = start + np.array([r[1] for r in rows], dtype=np.int64)
    thread = np.array([r[2] for r in rows], dtype=np.int64)
    order = np.lexsort((-(end - start), start, thread))
    np.testing.assert_array_equal(_enclosing(order, end, thread), _enclosing_py(order, end, thread))


@_needs_c
def test_ids_that_collide_in_the_c_table_are_left_to_pandas() -> None:
    """Ids chosen to share one slot of the C table (its hash, rebuilt here) make it
    decline rather than probe on; the positions still come out right."""
    n, mask = 200, 511  # 200 rows: a table of 512 slots
    rng = np.random.default_rng(7)
    pool = rng.integers(1, 1 << 62, 400_000, dtype=np.uint64)
    home = (pool ^ (pool >> np.uint64(23)) ^ (pool >> np.uint64(41))) & np.uint64(mask)
    sid = np.unique(pool[home == home[0]])[:n]
    assert len(sid) == n
    par = np.roll(sid, 1)
    par[0] = 12345  # absent
    out = np.empty(n, dtype=np.int64)
    assert not _accel.SPEEDUPS.parent_positions(sid, par, out)
    pid = np.zeros(n, dtype=np.int64)
    expected = np.array([-1, *range(n - 1)])
    np.testing.assert_array_equal(_parent_positions(sid, par, pid), expected)


@_needs_c
@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(-1, 39), st.booleans(), st.integers(0, 9)), min_size=1, max_size=40
    ),
    forest=st.booleans(),
)
def test_c_inherited_values_match_the_numpy_twin(
    rows: list[tuple[int, bool, int]], forest: bool
) -> None:
    """``_speedups.nearest_valued`` (each row's source found once) and
    ``_speedups.depths`` against their numpy walks, level by level: in forests and in
    parent positions with cycles."""
    n = len(rows)
    ppos = np.array(
        [p % (i if forest and i else n) if p >= 0 else -1 for i, (p, _, _) in enumerate(rows)]
    )
    if forest:
        ppos[0] = -1
    missing = np.array([m for _, m, _ in rows])
    values = np.array([v for _, _, v in rows], dtype=float)
    values[missing] = np.nan
    got, got_missing = _inherit_masked(values, missing, ppos)
    expected, expected_missing = _inherit_masked_py(values, missing, ppos)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got_missing, expected_missing)
    # and the depths (n + 1 where a chain meets a cycle, as the numpy walk stops there)
    np.testing.assert_array_equal(_depth(ppos), _depth_py(ppos))


@_needs_c
def test_the_c_index_helpers_refuse_arrays_they_cannot_read() -> None:
    c = _accel.SPEEDUPS
    ids = np.arange(4, dtype=np.uint64)
    with pytest.raises(ValueError, match="8-byte integers"):
        c.parent_positions(ids.astype(np.int32), ids, np.empty(4, np.int64))
    with pytest.raises(ValueError, match="one length"):
        c.parent_positions(ids, ids[:3], np.empty(4, np.int64))
    with pytest.raises(ValueError, match="row positions below 4"):
        c.enclosing_sorted(np.array([0, 9, 1, 2]), ids, ids, np.empty(4, np.int64))
    with pytest.raises(ValueError, match="from -1 to 3"):
        c.nearest_valued(np.ones(4, np.bool_), np.array([-1, 0, 7, 1]), np.empty(4, np.int64))
    with pytest.raises(ValueError, match="from -1 to 3"):
        c.depths(np.array([-1, 0, -2, 1]), np.empty(4, np.int64))
    # an out that is (part of) an input: refused, not read while it is written
    ppos = np.array([-1, 0, 1, 2])
    with pytest.raises(ValueError, match="array of its own"):
        c.depths(ppos, ppos)
    order = np.arange(4)
    with pytest.raises(ValueError, match="array of its own"):
        c.enclosing_sorted(order, ids, ids, order)
    with pytest.raises(ValueError, match="array of its own"):
        c.nearest_valued(np.ones(4, np.bool_), ppos, ppos)
    with pytest.raises(ValueError, match="array of its own"):
        c.parent_positions(ids, ids, ids.view(np.int64))
    shared = np.zeros(6, dtype=np.int64)  # two views of one memory, overlapping
    with pytest.raises(ValueError, match="array of its own"):
        c.depths(shared[:4], shared[2:])


@pytest.mark.parametrize(
    "names", [["a", "b", None, "a", "b"], ["x"], [], ["a", 1, "b", 1], ["é", "e", "é"]]
)
def test_name_codes_are_pandas_factorize(names: list[Any]) -> None:
    """The report's name codes (``dict_encode`` in C for str and None) are what
    ``pd.factorize`` gives, missing names included (-1)."""
    frame = pd.DataFrame({"name": pd.array(names, dtype=object)})
    codes, uniques = name_codes(frame)
    expected_codes, expected_uniques = pd.factorize(np.asarray(names, dtype=object))
    np.testing.assert_array_equal(codes, expected_codes)
    assert codes.dtype == np.int64 and uniques.dtype == object
    assert uniques.tolist() == list(expected_uniques)
