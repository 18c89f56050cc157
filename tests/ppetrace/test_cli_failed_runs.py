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

import exporters
import ppetrace

SCRIPT = """
import sys, threading, torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
mode, at = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
X, Y = torch.randn(320, 16), torch.randint(0, 4, (320,))

class Data(Dataset):
    def __len__(self):
        return 320

    def __getitem__(self, i):
        if mode == "fetch" and i == at * 8:
            raise RuntimeError("simulated bad sample")
        return X[i], Y[i]

model = nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)

def train():
    for i, (x, y) in enumerate(DataLoader(Data(), batch_size=8)):
        if mode == "exit" and i == at:
            sys.exit(int(sys.argv[3]))
        loss = F.cross_entropy(model(x), y)
        if mode == "step" and i == at:
            raise RuntimeError("simulated crash")
        loss.backward(); opt.step(); opt.zero_grad()

if mode == "thread":  # the training thread dies in a fetch; the main thread ends well
    mode = "fetch"
    t = threading.Thread(target=train)
    t.start(); t.join()
else:
    train()
"""

#: mode, its step, the script's exit code, and what compare says of the run (None: clean)
CASES = [
    ("ok", 0, 0, None),
    ("step", 25, 1, "ended with an error (RuntimeError: simulated crash)"),
    ("fetch", 25, 1, "it ended with an error (RuntimeError: simulated bad sample)"),
    ("exit", 25, 3, "it ended with an error (the process exited with code 3)"),
    ("exit", 25, 0, None),
    ("thread", 25, 0, "it ended with an error (a training thread died: RuntimeError"),
]


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


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize(("mode", "at", "code", "said"), CASES)
def test_a_script_that_failed_under_ppetrace_run_fails_the_gate(
    tmp_path: Path, mode: str, at: int, code: int, said: str | None
) -> None:
    """However the script failed (an exception in a step or in the loader, a non-zero
    exit, a training thread that died), the trace says so and compare exits 2; a
    script that ends well, also by sys.exit(0), passes."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    base, cand = tmp_path / "base.json", tmp_path / "cand.json"
    assert run("run", "--trace", str(base), "--no-report", str(script), "ok", "0")[0] == 0
    argv = ["run", "--trace", str(cand), "--no-report", str(script), mode, str(at)]
    if mode == "exit":
        argv.append(str(code))
    assert run(*argv)[0] == code
    failure = exporters.run_failure(exporters.read_chrome_trace(cand))
    if said is None:
        assert failure is None
        assert run("compare", str(base), str(cand))[0] in (0, 1)
        return
    assert failure is not None and said in failure
    got, _, err = run("compare", str(base), str(cand))
    assert got == 2 and said in err


def test_sys_exit_with_a_code_in_an_instrument_block_is_a_failed_run(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    model = nn.Linear(4, 2)
    with pytest.raises(SystemExit), ppetrace.instrument(trace_path=path):
        for _ in range(3):
            model(torch.ones(2, 4)).sum().backward()
        raise SystemExit("stopping early")  # a message: exit status 1, as Python gives
    frame = exporters.read_chrome_trace(path)
    assert exporters.run_failure(frame) == (
        "it ended with an error (the process exited with code 1)"
    )
    with pytest.raises(SystemExit), ppetrace.instrument(trace_path=path):
        raise SystemExit(0)
    assert exporters.run_failure(exporters.read_chrome_trace(path)) is None


def test_a_cut_off_trace_fails_the_gate(tmp_path: Path) -> None:
    base, cut = tmp_path / "base.json", tmp_path / "cut.json"
    _fit(base, None)
    text = base.read_text()
    cut.write_text(text[: int(len(text) * 0.7)])  # a kill in the middle of the file
    code, _, err = run("compare", str(base), str(cut))  # (the reader warns on stderr)
    assert code == 2
    assert "its trace is cut off (the process was killed, or still runs)" in err
    # repaired, or merged with another run's file, it still records a run that was cut off
    assert run("repair", str(cut))[0] == 0
    repaired = tmp_path / "cut.repaired.json"
    json.loads(repaired.read_text())  # strict JSON, for other viewers
    code, _, err = run("compare", str(base), str(repaired))
    assert code == 2 and f"its trace ({cut}) was cut off" in err
    merged = tmp_path / "merged.json"
    assert run("merge", str(merged), str(base), str(cut))[0] == 0
    code, _, err = run("compare", str(base), str(merged))
    assert code == 2 and f"its trace ({cut}) was cut off" in err
