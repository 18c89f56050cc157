"""Fixtures of the training tests."""

from __future__ import annotations

from typing import Any

import pytest

import ppetrace


@pytest.fixture
def traced_worker_shutdown(monkeypatch: pytest.MonkeyPatch) -> str:
    """Every DataLoader's worker shutdown runs inside a span of the returned name."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    shutdown = _MultiProcessingDataLoaderIter._shutdown_workers
    name = "user.shutdown"

    def traced(self: Any) -> None:
        with ppetrace.trace(name):
            shutdown(self)

    monkeypatch.setattr(_MultiProcessingDataLoaderIter, "_shutdown_workers", traced)
    return name
