"""Fixtures of the integrations tests: a fake device event source, tiny models and loaders."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ppetrace.integrations._instrument import active


class FakeEvent:
    __slots__ = ("t", "done")

    def __init__(self, t: int) -> None:
        self.t = t
        self.done = True


class FakeSource:
    """A device clock that the test moves with ``advance``; every event is reached at once."""

    def __init__(self) -> None:
        self.device_ns = 0
        self.recorded = 0

    def advance(self, ns: int) -> None:
        self.device_ns += ns

    def record(self) -> FakeEvent:
        self.recorded += 1
        return FakeEvent(self.device_ns)

    def query(self, event: FakeEvent) -> bool:
        return event.done

    def elapsed_ns(self, start: FakeEvent, end: FakeEvent) -> int:
        return end.t - start.t


@pytest.fixture
def fake_source() -> FakeSource:
    return FakeSource()


@pytest.fixture(autouse=True)
def _no_instrumentation_left() -> Iterator[None]:
    """Every test leaves torch unpatched: no instrument() still active."""
    before = (torch.nn.Module.__call__, torch.Tensor.backward, torch.autograd.backward)
    yield
    handle = active()
    if handle is not None:
        handle.close()
        pytest.fail("a test left ppetrace.instrument() active")
    after = (torch.nn.Module.__call__, torch.Tensor.backward, torch.autograd.backward)
    assert after == before


def loader(n: int = 32, batch_size: int = 8, **kwargs: Any) -> DataLoader[Any]:
    """``n`` samples of 16 features and a class out of 4, in batches."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
    return DataLoader(data, batch_size=batch_size, **kwargs)


@pytest.fixture
def make_loader() -> Any:
    return loader


def _torchrun_two(*argv: str, timeout: float) -> str:
    """``torchrun --standalone --nproc_per_node 2 ARGV...`` (gloo over loopback, one torch
    thread); its stderr, after checking that it ended with 0 within ``timeout`` s (a run
    that hangs is killed with its workers)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "MASTER_ADDR": "127.0.0.1"}  # fmt: skip
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc_per_node", "2", *argv,
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # torchrun and its workers: one process group to end
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"the torchrun run did not end in {timeout:g} s:\n{err[-6000:]}")
    assert proc.returncode == 0, err[-6000:]
    return err


@pytest.fixture
def torchrun_two() -> Any:
    """:func:`_torchrun_two`: a 2-process torchrun launch, its stderr."""
    return _torchrun_two
