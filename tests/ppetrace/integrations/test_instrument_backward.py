"""``instrument()`` hooks ``torch.autograd.backward`` only: ``Tensor.backward`` calls it,
also for a tensor subclass with ``__torch_function__`` and under a ``TorchFunctionMode``,
so each backward is one ``trainer.backward`` span."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import ppetrace
from exporters import read_chrome_trace


class _Tagged(torch.Tensor):
    """A tensor subclass whose ``__torch_function__`` runs for every call on it."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


class _Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("how", ["plain", "subclass", "mode"])
def test_each_backward_is_one_span_whatever_dispatches_it(tmp_path: Path, how: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "trace.json"
    mode = _Counting()
    _Tagged.calls = 0
    with ppetrace.instrument(trace_path=path):
        for _ in range(3):
            x = torch.randn(8, 4)
            if how == "subclass":
                x = x.as_subclass(_Tagged)
            if how == "mode":
                with mode:
                    model(x).sum().backward()
            else:
                model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert (_Tagged.calls > 0) is (how == "subclass")
    assert (mode.calls > 0) is (how == "mode")
    frame = read_chrome_trace(path)
    assert (frame["name"] == "trainer.backward").sum() == 3
    assert (frame["name"] == "trainer.step").sum() == 3
