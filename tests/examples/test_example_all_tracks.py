"""Smoke test: examples/all_tracks.py writes a trace with every CPU track, at tiny size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from example_loader import load

import ppetrace
from exporters import load_chrome_trace


def test_all_tracks_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = load("all_tracks")
    try:
        assert example.main(["--tiny", "--out", str(tmp_path), "--device", "cpu"]) == 0
    finally:
        ppetrace.configure()
    out = capsys.readouterr().out
    assert "top_functions" in out and "trainer.step" in out

    trace = load_chrome_trace(tmp_path / "trace.json")
    assert not trace.truncated
    tracks = example.track_names(tmp_path / "trace.json")
    assert "python (sampled)" in tracks
    assert any(t.startswith("torch ops: ") for t in tracks)
    assert {"counter: cpu_percent", "counter: rss_bytes"} <= set(tracks)
    names = {e.get("name") for e in trace.events if e.get("ph") == "X"}
    assert {"trainer.step", "trainer.backward"} <= names  # the hook spans
    assert any(str(n).startswith("aten::") for n in names)  # torch ops
    # schedule(skip_first=2, warmup=1, active=3): the recorded steps are 3-5
    profiles = tmp_path / "trace_profiles"
    assert (profiles / "pyinstrument_steps3-5.html").is_file()
    assert (profiles / "pyinstrument_steps3-5.speedscope.json").is_file()
    assert (profiles / "torch_steps3-5.json").is_file()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_all_tracks_example_on_cuda(tmp_path: Path) -> None:
    example = load("all_tracks")
    try:
        assert example.main(["--tiny", "--out", str(tmp_path), "--device", "cuda"]) == 0
    finally:
        ppetrace.configure()
    tracks = example.track_names(tmp_path / "trace.json")
    assert any(t.startswith("torch GPU") or "stream" in t for t in tracks)
    assert {"counter: cuda_allocated_bytes", "counter: cuda_reserved_bytes"} <= set(tracks)
