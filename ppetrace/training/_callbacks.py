"""Dispatch of :class:`~ppetrace.CallbackInterface` hooks, each inside a ``callback.<hook>`` span.

Which callbacks override which hook is decided once, when the list is built:
a hook that a callback does not override is never called (it is a no-op) and
records no span, which keeps the per-step cost of unused hooks at zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..interfaces.module_interface import CallbackInterface
from ..tracing._recorder import trace

__all__ = ["HOOKS", "CallbackList", "overrides"]

#: Every CallbackInterface hook, derived from the class itself.
HOOKS: tuple[str, ...] = tuple(
    name
    for name, value in vars(CallbackInterface).items()
    if name.startswith("on_") and callable(value)
)
_EVENTS = {name: "callback." + name for name in HOOKS}


def overrides(callback: object, hook: str) -> bool:
    """Whether ``callback``'s class implements ``hook`` with something other than the no-op."""
    impl = getattr(type(callback), hook, None)
    return impl is not None and impl is not getattr(CallbackInterface, hook)


class CallbackList:
    """The callbacks of a run, with, for each hook, the bound methods that implement it.

    ``callbacks`` may hold :class:`CallbackInterface` instances or any object
    that defines at least one of its hooks with the same signature.
    """

    def __init__(self, callbacks: Iterable[object]) -> None:
        self.callbacks = list(callbacks)
        for i, cb in enumerate(self.callbacks):
            if not isinstance(cb, CallbackInterface) and not any(overrides(cb, h) for h in HOOKS):
                raise TypeError(
                    "Expected each callback to be a ppetrace.CallbackInterface (or to define one "
                    f"of its hooks: {', '.join(HOOKS)}), but callback {i} is "
                    f"{type(cb).__name__}. Subclass CallbackInterface and override the hooks "
                    "you need."
                )
        self._impl: dict[str, list[Callable[..., Any]]] = {
            hook: [getattr(cb, hook) for cb in self.callbacks if overrides(cb, hook)]
            for hook in HOOKS
        }

    def wants(self, hook: str) -> bool:
        """Whether some callback overrides ``hook``."""
        return bool(self._impl[hook])

    def impl(self, hook: str) -> list[Callable[..., Any]]:
        """The bound methods implementing ``hook``, in callback order (possibly empty)."""
        return self._impl[hook]

    def call(self, hook: str, attrs: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        """Call ``hook(*args, **kwargs)`` on every callback that overrides it, each in its span."""
        fns = self._impl[hook]
        if fns:
            event = _EVENTS[hook]
            for fn in fns:
                with trace(event, attrs):
                    fn(*args, **kwargs)
