"""``join_ranks``: every rank that traces meets here before ppetrace's first collective.

ppetrace's collectives (rank 0's trace id, the clock measurements, the merge) need
every rank of the process group to trace alike. A rank that does not (run as plain
``python`` beside ranks under ``ppetrace run``, or a Trainer without ``trace_path``
beside ones with it) never calls them: the others then waited in a collective for
the process group's timeout (30 minutes) with no message, or met the training's own
collective in its place (DDP's parameter check, with a misleading error).

So before those collectives each rank says it is there through the process group's
key-value store (no collective: nothing to collide with), and waits for the others
at most :data:`JOIN_TIMEOUT_S` seconds (``PPETRACE_RANK_JOIN_TIMEOUT``). The calls
follow a rendezvous (``init_process_group``, or the Trainer's own collectives), so the
ranks that trace arrive within moments of each other. A rank that does not come is
named in a :class:`RankJoinError`.
"""

from __future__ import annotations

import itertools
import os
from datetime import timedelta
from typing import Any

__all__ = ["JOIN_TIMEOUT_S", "RankJoinError", "join_ranks"]

#: how long a rank waits for the others to reach the same point (seconds)
JOIN_TIMEOUT_S = 60.0
_calls = itertools.count()  # the same sequence on every rank that runs the same code


class RankJoinError(RuntimeError):
    """Some ranks of the process group do not trace (see the module doc)."""


def _timeout() -> float:
    text = os.environ.get("PPETRACE_RANK_JOIN_TIMEOUT")
    if text is None:
        return JOIN_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            "Expected a positive number of seconds in PPETRACE_RANK_JOIN_TIMEOUT, but it is "
            f"{text!r}. Set it to, e.g., 120, or unset it for {JOIN_TIMEOUT_S:g} s."
        )
    return value


def _store() -> Any:
    """The default process group's store, or None when torch does not give it."""
    try:
        from torch.distributed import distributed_c10d
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    getter = getattr(distributed_c10d, "_get_default_store", None)
    try:
        return None if getter is None else getter()
    except (RuntimeError, ValueError):
        return None


def join_ranks(what: str) -> None:
    """Wait until every rank of the default process group reaches its call of the same
    number; raise :class:`RankJoinError` naming the ranks that did not within the
    timeout. ``what``: the step about to run, for the message. Nothing without a
    process group, or where torch gives no store (the collectives then run unchecked).

    Every rank that comes decides alike, through one ``compare_set`` on the store: the
    first to decide sets ``go`` (it saw every rank) or ``alone`` (it waited in vain),
    and the others take that decision. So a rank that comes after another gave up does
    not enter a collective alone (it would meet the training's own)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    store = _store()
    if store is None:
        return
    timeout = _timeout()
    rank, world = dist.get_rank(), dist.get_world_size()
    prefix = f"ppetrace/join/{next(_calls)}/"
    store.set(f"{prefix}{rank}", "1")
    keys = [f"{prefix}{r}" for r in range(world)]
    missing: list[int] = []
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError:  # (torch's DistStoreError is one): a timeout
        missing = [r for r in range(world) if not store.check([f"{prefix}{r}"])]
    mine = b"alone" if missing else b"go"
    decided = bytes(store.compare_set(f"{prefix}decision", "", mine.decode()))
    if decided == b"go":
        return
    if missing:
        who = ("ranks " if len(missing) > 1 else "rank ") + ", ".join(map(str, missing))
        raise RankJoinError(
            f"Expected every rank of the process group to trace alike, but {who} did not "
            f"reach {what} within {timeout:g} s of rank {rank} (not traced, or that late). Run "
            "every rank under ppetrace run (torchrun ... -m ppetrace run train.py), or give "
            "every rank's Trainer the same trace_path; set PPETRACE_RANK_JOIN_TIMEOUT to wait "
            "longer."
        )
    raise RankJoinError(  # this rank came, but after another one had given up waiting
        f"Rank {rank} reached {what} more than {timeout:g} s after another rank, which gave "
        "up waiting: the ranks go on without ppetrace's collectives. Set "
        "PPETRACE_RANK_JOIN_TIMEOUT to wait longer."
    )
