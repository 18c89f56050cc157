"""The training steps of a loop that ppetrace does not drive, as the Trainer defines them.

A step is one batch, as in the Trainer: it starts when the DataLoader has
handed over the batch (the end of its ``trainer.fetch_batch``) and ends where
the next fetch begins, or at the end of the last optimizer step before that
fetch, whichever comes first. On a thread that fetches no batch, a step
starts at the first training activity (a forward with gradients enabled, a
backward, an optimizer step) and ends at the end of each optimizer step,
where the next one starts.

Whether a batch was a training step is known only when it ends: one that saw
a backward or an optimizer step is recorded then, after the fact, as a
``trainer.step`` span (``ppetrace.step``: optimizer steps done when it
started, ``ppetrace.stage``: ``train``, ``ppetrace.epoch``, and the batch's
``ppetrace.batch_idx``/``ppetrace.batch_size`` when a DataLoader handed it
over). A batch without one is not a step: its forward calls under
``torch.no_grad()``/``inference_mode()`` carry ``ppetrace.stage = "val"``,
and a run of such batches between training steps becomes one
``trainer.validation`` span, left out of step time like the Trainer's. A batch
whose forwards had gradients but no backward followed waits: it is a step when a
later batch of its loader trains (accumulation over a summed loss), else
evaluation (a loop without ``no_grad``), as is a forward with gradients after its
batch's optimizer step that nothing trains. A
forward under ``no_grad`` that turns out to be inside a training step (a
teacher model's, before the student's forward) is not tagged when its loader
trained before; on a loader's first batch it is tagged, and loses the tag when
the step ends, unless the recorder's scheduled flush took the span in between.

Each thread has its own steps; the profilers (``step_begin``/``step_end``,
counting batches handed over with gradients enabled) follow the thread that
started ``instrument()``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..runtime._convert import batch_size
from ..tracing import FrozenAttributes
from ..tracing._recorder import RECORDER
from ._detail import StepDetail
from ._modules import COMPILED, root_name
from ._record import current_parent
from ._step_state import Candidate, ThreadState, cancel_pair, last_seen, same_source
from ._step_state import deref as _deref
from ._step_state import weak as _weak

__all__ = ["StepTracker"]

_log = logging.getLogger("ppetrace")
_perf_ns = time.perf_counter_ns
_grad_enabled = torch.is_grad_enabled
TRAIN = "train"
VAL = "val"


class StepTracker:
    """Steps, optimizer steps and epochs of every thread of one ``instrument()``.

    ``profilers`` get ``step_begin``/``step_end`` around the batches of the
    thread that made the tracker; ``timer`` (a ``CudaTimer``) times each step
    on the device from its start.
    """

    def __init__(self, profilers: Sequence[Any] = (), timer: Any = None) -> None:
        #: optimizer steps done (``ppetrace.step``)
        self.global_step = 0
        #: DataLoader epochs that trained, completed
        self.epoch = 0
        #: ``trainer.step`` spans recorded
        self.steps = 0
        self.profilers = list(profilers)
        self.timer = timer
        self._profiled_batches = 0
        self._owner = threading.get_ident()
        #: per-thread: ``tls.state`` is the thread's :class:`ThreadState` once made
        self.tls = threading.local()
        self._states: dict[int, ThreadState] = {}
        self._lock = threading.Lock()
        #: which steps the trace keeps in full (``trace_detail``); None: every step
        self.detail: StepDetail | None = None
        self._trained_iterators: weakref.WeakSet[Any] = weakref.WeakSet()
        #: iterator -> the start of its ``trainer.loader_start`` (``DataLoader.__iter__``)
        self._started: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        #: a weak reference to the iterator added last (adding is not free)
        self._last_trained: Any = None
        #: iterator -> its loader (a weak reference), and the loaders whose current
        #: iterator trained and has not run out: a loop that leaves an epoch early
        #: (``break``) ends it when it asks the loader for the next iterator
        self._loader_of: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._open_epochs: weakref.WeakSet[Any] = weakref.WeakSet()
        #: ``{"ppetrace.step": global_step}``, shared by the spans that carry nothing else
        self.step_attrs = FrozenAttributes({"ppetrace.step": 0})
        #: module class -> the attributes of its outermost forward spans in this optimizer
        #: step (shared; cleared when the step count changes)
        self.forward_attrs: dict[type, FrozenAttributes] = {}
        self._closing = False  # close() ends the open steps
        self._forked = False  # in a forked child: see forget_threads
        _TRACKERS.add(self)

    # -- threads -------------------------------------------------------------------------

    def state(self) -> ThreadState:
        """This thread's state (made on first use). The state of a thread that ended and
        is forgotten here (its id taken by this thread, or past 64 threads) is ended first,
        as :meth:`close` ends it: its open step and pending spans are recorded."""
        try:
            state: ThreadState = self.tls.state
            return state
        except AttributeError:
            pass
        ident = threading.get_ident()
        st = ThreadState(ident == self._owner)
        st.in_fetch = self._forked  # a worker's modules load data: they are not the model
        self.tls.state = st
        with self._lock:
            states = self._states
            gone = [states[ident]] if ident in states else []  # its id: that thread ended
            if len(states) > 64:  # forget threads that ended
                gone += [v for k, v in states.items() if k != ident and not v.thread.is_alive()]
                states = {k: v for k, v in states.items() if v.thread.is_alive()}
            states[ident] = st
            self._states = states
        for dead in gone:
            try:
                self._end_thread(dead, _perf_ns(), None)
                dead.rows.close()
            except Exception:
                _log.exception("ppetrace: ending the steps of a thread that ended failed")
        return st

    def forget_threads(self) -> None:
        """In a forked child (a DataLoader worker): forget the parent's threads, whose open
        steps and pending spans are the parent's to record; the child's hooks start afresh,
        its module calls traced as data code (spans, no step: as inside a fetch)."""
        self.tls.__dict__.pop("state", None)  # (the forking thread's, the one left)
        self._states = {}
        self._lock = threading.Lock()
        self._forked = True

    # -- attributes ----------------------------------------------------------------------

    def forward_attrs_of(self, module: Any) -> FrozenAttributes:
        """The attributes of an outermost ``module.forward`` span of ``module`` now, kept for
        the next calls of its class until the step count changes (not for a
        ``torch.compile`` wrapper, which is named after the module inside it)."""
        kind = type(module)
        attrs = FrozenAttributes(
            {"ppetrace.module": root_name(module), "ppetrace.step": self.global_step}
        )
        if kind.__name__ != COMPILED:
            self.forward_attrs[kind] = attrs
        return attrs

    def flush_pending(self, st: ThreadState) -> None:
        """Record the pending forward and backward of ``st`` (``ThreadState.fwd_end``)."""
        end, st.fwd_end = st.fwd_end, 0
        if end:
            st.rows.record("module.forward", st.fwd_start, end, st.fwd_parent, st.fwd_attrs)
        end, st.bwd_end = st.bwd_end, 0
        if end:
            st.rows.record("trainer.backward", st.bwd_start, end, st.bwd_parent, st.bwd_attrs)
        cand, st.fetch_cand = st.fetch_cand, None
        if cand is not None and cand.fetched is not None:
            fetch = "trainer.fetch_batch"
            st.rows.record(fetch, cand.fetched, cand.start, cand.parent, cand.fetch_attrs)

    # -- candidates ----------------------------------------------------------------------

    def open(self, st: ThreadState, start: int) -> Candidate:
        """Open an implicit candidate step (no DataLoader handed its batch over) at ``start``."""
        attrs: dict[str, Any] = {
            "ppetrace.epoch": self.epoch,
            "ppetrace.step": self.global_step,
            "ppetrace.stage": TRAIN,
        }
        return self.begin(st, Candidate(start, attrs, None), start)

    def prepare(
        self,
        st: ThreadState,
        fetched: int,
        batch: Any,
        iterator: Any,
        batch_idx: int | None,
        parent: tuple[int, int] | None,
    ) -> Candidate:
        """The candidate step of ``batch`` (number ``batch_idx`` of ``iterator``) on the thread
        of ``st``, handed over
        by a fetch that started at ``fetched`` under ``parent`` (the fetch's parent: the step
        is its sibling); :meth:`begin` opens it. Made inside the fetch, so that its cost is
        not between the fetch and the step."""
        attrs: dict[str, Any] = {
            "ppetrace.epoch": self.epoch,
            "ppetrace.step": self.global_step,
            "ppetrace.stage": TRAIN,
        }
        if batch_idx is not None:
            attrs["ppetrace.batch_idx"] = batch_idx
        size = batch_size(batch)
        if size is not None:
            attrs["ppetrace.batch_size"] = size
        cand = Candidate(0, attrs, fetched, parent)
        weak = _weak(iterator)
        if weak is not st.weak_prev:  # a new iterator on this thread: its loader, once
            st.weak_prev = weak
            st.loader_prev = self._loader_of.get(iterator) if weak is not None else None
        cand.iterator, cand.loader = weak, st.loader_prev
        if batch_idx == 0 and weak is not None:  # the loader's start, for an evaluation's
            cand.loader_start = self._started.pop(iterator, None)
        return cand

    def open_untimed(self, st: ThreadState, cand: Candidate) -> bool:
        """Open ``cand`` before its start is known (no profilers, no CudaTimer): the caller
        sets ``cand.start`` next. True when the step is to be summarised: then call
        :meth:`summarise` with its start."""
        st.cand = cand
        detail = self.detail
        # (the batches still undecided count: they become steps before this one, if any)
        return (
            detail is not None
            and detail.armed
            and detail.due(self.steps + len(st.undecided))
            and _grad_enabled()
        )

    def summarise(self, st: ThreadState, start: int) -> None:
        """Publish the start of a step to summarise (see :meth:`open_untimed`)."""
        if self.detail is not None:
            self.detail.summarise_at(start + RECORDER.offset_ns, st.rows.tid)

    @property
    def untimed(self) -> bool:
        """No profilers and no CudaTimer to step: steps can open without their start."""
        return not self.profilers and self.timer is None

    def begin(self, st: ThreadState, cand: Candidate, start: int) -> Candidate:
        """Open ``cand`` at ``start``; the profilers' ``step_begin`` when it is profiled."""
        cand.start = start
        st.cand = cand
        attrs = cand.attrs
        detail = self.detail
        # a batch handed over under no_grad is evaluation: no step row will come
        if (
            detail is not None
            and detail.armed
            and detail.due(self.steps + len(st.undecided))  # (as in open_untimed)
            and _grad_enabled()
        ):
            detail.summarise_at(start + RECORDER.offset_ns, st.rows.tid)
        if st.profiled and (self.profilers or self.timer is not None) and _grad_enabled():
            cand.profiled = self._profiled_batches
            for prof in self.profilers:
                _call(prof.step_begin, cand.profiled)
            timer = self.timer
            if timer is not None:
                try:
                    pair = timer.wrap("trainer.step", attrs)
                    if pair is not None:
                        RECORDER.hooked[id(attrs)] = attrs  # copied when the row is taken
                        pair.begin(start, None)
                        cand.pair = pair
                except Exception:
                    _log.exception("ppetrace: timing a step on the device failed")
        return cand

    def ensure(self, st: ThreadState, now: int) -> Candidate:
        """The open candidate, or a new implicit one at ``now``. An implicit candidate
        that so far saw only evaluation ends here: the training starts now."""
        cand = st.cand
        if cand is None:
            return self.open(st, now)
        if cand.fetched is None and cand.val_start is not None and not cand.train_seen:
            self.finalize(st, now)
            return self.open(st, now)
        return cand

    def train_forward(self, st: ThreadState, now: int) -> Candidate:
        """A forward with gradients enabled starts at ``now``; returns its candidate (whose
        ``post_start`` is set when the forward comes after its optimizer step)."""
        cand = self.ensure(st, now)
        cand.train_seen = True
        if cand.opt_end and cand.post_start is None:
            cand.post_start = now
        return cand

    def training(self, st: ThreadState, now: int) -> None:
        """A backward or an optimizer step starts at ``now``: the candidate trains."""
        cand = self.ensure(st, now)
        cand.train_seen = cand.trained = True
        cand.post_start = None

    def is_val(self, st: ThreadState) -> bool:
        """Whether a forward with gradients disabled, starting now, is outside training: no
        step is open, or its optimizer step is done, or it has not trained yet and its
        batch does not come from a loader that trained before (whose batches are training
        steps: a forward under no_grad there is a teacher's)."""
        cand = st.cand
        if cand is None or cand.opt_end > 0:
            return True
        if cand.train_seen:
            return False
        return not self._trained(cand.iterator)

    def _trained(self, weak: Any) -> bool:
        """Whether the iterator of the weak reference ``weak`` (None: no DataLoader) trained:
        the last one that did (also when the loop let it go since), or one in the set."""
        if weak is None:
            return False
        if weak is self._last_trained:
            return True
        iterator = weak()
        return iterator is not None and iterator in self._trained_iterators

    def val_forward(
        self, st: ThreadState, attrs: list[dict[str, Any]], start: int, end: int
    ) -> None:
        """A forward tagged ``val`` (its spans' ``attrs``) ran from ``start`` to ``end``."""
        cand = st.cand
        if cand is None:
            self._extend_val(st, start, end, current_parent())
            return
        cand.val_attrs.append((attrs, start, end))
        if cand.val_start is None:
            cand.val_start = self._val_begin(cand, start)
        cand.val_end = end

    def _val_begin(self, cand: Candidate, start: int) -> int:
        """Where the evaluation of ``cand`` begins: its fetch (or ``start``), and for an
        evaluation loader's first batch the loader's start (``iter()``, the workers'
        start-up), as the loader's end is the validation's too."""
        begun = cand.fetched if cand.fetched is not None else start
        loader_start = cand.loader_start
        return begun if loader_start is None else min(begun, loader_start)

    def optimizer_end(self, st: ThreadState) -> int:
        """The outermost optimizer step ends now: count it, and return the time it ended
        (``perf_counter_ns``, read after the count), which ends the open step.
        :meth:`after_optimizer_step` follows once the step's span is recorded. The shared
        attributes take the new count."""
        self.global_step = step = self.global_step + 1
        self.step_attrs = FrozenAttributes({"ppetrace.step": step})
        self.forward_attrs.clear()
        now = _perf_ns()
        cand = st.cand
        if cand is not None:
            cand.opt_end = now
        return now

    def after_optimizer_step(self, st: ThreadState, end: int) -> None:
        """After the outermost optimizer step that ended at ``end``, when the open candidate
        came from no DataLoader (``cand.fetched`` None; the caller checks): one step per
        optimizer step, so the step ends there and the next one starts."""
        self.finalize(st, end)
        self.open(st, end)

    def iter_started(self, loader: Any, iterator: Any, start: int) -> None:
        """``iterator`` came from ``loader.__iter__``, whose span started at ``start``. If
        the loader's previous iterator trained and did not run out, the loop left that
        epoch early (a ``break``): it ends now. The step open on this thread ends where
        ``iter()`` began, as it would at the next fetch (``next(iter(loader))`` each step
        starts a new epoch each time; a validation loader's start is not the last training
        step's time)."""
        st = self.state()
        if st.cand is not None and not (st.in_fetch or st.depth or st.in_backward):
            self.finalize(st, start)
        with contextlib.suppress(TypeError):  # a loader or iterator without weak references
            if loader in self._open_epochs:
                self._open_epochs.discard(loader)
                self._last_trained = None  # its next step opens the new epoch again
                self.epoch += 1
            self._loader_of[iterator] = weakref.ref(loader)
            self._started[iterator] = start

    def exhausted(self, st: ThreadState, iterator: Any, end: int) -> None:
        """A DataLoader iterator ran out at ``end`` (its last fetch raised StopIteration).
        An evaluation loader's end is the validation's; a training loader's end right after
        a validation is not (the loop validated after its last step)."""
        if st.undecided:
            self._ran_out(st, iterator)  # its batches that did not train were evaluation
        trained = iterator in self._trained_iterators
        if st.last_was_val and st.val_start is not None and not trained:
            st.val_end = max(st.val_end, end)
        if trained:
            self._trained_iterators.discard(iterator)
            self._last_trained = None
            self.epoch += 1
            ref = self._loader_of.get(iterator)
            loader = ref() if ref is not None else None
            if loader is not None:
                self._open_epochs.discard(loader)

    def finalize(self, st: ThreadState, end: int, error: str | None = None) -> None:
        """Close the open candidate where the next fetch begins (``end``), or at the end
        of its last optimizer step; record it if it trained. ``error``: the text of the
        exception that ended the loop inside this candidate: a candidate that began to
        train (a forward with gradients) is then recorded as a step with ERROR status."""
        if st.fwd_end or st.bwd_end or st.fetch_cand is not None:
            self.flush_pending(st)  # before the step's row: the detail filter wants it so
        cand = st.cand
        if cand is None:
            return
        st.cand = None
        try:
            if cand.trained or (error is not None and cand.train_seen):
                self._record_step(st, cand, cand.opt_end or end, error)
                if cand.post_start is not None and cand.opt_end and error is None:
                    # forwards with gradients after the optimizer step that nothing trained
                    # (an evaluation that forgot no_grad), to where the batch ends
                    self._extend_val(st, cand.post_start, max(end, cand.post_end), cand.parent)
                    st.last_was_val = True
            else:
                self._not_a_step(st, cand, end)
        finally:
            if cand.profiled >= 0:
                self.profilers_end(cand)

    def profilers_end(self, cand: Candidate) -> None:
        """``step_end`` of the profilers for ``cand`` (once; a no-op if it was not profiled)."""
        if cand.profiled >= 0:
            index, cand.profiled = cand.profiled, -1
            self._profiled_batches += 1
            for prof in self.profilers:
                _call(prof.step_end, index)

    def _record_step(
        self, st: ThreadState, cand: Candidate, end: int, error: str | None = None
    ) -> None:
        if st.undecided:
            self._decide(st, cand)  # before it: steps of its group, or evaluation
        if st.val_start is not None:
            self._emit_validation(st)  # the evaluation before this step
        st.last_was_val = False
        for attrs, start, stop in cand.val_attrs:
            if start < end:  # under no_grad inside the training step: not evaluation
                for a in attrs:
                    a.pop("ppetrace.stage", None)
            else:  # after its optimizer step: evaluation before the next step
                self._extend_val(st, start, stop, cand.parent)
        pair = cand.pair
        if pair is not None:
            _call(pair.__exit__, None, None, None)
        if error is None:
            st.rows.record("trainer.step", cand.start, end, cand.parent, cand.attrs)
        else:  # the loop failed inside this step
            rows = st.rows
            rows.record(
                "trainer.step", cand.start, end, cand.parent, cand.attrs, None, "ERROR", error
            )
        st.had_step = True
        self.steps += 1
        weak = cand.iterator
        if weak is not None and weak is not self._last_trained:
            # (an iterator the loop let go already, as next(iter(loader)) does, still
            # trained: its loader's epoch is open, and its batches were training steps)
            iterator = weak()
            if iterator is not None:
                self._trained_iterators.add(iterator)
            self._last_trained = weak
            loader = _deref(cand.loader)
            if loader is not None:
                self._open_epochs.add(loader)

    def _not_a_step(self, st: ThreadState, cand: Candidate, end: int) -> None:
        """``cand`` ended at ``end`` without training: evaluation when it ran a forward,
        under ``no_grad`` (its tagged forwards) or not (an evaluation loop that forgot
        ``no_grad``: its forwards had gradients but no backward followed, from a loader
        that has not trained). Both join the validation run, which is not step time."""
        # (a forward with gradients decides first: a teacher's no_grad forward before it
        # keeps its tag until the batch turns out to be a step, as in _record_step)
        if cand.train_seen and cand.iterator is not None and self._trained(cand.iterator):
            # a batch whose loss waits for a later backward (gradient accumulation over a
            # summed loss): a step of the group, as in the Trainer (one step per batch);
            # not the batch that instrument() closes on (the loop left it: no next fetch
            # says where it ended)
            if not self._closing:
                self._record_step(st, cand, end)
                return
            self._drop_pair(cand)
            st.last_was_val = False
        elif cand.train_seen and cand.iterator is not None:
            # a loader that has not trained: known when it (or another batch of its
            # loader) trains, or it runs out; the device timing ends here
            if cand.pair is not None:
                _call(cand.pair.__exit__, None, None, None)
                cand.pair, cand.ended_pair = None, cand.pair
            st.undecided.append((cand, end, self.global_step))
            if len(st.undecided) > MAX_UNDECIDED:  # a loop that never trains: bounded
                self._as_validation(st, *st.undecided.pop(0))
        else:
            self._drop_pair(cand)
            if cand.val_start is not None:  # its forwards under no_grad: evaluation
                self._extend_val(st, cand.val_start, cand.val_end, cand.parent)
                st.last_was_val = True
            elif cand.train_seen:  # no DataLoader: a forward with gradients, no backward
                self._as_validation(st, cand, end)
            else:
                st.last_was_val = False

    def _drop_pair(self, cand: Candidate) -> None:
        """The device event pair of a batch that is no training step: never resolved."""
        for pair in (cand.pair, cand.ended_pair):
            if pair is not None:
                cancel_pair(self.timer, pair)
                RECORDER.hooked.pop(id(cand.attrs), None)  # no row will carry them
        cand.pair = cand.ended_pair = None

    def _as_validation(
        self, st: ThreadState, cand: Candidate, end: int, step: int | None = None
    ) -> None:
        """``cand``, which ended at ``end`` after ``step`` optimizer steps (default: now),
        joins the validation run."""
        self._drop_pair(cand)
        self._extend_val(st, self._val_begin(cand, cand.start), end, cand.parent)
        if step is not None:  # decided later (undecided): the steps done when it ended
            st.val_step = step
        st.last_was_val = True

    def _decide(self, st: ThreadState, trained: Candidate | None) -> None:
        """The undecided batches (:attr:`ThreadState.undecided`) of the iterator or loader
        of ``trained`` (a batch that trains now) are training steps; the others are
        evaluation (another loader's batch trains, or the loop closes, without them)."""
        undecided, st.undecided = st.undecided, []
        for cand, end, step in undecided:
            if trained is not None and same_source(cand, trained):
                self._record_step(st, cand, end)
            else:
                self._as_validation(st, cand, end, step)

    def _ran_out(self, st: ThreadState, iterator: Any) -> None:
        """The undecided batches of ``iterator``, which ran out without training, are
        evaluation; the others keep waiting."""
        weak = _weak(iterator)
        mine = [u for u in st.undecided if u[0].iterator is weak] if weak is not None else []
        if mine:
            st.undecided = [u for u in st.undecided if u[0].iterator is not weak]
        for cand, end, step in mine:
            self._as_validation(st, cand, end, step)

    def _extend_val(self, st: ThreadState, start: int, end: int, parent: tuple[int, int]) -> None:
        if st.val_start is None:
            st.val_start, st.val_parent = start, parent
        elif start < st.val_start:  # (decided later than a batch after it)
            st.val_start = start
        st.val_end = max(st.val_end, end)
        st.val_step = self.global_step

    def _emit_validation(self, st: ThreadState) -> None:
        """The run of evaluation batches since the last step, as one ``trainer.validation``."""
        start = st.val_start
        if start is None:
            return
        st.val_start = None
        # the steps done as of its end: the step that emits it has stepped already
        attrs = {"ppetrace.step": st.val_step, "ppetrace.stage": VAL}
        st.rows.record("trainer.validation", start, st.val_end, st.val_parent, attrs)

    # -- the end -------------------------------------------------------------------------

    def close(self, error: str | None = None) -> None:
        """Close every thread's open candidate (at its last optimizer step, or now) and the
        validation run that follows the last training step. ``error``: the text of the
        exception that ended the loop; the open step of the thread that made the tracker
        (the loop's) then ends with ERROR status, as the Trainer's spans do."""
        now = _perf_ns()
        with self._lock:
            states = list(self._states.values())
        self._closing = True
        for st in states:
            self._end_thread(st, now, error)

    def _end_thread(self, st: ThreadState, now: int, error: str | None) -> None:
        """Record what the thread of ``st`` holds open: its pending spans, its open step (at
        ``now``, or for a thread that ended where it was last seen) and its validation."""
        end, failed = now, error if st.profiled else None
        if not st.rows.alive():  # a thread that ended (joined): its rows are made here
            with self._lock:
                if st.ended:
                    return
                st.ended = True
            st.rows.adopt()
            end, failed = st.died or last_seen(st), st.error
        if st.fwd_end or st.bwd_end or st.fetch_cand is not None:
            self.flush_pending(st)
        if st.cand is not None:
            self.finalize(st, end, failed)
        if st.undecided:
            self._decide(st, None)
        if st.had_step:
            self._emit_validation(st)

    def thread_errors(self) -> list[str]:
        """The texts of the exceptions that ended threads the hooks saw (training threads
        that died; ``threading.excepthook``)."""
        with self._lock:
            states = list(self._states.values())
        return [st.error for st in states if st.died and st.error]

    def release(self) -> None:
        """After the hooks are gone: give every thread's buffer back to the recorder,
        which drains it once more and then forgets it."""
        with self._lock:
            states = list(self._states.values())
        for st in states:
            st.rows.close()


#: every tracker made in this process: a forked child forgets their threads
_TRACKERS: weakref.WeakSet[StepTracker] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for tracker in list(_TRACKERS):
        tracker.forget_threads()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

#: the batches that wait for their loader to train, per thread: past this many (a loop
#: that runs forwards with gradients and never trains, nor lets its loader run out), the
#: oldest is decided as evaluation
MAX_UNDECIDED = 256


def _call(fn: Any, *args: Any) -> None:
    """Call a profiler hook; telemetry never breaks training."""
    try:
        fn(*args)
    except Exception:
        _log.exception("ppetrace: profiler hook %r failed", fn)
