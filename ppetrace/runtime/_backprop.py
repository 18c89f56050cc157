"""What a CodeBlock back-propagates: the losses among its outputs, and where gradients stop.

As in pytorch-pfn-extras' ``PyTorchRuntime.execute``: without
``backprop_from``, *every* output that is a scalar floating-point tensor with a
gradient is a loss, and each one is back-propagated (their gradients add up);
with ``backprop_from``, only that output is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = ["backprop_inputs", "call_block_func", "describe_value", "select_losses"]


def call_block_func(func: Callable[..., Any], batch: Any) -> Any:
    """Call a CodeBlock's function: a dict batch as keywords, a tuple/list as positionals."""
    if type(batch) is dict:
        return func(**batch)
    if type(batch) in (tuple, list):
        return func(*batch)
    return func(batch)


def _is_loss(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.grad_fn is not None
        and value.numel() == 1
        and (value.dtype.is_floating_point or value.dtype.is_complex)
    )


def select_losses(out: Any, backprop_from: str | None, owner: str) -> list[torch.Tensor]:
    """The tensors to back-propagate from (see the module docstring); ``owner`` names the
    block in errors. Raises ``ValueError`` when there is none."""
    if backprop_from is not None:
        if not isinstance(out, Mapping) or backprop_from not in out:
            keys = ", ".join(map(str, out)) if isinstance(out, Mapping) else type(out).__name__
            raise ValueError(
                f"Expected the outputs of {owner} to contain backprop_from={backprop_from!r}, "
                f"but received {keys}. Return a dict with that key or change backprop_from."
            )
        loss = out[backprop_from]
        if not _is_loss(loss):
            raise ValueError(
                f"Expected output {backprop_from!r} of {owner} to be a scalar floating-point "
                f"tensor with a gradient, but received {describe_value(loss)}."
            )
        return [loss]
    if isinstance(out, torch.Tensor):
        candidates: Iterable[Any] = (out,)
    elif isinstance(out, Mapping):
        candidates = out.values()
    elif isinstance(out, (tuple, list)):
        candidates = out
    else:
        candidates = ()
    losses = [value for value in candidates if _is_loss(value)]
    if not losses:
        raise ValueError(
            f"Expected the outputs of {owner} to contain a scalar floating-point tensor with a "
            f"gradient to back-propagate from, but received {describe_value(out)}. Return the "
            "loss, or pass backprop_from='<key>' to update_parameters."
        )
    return losses


def describe_value(value: Any) -> str:
    """A short description of a block output, for error messages."""
    if isinstance(value, torch.Tensor):
        grad = "with" if value.grad_fn is not None else "without"
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} {grad} a gradient"
    if isinstance(value, Mapping):
        return "a dict with keys " + ", ".join(map(repr, value)) if value else "an empty dict"
    return f"a {type(value).__name__}"


def backprop_inputs(
    backprop_to: set[str] | None, batch: Any, out: Any
) -> list[torch.Tensor] | None:
    """The tensors named by ``backprop_to`` (outputs first, then the batch), or ``None``."""
    if backprop_to is None:
        return None
    values: list[torch.Tensor] = []
    for key in sorted(backprop_to):
        if isinstance(out, Mapping) and key in out:
            value = out[key]
        elif isinstance(batch, Mapping) and key in batch:
            value = batch[key]
        else:
            raise ValueError(
                f"Expected backprop_to key {key!r} in the block's outputs or input batch, "
                "but it is in neither. Name a tensor of the output dict or of the batch dict."
            )
        if not isinstance(value, torch.Tensor) or not value.requires_grad:
            raise ValueError(
                f"Expected backprop_to value {key!r} to be a tensor that requires grad, but "
                f"received {describe_value(value)}."
            )
        values.append(value)
    return values
