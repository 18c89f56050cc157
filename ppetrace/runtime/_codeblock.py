"""The CodeBlock API: device-agnostic forward and update steps run by the runtime.

As in pytorch-pfn-extras (``ppe.handler.CodeBlock``): :func:`forward` wraps a
module placed with :func:`ppetrace.to` in a :class:`CodeBlock`;
:func:`update_parameters` turns it into a training step (forward, backward,
optimizer step). Calling a block runs
``runtime.execute(block, batch)`` inside a ``runtime.execute`` span, so the
runtime decides how the block runs (autocast, GradScaler, device quirks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ._base import BaseRuntime, CodeBlock, _name
from ._registry import RUNTIME_TAG

__all__ = ["CodeBlock", "forward", "map", "update_parameters"]


def forward(module: torch.nn.Module | CodeBlock | Callable[..., Any]) -> CodeBlock:
    """A CodeBlock that runs the forward pass of ``module``.

    ``module`` is a module placed with :func:`ppetrace.to`, a bound method of
    such a module, or a CodeBlock (whose function, state and runtime are
    reused). Raises ``ValueError`` telling to call ``ppetrace.to`` when the
    module has no runtime, and ``TypeError`` for anything else.
    """
    if isinstance(module, CodeBlock):
        return CodeBlock(
            func=module.func,
            optimizers=[],
            backprop=False,
            backprop_from=None,
            backprop_to=None,
            state=module.state,
            runtime=module.runtime,
        )
    if isinstance(module, torch.nn.Module):
        owner: Any = module
    else:
        owner = getattr(module, "__self__", None)
        if not isinstance(owner, torch.nn.Module):
            raise TypeError(
                "Expected a torch.nn.Module, a bound method of one or a CodeBlock, but "
                f"received {type(module).__name__}. Wrap the computation in a module and "
                "place it with ppetrace.to(module, device)."
            )
    runtime = getattr(owner, RUNTIME_TAG, None)
    if not isinstance(runtime, BaseRuntime):
        raise ValueError(
            f"Expected a module placed with ppetrace.to, but {type(owner).__name__} has no "
            "ppetrace runtime. Call ppetrace.to(module, device) on it first."
        )
    return CodeBlock(
        func=module,
        optimizers=[],
        backprop=False,
        backprop_from=None,
        backprop_to=None,
        state={},
        runtime=runtime,
    )


def update_parameters(
    block: torch.nn.Module | CodeBlock | Callable[..., Any],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    backprop_from: str | None = None,
    backprop_to: Iterable[str] | None = None,
) -> CodeBlock:
    """A CodeBlock for one training step of ``block``: forward, backward, optimizer step.

    ``block`` is what :func:`forward` accepts (not a block that already
    back-propagates). ``optimizers`` is one optimizer or a sequence of them;
    ``backprop_from`` and ``backprop_to`` are described in :class:`CodeBlock`.
    """
    if isinstance(block, CodeBlock) and block.backprop:
        raise ValueError(
            "Expected a forward CodeBlock or a module for update_parameters, but received a "
            "block that already updates parameters. Pass the module or ppetrace.forward(module)."
        )
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizer_list = [optimizers]
    elif isinstance(optimizers, (list, tuple)):
        optimizer_list = list(optimizers)
    else:
        raise TypeError(
            "Expected a torch.optim.Optimizer or a list of them for optimizers, but received "
            f"{type(optimizers).__name__}."
        )
    for optimizer in optimizer_list:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "Expected every element of optimizers to be a torch.optim.Optimizer, but "
                f"received {type(optimizer).__name__}."
            )
    if isinstance(backprop_to, str):
        raise TypeError(
            f"Expected a set of names for backprop_to, but received the string {backprop_to!r}. "
            f"Pass {{{backprop_to!r}}}."
        )
    base = forward(block)
    return CodeBlock(
        func=base.func,
        optimizers=optimizer_list,
        backprop=True,
        backprop_from=backprop_from,
        backprop_to=None if backprop_to is None else set(backprop_to),
        state=base.state,
        runtime=base.runtime,
    )


def map(
    func: torch.nn.Module | CodeBlock | Callable[..., Any],
    iterable: Iterable[Any],
    out_keys: set[str] | None = None,
    device: Any = "cpu",
) -> Iterable[Any]:
    """Run ``func`` (what :func:`forward` accepts) on each item of ``iterable``, lazily.

    Delegates to the block's ``runtime.map``: each item is moved to the
    device, executed, cut down to ``out_keys`` (for dict outputs) and moved
    to ``device``. Returns an iterable that computes as it is consumed.
    """
    block = forward(func) if not isinstance(func, CodeBlock) else func
    runtime = block.runtime
    if runtime is None:
        raise ValueError(
            f"Expected a CodeBlock with a runtime, but {_name(block.func)} has none. "
            "Call ppetrace.to(module, device) first."
        )
    return runtime.map(block, iterable, out_keys, device)
