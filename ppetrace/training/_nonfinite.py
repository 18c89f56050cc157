"""Non-finite losses, found without a device sync in any step (``Trainer(on_nonfinite_loss=...)``).

The loss is looked at where its value reaches the host anyway, and nowhere
else:

- at each progress-bar redraw, which reads the loss already;
- at the end of each epoch (the epoch's last loss): read at once on the CPU;
  on another device an ``isfinite`` flag is computed and copied to host memory
  asynchronously, and resolved at the next flush of the recorder (a
  ``RECORDER.before_flush`` hook, as ``CudaTimer`` resolves its events): a
  flush forced inside a hook never waits for it, the Trainer's explicit flush
  at the end of the epoch, outside every hook, does;
- with ``on_nonfinite_loss="raise"``, after every step as well: on the CPU
  the loss is read at once; on another device each step's flag is checked
  without waiting once the device has reached it (a step or so later).

The first non-finite loss found in a ``fit`` is reported once: a
``RuntimeWarning`` naming the global step (``ppetrace.step`` of its batch),
the epoch and the batch, and the attribute ``ppetrace.nonfinite_loss`` (that
global step) on the ``trainer.epoch`` span. With ``"raise"`` the loop then
raises ``FloatingPointError``. Between those points a loss may become
non-finite unnoticed; the step named is where it was seen.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import torch

from ..tracing._recorder import RECORDER

__all__ = ["NONFINITE_ATTRIBUTE", "NONFINITE_MODES", "LossWatch", "check_nonfinite_mode"]

#: The ``trainer.epoch`` span attribute set to the global step of a non-finite loss.
NONFINITE_ATTRIBUTE = "ppetrace.nonfinite_loss"
#: What ``Trainer(on_nonfinite_loss=...)`` accepts.
NONFINITE_MODES = ("warn", "raise")

NonfiniteMode = Literal["warn", "raise"]


def check_nonfinite_mode(value: Any) -> NonfiniteMode:
    """``value`` if it is one of :data:`NONFINITE_MODES`, else ``ValueError``."""
    if value not in NONFINITE_MODES:
        raise ValueError(
            f"Expected 'warn' or 'raise' for on_nonfinite_loss, but received {value!r}. Pass "
            "on_nonfinite_loss='raise' to stop training at a non-finite loss."
        )
    return value


class _AsyncFlag:
    """``isfinite(loss)`` on its device, copied to host memory without waiting."""

    __slots__ = ("event", "host")

    def __init__(self, loss: torch.Tensor) -> None:
        flag = torch.isfinite(loss.detach()).all()
        self.host = torch.empty((), dtype=torch.bool, pin_memory=loss.is_cuda)
        self.host.copy_(flag, non_blocking=True)
        self.event = torch.cuda.Event() if loss.is_cuda else None
        if self.event is not None:
            self.event.record()

    def ready(self) -> bool:
        """Whether the device has copied the flag (never waits)."""
        return self.event is None or bool(self.event.query())

    def finite(self) -> bool:
        """The flag; waits for the device if it has not copied it yet."""
        if self.event is not None:
            self.event.synchronize()
        return bool(self.host)


#: (step, epoch, batch_idx, the epoch span's attributes, the flag) of a flag in flight
_Pending = tuple[int, int, int, "dict[str, Any] | None", Any]


class LossWatch:
    """Finds the first non-finite loss of a fit (module docstring); one per ``fit``.

    ``flag_factory`` builds the asynchronous flag of a loss that is not on the
    CPU (tests inject one; default: ``isfinite`` plus a pinned copy and a CUDA
    event).
    """

    def __init__(
        self,
        mode: NonfiniteMode,
        *,
        flag_factory: Callable[[torch.Tensor], Any] = _AsyncFlag,
    ) -> None:
        self.mode = mode
        #: check after every step (``"raise"``), not only at the epoch end and redraws
        self.every_step = mode == "raise"
        #: ``(global step, epoch, batch_idx, value)`` of the first non-finite loss found
        self.found: tuple[int, int, int, float | None] | None = None
        #: the attributes of the current ``trainer.epoch`` span (None: tracing disabled)
        self.epoch_attrs: dict[str, Any] | None = None
        self._flag_factory = flag_factory
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()
        self._installed = False

    # -- where the loss reaches the host -------------------------------------------------

    def observe(self, value: float | None, step: int, epoch: int, batch_idx: int) -> None:
        """A loss value that is on the host already (a progress-bar redraw read it)."""
        if self.found is None and value is not None and not math.isfinite(value):
            self._report(step, epoch, batch_idx, value, self.epoch_attrs)

    def sample(self, loss: Any, step: int, epoch: int, batch_idx: int) -> None:
        """Look at ``loss``: at once where it is on the host, else through an asynchronous
        flag resolved later (:meth:`poll`). Never waits for a device."""
        if self.found is not None or loss is None:
            return
        if not isinstance(loss, torch.Tensor):
            try:
                value = float(loss)
            except (TypeError, ValueError):
                return
            self.observe(value, step, epoch, batch_idx)
            return
        if loss.device.type == "cpu":
            if loss.numel() == 1:
                self.observe(loss.item(), step, epoch, batch_idx)
            elif not bool(torch.isfinite(loss.detach()).all()):
                self._report(step, epoch, batch_idx, None, self.epoch_attrs)
            return
        try:
            flag = self._flag_factory(loss)
        except Exception:  # a device without events or pinned memory: not checked
            return
        with self._lock:
            self._pending.append((step, epoch, batch_idx, self.epoch_attrs, flag))

    def poll(self, *, wait: bool = False) -> None:
        """Resolve the flags in flight that the device has reached (all of them with
        ``wait``), in order; the first non-finite one is reported."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                step, epoch, batch_idx, attrs, flag = self._pending[0]
                if not wait and not flag.ready():
                    return
                self._pending.popleft()
            if self.found is None and not flag.finite():
                self._report(step, epoch, batch_idx, None, attrs)

    def check(self) -> None:
        """With ``"raise"``: raise ``FloatingPointError`` once a non-finite loss was found."""
        found = self.found
        if found is not None and self.mode == "raise":
            step, epoch, batch_idx, value = found
            what = "not finite" if value is None else f"{value}"
            raise FloatingPointError(
                f"Expected a finite loss, but the loss at global step {step} (epoch {epoch}, "
                f"batch {batch_idx}) is {what}; training stops there because "
                "on_nonfinite_loss='raise'. Lower the learning rate, clip gradients "
                "(clip_grad_norm) or check the data of that batch."
            )

    # -- resolving at flush --------------------------------------------------------------

    def install(self) -> None:
        """Resolve flags in flight at every recorder flush (``RECORDER.before_flush``)."""
        if not self._installed:
            RECORDER.before_flush.append(self._on_flush)
            self._installed = True

    def uninstall(self) -> None:
        """Stop resolving at flushes."""
        if self._installed:
            with contextlib.suppress(ValueError):  # removed by a recorder reset
                RECORDER.before_flush.remove(self._on_flush)
            self._installed = False

    def _on_flush(self) -> None:
        self.poll(wait=not RECORDER.inline_flush)

    def _report(
        self,
        step: int,
        epoch: int,
        batch_idx: int,
        value: float | None,
        attrs: dict[str, Any] | None,
    ) -> None:
        if self.found is not None:
            return
        self.found = (step, epoch, batch_idx, value)
        if attrs is not None:
            attrs[NONFINITE_ATTRIBUTE] = step
        what = "not finite" if value is None else f"{value}"
        hint = (
            "training stops there (on_nonfinite_loss='raise')"
            if self.mode == "raise"
            else "training goes on; pass on_nonfinite_loss='raise' to stop there"
        )
        warnings.warn(
            f"ppetrace: the loss at global step {step} (epoch {epoch}, batch {batch_idx}) is "
            f"{what}; {hint}. The span trainer.epoch carries {NONFINITE_ATTRIBUTE}={step}.",
            RuntimeWarning,
            stacklevel=2,
        )
