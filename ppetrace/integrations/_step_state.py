"""What the step tracker of ``instrument()`` keeps per batch and per thread (see
:mod:`._stepper`): a :class:`Candidate` for each batch that may become a training step,
and a :class:`ThreadState` for each thread that runs hooks; and the helpers that read
them (:func:`last_seen`, :func:`same_source`, :func:`cancel_pair`)."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from ._record import RowBuffer, current_parent

_log = logging.getLogger("ppetrace")

__all__ = ["Candidate", "ThreadState", "cancel_pair", "deref", "last_seen", "same_source", "weak"]


class Candidate:
    """A batch (or, without a DataLoader, an optimizer step's worth of work) that becomes
    a ``trainer.step`` if it trains."""

    __slots__ = (
        "start",
        "fetched",
        "attrs",
        "parent",
        "trained",
        "train_seen",
        "val_start",
        "val_end",
        "val_attrs",
        "opt_end",
        "iterator",
        "profiled",
        "pair",
        "fetch_attrs",
        "loader",
        "loader_start",
        "post_start",
        "post_end",
        "ended_pair",
    )

    def __init__(
        self,
        start: int,
        attrs: dict[str, Any],
        fetched: int | None,
        parent: tuple[int, int] | None = None,
    ) -> None:
        self.start = start
        #: the start of the fetch that handed the batch over, or None
        self.fetched = fetched
        self.attrs = attrs
        #: (trace id, span id) of the span the step is recorded under
        self.parent = current_parent() if parent is None else parent
        self.trained = False
        self.train_seen = False
        self.val_start: int | None = None
        self.val_end = 0
        #: the evaluation forwards in it: their spans' attributes, start and end
        self.val_attrs: list[tuple[list[dict[str, Any]], int, int]] = []
        self.opt_end = 0
        #: a weak reference to the DataLoader iterator that handed the batch over, or None:
        #: ppetrace never keeps an iterator alive (a loop that leaves it with ``break``
        #: shuts its workers down when it lets it go, not at a later step)
        self.iterator: Any = None
        #: a weak reference to the DataLoader of that iterator (``iter()`` noted it), or None
        self.loader: Any = None
        #: the start of its loader's ``iter()`` (``trainer.loader_start``), for a first batch
        self.loader_start: int | None = None
        #: the start of the first forward with gradients after the batch's optimizer step
        #: that no backward or optimizer step followed (yet), and the end of the last:
        #: an evaluation that forgot ``no_grad`` (a GAN's generator step clears it)
        self.post_start: int | None = None
        self.post_end = 0
        #: a CudaTimer's pair ended while the batch waits to be decided (undecided)
        self.ended_pair: Any = None
        self.profiled = -1
        self.pair: Any = None
        #: the attributes of the fetch that handed the batch over (recorded after the fact)
        self.fetch_attrs: Any = None


class ThreadState:
    """What the hooks keep per thread: module depth, the open candidate, open optimizer
    steps, and the validation run waiting for the next training step."""

    __slots__ = (
        "depth",
        "root",
        "in_backward",
        "in_fetch",
        "cand",
        "opts",
        "val_start",
        "val_end",
        "val_parent",
        "val_step",
        "last_was_val",
        "had_step",
        "val_attrs",
        "rows",
        "profiled",
        "thread",
        "fwd_start",
        "fwd_end",
        "fwd_attrs",
        "fwd_parent",
        "bwd_start",
        "bwd_end",
        "bwd_attrs",
        "bwd_parent",
        "fetch_cand",
        "undecided",
        "weak_prev",
        "loader_prev",
        "died",
        "error",
        "ended",
    )

    def __init__(self, profiled: bool) -> None:
        self.depth = 0
        self.root: Any = None
        self.in_backward = False
        #: inside a DataLoader fetch: modules there load data, they are not the model
        self.in_fetch = False
        self.cand: Candidate | None = None
        self.opts: list[tuple[Any, int, tuple[int, int], dict[str, Any], Any]] = []
        self.val_start: int | None = None
        self.val_end = 0
        self.val_parent = (0, 0)
        #: optimizer steps done when the validation run last grew (its ``ppetrace.step``)
        self.val_step = 0
        self.last_was_val = False
        self.had_step = False
        #: the attributes of the evaluation forward running now and its submodules' calls
        self.val_attrs: list[dict[str, Any]] | None = None
        self.rows = RowBuffer()
        self.profiled = profiled
        self.thread = threading.current_thread()
        #: when an exception ended the thread (``threading.excepthook``), and its text
        self.died = 0
        self.error: str | None = None
        #: what the ended thread left open was recorded (``StepTracker._end_thread``: once,
        #: whether ``close()`` or a new thread that took its id came first)
        self.ended = False
        #: the last outermost training forward, recorded at the next hook (its row is not
        #: made between its end and the return to the caller): pending while fwd_end > 0
        self.fwd_start = 0
        self.fwd_end = 0
        self.fwd_attrs: Any = None
        self.fwd_parent = (0, 0)
        #: the same for the last outermost backward
        self.bwd_start = 0
        self.bwd_end = 0
        self.bwd_attrs: Any = None
        self.bwd_parent = (0, 0)
        #: the candidate whose fetch (``fetched`` to ``start``) is still to be recorded
        self.fetch_cand: Candidate | None = None
        #: (candidate, end, optimizer steps done then) of batches that ran a forward with
        #: gradients and no backward, from a loader that has not trained yet: training
        #: steps if a later batch of the same iterator or loader trains (gradient
        #: accumulation over a summed loss), else evaluation (a loop that forgot
        #: ``no_grad``); see ``StepTracker._decide``
        self.undecided: list[tuple[Candidate, int, int]] = []
        #: the weak reference of the last iterator that handed this thread a batch, and
        #: the weak reference of its loader
        self.weak_prev: Any = None
        self.loader_prev: Any = None


def weak(iterator: Any) -> Any:
    """A weak reference to ``iterator`` (the same object for the same live iterator), or
    None for one that takes none."""
    try:
        return weakref.ref(iterator)
    except TypeError:
        return None


def deref(ref: Any) -> Any:
    """The object of a weak reference from :func:`weak`, or None (None, or gone)."""
    return None if ref is None else ref()


def last_seen(st: ThreadState) -> int:
    """The latest time the hooks saw of a thread that ended without an exception: where
    its open step ends."""
    cand = st.cand
    times = [st.fwd_end, st.bwd_end, st.val_end]
    if cand is not None:
        times += [cand.start, cand.opt_end or 0, cand.post_end or 0]
    return max(times)


def same_source(cand: Candidate, other: Candidate) -> bool:
    """Whether two batches came from one iterator, or one loader (``next(iter(loader))``
    each step makes an iterator per batch)."""
    if cand.iterator is other.iterator:
        return True
    return cand.loader is not None and cand.loader is other.loader


def cancel_pair(timer: Any, pair: Any) -> None:
    """Drop the device event pair of a batch that was not a training step: it is
    neither resolved nor drawn on the device track (``CudaTimer`` internals)."""
    rec = getattr(pair, "_rec", None)
    if timer is None or rec is None:
        return
    try:
        stack = timer._stack
        if rec in stack:
            stack.remove(rec)
        with timer._lock:
            if rec in timer._records:
                timer._records.remove(rec)
    except Exception:
        _log.exception("ppetrace: dropping a device event pair failed")
