"""Smoke test of the runtime-hook rows of bench_hotpath at tiny size; no timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the repository, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_hotpath  # noqa: E402


def test_runtime_hook_rows_have_figures_and_ordered_intervals() -> None:
    out = bench_hotpath.measure_runtime_trace(50, 2)
    for name in ("default trace", "PyTorchRuntime", "ppe-style record_function"):
        assert out[name] > 0
    for name in ("PyTorchRuntime / default trace", "ppe-style record_function / default trace"):
        ratio, low, high = out[name]
        assert 0 < low <= ratio <= high
