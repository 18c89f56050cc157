"""``ppetrace run --detail all|auto|N --max-trace-bytes BYTES``."""

from __future__ import annotations

import io
import re
import textwrap
from pathlib import Path

import pytest

from exporters import read_chrome_trace
from ppetrace.cli import main

LOOP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = DataLoader(TensorDataset(torch.randn(24, 4), torch.randint(0, 2, (24,))), batch_size=4)
for x, y in data:
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
"""


def _run(tmp_path: Path, *options: str) -> tuple[int, str, Path]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LOOP))
    trace = tmp_path / "t.json"
    err = io.StringIO()
    argv = ["run", "--no-report", "--trace", str(trace), *options, str(script)]
    code = main(argv, stdout=io.StringIO(), stderr=err)
    return code, err.getvalue(), trace


def _summarised(trace: Path) -> list[bool]:
    frame = read_chrome_trace(trace)
    steps = frame[frame["name"] == "trainer.step"].sort_values("start_ns")
    return [isinstance(v, str) for v in steps.get("ppetrace.hooks", [None] * len(steps))]


def test_detail_n_keeps_one_step_in_n_in_full(tmp_path: Path) -> None:
    code, err, trace = _run(tmp_path, "--detail", "3")
    assert code == 0, err
    assert _summarised(trace) == [i % 3 != 2 for i in range(6)]
    detail = read_chrome_trace(trace).attrs["metadata"]["ppetrace.detail"]
    assert detail["policy"] == "schedule" and detail["schedule"]["wait"] == 2


def test_detail_all_and_a_budget(tmp_path: Path) -> None:
    code, err, trace = _run(tmp_path, "--detail", "all")
    assert code == 0, err
    assert _summarised(trace) == [False] * 6
    detail = read_chrome_trace(trace).attrs["metadata"]["ppetrace.detail"]
    assert detail == {"policy": "all", "max_trace_bytes": None, "schedule": None}
    code, err, trace = _run(tmp_path, "--max-trace-bytes", "5000000")
    assert code == 0, err
    detail = read_chrome_trace(trace).attrs["metadata"]["ppetrace.detail"]
    assert detail["policy"] == "auto" and detail["max_trace_bytes"] == 5_000_000


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (("--detail", "some"), "Expected --detail all, auto or a positive integer N"),
        (("--detail", "0"), r"but received '0'\. Pass --detail all"),
        (("--max-trace-bytes", "0"), "expected a positive integer for --max-trace-bytes"),
        (("--detail", "all", "--max-trace-bytes", "1"), "only with --detail auto"),
        (("--detail", "10", "--max-trace-bytes", "1"), "received --detail 10, which does"),
    ],
)
def test_bad_detail_options_are_one_line_errors(
    tmp_path: Path, options: tuple[str, ...], match: str
) -> None:
    code, err, _ = _run(tmp_path, *options)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert re.search(match, err), err
