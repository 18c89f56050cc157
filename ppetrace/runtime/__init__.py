"""Runtimes: where modules and batches live, and how a CodeBlock runs (``ppe.runtime``).

Takes in: a device string (``"cpu"``, ``"cuda:1"``, any type registered in
:data:`runtime_registry`) or a ``torch.device``, and the modules, tensors and
batches to place there. :func:`to` builds the runtime class registered for
the device type (an unknown type falls back to :class:`PyTorchRuntime`),
moves the object and tags the module with its runtime; :class:`CodeBlock`\\ s
built with :func:`forward` / :func:`update_parameters` run through
``runtime.execute``.

Hands on: every hook the lifecycle calls runs through :func:`call_hook`,
inside ``type(runtime).trace("runtime.<method>", arg)``, which records a span
with :mod:`ppetrace.tracing`. The names and signatures are those of
pytorch-pfn-extras' ``ppe.runtime``, so ``ppetrace.runtime.BaseRuntime`` and
``ppetrace.runtime.runtime_registry`` are where ppe users expect them.
"""

from __future__ import annotations

from ._base import LIFECYCLE_HOOKS, BaseRuntime, CodeBlock, call_hook
from ._codeblock import forward, map, update_parameters
from ._pytorch import PyTorchRuntime
from ._registry import RuntimeRegistry, make_runtime, runtime_of, runtime_registry, to

__all__ = [
    "LIFECYCLE_HOOKS",
    "BaseRuntime",
    "CodeBlock",
    "PyTorchRuntime",
    "RuntimeRegistry",
    "call_hook",
    "forward",
    "make_runtime",
    "map",
    "runtime_of",
    "runtime_registry",
    "to",
    "update_parameters",
]
