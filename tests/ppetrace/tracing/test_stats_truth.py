"""``stats()`` tells the truth in the cases a loss audit found it did not: a call that
succeeds after export_timeout, spans still on the Chrome writer's thread, spans given up
at shutdown, and tracing set up where no SIGTERM handler can be installed."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from test_no_span_lost import Hung, balanced, burst, fit_tiny, wait_for

import ppetrace
from exporters import ChromeTraceExporter, read_chrome_trace
from exporters.chrome import _appender


@pytest.fixture
def clean() -> Any:
    yield
    ppetrace.configure()


def test_a_call_that_succeeds_after_export_timeout_counts_its_spans_delivered(
    clean: None,
) -> None:
    """An exporter slower than export_timeout that still succeeds received every span:
    they move from ``timeout`` to delivered when it returns (a slow OTLP collector read as
    total loss)."""
    slow = Hung()
    ppetrace.configure(exporters=[slow], export_timeout=0.05)
    burst(40)
    ppetrace.flush()  # abandons the call after 0.05 s
    (s,) = ppetrace.stats().sinks
    assert s.dropped["timeout"] == 40 and s.delivered == 0 and balanced(s)
    slow.release.set()
    assert wait_for(lambda: ppetrace.stats().sinks[0].delivered == 40)
    (s,) = ppetrace.stats().sinks
    assert slow.received == 40 and s.dropped["timeout"] == 0 and balanced(s)


def test_a_call_that_fails_after_export_timeout_stays_counted_as_lost(clean: None) -> None:
    """A late FAILURE delivered nothing: its spans stay dropped (timeout)."""
    from opentelemetry.sdk.trace.export import SpanExportResult

    class LateFailure(Hung):
        def export(self, spans: Any) -> SpanExportResult:
            super().export(spans)
            return SpanExportResult.FAILURE

    late = LateFailure()
    ppetrace.configure(exporters=[late], export_timeout=0.05)
    burst(10)
    ppetrace.flush()
    from ppetrace.tracing._setup import FLUSHER

    (sink,) = FLUSHER.sinks
    late.release.set()
    assert wait_for(lambda: late.received == 10 and not sink._stalled)  # it came back
    (s,) = ppetrace.stats().sinks
    assert s.delivered == 0 and s.dropped["timeout"] == 10 and balanced(s)


def test_spans_given_up_at_shutdown_are_logged_with_their_count(
    clean: None, caplog: pytest.LogCaptureFixture
) -> None:
    hung = Hung()
    exporter_sink = ppetrace.tracing._setup.FLUSHER  # the sinks live here
    ppetrace.configure(exporters=[hung], export_timeout=0.05)
    burst(10)
    ppetrace.flush()  # the first call hangs
    burst(7)
    ppetrace.flush()  # queued behind it
    (sink,) = exporter_sink.sinks
    with caplog.at_level(logging.WARNING, logger="ppetrace"):
        ppetrace.configure()  # shuts the old sink down: it gives up what it holds
    assert "the 7 spans still queued for it are counted as dropped (timeout)" in caplog.text
    assert sink.dropped["timeout"] == 17
    hung.release.set()


def test_spans_on_the_chrome_writers_thread_are_buffered_not_delivered(
    clean: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large batch is written on the writer's thread after export_batch returned: until
    it is in the file, stats() counts it buffered (a trial killed the process once
    stats() said delivered, and up to 5,000 of those spans were not in the file)."""
    gate = threading.Event()
    write = _appender._Appender._write

    def held(self: Any, data: Any) -> None:
        gate.wait(30)
        write(self, data)

    monkeypatch.setattr(_appender._Appender, "_write", held)
    path = tmp_path / "t.json"
    ppetrace.configure(exporters=[ChromeTraceExporter(path)])
    for i in range(6_000):  # over 1 MB of JSON: written on the thread
        with ppetrace.trace("big", {"i": i, "pad": "x" * 200}):
            pass
    from ppetrace.tracing._setup import FLUSHER

    FLUSHER.drain(background=False)  # (a flush would wait for the write)
    (sink,) = FLUSHER.sinks
    assert wait_for(lambda: sink.delivered == 6_000)  # export_batch returned: accepted
    (s,) = ppetrace.stats().sinks
    assert s.delivered == 0 and s.buffered == 6_000 and balanced(s)
    gate.set()
    ppetrace.flush()
    (s,) = ppetrace.stats().sinks
    assert s.delivered == 6_000 and s.buffered == 0
    ppetrace.configure()
    assert (read_chrome_trace(path)["name"] == "big").sum() == 6_000


def test_tracing_set_up_outside_the_main_thread_says_sigterm_is_not_handled(
    clean: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ppetrace.tracing import _setup

    monkeypatch.setattr(_setup, "_sigterm_warned", False)

    def configure_in_a_thread() -> None:
        worker = threading.Thread(target=ppetrace.configure, name="trainer-thread")
        worker.start()
        worker.join()

    with caplog.at_level(logging.WARNING, logger="ppetrace"):
        ppetrace.configure()  # on the main thread: the handler is installed
        configure_in_a_thread()  # and stays: nothing to say
    assert "outside the main thread" not in caplog.text
    ppetrace.configure(handle_sigterm=False)  # no handler now
    with caplog.at_level(logging.WARNING, logger="ppetrace"):
        configure_in_a_thread()
    assert "configured outside the main thread (trainer-thread)" in caplog.text
    assert "SIGTERM" in caplog.text


def test_buffer_full_drops_are_logged_once(
    clean: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spans dropped because full buffers waited for the flusher: counted (buffer_full)
    and now said once (a trial lost 79% of its spans to it without a word)."""
    from ppetrace.tracing._setup import FLUSHER

    monkeypatch.setattr(FLUSHER, "_dropped_said", False)
    ppetrace.configure(buffer_spans=64, max_queued_buffers=1, flush_interval=3600)
    with caplog.at_level(logging.WARNING, logger="ppetrace"):
        for _ in range(2):
            with FLUSHER._lock:  # no drain until the burst is over: the full buffers drop
                burst(1_000)
            ppetrace.flush()
    said = [r for r in caplog.records if "spans were dropped" in r.getMessage()]
    assert len(said) == 1 and "max_queued_buffers=1" in said[0].getMessage()


def test_stats_keep_what_a_sink_delivered_after_it_is_shut_down(
    clean: None, tmp_path: Path
) -> None:
    """After fit (its file closed) or shutdown, the sink is gone from stats().sinks; its
    final counts stay in stats().closed (a trial could not check delivery after a run)."""
    fit_tiny(tmp_path / "t.json", epochs=1, batches=3)
    assert not any(s.name.startswith("ChromeTraceExporter") for s in ppetrace.stats().sinks)
    final = ppetrace.stats().closed[-1]
    spans = len(read_chrome_trace(tmp_path / "t.json"))
    assert final.name.startswith("ChromeTraceExporter") and balanced(final)
    assert final.delivered == spans and final.buffered == 0 and final.dropped_total == 0
    hung = Hung()
    ppetrace.configure(exporters=[hung], export_timeout=0.05)
    burst(5)
    ppetrace.flush()
    ppetrace.configure()  # replaces it: it gives up its 5 spans
    gone = ppetrace.stats().closed[-1]
    assert gone.recorded == 5 and gone.dropped["timeout"] == 5 and balanced(gone)
    hung.release.set()
