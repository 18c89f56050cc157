"""What a fresh interpreter has loaded after some imports (the tests of cheap imports)."""

from __future__ import annotations

import json
import subprocess
import sys

__all__ = ["loaded_after"]


def loaded_after(imports: str, modules: tuple[str, ...]) -> list[str]:
    """Which of ``modules`` a fresh interpreter has in ``sys.modules`` after ``import
    IMPORTS`` (a comma-separated list), sorted; fails the test when the import fails."""
    script = (
        f"import json, sys, {imports}; "
        f"print(json.dumps(sorted(m for m in {modules!r} if m in sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout))
