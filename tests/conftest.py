"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import isolation_guard
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import ppetrace
from exporters import SpanBatch, SpanRow
from ppetrace.tracing._recorder import RECORDER


@pytest.fixture
def span_exporter() -> Iterator[InMemorySpanExporter]:
    """ppetrace configured to send every span to a fresh in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    ppetrace.configure(tracer_provider=provider, service_name="ppetrace-tests")
    yield exporter
    ppetrace.flush()
    ppetrace.configure()


class RowSink:
    """A ppetrace sink that keeps the rows it is given, with their attribute objects."""

    def __init__(self) -> None:
        self.rows: list[SpanRow] = []

    def export_batch(self, batch: SpanBatch) -> None:
        self.rows.extend(batch.rows)

    def shutdown(self) -> None:
        pass


def _event_counts(frame: Any) -> dict[str, int]:
    """Each event's count in a trace frame: its spans, plus the counts in the aggregates
    of the summarised steps (``ppetrace.hooks`` under the ``ppetrace.hook_names`` in force),
    read here independently of exporters' own reader."""
    counts = {str(k): int(v) for k, v in frame["name"].value_counts().items()}
    names: list[str] = []
    steps = frame[frame["name"] == "trainer.step"].sort_values("start_ns")
    for row in steps.to_dict("records"):
        if isinstance(row.get("ppetrace.hook_names"), str):
            names = row["ppetrace.hook_names"].split(";")
        if isinstance(row.get("ppetrace.hooks"), str):
            for name, entry in zip(names, row["ppetrace.hooks"].split(";"), strict=False):
                if entry:
                    parts = entry.split("/")
                    counts[name] = counts.get(name, 0) + (int(parts[2]) if len(parts) > 2 else 1)
    return counts


@pytest.fixture
def event_counts() -> Callable[[Any], dict[str, int]]:
    """:func:`_event_counts`: spans plus the aggregates of summarised steps, per event."""
    return _event_counts


@pytest.fixture
def row_sink() -> Iterator[RowSink]:
    """ppetrace configured with one :class:`RowSink` as its only sink."""
    sink = RowSink()
    ppetrace.configure(exporters=[sink])
    yield sink
    ppetrace.configure()


@pytest.fixture(autouse=True)
def _recorder_left_clean() -> Iterator[None]:
    """Every test leaves tracing enabled, with no span still open on this thread, and
    nothing behind that goes on feeding the recorder (tests/isolation_guard.py): those
    would change the process-wide counts and the flusher's work in later tests, so they
    fail the test that left them."""
    before = isolation_guard.snapshot()
    yield
    from opentelemetry import trace as otel_trace

    current = otel_trace.get_current_span()
    assert not isinstance(current, ppetrace.tracing._recorder.Span), (
        f"a test left the span {current!r} open"
    )
    if not RECORDER.enabled:
        ppetrace.configure()
    left = isolation_guard.leftovers(before)
    assert not left, (
        "Expected the test to leave nothing that goes on recording spans or adds work to "
        f"the flusher, but it left {'; '.join(left)}. Stop, join or close them in the test "
        "(or in a fixture's teardown)."
    )


#: Seconds a torchrun launch of the tests may take before it counts as hung.
TORCHRUN_TIMEOUT_S = 240


#: What a rank prints when torch's gloo threads abort the process at its exit (a C++
#: thread still joinable when the interpreter ends: pytorch#179291, #190489). Seen twice
#: in about fifteen CI runs, after every output of the run was written.
EXIT_ABORT = "terminate called without an active exception"


def torchrun_two_processes(*argv: str, timeout: float = TORCHRUN_TIMEOUT_S) -> str:
    """``torchrun --standalone --nproc_per_node 2 ARGV...`` (gloo over loopback, one torch
    thread each); its stderr, after checking that it ended with exit code 0 within
    ``timeout`` s (a run that hangs is killed with its workers). Skips without gloo. A run
    that torch's exit abort (:data:`EXIT_ABORT`) failed runs once more, with a warning:
    any other failure, or that abort twice, fails the test."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    for attempt in (1, 2):
        code, stdout, stderr = _torchrun_once(argv, timeout)
        if code == 0:
            return stderr
        if attempt == 1 and EXIT_ABORT in stderr:
            warnings.warn(
                f"the torchrun run ended in torch's exit abort ({EXIT_ABORT!r}); run again",
                stacklevel=2,
            )
            continue
        break
    pytest.fail(
        f"the torchrun run failed with exit code {code}:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    )


def _torchrun_once(argv: tuple[str, ...], timeout: float) -> tuple[int, str, str]:
    """One launch: its exit code, stdout and stderr (a hang fails the test)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1",
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc_per_node", "2", *argv,
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # torchrun and its workers: one process group to end
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the torchrun run did not end in {timeout:g} s:\n{stderr[-6000:]}")
    return proc.returncode, stdout, stderr


@pytest.fixture
def torchrun_two() -> Callable[..., str]:
    """:func:`torchrun_two_processes`, for tests that launch a 2-process run of their own."""
    return torchrun_two_processes


@pytest.fixture(scope="session")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-process torchrun run (gloo, CPU, loopback only) of
    tests/ppetrace/training/ddp_worker.py, shared by the distributed tests; returns its
    output folder (``result_rank<R>.json``, traces, checkpoints)."""
    out = tmp_path_factory.mktemp("torchrun")
    worker = Path(__file__).parent / "ppetrace" / "training" / "ddp_worker.py"
    torchrun_two_processes(str(worker), str(out))
    return out
