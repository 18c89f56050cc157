"""Integrations: tracing what ppetrace does not drive itself.

Takes in: any PyTorch script or loop, through process-wide hooks
(:func:`instrument`: DataLoader iterators, module calls, backward and
optimizer steps; ``ppetrace run`` runs a script or module under it, in
:mod:`._run`); Lightning's profiler actions
(:class:`ppetrace.integrations.lightning.LightningProfiler`, the only module
here that imports Lightning); and the worker processes of a ``DataLoader``
(:mod:`ppetrace.integrations.dataloader`: their spans, ppetrace's own and the
user's ``trace()`` calls in ``__getitem__`` and ``collate_fn``, are forwarded
to the parent, each worker on a track of its own). The steps of loops that
ppetrace does not drive follow the Trainer's definition (:mod:`._stepper`);
spans known only when they end (a step, an optimizer step, a Lightning
action) are recorded after the fact (:mod:`._record`). While ppetrace's own
Trainer or a LightningProfiler traces the loop, the hooks stand aside
(:mod:`._precedence`). Hands on: spans with the Trainer's event names to
:mod:`ppetrace.tracing`, whose flusher hands them to its sinks, so that the
Chrome trace, the step report and ``compare`` of :mod:`exporters` read them
like the Trainer's; under torchrun, a per-rank trace file (:mod:`._ranks`).
Importing this package is cheap: :func:`instrument` loads its hooks on first use.

:mod:`ppetrace.integrations.distributed` takes a ``torch.distributed`` process
group and gives out each rank's clock offset to rank 0 (NTP-style pings, with
an error bound), ``dist.<name>`` spans for the collectives user code calls
(with their byte counts), and one trace file per rank
(``trace.ranks/rank<R>.json``, on rank 0's clock, with ``distributedInfo``)
merged by rank 0 into one timeline.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._instrument import Instrumentation, instrument

__all__ = ["Instrumentation", "instrument"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module("._instrument", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ppetrace.integrations' has no attribute {name!r}")
