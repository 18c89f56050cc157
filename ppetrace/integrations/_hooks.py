"""The global hooks of ``instrument()``: what they patch, and how ``close()`` puts it back.

- DataLoader: ``DataLoader.__iter__`` runs inside ``trainer.loader_start`` and
  traces the workers of a loader with ``num_workers > 0`` into the trace
  (``trace_workers``), and
  ``torch.utils.data.dataloader._BaseDataLoaderIter.__next__``
  (every DataLoader iterator, with or without worker processes) runs inside
  ``trainer.fetch_batch``; the batch it hands over opens a candidate step. The
  call that finds the end is ``trainer.loader_end`` (while profilers step around
  the batches, that span is named before it runs: from the count of batches handed
  over for a map-style dataset, ``trainer.fetch_batch`` for an iterable one). A
  worker-process iterator let go before its end (``break``) shuts its workers down in
  ``trainer.loader_end`` too (``_MultiProcessingDataLoaderIter._shutdown_workers``).
- Modules: ``torch.nn.Module.__call__`` runs a call at depth <= ``module_depth``
  (1: the outermost module calls) inside ``module.forward``, with
  ``ppetrace.module`` = the class name at depth 1 and the dotted path below.
  While torch.compile traces (``torch.compiler.is_compiling()``) the hook calls
  straight through, so a compiled module is traced from outside and compiles
  to the same graphs as without ppetrace.
- Backward: ``torch.autograd.backward`` runs inside ``trainer.backward`` (the outermost
  call only), and so does ``torch.autograd.grad`` (a gradient penalty's), which alone
  makes no batch a training step. ``Tensor.backward`` is not patched: it calls
  ``torch.autograd.backward`` (through the module attribute, so the patched one), also
  for a tensor subclass once its ``__torch_function__`` has run; a second wrapper around
  it would cost a call more per step and change no span.
- Optimizer steps (:mod:`._optim_hooks`): torch's global optimizer step hooks
  (``register_optimizer_step_pre_hook``/``..._post_hook``) bracket
  ``trainer.optimizer_step``, recorded after the fact: the hooks give a start
  and an end, not a block to wrap, and a step that raises leaves no span.

The outermost module of a training forward, the outermost backward and every
fetch are recorded *after the fact* (unless a CudaTimer, or profilers stepped
around the batches, need a span): two clock reads right around the wrapped
call, all bookkeeping between them, and the row made at the next hook
(``StepTracker.flush_pending``), so that each span matches the call as the
loop times it (``benchmarks/bench_instrument.py``, truth). Such a row enters no
OpenTelemetry context: spans recorded inside it keep the parent outside it,
and the exporters nest them by time (:mod:`exporters._nesting`), as for
``LightningProfiler``'s actions. The other module calls (submodules at
``module_depth`` > 1, evaluation forwards, modules in a fetch) stay ``with``
spans; module calls below ``module_depth`` call straight through.

Every wrapper calls through unchanged once the hooks are off (after
``close()``, also when another library wrapped it meanwhile) and while ppetrace's
own Trainer or a LightningProfiler traces the loop (:mod:`._precedence`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data.dataloader as _dl
from opentelemetry.trace.propagation import _SPAN_KEY
from torch.optim import optimizer as _optim

from ..tracing._recorder import RECORDER, _error_text, _get_ctx, span_attributes, trace
from . import _precedence
from ._modules import Paths, root_name
from ._optim_hooks import compiler as _compiler
from ._optim_hooks import dynamo_compiling as _dynamo_compiling
from ._optim_hooks import optimizer_hooks
from ._precedence import standing_aside
from ._record import current_parent
from ._stepper import VAL, StepTracker
from .dataloader import tracing_iter

__all__ = ["Hooks"]

_log = logging.getLogger("ppetrace")
_perf_ns = time.perf_counter_ns
#: the autograd node running backward on this thread, or None (torch 2.x)
_autograd_node: Callable[[], Any] = getattr(torch._C, "_current_autograd_node", lambda: None)
_MISSING = object()


def _at_the_end(it: Any, yielded: int) -> bool:
    """Whether the next ``__next__`` of the DataLoader iterator ``it``, which handed over
    ``yielded`` batches, finds the end: known for a map-style dataset, whose iterator
    stops after ``len(it)`` batches (its batch sampler's length); False when unknown
    (an iterable dataset, a sampler without a length)."""
    try:
        if it._dataset_kind != _dl._DatasetKind.Map:
            return False
        return bool(yielded >= len(it))
    except Exception:
        return False


def _inner_fetch(orig: Callable[[Any], Any], it: Any, attrs: Any) -> Any:
    """A fetch of a loader inside another loader's fetch: only its span, named
    ``trainer.loader_end`` for the call that finds a map-style loader's end, as at the
    top level; the StopIteration that ends the loader is no error of it."""
    yielded = getattr(it, "_num_yielded", None)
    at_end = isinstance(yielded, int) and _at_the_end(it, yielded)
    with trace("trainer.loader_end" if at_end else "trainer.fetch_batch", attrs):
        try:
            return orig(it)
        except StopIteration as exc:
            end = exc  # raised after the span closed, which it does not fail
    raise end


_drivers = _precedence.drivers
_session = _precedence.session


class Hooks:
    """Installs the hooks for one ``instrument()`` and removes them again."""

    def __init__(
        self, tracker: StepTracker, *, module_depth: int, span: Callable[..., Any]
    ) -> None:
        self.tracker = tracker
        self.module_depth = module_depth
        self.span = span  # ppetrace.trace, or a CudaTimer's span()
        self.on = False
        self._saved: list[tuple[Any, str, Any, Any]] = []
        self._handles: list[Any] = []
        self._paths = Paths()
        self._reported: set[str] = set()

    def failed(self, where: str) -> None:
        """Log a failure of ppetrace's own bookkeeping, once per hook; the traced code goes
        on (telemetry never breaks training)."""
        if where not in self._reported:
            self._reported.add(where)
            _log.exception("ppetrace: the %s hook of instrument() failed; the loop goes on", where)

    # -- install and remove ----------------------------------------------------------

    def install(self) -> None:
        """Patch the DataLoader iterator, ``Module.__call__`` and backward; register the
        optimizer step hooks."""
        self.on = True
        standing_aside()  # finds the Trainer's flag if the training package is imported
        base = _dl._BaseDataLoaderIter
        self._patch(base, "__next__", self._fetch_wrapper(base.__next__))
        workers = _dl._MultiProcessingDataLoaderIter
        self._patch(workers, "_shutdown_workers", self._shutdown_wrapper(workers._shutdown_workers))
        # the workers of each loader iterated, traced; not while the Trainer or a
        # LightningProfiler drives the loop (they trace their loaders themselves)
        loader = _dl.DataLoader
        hooks = self
        self._patch(
            loader,
            "__iter__",
            tracing_iter(
                loader.__iter__,
                lambda: hooks.on and not standing_aside(),
                "trainer.loader_start",
                self.tracker.iter_started,
            ),
        )
        # also at module_depth 0 (no module spans): forwards find training and evaluation
        self._patch(torch.nn.Module, "__call__", self._module_wrapper(torch.nn.Module.__call__))
        # a training thread that dies of an exception: its open step ends there, with ERROR
        self._patch(threading, "excepthook", self._excepthook_wrapper(threading.excepthook))
        # (Tensor.backward calls this one: see the module doc)
        self._patch(torch.autograd, "backward", self._backward_wrapper(torch.autograd.backward))
        grad = self._backward_wrapper(torch.autograd.grad, trains=False)
        self._patch(torch.autograd, "grad", grad)
        pre, post = optimizer_hooks(self)
        self._handles.append(_optim.register_optimizer_step_pre_hook(pre))
        self._handles.append(_optim.register_optimizer_step_post_hook(post))

    def _patch(self, owner: Any, name: str, wrapper: Any) -> None:
        before = (
            owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name)
        )
        self._saved.append((owner, name, before, wrapper))
        setattr(owner, name, wrapper)

    def uninstall(self) -> None:
        """Restore every patched attribute and remove the optimizer hooks. An attribute
        that someone else replaced after us is left to them (our wrapper inside it calls
        straight through from now on)."""
        self.on = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for owner, name, before, wrapper in reversed(self._saved):
            now = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
            if now is not wrapper:
                _log.warning(
                    "ppetrace: %s.%s was replaced while instrument() was active; leaving the "
                    "replacement in place (ppetrace's hook inside it is now inert).",
                    getattr(owner, "__name__", owner),
                    name,
                )
                continue
            if before is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        self._saved.clear()

    # -- the wrappers ----------------------------------------------------------------

    def _fetch_wrapper(self, orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
        hooks, tracker = self, self.tracker
        tls = tracker.tls
        drivers, sessions = _drivers, _session
        spanned = self._fetch_span
        get_ctx, rec = _get_ctx, RECORDER
        untimed = tracker.untimed  # (its profilers and timer are fixed when it is made)

        @functools.wraps(orig)
        def __next__(self: Any) -> Any:
            session = sessions[0]
            if not hooks.on or drivers[0] or (session is not None and session.running):
                return orig(self)  # off, or the Trainer or Lightning traces the loop
            if not untimed:
                return spanned(orig, self)  # profilers step around the batch: a span
            # as the outermost training forward: after the fact, from clock reads right
            # around the call; the step opens before the second, which is its start
            start = _perf_ns()
            try:
                st = tls.state
            except AttributeError:
                st = tracker.state()
            if st.in_fetch:  # a loader inside a loader's fetch: only its span
                return _inner_fetch(orig, self, tracker.step_attrs)
            if st.fwd_end or st.bwd_end or st.fetch_cand is not None:
                tracker.flush_pending(st)
            try:
                idx = self._num_yielded
            except AttributeError:
                idx = None
                attrs: Any = tracker.step_attrs
            else:
                attrs = {"ppetrace.step": tracker.global_step, "ppetrace.batch_idx": idx}
            parent = (rec.trace_id, 0) if get_ctx().get(_SPAN_KEY) is None else current_parent()
            if st.cand is not None:
                try:
                    tracker.finalize(st, start)  # the step ends where this fetch begins
                except Exception:
                    hooks.failed("DataLoader")
            st.in_fetch = True  # modules that load data (transforms) are not the model
            try:
                batch = orig(self)
            except BaseException as exc:
                end = _perf_ns()
                st.in_fetch = False
                stopped = isinstance(exc, StopIteration)
                try:
                    status, error = ("UNSET", "") if stopped else ("ERROR", _error_text(exc))
                    # the wait that found the end (and a loader's workers shut down): no
                    # step's data wait, the iterator's end as in the Trainer
                    fetch = "trainer.loader_end" if stopped else "trainer.fetch_batch"
                    st.rows.record(fetch, start, end, parent, attrs, None, status, error)
                    if stopped:
                        tracker.exhausted(st, self, end)
                except Exception:
                    hooks.failed("DataLoader")
                raise
            st.in_fetch = False
            summarise = False
            try:  # inside the fetch: what the step needs to know about its batch
                cand = tracker.prepare(st, start, batch, self, idx, parent)
                cand.fetch_attrs = attrs
                summarise = tracker.open_untimed(st, cand)
                st.fetch_cand = cand  # its fetch is recorded at the next hook
            except Exception:
                cand = None
                hooks.failed("DataLoader")
            end = _perf_ns()
            if cand is None:
                st.rows.record("trainer.fetch_batch", start, end, parent, attrs)
                return batch
            cand.start = end
            if summarise:
                tracker.summarise(st, end)
            return batch

        return __next__

    def _shutdown_wrapper(self, orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """The workers' shutdown of an iterator let go before its end (``break``: its
        ``__del__``) is ``trainer.loader_end``; at the end, the fetch that finds it is."""
        hooks, tracker = self, self.tracker
        drivers, sessions = _drivers, _session

        @functools.wraps(orig)
        def _shutdown_workers(it: Any) -> Any:
            session = sessions[0]
            if (
                not hooks.on
                or it.__dict__.get("_shutdown", True)  # shut down already (or not started)
                or drivers[0]
                or (session is not None and session.running)
            ):
                return orig(it)
            try:
                inside = tracker.state().in_fetch  # the fetch that found the end
            except Exception:
                inside = True
            if inside:
                return orig(it)
            with trace("trainer.loader_end", tracker.step_attrs):
                return orig(it)

        return _shutdown_workers

    def _fetch_span(self, orig: Callable[[Any], Any], it: Any) -> Any:
        """A fetch while profilers step around each batch: a span, the step opened after
        it with the profilers' ``step_begin``."""
        tracker = self.tracker
        st = tracker.state()  # (the fast paths inline its lookup; this one is not one)
        if st.in_fetch:  # a loader inside a loader's fetch: only its span
            return _inner_fetch(orig, it, tracker.step_attrs)
        cand = st.cand
        if cand is not None and cand.profiled >= 0:
            tracker.profilers_end(cand)  # outside the fetch, as the Trainer does
        # the span starts as soon as it can: the fetch is the call around it; what the
        # previous step leaves to do is done inside it (the step ended where it began)
        try:
            idx = it._num_yielded
        except AttributeError:
            idx = None
            span = trace("trainer.fetch_batch", tracker.step_attrs)
        else:
            # the span is named before the call: the call that will find the end of a
            # map-style dataset's batches is known by its count (what the untimed path
            # learns from the StopIteration)
            span = trace(
                "trainer.loader_end" if _at_the_end(it, idx) else "trainer.fetch_batch",
                {"ppetrace.step": tracker.global_step, "ppetrace.batch_idx": idx},
            )
        span.__enter__()
        start = getattr(span, "start_ns", None) or _perf_ns()
        if st.fwd_end or st.bwd_end or st.fetch_cand is not None:
            tracker.flush_pending(st)
        if cand is not None:
            try:
                tracker.finalize(st, start)  # the step ends where this fetch begins
            except Exception:
                self.failed("DataLoader")
        st.in_fetch = True  # modules that load data (transforms) are not the model
        try:
            batch = orig(it)
        except StopIteration:
            st.in_fetch = False
            span.__exit__(None, None, None)
            try:
                tracker.exhausted(st, it, getattr(span, "end_ns", None) or _perf_ns())
            except Exception:
                self.failed("DataLoader")
            raise
        except BaseException as exc:
            st.in_fetch = False
            span.__exit__(type(exc), exc, exc.__traceback__)
            raise
        try:  # inside the fetch: what the step needs to know about its batch
            parent = getattr(span, "parent_id", None)
            if parent is not None:
                parent = (span.trace_id, parent)
            cand = tracker.prepare(st, start, batch, it, idx, parent)
        except Exception:
            cand = None
            self.failed("DataLoader")
        finally:
            st.in_fetch = False
            span.__exit__(None, None, None)
        if cand is not None:
            try:
                tracker.begin(st, cand, getattr(span, "end_ns", None) or _perf_ns())
            except Exception:
                self.failed("DataLoader")
        return batch

    def _module_wrapper(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hooks, tracker = self, self.tracker
        spans = self.module_depth > 0  # module_depth 0: no spans, the bookkeeping only
        max_depth = max(1, self.module_depth)
        grad_enabled = torch.is_grad_enabled
        tls = tracker.tls
        dynamo, compiler = _dynamo_compiling, _compiler
        drivers, sessions = _drivers, _session
        forward_attrs = tracker.forward_attrs
        other_call = self._module_call
        # a CudaTimer times spans it opens itself: every call takes the span path
        timed = self.span is not trace
        get_ctx, rec = _get_ctx, RECORDER

        @functools.wraps(orig)
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            if dynamo() or compiler._is_compiling_flag or not hooks.on:
                return orig(self, *args, **kwargs)
            try:
                st = tls.state
            except AttributeError:
                st = tracker.state()
            depth = st.depth
            if depth >= max_depth or st.in_backward:
                # below the traced depth, or a recomputation inside backward (activation
                # checkpointing: the backward's time): nothing to record or count
                return orig(self, *args, **kwargs)
            # The outermost module of a training forward, the common call, is recorded
            # after the fact from two clock reads right around it, all bookkeeping between
            # them and its row made at the next hook: the span is the call around it.
            start = _perf_ns()
            if not depth and st.cand is None and _autograd_node() is not None:
                return orig(self, *args, **kwargs)  # the same, on an autograd thread
            session = sessions[0]
            if drivers[0] or (session is not None and session.running):
                return orig(self, *args, **kwargs)  # the Trainer or Lightning traces it
            if depth or st.in_fetch or timed or not grad_enabled():
                return other_call(orig, self, args, kwargs, st, depth)
            if st.fwd_end or st.bwd_end or st.fetch_cand is not None:
                tracker.flush_pending(st)  # the rows of the hooks before
            cand = st.cand
            after = False  # a forward after its batch's optimizer step (evaluation, or a GAN's)
            if cand is not None and (cand.train_seen or cand.fetched is not None):
                cand.train_seen = True  # the common case, without a call
                if cand.opt_end:
                    after = True
                    if cand.post_start is None:
                        cand.post_start = start
            else:
                try:
                    tracker.train_forward(st, start)
                except Exception:
                    hooks.failed("module call")
            attrs = forward_attrs.get(type(self))
            if attrs is None:
                attrs = tracker.forward_attrs_of(self)
            st.fwd_attrs = attrs
            st.fwd_parent = (
                (rec.trace_id, 0) if get_ctx().get(_SPAN_KEY) is None else current_parent()
            )
            st.fwd_start = start
            st.root = self
            st.depth = 1
            try:
                result = orig(self, *args, **kwargs)
            except BaseException as exc:
                st.depth = 0
                try:
                    err = _error_text(exc)  # its row now, with ERROR status
                    fwd = "module.forward"
                    if spans:
                        end = _perf_ns()
                        st.rows.record(fwd, start, end, st.fwd_parent, attrs, None, "ERROR", err)
                except Exception:
                    hooks.failed("module call")
                raise
            st.depth = 0
            end = _perf_ns()
            if spans:
                st.fwd_end = end
            if after:
                cand.post_end = end
            return result

        return __call__

    def _module_call(
        self, orig: Callable[..., Any], module: Any, args: Any, kwargs: Any, st: Any, depth: int
    ) -> Any:
        """A traced module call that is not the outermost module of a training forward:
        a submodule (``module_depth`` > 1), a module inside a DataLoader fetch, or a
        forward with gradients disabled (evaluation, ``ppetrace.stage = "val"``)."""
        tracker = self.tracker
        if st.fwd_end or st.bwd_end or st.fetch_cand is not None:
            tracker.flush_pending(st)
        post = None  # a forward with gradients after its batch's optimizer step
        try:
            if depth == 0:
                st.root = module
                attrs = {
                    "ppetrace.module": root_name(module),
                    "ppetrace.step": tracker.global_step,
                }
                st.val_attrs = None
                if st.in_fetch:
                    pass  # a module that loads data: no step bookkeeping
                elif torch.is_grad_enabled():
                    cand = tracker.train_forward(st, _perf_ns())
                    post = cand if cand.post_start is not None else None
                elif tracker.is_val(st):
                    attrs["ppetrace.stage"] = VAL
                    st.val_attrs = []
            else:
                attrs = {
                    "ppetrace.module": self._paths.of(st.root, module),
                    "ppetrace.step": tracker.global_step,
                }
                if st.val_attrs is not None:  # inside an evaluation forward
                    attrs["ppetrace.stage"] = VAL
        except Exception:
            self.failed("module call")
            attrs = {"ppetrace.module": type(module).__name__}
        st.depth = depth + 1
        start = _perf_ns()
        try:
            if not self.module_depth:  # no module spans (module_depth 0)
                return orig(module, *args, **kwargs)
            with self.span("module.forward", attrs) as entered:
                if st.val_attrs is not None:
                    # the dict the span records (a snapshot of attrs): the step
                    # takes the tag back if the forward turns out to be inside it
                    recorded = span_attributes(entered)
                    if recorded is not None:
                        st.val_attrs.append(recorded)
                return orig(module, *args, **kwargs)
        finally:
            st.depth = depth
            if post is not None:
                post.post_end = _perf_ns()
            if depth == 0 and st.val_attrs is not None:
                try:
                    tracker.val_forward(st, st.val_attrs, start, _perf_ns())
                except Exception:
                    self.failed("module call")
                st.val_attrs = None

    def _excepthook_wrapper(self, orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``threading.excepthook``, called in a thread that an exception ends: the time
        and the text, for its open step (:meth:`StepTracker.close`)."""
        hooks, tls = self, self.tracker.tls

        @functools.wraps(orig)
        def excepthook(args: Any) -> Any:
            if hooks.on and args.exc_type is not SystemExit:
                try:
                    if args.thread is threading.current_thread():
                        st = tls.state  # AttributeError: no hook ran on this thread
                        st.died, st.error = _perf_ns(), _error_text(args.exc_value)
                except Exception:
                    pass
            return orig(args)

        return excepthook

    def _backward_wrapper(
        self, orig: Callable[..., Any], *, trains: bool = True
    ) -> Callable[..., Any]:
        """``trains``: the call makes its batch a training step; not ``autograd.grad`` (an
        evaluation's input gradients do not train; a gradient penalty's batch backward)."""
        hooks, tracker, span = self, self.tracker, self.span
        tls = tracker.tls
        dynamo, compiler = _dynamo_compiling, _compiler
        drivers, sessions = _drivers, _session
        timed = span is not trace  # a CudaTimer times the span it opens itself
        get_ctx, rec = _get_ctx, RECORDER

        @functools.wraps(orig)
        def backward(*args: Any, **kwargs: Any) -> Any:
            if dynamo() or compiler._is_compiling_flag or not hooks.on:
                return orig(*args, **kwargs)
            start = _perf_ns()
            try:
                st = tls.state
            except AttributeError:
                st = tracker.state()
            if st.in_backward or st.in_fetch:  # a backward inside one, or data code
                return orig(*args, **kwargs)
            session = sessions[0]
            if drivers[0] or (session is not None and session.running):
                return orig(*args, **kwargs)  # the Trainer or Lightning traces it
            # as the outermost training forward: after the fact, from clock reads right
            # around the call, its row made at the next hook
            if st.fwd_end or st.bwd_end or st.fetch_cand is not None:
                tracker.flush_pending(st)
            cand = st.cand
            if not trains:
                pass
            elif cand is not None and (cand.train_seen or cand.fetched is not None):
                cand.train_seen = cand.trained = True  # the common case, without a call
                cand.post_start = None  # the forwards after an optimizer step trained
            else:
                try:
                    tracker.training(st, start)
                except Exception:
                    hooks.failed("backward")
            st.in_backward = True
            if timed:
                try:
                    with span("trainer.backward", tracker.step_attrs):
                        return orig(*args, **kwargs)
                finally:
                    st.in_backward = False
            st.bwd_attrs = tracker.step_attrs
            st.bwd_parent = (
                (rec.trace_id, 0) if get_ctx().get(_SPAN_KEY) is None else current_parent()
            )
            st.bwd_start = start
            try:
                result = orig(*args, **kwargs)
            except BaseException as exc:
                st.in_backward = False
                try:
                    err = _error_text(exc)  # its row now, with ERROR status
                    bwd = "trainer.backward"
                    end = _perf_ns()
                    st.rows.record(bwd, start, end, st.bwd_parent, st.bwd_attrs, None, "ERROR", err)
                except Exception:
                    hooks.failed("backward")
                raise
            st.in_backward = False
            st.bwd_end = _perf_ns()
            return result

        return backward
