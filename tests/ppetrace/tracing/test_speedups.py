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
