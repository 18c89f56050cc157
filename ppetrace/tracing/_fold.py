"""``begin_light``: start a light step's fold on the calling thread (see :mod:`._light`),
on the C hot path or the pure-Python one, whichever records the owner span."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _recorder as rec
from ._light import Light

__all__ = ["begin_light"]


def begin_light(
    owner: Any, publish: Callable[[tuple[int, tuple[Any, ...]]], Any], full: Any
) -> bool:
    """Record the spans of this thread as aggregates until the entered span ``owner``
    ends (a *fold*, see the module doc): True; False when it cannot (tracing disabled,
    ``owner`` not a recorded span open in full, a fold already open on this thread).
    ``full``: a frozenset of the names to record in full; ``publish((start_ns,
    aggregates))`` receives the fold's aggregates when ``owner`` ends."""
    if type(full) is not frozenset:
        raise TypeError(f"Expected a frozenset of str for full, but received {full!r}.")
    speedups = rec._speedups
    if speedups is not None and isinstance(owner, speedups.SpanBase):
        return bool(speedups.light_begin(owner, publish, full))  # it checks full's names
    tls = rec._tls
    if (
        not isinstance(owner, rec.PySpan)
        or not rec.RECORDER.enabled
        or owner._token is None
        or owner._lmode != 0
        or getattr(tls, "light", None) is not None
        or not callable(publish)
    ):
        return False
    spare = getattr(tls, "light_spare", None)
    tls.light_spare = None
    if spare is not None and spare.full is full:  # the names of the thread's last fold
        spare.again(owner, publish)
        tls.light = spare
        return True
    # a new set of full names is checked once, as in C (not on every step)
    if not all(type(n) is str for n in full):
        raise TypeError(f"Expected a frozenset of str for full, but received {full!r}.")
    tls.light = Light(owner, publish, full)
    return True
