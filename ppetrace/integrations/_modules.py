"""The names ``instrument()`` gives module calls: ``ppetrace.module`` of ``module.forward``.

The outermost module of a call is named by its class (by the class of the module
inside a ``torch.compile`` wrapper); a submodule traced below it
(``module_depth`` > 1) by its dotted path from that module, as
``named_modules()`` spells it.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["COMPILED", "Paths", "root_name"]

COMPILED = "OptimizedModule"  # torch.compile's wrapper: named after the module inside


def root_name(module: Any) -> str:
    """The class name of a module (of the module inside a ``torch.compile`` wrapper).
    ``nn.Module.__getattr__`` is slow for a missing name, so it is asked only of the wrapper."""
    kind = type(module)
    if kind.__name__ == COMPILED:
        inner = module.__dict__.get("_modules", {}).get("_orig_mod")
        if inner is not None:
            return type(inner).__name__
    return kind.__name__


class Paths:
    """Dotted paths of submodules below their outermost module, made once per root."""

    def __init__(self) -> None:
        self._by_root: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()

    def of(self, root: Any, module: Any) -> str:
        try:
            paths = self._by_root.get(root)
        except TypeError:  # a module that cannot be weakly referenced
            return type(module).__name__
        if paths is None or id(module) not in paths:
            base = root_name(root)
            target = root.__dict__.get("_modules", {}).get("_orig_mod", root)
            paths = {
                id(m): f"{base}.{name}" if name else base for name, m in target.named_modules()
            }
            paths.setdefault(id(module), type(module).__name__)  # not below this root
            self._by_root[root] = paths
        return paths[id(module)]
