"""Runtime events as ``torch.profiler`` ranges too, while a torch profiler records.

pytorch-pfn-extras' ``PyTorchRuntime.trace`` opens a
``torch.autograd.profiler.record_function`` range for every runtime event, so
its events show up in ``torch.profiler`` traces. :func:`range_trace` does the
same while a torch profiler is active (``torch.profiler.profile`` or
``torch.autograd.profiler.profile``), around the ppetrace span. When none is
active it is the plain span: one flag read more, since ``record_function``
itself costs microseconds even with the profiler off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.autograd.profiler as _autograd_profiler

from ..tracing import _recorder

__all__ = ["range_trace", "torch_profiler_active"]

_NULL_CONTEXT: contextlib.nullcontext[None] = contextlib.nullcontext()
#: Whether torch keeps the module flag that its profilers set on start and clear on stop
#: (read directly on the hot path: 4x cheaper than asking the C side).
HAS_PROFILER_FLAG = hasattr(_autograd_profiler, "_is_profiler_enabled")


def torch_profiler_active() -> bool:
    """Whether a torch profiler is recording now."""
    if HAS_PROFILER_FLAG:
        return bool(_autograd_profiler._is_profiler_enabled)
    return bool(torch._C._autograd._profiler_enabled())  # pragma: no cover - older torch


@contextlib.contextmanager
def _span_and_range(event_name: str, arg: Any) -> Iterator[None]:
    with _recorder.trace(event_name, arg), torch.profiler.record_function(event_name):
        yield


def range_trace(
    cls: type, event_name: str | None, arg: Any
) -> contextlib.AbstractContextManager[Any]:
    """The ppetrace span of ``event_name``, plus a ``record_function`` range inside it while
    a torch profiler is active; ``event_name=None`` records nothing. (``PyTorchRuntime.trace``.)
    """
    if event_name is None:
        return _NULL_CONTEXT
    if torch_profiler_active():
        return _span_and_range(event_name, arg)
    return _recorder.trace(event_name, arg)
