"""The package layout: the public API, ppe's import paths, one-way arrows between stages."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import ppetrace

ROOT = Path(ppetrace.__file__).parent
#: Which subpackages each stage may import (DESIGN.md: "arrows go one way").
ALLOWED = {
    "tracing": set(),
    "interfaces": set(),
    "runtime": {"tracing"},
    "profilers": {"tracing"},
    "training": {"tracing", "runtime", "interfaces", "profilers", "integrations"},
    # integrations.dataloader (the Trainer traces its loaders' workers), instrument(),
    # `ppetrace run` and LightningProfiler: they trace what ppetrace does not drive
    "integrations": {"tracing", "runtime", "interfaces", "profilers"},
}
#: Modules at the top of the package, which may use any stage.
TOP = {
    "__init__",
    "__main__",
    "_version",
    "cli",
    "pytest_plugin",
}
MAX_LINES = 650


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of ppetrace."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ppetrace modules that ``name`` imports, anywhere in the file (TYPE_CHECKING too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules]
            targets = targets or [module]
        else:
            continue
        out.update(t for t in targets if t in modules)
    return out


def _stage(module: str) -> str:
    """``tracing`` for ``ppetrace.tracing._recorder``; ``__init__`` for ``ppetrace`` itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_stages_import_one_way() -> None:
    modules = _modules()
    edges = set()
    for name, path in modules.items():
        src = _stage(name)
        if src in TOP:
            continue
        assert src in ALLOWED, f"{name}: a stage that the layout does not know"
        for target in _imports(name, path, modules):
            dst = _stage(target)
            if dst != src and dst not in ("__init__", "_version"):
                edges.add((src, dst, name, target))
    wrong = sorted(f"{n} imports {t}" for s, d, n, t in edges if d not in ALLOWED[s])
    assert not wrong, wrong
    assert ("training", "runtime") in {(s, d) for s, d, _, _ in edges}  # the test sees imports


def test_no_import_cycle_between_modules() -> None:
    """Within the package, no module imports itself through others (package inits only
    re-export, so imports of an ``__init__`` are left out)."""
    modules = _modules()
    graph = {
        name: {t for t in _imports(name, path, modules) if modules[t].name != "__init__.py"}
        for name, path in modules.items()
        if path.name != "__init__.py"
    }
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join([*trail[trail.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert "ppetrace.runtime._codeblock" in graph  # the once-cyclic trio is checked


def test_no_python_module_is_over_about_600_lines() -> None:
    exporters_root = ROOT.parent / "exporters"
    long = {
        str(p.relative_to(ROOT.parent)): n
        for p in [*ROOT.rglob("*.py"), *exporters_root.rglob("*.py")]
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_every_public_name_and_ppe_import_path_resolves() -> None:
    script = textwrap.dedent(
        """
        import sys
        import ppetrace
        cheap = "torch" not in sys.modules
        missing = [n for n in ppetrace.__all__ if getattr(ppetrace, n, None) is None]
        from ppetrace.runtime import BaseRuntime, PyTorchRuntime, runtime_registry
        from ppetrace.runtime import CodeBlock, forward, map, to, update_parameters
        from ppetrace.training import CheckpointError, Evaluator, StepProfiler, Trainer
        from ppetrace.interfaces import AbstractPyTorchNetwork, ModuleInterface, Stage
        from ppetrace.tracing import configure, flush, stats, trace
        same = (
            ppetrace.BaseRuntime is BaseRuntime
            and ppetrace.PyTorchRuntime is PyTorchRuntime
            and ppetrace.runtime_registry is runtime_registry
            and ppetrace.Trainer is Trainer
            and ppetrace.ModuleInterface is ModuleInterface
            and ppetrace.trace is trace
            and runtime_registry.get_runtime_class_for_device_spec("cpu") is PyTorchRuntime
        )
        print(cheap, missing, same, len(ppetrace.__all__))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    cheap, missing, same, count = result.stdout.split(maxsplit=3)
    assert (cheap, missing, same) == ("True", "[]", "True"), result.stdout
    assert int(count) >= 27
