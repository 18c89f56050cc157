"""Appending to a trace file in call order, a large write on a thread of its own."""

from __future__ import annotations

import os
import threading
from typing import IO

_ASYNC_BYTES = 1 << 20  # writes at least this large run on the writer thread


class _Appender:
    """Appends to the trace file in call order, a large write on a thread of its own.

    A part of 16,384 spans is about 5 MB of JSON. While the kernel copies one
    part into the file (the GIL is released meanwhile), the exporter encodes the
    next. At most one write is in flight: each call first waits for the one
    before, so a killed process loses at most the last batch, as with direct
    writes. An error of a write on the thread is returned by the next call
    (or by :meth:`wait`), with the number of spans that write held. In a
    forked child every write is direct.
    """

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._spans = 0  # spans in the write in flight
        self.good = 0  # bytes written and flushed without an error

    def in_flight(self) -> int:
        """Spans of the write still running on the thread (0 when none runs)."""
        thread, spans = self._thread, self._spans
        return spans if thread is not None and thread.is_alive() else 0

    def wait(self) -> tuple[BaseException | None, int]:
        """Wait for the write in flight; return its error (or None) and its span count."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None  # (after the join: in_flight counts the write until then)
        error, self._error = self._error, None
        spans, self._spans = self._spans, 0
        return error, spans if error is not None else 0

    def append(self, data: bytes | memoryview, spans: int = 0) -> tuple[BaseException | None, int]:
        """Write ``data`` (holding ``spans`` spans) and flush, on the thread when large;
        return the error of the write before, and its span count. An error of a direct
        write is raised."""
        before = self.wait()
        if len(data) >= _ASYNC_BYTES and os.getpid() == self._pid:
            self._spans = spans
            self._thread = threading.Thread(
                target=self._write, args=(data,), name="exporters-chrome-writer"
            )
            self._thread.start()
        else:
            self.file.write(data)
            self.file.flush()
            self.good += len(data)
        return before

    def _write(self, data: bytes | memoryview) -> None:
        try:
            self.file.write(data)
            self.file.flush()
            self.good += len(data)
        except BaseException as exc:  # reported by the next append or wait
            self._error = exc
