"""``ppetrace compare`` on runs that failed: a Trainer fit that raised, a script that
crashed under ``ppetrace run``, a trace cut off by a kill. Such a comparison exits 2
(before this, a candidate that crashed at step 50 passed the gate, even as an
improvement), unless ``--allow-failed-runs``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_cli import run
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ppetrace

SCRIPT = """
import sys, torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
fail_at = int(sys.argv[1])
torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(320, 16), torch.randint(0, 4, (320,))), batch_size=8)
model = nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i, (x, y) in enumerate(loader):
    loss = F.cross_entropy(model(x), y)
    if i == fail_at:
        raise RuntimeError("simulated crash")
    loss.backward(); opt.step(); opt.zero_grad()
"""


def _fit(path: Path, fail_at: int | None) -> None:
    """A tiny Trainer fit of 40 steps; ``fail_at``: its loss raises at that call."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(320, 16), torch.randint(0, 4, (320,)))
    model = nn.Linear(16, 4)
    calls = [0]

    def loss_fn(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if calls[0] == fail_at:
            raise RuntimeError("CUDA out of memory (simulated)")
        calls[0] += 1
        return F.cross_entropy(pred, target)

    trainer = ppetrace.Trainer(
        max_epochs=1, progress=False, val_every_n_epochs=None, trace_path=path
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer.fit(model, DataLoader(data, batch_size=8), optimizer=opt, loss_fn=loss_fn)


def test_a_trainer_fit_that_raised_fails_the_gate_unless_allowed(tmp_path: Path) -> None:
    base, cand = tmp_path / "base.json", tmp_path / "cand.json"
    _fit(base, None)
    with pytest.raises(RuntimeError, match="simulated"):
        _fit(cand, 20)
    code, out, err = run("compare", str(base), str(cand))
    assert code == 2
    assert out.startswith("ppetrace compare: a candidate run failed, ")
    assert err.strip().splitlines()[-1] == (
        "ppetrace compare: error: Expected runs that ended without an error, but this one "
        f"failed (candidate: {cand}: 1 trainer.run span, 1 trainer.epoch span, 1 trainer.step "
        "span ended with an error (RuntimeError: CUDA out of memory (simulated))). Steps up to "
        "a failure are no measure of the code's speed, so the comparison is no verdict. Fix "
        "the failure and record the run again, or pass --allow-failed-runs to decide on the "
        "steps they ran."
    )
    code, out, err = run("compare", str(base), str(cand), "--allow-failed-runs", "--format", "json")
    assert code in (0, 1)  # decided on the steps it ran, as any other comparison
    assert list(json.loads(out)["failed_runs"]) == ["candidate"]
    code, _, _ = run("compare", str(cand), str(base))  # a failed baseline, too
    assert code == 2
    assert run("compare", str(base), str(base))[0] == 0


def test_a_script_that_crashed_under_ppetrace_run_fails_the_gate(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    base, cand = tmp_path / "base.json", tmp_path / "cand.json"
    assert run("run", "--trace", str(base), "--no-report", str(script), "-1")[0] == 0
    code, _, err = run("run", "--trace", str(cand), "--no-report", str(script), "25")
    assert code == 1 and "simulated crash" in err
    code, _, err = run("compare", str(base), str(cand))
    assert code == 2
    assert "1 trainer.step span ended with an error (RuntimeError: simulated crash)" in err


def test_a_cut_off_trace_fails_the_gate(tmp_path: Path) -> None:
    base, cut = tmp_path / "base.json", tmp_path / "cut.json"
    _fit(base, None)
    text = base.read_text()
    cut.write_text(text[: int(len(text) * 0.7)])  # a kill in the middle of the file
    code, _, err = run("compare", str(base), str(cut))  # (the reader warns on stderr)
    assert code == 2
    assert "its trace is cut off (the process was killed, or still runs)" in err
