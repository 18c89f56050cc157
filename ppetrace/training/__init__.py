"""Training: the Trainer and the Evaluator drive the lifecycle, each hook in its span.

Takes in: a module of one of three kinds (a plain ``nn.Module`` with an
optimizer and a loss function, a PyMarlin-style
:class:`~ppetrace.ModuleInterface`, a delira-style
:class:`~ppetrace.AbstractPyTorchNetwork`), loaders, callbacks and
profilers. One adapter per module kind (``_adapters``) gives the loop a
single shape; the Trainer (``_trainer``) and its per-batch loop (``_loop``)
call the hooks in the documented order, moving everything through the runtime
(:mod:`ppetrace.runtime`) and opening every span with
:mod:`ppetrace.tracing`. Accumulation, clipping, AMP and schedulers
(``_optim``), evaluation (``_evaluator``), checkpoints and resuming
(``_checkpoint``, ``_resume``), output collation (``_collate``), the
progress bar (``_progress``) and non-finite losses (``_nonfinite``) each have
their own module.

Hands on: trained modules, checkpoints, collated outputs for callbacks, and
spans (with ``trace_path``, a Chrome trace written by :mod:`exporters`).
"""

from __future__ import annotations

from ._checkpoint import CheckpointError
from ._evaluator import Evaluator
from ._run import StepProfiler
from ._trainer import Trainer

__all__ = ["CheckpointError", "Evaluator", "StepProfiler", "Trainer"]
