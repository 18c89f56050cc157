"""Trainer.print: callbacks write above the progress bar, or plainly without one."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ppetrace


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _fit(trainer: ppetrace.Trainer) -> None:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(24, 8, generator=g), torch.randint(0, 4, (24,), generator=g))
    net = torch.nn.Linear(8, 4)

    class Say(ppetrace.CallbackInterface):
        def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
            trainer.print("step", global_step, "done", file=trainer.progress_stream)

    trainer.callbacks = [Say()]
    trainer.fit(
        net,
        DataLoader(ds, batch_size=8),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss_fn=F.cross_entropy,
    )


def test_print_writes_whole_lines_above_the_bar() -> None:
    stream = Tty()
    trainer = ppetrace.Trainer(max_epochs=1, progress_stream=stream)
    _fit(trainer)
    text = stream.getvalue()
    # tqdm.write clears the bar's line first ("\r" then blanks then "\r"), so each message
    # starts a line of its own; a plain print would land after the bar's text instead
    for step in (1, 2, 3):
        assert f"\rstep {step} done\n" in text
    assert "3/3" in text
    assert trainer._progress_bar is None  # closed with the run


def test_print_is_a_plain_print_without_a_bar(capsys: pytest.CaptureFixture[str]) -> None:
    trainer = ppetrace.Trainer(max_epochs=1, progress=False)
    trainer.print("a", 1, sep="-", end="!\n")
    _fit(trainer)
    out = capsys.readouterr().out
    assert out == "a-1!\nstep 1 done\nstep 2 done\nstep 3 done\n"
