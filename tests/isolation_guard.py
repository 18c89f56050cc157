"""What a test must not leave behind (checked after every test by tests/conftest.py):
anything that goes on feeding ppetrace's process-wide recorder, whose counts (``stats()``)
and flusher every later test in the same pytest process shares. A thread the test
started that recorded spans and still runs, a span source added to the flusher, a
before-flush hook, an active ``instrument()``: each is reported and removed. DataLoader
worker channels, which ppetrace keeps for the life of the process by design, are closed
after the test that opened them and not reported."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any

from ppetrace.tracing._recorder import RECORDER
from ppetrace.tracing._setup import FLUSHER

#: ppetrace's own threads, which record no span of a test's
OWN_THREADS = ("ppetrace-flusher", "ppetrace-sink ", "ppetrace-sigterm", "ppetrace-counters")


@dataclass(frozen=True)
class Snapshot:
    threads: frozenset[threading.Thread]
    sources: tuple[Any, ...]
    hooks: tuple[Any, ...]
    channels: dict[Any, Any]


def snapshot() -> Snapshot:
    """What runs and is registered now (before a test)."""
    return Snapshot(
        frozenset(threading.enumerate()),
        tuple(FLUSHER.sources),
        tuple(RECORDER.before_flush),
        dict(_channels()),
    )


def leftovers(before: Snapshot, *, join_s: float = 1.0) -> list[str]:
    """What was added since ``before`` and is still there, one line each; removes it (a
    thread cannot be removed: one that is ending gets ``join_s`` seconds to end)."""
    _close_new_channels(before.channels)
    left: list[str] = []
    sources = [s for s in FLUSHER.sources if s not in before.sources]
    if sources:
        FLUSHER.sources[:] = [s for s in FLUSHER.sources if s not in sources]
        left.append(f"span sources in FLUSHER.sources: {sources!r}")
    hooks = [h for h in RECORDER.before_flush if h not in before.hooks]
    if hooks:
        RECORDER.before_flush[:] = [h for h in RECORDER.before_flush if h not in hooks]
        left.append(f"before-flush hooks in RECORDER.before_flush: {hooks!r}")
    instrument = sys.modules.get("ppetrace.integrations._instrument")
    handle = instrument.active() if instrument is not None else None
    if handle is not None:
        handle.close()
        left.append(f"an active instrument(): {handle!r}")
    recording = recording_threads(before.threads)
    for thread in recording:
        thread.join(timeout=join_s)
    names = [t.name for t in recording if t.is_alive()]
    if names:
        left.append(f"running threads that recorded spans: {names}")
    return left


def recording_threads(before: frozenset[threading.Thread]) -> list[threading.Thread]:
    """Threads not in ``before``, still running, that recorded spans (they have a
    buffer in the recorder), ppetrace's own left out."""
    with RECORDER._buffers_lock:
        owners = [buf.thread() for buf in RECORDER._buffers]
    return [
        t
        for t in dict.fromkeys(owners)
        if t is not None and t.is_alive() and t not in before and not t.name.startswith(OWN_THREADS)
    ]


def _channels() -> dict[Any, Any]:
    module = sys.modules.get("ppetrace.integrations.dataloader")
    return module._channels if module is not None else {}


def _close_new_channels(before: dict[Any, Any]) -> None:
    """Close the DataLoader worker channels opened since ``before`` and take their
    drains out of the flusher's sources."""
    channels = _channels()
    for key in [k for k in channels if channels[k] is not before.get(k)]:
        channel = channels.pop(key)
        if channel.drain in FLUSHER.sources:
            FLUSHER.sources.remove(channel.drain)
        channel.queue.close()
