"""Collation of step outputs for callbacks, with a memory bound.

Outputs handed to callbacks are collated as in PyMarlin: each output is
detached and copied to the CPU, then the steps are joined output by output
(a 0-dim tensor counts as one row; tensors are concatenated on dim 0). A dict
output (a delira network's ``{"pred": ...}``) is collated key by key into one
dict.

**The bound.** A collector keeps at most ``max_bytes`` of tensor data (the
Trainer's ``max_collated_bytes``, 256 MiB by default). When a new step would
exceed it, the *oldest* steps are dropped (a ``RuntimeWarning`` says so once
per collector), so an epoch's outputs can never exhaust memory; the most
recent step is always kept.

The Trainer creates collectors only when a callback overrides a hook that
receives outputs, so a run without such callbacks never copies an output.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["DEFAULT_MAX_COLLATED_BYTES", "OutputCollector", "as_outputs", "collate"]

#: The default bound on the outputs one collector keeps: 256 MiB.
DEFAULT_MAX_COLLATED_BYTES = 256 * 1024 * 1024

_Tensor = torch.Tensor


def as_outputs(out: Any) -> tuple[Any, ...]:
    """A step's return value as a tuple of outputs (a lone value becomes a 1-tuple)."""
    if type(out) is tuple:
        return out
    if isinstance(out, (tuple, list)):
        return tuple(out)
    if out is None:
        return ()
    return (out,)


def _to_host(value: Any) -> Any:
    """A tensor as a detached CPU copy that owns its memory (a view would keep the whole
    storage it views alive and hide it from the byte bound); a dict's values likewise;
    other values unchanged."""
    if isinstance(value, _Tensor):
        if value.device.type == "cpu":
            return value.detach().clone()
        return value.detach().to("cpu")
    if type(value) is dict:
        return {key: _to_host(v) for key, v in value.items()}
    return value


def _size(value: Any) -> int:
    if isinstance(value, _Tensor):
        return value.element_size() * value.numel()
    if type(value) is dict:
        return sum(_size(v) for v in value.values())
    return 0


def _nbytes(outputs: tuple[Any, ...]) -> int:
    return sum(_size(v) for v in outputs)


def collate(steps: Sequence[tuple[Any, ...]]) -> tuple[Any, ...]:
    """Join per-step outputs position by position.

    Tensors are concatenated on dim 0 (0-dim tensors become one row each);
    dicts with the same keys are collated key by key; any other values are
    gathered into a list. All steps must return the same number of outputs.
    """
    if not steps:
        return ()
    width = len(steps[0])
    for i, step in enumerate(steps):
        if len(step) != width:
            raise ValueError(
                f"Expected every step to return {width} outputs to collate, but step {i} "
                f"returned {len(step)}. Return the same outputs from every step."
            )
    return tuple(_collate_column([step[pos] for step in steps], str(pos)) for pos in range(width))


def _collate_column(column: list[Any], where: str) -> Any:
    """One output over the steps: tensors concatenated, dicts key by key, else a list."""
    if all(isinstance(v, _Tensor) for v in column):
        rows = [v.reshape(1) if v.dim() == 0 else v for v in column]
        try:
            return torch.cat(rows, dim=0)
        except RuntimeError as exc:
            shapes = ", ".join(str(tuple(v.shape)) for v in column[:4])
            raise ValueError(
                f"Expected output {where} of every step to have the same shape after dim 0 so "
                f"it can be concatenated, but received shapes {shapes}. Return tensors that "
                "differ only in their first dimension."
            ) from exc
    if all(type(v) is dict for v in column) and all(v.keys() == column[0].keys() for v in column):
        return {
            key: _collate_column([v[key] for v in column], f"{where}[{key!r}]") for key in column[0]
        }
    return column


class OutputCollector:
    """Keeps detached CPU copies of step outputs, bounded by ``max_bytes`` (oldest dropped).

    ``what`` names the outputs in the warning (e.g. ``"on_end_train_epoch"``).
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_COLLATED_BYTES, *, what: str = "outputs"):
        self.max_bytes = max_bytes
        self.what = what
        self._steps: deque[tuple[tuple[Any, ...], int]] = deque()
        self._bytes = 0
        self.dropped_steps = 0
        self._warned = False

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data currently kept."""
        return self._bytes

    def add(self, outputs: tuple[Any, ...], *, on_host: bool = False) -> tuple[Any, ...]:
        """Keep one step's outputs and return them as kept (detached, on the CPU).

        ``on_host=True`` says the outputs were already detached and copied.
        """
        if not on_host:
            outputs = tuple(_to_host(v) for v in outputs)
        size = _nbytes(outputs)
        self._steps.append((outputs, size))
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._steps) > 1:
            _, old = self._steps.popleft()
            self._bytes -= old
            self.dropped_steps += 1
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"ppetrace: the outputs collected for {self.what} exceed max_collated_bytes="
                    f"{self.max_bytes}; the oldest steps are dropped. Raise max_collated_bytes "
                    "on the Trainer or return smaller outputs from the step.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return outputs

    def collated(self) -> tuple[Any, ...]:
        """The kept steps joined by :func:`collate`."""
        return collate([outputs for outputs, _ in self._steps])

    def clear(self) -> None:
        """Forget every kept step (the drop count and the warning flag stay)."""
        self._steps.clear()
        self._bytes = 0


def to_host(outputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Detached CPU copies of the tensors in ``outputs``; other values unchanged."""
    return tuple(_to_host(v) for v in outputs)
