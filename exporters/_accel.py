"""The optional C helpers of the exporters (``exporters/_speedups.c``).

Built by ``pip install`` where a C compiler exists (see setup.py). Each use
keeps a pure-Python path that produces the same output; ``PPETRACE_PURE_PYTHON``
set in the environment forces that path.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from ._spans import FrozenAttributes


def load_speedups() -> Any:
    """``exporters._speedups``, or None (not built, ``PPETRACE_PURE_PYTHON`` set, or
    imported in a second interpreter of the process, which it refuses)."""
    if os.environ.get("PPETRACE_PURE_PYTHON"):
        return None
    try:
        module = importlib.import_module("exporters._speedups")
    except ImportError:
        return None
    module.register_frozen_type(FrozenAttributes)  # handled like a dict, as in Python
    return module


SPEEDUPS: Any = load_speedups()
