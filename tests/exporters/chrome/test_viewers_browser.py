"""ppetrace's traces in speedscope (its npm package, in headless Chromium).

speedscope keys its frames by name plus ``args``: its Sandwich view adds up
every span of a name only when nothing unique to a span is in ``args``. Frames
that touch must not overlap once it adds ``ts + dur`` in float64, process names
must not repeat the pid it adds itself, and a killed run's file must load once
repaired. Needs ``bash .ci/install-viewers`` (the tests skip, saying so, where
Chromium or speedscope is missing).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from speedscope_harness import show
from test_reader import killed_trace

from exporters import ChromeTraceExporter, repair_chrome_trace
from ppetrace.profilers._base import PYTHON_TID
from ppetrace.profilers._pyinstrument import stack_events

pytestmark = pytest.mark.browser

RunBuilder = Any  # the builder from conftest.py's run_builder fixture


def _trace(path: Path, rb: RunBuilder) -> Path:
    """A short run whose spans differ per step (step, batch_idx), sub-µs hooks, a failed
    span, and a sampled-Python track whose frames touch at odd nanoseconds.

    Spans are apart by a few ns at least, as two clock reads always are in a real run
    (an end exactly at the next start, to the ns, can mis-nest in speedscope: it
    subtracts the first ``ts`` from all of them in float64 before it adds ``dur``).
    """
    run = rb.span("trainer.run", 0, 10**6)
    t = 1_013
    for i in range(12):
        attrs = {"ppetrace.step": i, "ppetrace.batch_idx": i}
        rb.span("trainer.fetch_batch", t, t + (401, 1_333, 999)[i % 3], run, attrs)
        t += 1_400
        step = rb.span("trainer.step", t, t + 2_000 + 333 * i, run, attrs)
        rb.span("module.train_step", t + 37, t + 1_036, step, attrs)
        rb.span("callback.on_end_step", t + 1_100, t + 1_650, step, attrs)  # sub-µs
        t += 2_100 + 333 * i
    rb.span("user.fails", t + 10, t + 900, run, status="ERROR", error="E: bad")
    exporter = ChromeTraceExporter(path)
    exporter.export_batch(rb.batch())
    ident = "{0}\x00/src/m.py\x00{1}"
    records = [
        ([ident.format("main", 1), ident.format(f, 10 + i)], dt)
        for i, (f, dt) in enumerate(
            zip(
                "fgfhg" * 4,
                [0.001000333, 0.000999667, 0.0010001, 0.0029999, 0.000333] * 4,
                strict=True,
            )
        )
    ]
    anchor = rb.T0 + 543_438_140_999
    exporter.add_events(
        stack_events(records, anchor, start_ns=anchor, end_ns=anchor + 10**9, tid=PYTHON_TID)
    )
    exporter.shutdown()
    return path


def test_the_sandwich_view_adds_up_spans_by_name_and_nothing_mis_nests(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    rb = run_builder(pid=4242, tid=11)
    shown = show(_trace(tmp_path / "trace.json", rb))
    assert "Importing as Trace Event Format profile" in shown.console
    assert shown.warnings == []  # no frame ended out of order, on any track
    spans = {r.name for r in rb.rows if r.name != "user.fails"}
    assert sorted(shown.symbols) == sorted([*spans, 'user.fails {"error":"E: bad"}'])
    # one row per name: each trainer.step of the 12 adds to the same frame
    assert len(shown.symbols) == len(set(shown.symbols))
    assert "tests rank 0 (pid 4242), MainThread (tid 11)" in shown.text  # no pid twice


def test_ids_in_args_would_keep_each_span_apart(
    tmp_path: Path, run_builder: Callable[..., RunBuilder]
) -> None:
    """The check above can fail: the older layout (ids and attributes in args) gives one
    Sandwich row per span."""
    path = _trace(tmp_path / "trace.json", run_builder())
    doc = json.loads(path.read_text())
    for e in doc["traceEvents"]:
        if "span_id" in e:
            e["args"] = {"span_id": e.pop("span_id"), **e.pop("attrs", {})}
    path.write_text(json.dumps(doc))
    shown = show(path)
    steps = [s for s in shown.symbols if s.startswith("trainer.step {")]
    assert len(steps) > 1 and len(set(steps)) == len(steps)


def test_a_killed_runs_trace_loads_once_repaired(tmp_path: Path) -> None:
    """As it was left, the file is no JSON (test_reader.py); speedscope answers it with an
    alert that blocks a headless page, so only the repaired file is loaded here."""
    shown = show(repair_chrome_trace(killed_trace(tmp_path)).path)
    assert "Importing as Trace Event Format profile" in shown.console
    assert shown.warnings == []
    assert shown.symbols == ["trainer.step"]
