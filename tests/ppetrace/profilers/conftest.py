"""Fixtures of the ppetrace tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import ppetrace
from exporters import ChromeTraceExporter


@pytest.fixture
def exporter(tmp_path: Path) -> Iterator[ChromeTraceExporter]:
    """ppetrace configured to stream spans to ``tmp_path/trace.json``."""
    exp = ChromeTraceExporter(tmp_path / "trace.json")
    ppetrace.configure(exporters=[exp], service_name="profilers-test")
    yield exp
    ppetrace.shutdown()
    ppetrace.configure()
