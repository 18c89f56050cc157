"""Loading an example script as a module, for the example tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def load(relative: str) -> ModuleType:
    """``examples/<relative>`` (``.py`` optional, e.g. ``"ci/bench_step"``) as a fresh module."""
    if not relative.endswith(".py"):
        relative += ".py"
    name = "example_" + relative.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
