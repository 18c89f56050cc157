"""ppetrace: PyTorch training in which every hook is an OpenTelemetry span.

``import ppetrace`` is cheap: it loads the recorder only. Everything that needs
torch (runtimes, the Trainer, module interfaces) is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._tracing import bind_context, configure, flush, shutdown, stats, trace
from ._version import __version__

if TYPE_CHECKING:
    from ._checkpoint import CheckpointError
    from ._codeblock import CodeBlock, forward, map, update_parameters
    from ._evaluator import Evaluator
    from ._registry import runtime_of, runtime_registry, to
    from ._runtime import BaseRuntime, PyTorchRuntime
    from ._trainer import StepProfiler, Trainer
    from .module_interface import CallbackInterface, ModuleInterface, Stage
    from .network import AbstractPyTorchNetwork, DataParallelPyTorchNetwork, scale_loss
    from .profilers import Schedule

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "BaseRuntime": "._runtime",
    "PyTorchRuntime": "._runtime",
    "runtime_registry": "._registry",
    "to": "._registry",
    "runtime_of": "._registry",
    "CodeBlock": "._codeblock",
    "update_parameters": "._codeblock",
    "forward": "._codeblock",
    "map": "._codeblock",
    "Stage": ".module_interface",
    "CallbackInterface": ".module_interface",
    "ModuleInterface": ".module_interface",
    "AbstractPyTorchNetwork": ".network",
    "DataParallelPyTorchNetwork": ".network",
    "scale_loss": ".network",
    "Trainer": "._trainer",
    "StepProfiler": "._trainer",
    "CheckpointError": "._checkpoint",
    "Evaluator": "._evaluator",
    "Schedule": ".profilers",
}

__all__ = [
    "AbstractPyTorchNetwork",
    "BaseRuntime",
    "CallbackInterface",
    "CheckpointError",
    "CodeBlock",
    "DataParallelPyTorchNetwork",
    "Evaluator",
    "ModuleInterface",
    "PyTorchRuntime",
    "Schedule",
    "Stage",
    "StepProfiler",
    "Trainer",
    "__version__",
    "bind_context",
    "configure",
    "flush",
    "forward",
    "map",
    "runtime_of",
    "runtime_registry",
    "scale_loss",
    "shutdown",
    "stats",
    "to",
    "trace",
    "update_parameters",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ppetrace' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
