"""The training progress bar: step, loss and steps/s, refreshed a few times per second.

The bar (tqdm) is shown only when ``progress=True`` and its stream is a
terminal. :meth:`ProgressBar.update` is called after every batch but does
nothing until ``interval`` seconds have passed on the injected clock; only
then does it read the loss (one ``.item()``, which syncs the device) and
redraw. So the per-batch cost is one clock read. The Trainer checks the
loss value read there for a non-finite loss (``_nonfinite``).
:meth:`ProgressBar.write` prints above the bar (``Trainer.print``).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from typing import IO, Any

__all__ = ["ProgressBar", "progress_wanted"]


def progress_wanted(progress: bool, stream: IO[str] | None) -> bool:
    """Whether to show a bar: ``progress`` is on and ``stream`` is a terminal."""
    if not progress:
        return False
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except (ValueError, OSError):  # closed stream
        return False


class ProgressBar:
    """A tqdm bar over training batches with ``step``, ``loss`` and ``steps/s`` in its postfix.

    Args:
        total: the expected number of batches of the run, or ``None``.
        stream: where to draw (default ``sys.stderr``).
        clock: seconds as a float; injected by tests.
        interval: the minimum seconds between two redraws.
        initial: batches already done (after a resume).
        initial_step: the global step at the start (after a resume).
    """

    def __init__(
        self,
        total: int | None,
        *,
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        interval: float = 0.25,
        initial: int = 0,
        initial_step: int = 0,
    ) -> None:
        from tqdm.auto import tqdm

        self._clock = clock
        self._interval = interval
        now = clock()
        self._next = now + interval
        self._last_time = now
        self._last_step = initial_step
        self._shown = initial
        self.bar: Any = tqdm(
            total=total,
            initial=initial,
            file=sys.stderr if stream is None else stream,
            unit="batch",
            dynamic_ncols=True,
            leave=True,
            mininterval=0,
        )
        #: the last postfix drawn: {"step": ..., "loss": ..., "steps/s": ...}
        self.postfix: dict[str, Any] = {}
        #: the loss value read at the last redraw (None: no loss, or not a number)
        self.loss_value: float | None = None

    def update(self, batches: int, step: int, loss: Any) -> bool:
        """Record progress; redraws only when ``interval`` has passed since the last redraw.
        Returns whether it redrew and read the loss (then :attr:`loss_value` holds it)."""
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self._interval
        self._draw(now, batches, step, loss)
        return self.loss_value is not None

    def _draw(self, now: float, batches: int, step: int, loss: Any) -> None:
        postfix: dict[str, Any] = {"step": step}
        self.loss_value = None
        if loss is not None:
            detach = getattr(loss, "detach", None)
            if detach is not None:
                loss = detach()
            with contextlib.suppress(TypeError, ValueError, RuntimeError):
                self.loss_value = value = float(loss)
                postfix["loss"] = f"{value:.4g}"
        elapsed = now - self._last_time
        if elapsed > 0:
            postfix["steps/s"] = f"{(step - self._last_step) / elapsed:.3g}"
        self._last_time = now
        self._last_step = step
        self.postfix = postfix
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(batches - self._shown)
        self._shown = batches

    def write(self, text: str, *, file: IO[str] | None = None, end: str = "\n") -> None:
        """Write ``text`` above the bar (``tqdm.write``: the bar is cleared, the text
        written to ``file`` (default ``sys.stdout``), and the bar drawn again below)."""
        type(self.bar).write(text, file=file, end=end)

    def close(self, batches: int, step: int, loss: Any) -> None:
        """Draw the final state and close the bar."""
        self._draw(self._clock(), batches, step, loss)
        self.bar.close()
