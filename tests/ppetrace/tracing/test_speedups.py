"""The C hot path and its pure-Python reference implementation agree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppetrace.tracing import _recorder

TESTS = Path(__file__).parent


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("cc") is None,
    reason="the C hot path is built on Linux with a C compiler only",
)
def test_c_hot_path_is_in_use_where_it_can_be_built() -> None:
    assert not os.environ.get("PPETRACE_PURE_PYTHON")
    assert _recorder.IMPLEMENTATION == "c"
    assert issubclass(_recorder.Span, _recorder._speedups.SpanBase)


@pytest.mark.skipif(_recorder._speedups is None, reason="the C hot path is not built")
def test_c_clock_is_the_clock_of_perf_counter_ns() -> None:
    # profilers place their events with perf_counter_ns + RECORDER.offset_ns
    for _ in range(100):
        a = time.perf_counter_ns()
        b = _recorder._speedups.now_ns()
        c = time.perf_counter_ns()
        assert a <= b <= c


def test_tracing_tests_pass_with_the_pure_python_hot_path() -> None:
    env = {**os.environ, "PPETRACE_PURE_PYTHON": "1"}
    check = subprocess.run(
        [sys.executable, "-c", "import ppetrace.tracing._recorder as r; print(r.IMPLEMENTATION)"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert check.stdout.strip() == "python"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(TESTS / "test_tracing.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "failed" not in out.stdout


def _extension_path(module: str) -> str:
    import importlib

    return str(importlib.import_module(module).__file__)


@pytest.mark.skipif(_recorder._speedups is None, reason="the C hot path is not built")
def test_span_base_refuses_to_run_before_install() -> None:
    """The callbacks are NULL until install(): SpanBase says so instead of crashing."""
    path = _extension_path("ppetrace.tracing._speedups")
    code = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("_speedups", {path!r})
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
span = m.SpanBase("x", {{"a": 1}})
try:
    span.__enter__()
except RuntimeError as exc:
    print("refused:", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: Expected ppetrace.tracing._speedups to be installed" in out.stdout


@pytest.mark.skipif(_recorder._speedups is None, reason="the C hot path is not built")
def test_the_c_extensions_refuse_a_second_interpreter() -> None:
    """Their state is process-wide: a subinterpreter gets ImportError (and so the
    pure-Python paths), never the first interpreter's objects."""
    interpreters = pytest.importorskip("_xxsubinterpreters")
    del interpreters
    paths = [_extension_path("ppetrace.tracing._speedups"), _extension_path("exporters._speedups")]
    code = f"""
import importlib.util, _xxsubinterpreters as interpreters

def load(path):
    spec = importlib.util.spec_from_file_location("_speedups", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

for path in {paths!r}:
    load(path)  # the first interpreter: loads
    sub = interpreters.create()
    try:
        interpreters.run_string(sub, f"import importlib.util\\n"
            f"spec = importlib.util.spec_from_file_location('_speedups', {{path!r}})\\n"
            f"spec.loader.exec_module(importlib.util.module_from_spec(spec))")
        print("loaded in a subinterpreter")
    except interpreters.RunFailedError as exc:
        print("refused:", exc)
    finally:
        interpreters.destroy(sub)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and all("ImportError" in line for line in lines), lines
    assert all("one interpreter per process" in line for line in lines)
