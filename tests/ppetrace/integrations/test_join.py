"""``join_ranks``: the ranks that trace meet through the store, and a rank that does not
come is named after the timeout instead of a collective that hangs for 30 minutes."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from ppetrace.integrations import _join


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Rank 0 of a 2-rank group whose store is an in-process HashStore."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    store = dist.HashStore()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(_join, "_store", lambda: store)
    monkeypatch.setenv("PPETRACE_RANK_JOIN_TIMEOUT", "0.2")
    return store


def test_a_rank_that_never_comes_is_named(two_ranks: Any) -> None:
    with pytest.raises(_join.RankJoinError) as caught:
        _join.join_ranks("the clock measurement")
    assert str(caught.value).startswith(
        "Expected every rank of the process group to trace alike, but rank 1 did not reach "
        "the clock measurement within 0.2 s of rank 0 (not traced, or that late). Run every"
    )


def test_ranks_that_come_pass_and_each_call_has_its_own_keys(two_ranks: Any) -> None:
    number = next(_join._calls) + 1  # the number the next call takes
    two_ranks.set(f"ppetrace/join/{number}/1", "1")  # rank 1 is there already
    _join.join_ranks("the trace id")
    with pytest.raises(_join.RankJoinError):  # the next call waits for rank 1 again
        _join.join_ranks("the trace id")


def test_a_rank_that_comes_after_another_gave_up_does_not_go_on(two_ranks: Any) -> None:
    """Rank 1 waited in vain and decided to go on alone; rank 0 comes later and finds
    every key, but takes that decision: it must not enter a collective by itself."""
    number = next(_join._calls) + 1
    two_ranks.set(f"ppetrace/join/{number}/1", "1")
    two_ranks.set(f"ppetrace/join/{number}/decision", "alone")
    with pytest.raises(
        _join.RankJoinError, match=r"Rank 0 reached the trace id more than 0\.2 s after another"
    ):
        _join.join_ranks("the trace id")


@pytest.mark.parametrize("value", ["0", "-3", "soon"])
def test_a_bad_timeout_is_refused_in_a_sentence(
    two_ranks: Any, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("PPETRACE_RANK_JOIN_TIMEOUT", value)
    with pytest.raises(ValueError, match="Expected a positive number of seconds in PPETRACE"):
        _join.join_ranks("the trace id")


def test_nothing_happens_without_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_join, "_store", lambda: pytest.fail("no store is asked for"))
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is up in this process")
    _join.join_ranks("the trace id")
