"""Fixtures for the exporters tests: spans with exact, injected times."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pandas as pd
import pytest

from exporters import SpanBatch, SpanRow

# 2023-11-14T22:13:20.123456789Z: an epoch time with every nanosecond digit set
T0 = 1_700_000_000_123_456_789
TRACE_ID = 0x0123456789ABCDEF0123456789ABCDEF


class RunBuilder:
    """Builds :class:`SpanRow`s whose times (ns after :data:`T0`) the test chooses."""

    T0 = T0
    TRACE_ID = TRACE_ID

    def __init__(self, *, tid: int = 11, pid: int = 4242, rank: int | None = 0) -> None:
        self.rows: list[SpanRow] = []
        self.tid = tid
        self.pid = pid
        self.rank = rank
        self._next_id = 0x1000

    def span(
        self,
        name: str,
        start: int,
        end: int,
        parent: int = 0,
        attrs: Mapping[str, Any] | None = None,
        *,
        tid: int | None = None,
        status: str = "UNSET",
        error: str = "",
        span_id: int | None = None,
    ) -> int:
        """Add a span from ``T0 + start`` to ``T0 + end``; return its id."""
        if span_id is None:
            self._next_id += 1
            span_id = self._next_id
        self.rows.append(
            SpanRow(
                name,
                span_id,
                parent,
                TRACE_ID,
                T0 + start,
                T0 + end,
                self.tid if tid is None else tid,
                dict(attrs or {}),
                status,
                error,
            )
        )
        return span_id

    def batch(self, rows: Sequence[SpanRow] | None = None) -> SpanBatch:
        """The rows (default: all, sorted by start like the recorder) as one batch."""
        chosen = sorted(self.rows, key=lambda r: r.start_ns) if rows is None else list(rows)
        resource: dict[str, Any] = {"service.name": "tests", "ppetrace.version": "0.0-test"}
        if self.rank is not None:
            resource["ppetrace.rank"] = self.rank
        return SpanBatch(chosen, resource, self.pid, {self.tid: "MainThread"})

    def training(
        self,
        step_ns: Sequence[int],
        *,
        fetch_ns: int | Sequence[int] = 1_000,
        gap_ns: int = 500,
        backward_ns: int | None = None,
        batch_size: int | None = None,
        epoch: int = 0,
        start: int = 0,
        step_offset: int = 0,
    ) -> dict[str, Any]:
        """A run > epoch > (fetch, step > backward)* with exact durations.

        Each step ``i`` is preceded by a gap of ``gap_ns`` (loop overhead) and a
        fetch; ``trainer.backward`` (``backward_ns``, default a third of the step)
        starts 10 ns into each step. Returns the ids and times it made.
        """
        fetches = [fetch_ns] * len(step_ns) if isinstance(fetch_ns, int) else list(fetch_ns)
        t = start + 100
        run = self._next_id + 1
        self._next_id += 2
        epoch_id = self._next_id
        steps = []
        for i, dur in enumerate(step_ns):
            t += gap_ns
            f_start, f_end = t, t + fetches[i]
            self.span("trainer.fetch_batch", f_start, f_end, epoch_id, {"ppetrace.batch_idx": i})
            t = f_end
            attrs: dict[str, Any] = {
                "ppetrace.step": step_offset + i,
                "ppetrace.batch_idx": i,
                "ppetrace.stage": "train",
            }
            if batch_size is not None:
                attrs["ppetrace.batch_size"] = batch_size
            sid = self.span("trainer.step", t, t + dur, epoch_id, attrs)
            bw = dur // 3 if backward_ns is None else backward_ns
            self.span("trainer.backward", t + 10, t + 10 + bw, sid)
            steps.append({"id": sid, "start": t, "end": t + dur, "fetch": (f_start, f_end)})
            t += dur
        end = t + 1_000
        self.span(
            "trainer.epoch", start + 50, end, run, {"ppetrace.epoch": epoch}, span_id=epoch_id
        )
        self.span("trainer.run", start, end + 50, 0, span_id=run)
        return {"run": run, "epoch": epoch_id, "steps": steps, "end": end + 50}


@pytest.fixture
def run_builder() -> Callable[..., RunBuilder]:
    """A factory of :class:`RunBuilder`s."""
    return RunBuilder


def _storages() -> list[Any]:
    arrow = pytest.param(
        "pyarrow",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("pyarrow") is None, reason="pyarrow is not installed"
        ),
    )
    return ["python", arrow]


@pytest.fixture(params=_storages())
def string_storage(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test with pandas keeping strings in Python objects, then in pyarrow.

    pandas 3 stores ``str`` columns in pyarrow whenever it is installed, and
    pyarrow refuses strings that are not valid UTF-8 (lone surrogates).
    """
    with pd.option_context("mode.string_storage", request.param):
        yield request.param
