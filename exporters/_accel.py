"""The optional C helpers of the exporters (``exporters/_speedups.c``).

Built by ``pip install`` where a C compiler exists (see setup.py). Each use
keeps a pure-Python path that produces the same output; ``PPETRACE_PURE_PYTHON``
set in the environment forces that path.
"""

from __future__ import annotations

import importlib
import os
from typing import Any


def load_speedups() -> Any:
    """``exporters._speedups``, or None (not built, or ``PPETRACE_PURE_PYTHON`` set)."""
    if os.environ.get("PPETRACE_PURE_PYTHON"):
        return None
    try:
        return importlib.import_module("exporters._speedups")
    except ImportError:
        return None


SPEEDUPS: Any = load_speedups()
