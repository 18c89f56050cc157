"""The exporters package never imports ppetrace or torch (DESIGN.md: the one rule)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import exporters

PACKAGE = Path(exporters.__file__).parent
FORBIDDEN = ("ppetrace", "torch")
ALLOWED_THIRD_PARTY = {"numpy", "pandas", "scipy", "opentelemetry", "msgspec"}


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_no_module_of_exporters_imports_ppetrace_or_torch_statically() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) >= 6
    stdlib = set(sys.stdlib_module_names)
    for path in files:
        for lineno, module in _imported_modules(path):
            top = module.split(".")[0]
            assert top not in FORBIDDEN, f"{path.name}:{lineno} imports {module}"
            assert top in stdlib or top in ALLOWED_THIRD_PARTY or top == "__future__", (
                f"{path.name}:{lineno} imports {module}, outside the allowed dependencies"
            )


def test_importing_and_using_exporters_loads_neither_ppetrace_nor_torch(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        import exporters
        from exporters import SpanBatch, SpanRow
        rows = [SpanRow("trainer.step", i + 1, 0, 1, 10**18 + i * 1000, 10**18 + i * 1000 + 500,
                        1, {{"ppetrace.step": i}}) for i in range(8)]
        path = {str(tmp_path / "t.json")!r}
        exporter = exporters.ChromeTraceExporter(path)
        exporter.export_batch(SpanBatch(rows))
        exporter.shutdown()
        frame = exporters.read_chrome_trace(path)
        exporters.render_table(exporters.step_report(frame))
        exporters.compare(frame, frame)
        exporters.merge_traces({str(tmp_path / "m.json")!r}, [path])
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("ppetrace", "torch"))
        print(",".join(bad) or "clean")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clean"


def test_import_exporters_is_cheap_and_every_public_name_resolves() -> None:
    script = textwrap.dedent(
        """
        import sys, types
        import exporters
        heavy = sorted(m for m in ("pandas", "scipy", "torch") if m in sys.modules)
        # submodules loaded first must not shadow the functions of the same package
        exporters.render_comparison
        import exporters.chrome, exporters.comparison, exporters.frame, exporters.report
        modules = [n for n in exporters.__all__
                   if isinstance(getattr(exporters, n), types.ModuleType)]
        print(heavy, modules, callable(exporters.compare))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] [] True"
