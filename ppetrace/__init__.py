"""ppetrace: PyTorch training in which every hook is an OpenTelemetry span.

``import ppetrace`` is cheap: it loads the recorder only. Everything that needs
torch (runtimes, the Trainer, module interfaces) is imported on first use.

The subpackages, along the data flow: :mod:`ppetrace.training` drives the
lifecycle of the modules defined by :mod:`ppetrace.interfaces`, moving them
through :mod:`ppetrace.runtime`; every hook is a span recorded by
:mod:`ppetrace.tracing`, which hands batches of spans to :mod:`exporters`
and to OpenTelemetry. :mod:`ppetrace.profilers` add deep profiles on a
schedule. :mod:`ppetrace.integrations` traces loops that ppetrace does not drive
(:func:`instrument`, ``ppetrace run``, the Lightning profiler).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .tracing import bind_context, configure, flush, shutdown, stats, trace

if TYPE_CHECKING:
    from .integrations import Instrumentation, instrument
    from .interfaces import (
        AbstractPyTorchNetwork,
        CallbackInterface,
        DataParallelPyTorchNetwork,
        ModuleInterface,
        Stage,
        scale_loss,
    )
    from .profilers import Schedule
    from .runtime import (
        BaseRuntime,
        CodeBlock,
        PyTorchRuntime,
        forward,
        map,
        runtime_of,
        runtime_registry,
        to,
        update_parameters,
    )
    from .training import CheckpointError, Evaluator, StepProfiler, Trainer

# public name -> the subpackage that defines it (imported on first access)
_LAZY = {
    **dict.fromkeys(
        (
            "BaseRuntime",
            "PyTorchRuntime",
            "runtime_registry",
            "to",
            "runtime_of",
            "CodeBlock",
            "update_parameters",
            "forward",
            "map",
        ),
        ".runtime",
    ),
    **dict.fromkeys(
        (
            "Stage",
            "CallbackInterface",
            "ModuleInterface",
            "AbstractPyTorchNetwork",
            "DataParallelPyTorchNetwork",
            "scale_loss",
        ),
        ".interfaces",
    ),
    **dict.fromkeys(("Trainer", "StepProfiler", "CheckpointError", "Evaluator"), ".training"),
    "Schedule": ".profilers",
    **dict.fromkeys(("instrument", "Instrumentation"), ".integrations"),
}

__all__ = [
    "AbstractPyTorchNetwork",
    "BaseRuntime",
    "CallbackInterface",
    "CheckpointError",
    "CodeBlock",
    "DataParallelPyTorchNetwork",
    "Evaluator",
    "Instrumentation",
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
    "instrument",
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
