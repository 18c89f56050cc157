"""The suite's guard (tests/isolation_guard.py, run after every test by tests/conftest.py)
reports what a test leaves feeding the process-wide recorder, where it is left, instead
of letting it change the counts of a later test."""

from __future__ import annotations

import threading

import isolation_guard

import ppetrace
from ppetrace.integrations import dataloader
from ppetrace.tracing._recorder import RECORDER
from ppetrace.tracing._setup import FLUSHER


def test_a_thread_that_goes_on_recording_is_reported_and_one_that_ended_is_not() -> None:
    before = isolation_guard.snapshot()
    stop, recorded = threading.Event(), threading.Event()

    def loop() -> None:
        while not stop.is_set():
            with ppetrace.trace("left.running"):
                pass
            recorded.set()  # its buffer exists from the first span's end on

    thread = threading.Thread(target=loop, name="left-recording")
    thread.start()
    try:
        assert recorded.wait(30)
        left = isolation_guard.leftovers(before, join_s=0.01)
        assert left == ["running threads that recorded spans: ['left-recording']"]
    finally:
        stop.set()
        thread.join()
    assert isolation_guard.leftovers(before) == []
    quiet = threading.Thread(target=stop.wait, args=(30,), name="records-nothing")
    stop.clear()
    quiet.start()
    try:  # a thread that recorded no span is not the recorder's business
        assert isolation_guard.leftovers(before, join_s=0.01) == []
    finally:
        stop.set()
        quiet.join()


def test_a_span_source_and_a_before_flush_hook_left_are_reported_and_removed() -> None:
    before = isolation_guard.snapshot()

    def source() -> None: ...

    def hook() -> None: ...

    FLUSHER.sources.append(source)
    RECORDER.before_flush.append(hook)
    left = isolation_guard.leftovers(before)
    assert len(left) == 2
    assert left[0].startswith("span sources in FLUSHER.sources: [<function ")
    assert left[1].startswith("before-flush hooks in RECORDER.before_flush: [<function ")
    assert source not in FLUSHER.sources and hook not in RECORDER.before_flush


def test_a_dataloader_channel_opened_in_a_test_is_closed_not_reported() -> None:
    before = isolation_guard.snapshot()
    assert not dataloader._channels  # the guard closed those of earlier tests
    channel = dataloader._channel("spawn")
    assert channel.drain in FLUSHER.sources
    assert isolation_guard.leftovers(before) == []
    assert not dataloader._channels and channel.drain not in FLUSHER.sources
    assert channel.queue._reader.closed
