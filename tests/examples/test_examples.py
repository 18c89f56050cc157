"""Smoke tests at tiny size: quickstart, transformer_lm, custom_runtime and the CI step."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from example_loader import load

import ppetrace
from exporters import read_chrome_trace
from ppetrace import cli


def test_quickstart_writes_a_trace_and_prints_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.json"
    code = load("quickstart.py").main(["--epochs", "1", "--samples", "256", "--trace", str(trace)])
    assert code == 0
    frame = read_chrome_trace(trace)
    steps = frame[frame["name"] == "trainer.step"]
    assert len(steps) == 256 // 64  # default batch size 64: four steps
    assert sorted(steps["batch_idx"]) == [0, 1, 2, 3]
    assert {"trainer.run", "trainer.validation", "evaluator.step"} <= set(frame["name"])
    out = capsys.readouterr().out
    assert "steps/s" in out
    assert "trainer.step" in out
    assert re.search(r"^train: loss \d+\.\d{3}, accuracy \d+\.\d% \(chance 10%\)$", out, re.M)
    assert re.search(r"^val: loss \d+\.\d{3}, accuracy \d+\.\d%", out, re.M)
    assert (
        f"Wrote {trace}: open it in Perfetto UI (https://ui.perfetto.dev) or speedscope (https://www.speedscope.app)."
        in out
    )


def test_transformer_lm_learns_and_traces_validation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load("transformer_lm.py")
    trace = tmp_path / "lm.json"
    history = example.main(
        [
            "--epochs", "2", "--samples", "256", "--length", "4", "--symbols", "6",
            "--batch-size", "32", "--d-model", "32", "--layers", "1",
            "--no-progress", "--trace", str(trace),
        ]
    )  # fmt: skip
    losses, accuracy = history["val_loss"], history["val_accuracy"]
    assert len(losses) == 2 and losses[1] < losses[0]  # validation every epoch, and it learns
    assert losses[0] < math.log(6) * 1.5  # a sane cross-entropy over 6 symbols
    assert all(0.0 <= a <= 1.0 for a in accuracy)
    frame = read_chrome_trace(trace)
    counts = frame["name"].value_counts()
    assert counts["trainer.step"] == 2 * (256 // 32)
    assert counts["trainer.validation"] == 2
    assert counts["module.val_step"] == 2 * math.ceil(64 / 256)  # 64 val sentences, batch 256
    assert "token accuracy" in capsys.readouterr().out


def test_transformer_lm_data_is_a_reversal_language() -> None:
    example = load("transformer_lm.py")
    inputs, targets = example.reversal_sentences(5, 3, 4, seed=0)
    assert inputs.shape == targets.shape == (5, 2 * 3 + 1)
    assert (inputs[:, 0] == example.BOS).all() and (inputs[:, 4] == example.SEP).all()
    prefix = inputs[:, 1:4]
    assert (targets[:, 4:] == prefix.flip(1)).all()  # after <sep>: the prefix reversed
    assert (targets[:, :3] == example.IGNORE).all()  # the random prefix is not scored
    assert ((prefix >= example.SPECIAL) & (prefix < example.SPECIAL + 4)).all()


def test_custom_runtime_is_registered_and_traces_its_hooks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load("custom_runtime.py")
    trace = tmp_path / "runtime.json"
    try:
        result = example.main(
            ["--epochs", "2", "--samples", "256", "--batch-size", "32", "--trace", str(trace)]
        )
        cls = ppetrace.runtime_registry.get_runtime_class_for_device_spec("my_device:0")
        assert cls is example.MyDeviceRuntime
    finally:
        ppetrace.runtime_registry.unregister("my_device")
    batches = 2 * (256 // 32)
    calls = result["calls"]
    assert calls["runtime.train_pre_step"] == calls["runtime.train_post_step"] == batches
    assert calls["runtime.train_epoch_begin"] == 2
    mse = result["val_mse"]
    assert len(mse) == 2 and mse[1] < mse[0]

    frame = read_chrome_trace(trace)
    # every hook the runtime traced is in the file, runtime.move_module (before the first
    # step) included
    assert calls["runtime.move_module"] == 1
    assert {name: int((frame["name"] == name).sum()) for name in calls} == calls
    pre = frame[frame["name"] == "runtime.train_pre_step"]
    assert len(pre) == batches
    assert set(pre["ppetrace.runtime"]) == {"MyDeviceRuntime"}
    assert set(pre["ppetrace.device"]) == {"my_device"}
    # the runtime's own trace() numbered each call of the hook
    assert sorted(pre["my_device.call"].astype(int)) == list(range(1, batches + 1))
    # the Trainer's own spans do not go through the runtime's trace()
    steps = frame[frame["name"] == "trainer.step"]
    assert len(steps) == batches and steps["my_device.call"].isna().all()
    assert "runtime.convert_batch" in capsys.readouterr().out


def test_custom_runtime_moves_batches_to_float32() -> None:
    import torch

    example = load("custom_runtime.py")
    runtime = example.MyDeviceRuntime("my_device", None)
    x = torch.zeros(2, dtype=torch.float64)
    labels = torch.zeros(2, dtype=torch.int64)
    moved = runtime.convert_batch({"x": x, "labels": labels})
    assert moved["x"].dtype == torch.float32 and moved["labels"].dtype == torch.int64


def test_ci_bench_step_twice_then_compare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step = load("ci/bench_step.py")
    base, cand = tmp_path / "base.json", tmp_path / "cand.json"
    for out in (base, cand):
        argv = ["--out", str(out), "--steps", "12", "--hidden", "16", "--warmup-steps", "2"]
        assert step.main(argv) == 0
        assert len(read_chrome_trace(out).query("name == 'trainer.step'")) == 12
    comment = tmp_path / "comment.md"
    code = cli.main(
        ["compare", str(base), str(cand), "--warmup", "2", "--format", "md", "--output",
         str(comment)]
    )  # fmt: skip
    assert code in (0, 1)  # 1 would be a (noise) regression; 2 would be bad input
    text = comment.read_text()
    assert text.startswith("### ppetrace compare")
    assert "| `trainer.step` | gated |" in text
    capsys.readouterr()


def test_ci_bench_step_rejects_zero_steps(capsys: pytest.CaptureFixture[str]) -> None:
    step = load("ci/bench_step.py")
    with pytest.raises(SystemExit) as exc:
        step.main(["--steps", "0"])
    assert exc.value.code == 2
    assert "expected a positive integer, but received '0'" in capsys.readouterr().err
