"""Light steps: the spans of a step as aggregates, without rows (the pure-Python twin).

``begin_light(owner, publish, full)`` (:mod:`._fold`) starts a *fold* on the
calling thread. Until the span ``owner`` (an entered span: a summarised
``trainer.step``) ends, every span entered on this thread whose name is not in
the frozenset ``full`` is *light*: it reads the clock when it starts and when it
ends, and nothing else. It takes no attribute snapshot and no ids, sets no
context (spans inside it see the span around it as their parent), and makes no
row. Its duration goes into the fold's count, total and self time for its name.
Its self time is its duration less the durations of the spans that ran directly
inside it, light or not: each open span of the fold has a frame on the fold's
stack. When ``owner`` ends, before its own row is made, ``publish((start_ns,
aggregates))`` is called with one pair (so that ``publish`` can be a C callable
such as ``deque.append``): the epoch start of ``owner``, and a tuple
``(name, total, self, count, name, ...)`` with one entry per name that occurred, in
the order the thread's folds first met them (a fold keeps the names of the
thread's last fold that had the same set ``full``: found again by address, they
need no comparison).

A light span whose block raises, or that ends after its fold (a generator left
open), is recorded in full instead, as a span that started when it did. Its ids,
attributes and parent (the current span) are taken when it ends. A span nested
deeper than :data:`DEPTH`, or one whose name would be past :data:`NAMES` names,
is recorded in full too.

The C twin is the "light steps" section of ``_speedups.c``. Both give the same
aggregates (names, order, counts) for the same blocks.
"""

from __future__ import annotations

import logging
from time import perf_counter_ns as _perf_ns
from typing import Any

__all__ = ["DEPTH", "LIGHT", "NAMES", "Light"]

_log = logging.getLogger("ppetrace")

#: the deepest nesting of a fold's open spans, and the most names it keeps (as in C)
DEPTH = 64
NAMES = 64
#: the token of an open light span (it set no context)
LIGHT = object()


class Light:
    """One thread's fold (see the module doc)."""

    __slots__ = ("owner", "publish", "full", "frames", "names", "index", "sums")

    def __init__(self, owner: Any, publish: Any, full: frozenset[str]) -> None:
        self.owner = owner
        self.publish = publish
        self.full = full
        self.frames: list[list[Any]] = []  # [span, time of its direct children]
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.sums: list[list[int]] = []  # per name: [total, self, count]

    def again(self, owner: Any, publish: Any) -> None:
        """Begin the next fold with this one's names (none seen yet)."""
        self.owner, self.publish = owner, publish
        self.frames = []
        for sums in self.sums:
            sums[0] = sums[1] = sums[2] = 0

    def slot(self, name: Any) -> int:
        """The place of ``name`` (added when new), or -1: record the span in full."""
        if type(name) is not str:
            return -1
        at = self.index.get(name)
        if at is not None:
            return at
        if name in self.full or len(self.names) == NAMES:
            return -1
        at = self.index[name] = len(self.names)
        self.names.append(name)
        self.sums.append([0, 0, 0])
        return at

    def enter(self, span: Any) -> bool:
        """Open ``span`` as a light span; False: record it as usual."""
        if span is self.owner or len(self.frames) == DEPTH:
            return False
        at = self.slot(span.name)
        if at < 0:
            return False
        span._lmode, span._lslot, span._token = 1, at, LIGHT
        if hasattr(span, "trace_id"):  # no ids: its span context is invalid, as when disabled
            del span.trace_id
        self.frames.append([span, 0])
        span.start_ns = _perf_ns()
        return True

    def enter_full(self, span: Any) -> None:
        """``span`` was entered in full: give it a frame."""
        if span is not self.owner and len(self.frames) < DEPTH:
            span._lmode = 2
            self.frames.append([span, 0])

    def pop(self, span: Any, dur: int) -> int:
        """Pop the frame of ``span`` (and any left open above it): the time of its direct
        children, or -1 when it has no frame."""
        frames = self.frames
        for d in range(len(frames) - 1, -1, -1):
            if frames[d][0] is span:
                child = frames[d][1]
                del frames[d:]
                if d:
                    frames[d - 1][1] += dur
                return int(child)
        return -1

    def add(self, at: int, dur: int, child: int) -> None:
        sums = self.sums[at]
        sums[0] += dur
        sums[1] += dur - min(child, dur)
        sums[2] += 1

    def aggregates(self) -> tuple[Any, ...]:
        out: list[Any] = []
        for name, (total, own, count) in zip(self.names, self.sums, strict=True):
            if count:
                out += (name, total, own, count)
        return tuple(out)

    def finish(self, start_ns: int) -> None:
        """The owner ends (it starts at ``start_ns``, epoch): publish the aggregates,
        before the owner's own row is made. The caller has unlinked the fold."""
        owner, publish = self.owner, self.publish
        self.owner = self.publish = None
        try:
            publish((start_ns, self.aggregates()))
        except Exception:  # as in C (reported, never raised): the step's own row still comes
            _log.exception("ppetrace: publishing the aggregates of %r failed", owner.name)


def exit_light(light: Light | None, span: Any, end: int, exc: BaseException | None) -> bool:
    """The end of the light span ``span``: True when its fold took it; False: the caller
    records it in full (its block raised, or its fold is gone)."""
    dur = max(0, end - span.start_ns)
    span._lmode = 0
    span._token = None
    child = light.pop(span, dur) if light is not None else -1
    if child >= 0 and exc is None and light is not None:
        light.add(span._lslot, dur, child)
        return True
    return False


def exit_full(light: Light, span: Any, end: int) -> None:
    """The end of a span entered in full inside ``light``."""
    span._lmode = 0
    light.pop(span, max(0, end - span.start_ns))
