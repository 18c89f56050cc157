"""Fixtures of the integrations tests: a fake device event source, tiny models and loaders."""

from __future__ import annotations

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
