"""The runtime hooks of every batch, resolved once per run instead of on every call.

:func:`~ppetrace.runtime.call_hook` looks up the hook and the runtime's
``trace`` on each call. A training or evaluation loop calls the same three
hooks on every batch (``train_pre_step``, ``convert_batch``,
``train_post_step``, or the ``eval_*`` pair), so :class:`StepHooks` resolves
them once, when the run starts, into ``(open, module, fn)`` triples:

- ``open(event, arg)`` opens the hook's span exactly as ``call_hook`` would:
  ``ppetrace.trace`` itself where the runtime's class keeps the default
  ``trace`` (or ``PyTorchRuntime``'s, while no torch profiler records),
  else the class's own ``trace``;
- ``fn`` is the bound hook, or ``None`` where it is ``BaseRuntime``'s
  documented no-op (not overridden on the class or the instance): the loop
  then opens the span and calls nothing.

So a runtime that does not override a hook still gets its span (the
hook-order contract), at the cost of the span alone. Two sets are kept:
:attr:`StepHooks.plain` while no torch profiler records and
:attr:`StepHooks.ranged` while one does (every span through the class's
``trace``, which adds ``record_function`` ranges); :data:`PROFILER_FLAGS`
``._is_profiler_enabled`` says which applies, one attribute read per batch.
A hook assigned to a runtime or its class after the run started is not seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..tracing._recorder import trace
from . import _ranges
from ._base import _BASE_TRACE, _RANGE_TRACE, LIFECYCLE_HOOKS, BaseRuntime

__all__ = [
    "NO_OP_HOOKS",
    "PROFILER_FLAGS",
    "HookCall",
    "Reopen",
    "StepHooks",
    "bound_hook",
    "reusable",
    "span_opener",
]

#: The hooks that ``BaseRuntime`` implements as documented no-ops: every lifecycle hook but
#: those that move or run something.
NO_OP_HOOKS = frozenset(LIFECYCLE_HOOKS) - {
    "convert_batch",
    "move_module",
    "move_tensor",
    "execute",
    "map",
}


class _Profiling:
    """Stands in for torch's profiler module where it lacks the flag: always "recording",
    so every span goes through the class's ``trace``, which asks torch itself."""

    _is_profiler_enabled = True


#: ``._is_profiler_enabled`` is true while a torch profiler records (torch's own module flag).
PROFILER_FLAGS: Any = _ranges._autograd_profiler if _ranges.HAS_PROFILER_FLAG else _Profiling()

SpanOpener = Callable[[str, Any], contextlib.AbstractContextManager[Any]]


class HookCall(NamedTuple):
    """One placed part's hook: its span opener, its module and the bound hook (or None)."""

    open: SpanOpener
    module: torch.nn.Module
    fn: Callable[..., Any] | None


def span_opener(runtime: BaseRuntime, *, profiling: bool) -> SpanOpener:
    """What opens ``runtime``'s hook spans: ``ppetrace.trace`` where that is what the class's
    ``trace`` would do (``profiling`` false: no torch profiler records), else the class's
    ``trace``."""
    tracer = type(runtime).trace
    func = getattr(tracer, "__func__", None)
    if func is _BASE_TRACE or (func is _RANGE_TRACE and not profiling):
        return trace
    return tracer


class Reopen:
    """``again(arg)`` opens ``open(name, arg)``: a span opener that is not ``trace`` itself
    (a runtime's own ``trace``, a profiler's span) in the shape of a reused ``trace(name)``."""

    __slots__ = ("name", "open")

    def __init__(self, name: str, open: SpanOpener) -> None:
        self.name, self.open = name, open

    def again(self, arg: Any) -> contextlib.AbstractContextManager[Any]:
        return self.open(self.name, arg)

    def mark(self, arg: Any) -> None:
        """The span of an empty block, through the opener."""
        with self.open(self.name, arg):
            pass


def reusable(open: SpanOpener, name: str) -> Any:
    """An object whose ``again(arg)`` opens the span ``open(name, arg)`` would, and whose
    ``mark(arg)`` records it around an empty block: one ``trace(name)`` entered again each
    time (``trace.again``, ``trace.mark``) where ``open`` is ``trace``, else a
    :class:`Reopen`. A loop makes one per event and enters it batch after batch."""
    return trace(name) if open is trace else Reopen(name, open)


def bound_hook(runtime: BaseRuntime, name: str) -> Callable[..., Any] | None:
    """``runtime.<name>`` bound now, or None where it is ``BaseRuntime``'s no-op."""
    own = getattr(runtime, "__dict__", {}).get(name)
    if own is not None:
        return own
    if name in NO_OP_HOOKS and getattr(type(runtime), name, None) is getattr(BaseRuntime, name):
        return None
    return getattr(runtime, name)


class StepHooks:
    """The per-batch hooks of a run: ``pre`` and ``post`` of every placed part, and the
    batch conversion of the run's runtime.

    Args:
        runtime: the runtime that converts the batches.
        placements: ``(name, module, runtime)`` for each placed part.
        pre, post: the hook names (``"train_pre_step"``/``"train_post_step"`` or the
            ``eval_*`` pair).

    :attr:`plain` and :attr:`ranged` are each ``(pre_calls, convert_open, convert,
    post_calls)``: tuples of :class:`HookCall` for the pre- and post-step hooks, the span
    opener of ``convert_batch`` and the bound ``convert_batch``. :meth:`reused` gives the
    same with each opener made :func:`reusable` for its event.
    """

    def __init__(
        self,
        runtime: BaseRuntime,
        placements: Sequence[tuple[str, torch.nn.Module, BaseRuntime]],
        pre: str,
        post: str,
    ) -> None:
        convert = runtime.convert_batch
        self._events = (f"runtime.{pre}", "runtime.convert_batch", f"runtime.{post}")

        def calls(name: str, profiling: bool) -> tuple[HookCall, ...]:
            return tuple(
                HookCall(span_opener(rt, profiling=profiling), sub, bound_hook(rt, name))
                for _, sub, rt in placements
            )

        Set = tuple[tuple[HookCall, ...], SpanOpener, Callable[[Any], Any], tuple[HookCall, ...]]
        self.plain: Set = (
            calls(pre, False),
            span_opener(runtime, profiling=False),
            convert,
            calls(post, False),
        )
        self.ranged: Set = (
            calls(pre, True),
            span_opener(runtime, profiling=True),
            convert,
            calls(post, True),
        )

    def reused(self, ranged: bool) -> tuple[Any, ...]:
        """:attr:`ranged` (or :attr:`plain`) with every span opener made :func:`reusable`
        for its hook's event: ``(pre, convert_open, convert, post)``, where ``pre`` and
        ``post`` hold ``(opener, module, fn)`` and each opener's ``again(arg)`` opens the
        span. Make them once per loop over the batches."""
        pre, convert_open, convert, post = self.ranged if ranged else self.plain
        pre_event, convert_event, post_event = self._events
        return (
            tuple((reusable(c.open, pre_event), c.module, c.fn) for c in pre),
            reusable(convert_open, convert_event),
            convert,
            tuple((reusable(c.open, post_event), c.module, c.fn) for c in post),
        )
