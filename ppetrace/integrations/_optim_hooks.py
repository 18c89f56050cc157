"""What ``instrument()``'s hooks share about ``torch.compile``, and its optimizer step hooks.

- ``compiler`` and ``dynamo_compiling``: while torch.compile traces, every hook calls
  straight through (no graph break).
- :func:`optimizer_hooks`: torch's global optimizer step pre and post hooks, which record
  ``trainer.optimizer_step`` after the fact (see :mod:`._hooks`).
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from typing import Any

import torch
from opentelemetry.trace.propagation import _SPAN_KEY

from ..tracing._recorder import RECORDER, _get_ctx
from . import _precedence
from ._record import current_parent

__all__ = ["compiler", "dynamo_compiling", "optimizer_hooks"]

_perf_ns = time.perf_counter_ns

compiler: Any = torch.compiler
if not hasattr(compiler, "_is_compiling_flag"):  # an older torch: is_compiling() says it all
    compiler = types.SimpleNamespace(
        _is_compiling_flag=False,
        is_compiling=torch.compiler.is_compiling,
    )
# While torch.compile traces, the hooks must call straight through (no graph break):
# is_dynamo_compiling() is what dynamo folds to True, and is cheaper than is_compiling()
# (which also covers torch.export, through the flag read beside it).
dynamo_compiling = getattr(compiler, "is_dynamo_compiling", compiler.is_compiling)


def optimizer_hooks(hooks: Any) -> tuple[Callable[..., None], Callable[..., None]]:
    """torch's global optimizer step pre and post hooks: ``trainer.optimizer_step``
    from the start of the first to the end of the second, recorded after the fact."""
    tracker = hooks.tracker
    tls = tracker.tls
    dynamo = dynamo_compiling
    get_ctx, rec = _get_ctx, RECORDER
    drivers, sessions = _precedence.drivers, _precedence.session

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        now = _perf_ns()
        if dynamo() or compiler._is_compiling_flag or not hooks.on:
            return
        session = sessions[0]
        if drivers[0] or (session is not None and session.running):
            return  # the Trainer or Lightning traces it
        try:
            try:
                st = tls.state
            except AttributeError:
                st = tracker.state()
            cand = st.cand
            if cand is not None and (cand.train_seen or cand.fetched is not None):
                cand.train_seen = cand.trained = True  # the common case, without a call
                cand.post_start = None
            else:
                tracker.training(st, now)
            if st.fwd_end or st.bwd_end or st.fetch_cand is not None:
                tracker.flush_pending(st)
            opts = st.opts
            if opts and opts[-1][0] is opt:
                opts.pop()  # its last step raised: no post hook came
            attrs = {
                "ppetrace.step": tracker.global_step,
                "ppetrace.optimizer": type(opt).__name__,
            }
            pair = None
            timer = tracker.timer
            if timer is not None:
                pair = timer.wrap("trainer.optimizer_step", attrs)
                if pair is not None:
                    RECORDER.hooked[id(attrs)] = attrs  # copied when the row is taken
                    pair.begin(now, None)
            parent = (rec.trace_id, 0) if get_ctx().get(_SPAN_KEY) is None else current_parent()
            opts.append((opt, now, parent, attrs, pair))
        except Exception:
            hooks.failed("optimizer step")

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        if dynamo() or compiler._is_compiling_flag or not hooks.on:
            return
        session = sessions[0]
        if drivers[0] or (session is not None and session.running):
            return
        try:
            try:
                st = tls.state
            except AttributeError:
                st = tracker.state()
            opts = st.opts
            while opts:
                entry = opts.pop()
                if entry[0] is opt:
                    break
            else:
                return  # its pre hook ran before instrument() started
            _, start, parent, attrs, pair = entry
            if pair is not None:
                pair.__exit__(None, None, None)
            # the bookkeeping before the clock is read: inside the optimizer step,
            # not in the time between steps
            end = _perf_ns() if opts else tracker.optimizer_end(st)
            st.rows.record("trainer.optimizer_step", start, end, parent, attrs)
            if not opts:
                cand = st.cand
                if cand is not None and cand.fetched is None:  # no DataLoader's batch
                    tracker.after_optimizer_step(st, end)
        except Exception:
            hooks.failed("optimizer step")

    return pre, post
