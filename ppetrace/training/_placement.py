"""Where a run's module lives: placed whole by the Trainer, or in parts by the user.

As in pytorch-pfn-extras, the runtime hooks go to every *outermost* module
that carries a runtime tag, each through its own runtime (ppe's
``Handler._runtime_iterator`` over ``named_runtime_modules``). So:

- a module that nobody placed, or whose top module is tagged, is placed whole
  with the Trainer's runtime (:func:`ppetrace.to`): one placement, ``"main"``;
- a module whose top is untagged but some of whose submodules were placed
  with :func:`ppetrace.to` (``ppetrace.to(model.encoder, "cuda:0")``) keeps
  those placements, and nothing is moved: each placed part gets the runtime
  hooks of its own runtime, named by its attribute name. The Trainer's own
  runtime still converts the batches (ppe's entry runtime).
"""

from __future__ import annotations

from typing import Any

import torch

from ..runtime._base import BaseRuntime, call_hook
from ..runtime._registry import named_runtime_modules, to

__all__ = ["Placements", "call_module_hook", "place"]

#: ``(name, module, runtime)`` for each placed part of a run's module.
Placements = tuple[tuple[str, torch.nn.Module, BaseRuntime], ...]


def place(module: torch.nn.Module, runtime: BaseRuntime) -> tuple[torch.nn.Module, Placements]:
    """Place ``module`` (see the module docstring); returns the module and its placements."""
    found = tuple(named_runtime_modules(module))
    if found and found[0][1] is not module:
        return module, found
    moved = to(module, runtime)
    return moved, (("main", moved, runtime),)


def call_module_hook(placements: Placements, name: str, attrs: dict[str, Any]) -> None:
    """Call the one-argument hook ``name(module)`` of every placement, each in its span."""
    for _, sub, rt in placements:
        call_hook(rt, name, attrs, sub)
