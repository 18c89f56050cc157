"""Smoke tests: the Trainer examples run at tiny size and learn something."""

from __future__ import annotations

from pathlib import Path

import pytest
from example_loader import load
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import ppetrace


def test_pymarlin_style_example(
    span_exporter: InMemorySpanExporter, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    history = load("pymarlin_style").main(
        [
            "--epochs",
            "2",
            "--samples",
            "256",
            "--batch-size",
            "16",
            "--no-progress",
            "--checkpoint-dir",
            str(tmp_path),
        ]
    )
    losses = history["train_loss"]
    assert len(losses) == 2 and losses[1] < losses[0]
    accs = dict(history["val_acc"][-2:])
    assert set(accs) == {"clean", "shifted"} and accs["clean"] > 0.5  # 5 classes: chance is 0.2
    assert (tmp_path / "last.pt").is_file()
    assert "val[clean] accuracy" in capsys.readouterr().out
    ppetrace.flush()
    names = {s.name for s in span_exporter.get_finished_spans()}
    assert {"trainer.step", "callback.on_end_val_epoch", "trainer.checkpoint"} <= names


def test_delira_style_example(span_exporter: InMemorySpanExporter) -> None:
    result = load("delira_style").main(
        ["--epochs", "2", "--samples", "256", "--batch-size", "32", "--no-progress"]
    )
    mse = result["val_mse"]
    assert len(mse) == 2 and mse[1] < mse[0]
    assert result["init_kwargs"] == {"features": 16, "hidden": 32}
    ppetrace.flush()
    names = {s.name for s in span_exporter.get_finished_spans()}
    assert {"network.prepare_batch", "network.closure", "trainer.backward"} <= names
