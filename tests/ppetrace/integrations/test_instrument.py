"""ppetrace.instrument(): the spans of a hand-written loop, its steps, and a clean close."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import torch.utils.data.dataloader as dl
from torch import nn
from torch.optim import optimizer as optim_mod

import ppetrace
from exporters import event_samples, load_chrome_trace, read_chrome_trace, render, step_report
from ppetrace.integrations import Instrumentation
from ppetrace.tracing import ENVIRONMENT_FIELDS

Loader = Callable[..., Any]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


def _train(model: nn.Module, loader: Any, opt: torch.optim.Optimizer, accumulate: int = 1) -> None:
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(x), y) / accumulate
        loss.backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()


def _summed_loss_epochs(model: nn.Module, loader: Any, opt: torch.optim.Optimizer) -> None:
    """Two epochs of accumulation over a summed loss: one backward per group of 4 batches."""
    for _ in range(2):
        total: Any = 0
        for i, (x, y) in enumerate(loader):
            total = total + nn.functional.cross_entropy(model(x), y)
            if (i + 1) % 4 == 0:
                total.backward()
                opt.step()
                opt.zero_grad()
                total = 0


def _frame(path: Path) -> pd.DataFrame:
    return read_chrome_trace(path)


def _names(frame: pd.DataFrame, name: str) -> pd.DataFrame:
    return frame[frame["name"] == name].sort_values("start_ns")


def test_a_plain_loop_gives_fetch_forward_backward_optimizer_and_step_spans(
    tmp_path: Path, make_loader: Loader
) -> None:
    model, data = _model(), make_loader(32, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        for _ in range(2):
            _train(model, data, opt)
    assert isinstance(handle, Instrumentation) and handle.closed
    assert (handle.steps, handle.global_step, handle.epoch) == (8, 8, 2)
    # the environment, as the Trainer records it (report lines, compare --strict-env)
    environment = load_chrome_trace(tmp_path / "t.json").metadata["environment"]
    assert tuple(environment) == ENVIRONMENT_FIELDS and environment["device"] == "cpu"
    assert environment["torch_threads"] == torch.get_num_threads()
    frame = _frame(tmp_path / "t.json")
    counts = frame["name"].value_counts()
    assert counts["trainer.fetch_batch"] == 2 * 4
    # each epoch: iter(loader), and the wait that found the loader's end
    assert counts["trainer.loader_start"] == counts["trainer.loader_end"] == 2
    for name in ("module.forward", "trainer.backward", "trainer.optimizer_step", "trainer.step"):
        assert counts[name] == 8, name
    forward = _names(frame, "module.forward")
    assert set(forward["ppetrace.module"]) == {"Sequential"}  # the outermost module only
    steps = _names(frame, "trainer.step")
    assert list(steps["step"]) == list(range(8))
    assert list(steps["epoch"]) == [0] * 4 + [1] * 4
    assert list(steps["batch_idx"]) == [0, 1, 2, 3] * 2
    assert set(steps["ppetrace.batch_size"]) == {8} and set(steps["stage"]) == {"train"}
    assert set(_names(frame, "trainer.optimizer_step")["ppetrace.optimizer"]) == {"SGD"}
    # each step starts where its fetch ended and ends with its optimizer step
    fetches = _names(frame, "trainer.fetch_batch")
    handed = fetches[fetches["end_ns"].isin(steps["start_ns"])]
    assert len(handed) == 8
    assert list(steps["end_ns"]) == list(_names(frame, "trainer.optimizer_step")["end_ns"])
    report = step_report(frame, warmup_steps=0)
    assert report.total_steps == 8
    assert list(report.steps["data_wait_ns"]) == list(handed["dur_ns"])


def test_close_restores_every_hook_and_patch_exactly() -> None:
    base = dl._BaseDataLoaderIter
    saved = (
        base.__dict__["__next__"],
        nn.Module.__dict__["__call__"],
        torch.Tensor.__dict__["backward"],
        torch.autograd.backward,
        dl.DataLoader.__dict__["__iter__"],
        dict(optim_mod._global_optimizer_pre_hooks),
        dict(optim_mod._global_optimizer_post_hooks),
    )
    handle = ppetrace.instrument(module_depth=3)
    patched = (base.__dict__["__next__"], nn.Module.__dict__["__call__"])
    assert patched[0] is not saved[0] and patched[1] is not saved[1]
    assert dl.DataLoader.__dict__["__iter__"] is not saved[4]
    assert len(optim_mod._global_optimizer_pre_hooks) == len(saved[5]) + 1
    handle.close()
    handle.close()  # closing twice does nothing
    after = (
        base.__dict__["__next__"],
        nn.Module.__dict__["__call__"],
        torch.Tensor.__dict__["backward"],
        torch.autograd.backward,
        dl.DataLoader.__dict__["__iter__"],
        dict(optim_mod._global_optimizer_pre_hooks),
        dict(optim_mod._global_optimizer_post_hooks),
    )
    assert all(a is b for a, b in zip(after[:5], saved[:5], strict=True))
    assert after[5:] == saved[5:]
    # a wrapper kept by someone (here: the one we hold) calls straight through once closed
    before = ppetrace.stats().recorded
    assert patched[1](nn.Identity(), torch.ones(1)).item() == 1.0
    assert ppetrace.stats().recorded == before


def test_a_second_instrument_raises_until_the_first_is_closed() -> None:
    with ppetrace.instrument():
        with pytest.raises(RuntimeError, match=r"no other active ppetrace.instrument\(\)") as err:
            ppetrace.instrument()
        # it says where the first one was started: this file, that line, its source
        said = str(err.value)
        assert f'"{__file__}", line' in said and "with ppetrace.instrument():" in said
        with pytest.raises(RuntimeError, match="Close it first"), ppetrace.instrument():
            pass
    ppetrace.instrument().close()  # fine once the first one is closed


def test_bad_arguments_are_refused_with_full_sentences() -> None:
    with pytest.raises(ValueError, match=r"non-negative int for module_depth .* but received -1"):
        ppetrace.instrument(module_depth=-1)
    with pytest.raises(
        TypeError, match=r"Expected a str or os.PathLike for trace_path .* but received int 3\."
    ):
        ppetrace.instrument(trace_path=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"profiler 0 \(object\) lacks setup, step_begin"):
        ppetrace.instrument(profilers=[object()])
    if not torch.cuda.is_available():  # a device this machine does not have
        with pytest.raises(ValueError, match=r"device='cuda' and CUDA is not available here"):
            ppetrace.instrument(device="cuda")
        lightning = pytest.importorskip("ppetrace.integrations.lightning")
        with pytest.raises(ValueError, match=r"device='cuda:1' and CUDA is not available here"):
            lightning.LightningProfiler(device="cuda:1")


def test_the_step_an_exception_breaks_off_ends_with_error_status(
    tmp_path: Path, make_loader: Loader
) -> None:
    model, data = _model(), make_loader(32, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(ValueError, match="boom"),
        ppetrace.instrument(trace_path=tmp_path / "t.json"),
    ):
        for i, (x, y) in enumerate(data):
            loss = nn.functional.cross_entropy(model(x), y)
            if i == 2:  # after the forward, before the backward
                raise ValueError("boom")
            loss.backward()
            opt.step()
            opt.zero_grad()
    frame = _frame(tmp_path / "t.json")
    steps = _names(frame, "trainer.step")
    assert list(steps["status"]) == ["UNSET", "UNSET", "ERROR"]
    assert steps["error"].iloc[2].startswith("ValueError: boom")
    # a step cut off is no whole step: the report and compare leave it out, and say so
    report = step_report(frame, warmup_steps=0)
    assert (report.total_steps, report.failed_steps, len(report.steps)) == (3, 1, 2)
    assert "1 failed step excluded (ERROR status" in render(report, "table")
    assert len(event_samples(frame, warmup_steps=0)["trainer.step"]) == 2
    # closed without an exception, a batch that only ran a forward is no step
    handle = ppetrace.instrument(trace_path=tmp_path / "u.json")
    for i, (x, y) in enumerate(data):
        loss = nn.functional.cross_entropy(model(x), y)
        if i == 1:
            break
        loss.backward()
        opt.step()
    handle.close()
    closed = _frame(tmp_path / "u.json")
    assert len(_names(closed, "trainer.step")) == 1
    # nor validation: its loader trained (a forward whose backward never came)
    assert "trainer.validation" not in set(closed["name"])


def test_gradient_accumulation_steps_per_batch_and_counts_optimizer_steps(
    tmp_path: Path, make_loader: Loader
) -> None:
    model, data = _model(), make_loader(48, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        _train(model, data, opt, accumulate=3)
    assert (handle.steps, handle.global_step) == (6, 2)
    frame = _frame(tmp_path / "t.json")
    steps = _names(frame, "trainer.step")
    assert list(steps["step"]) == [0, 0, 0, 1, 1, 1]  # optimizer steps done at the batch start
    fetch_starts = _names(frame, "trainer.fetch_batch")["start_ns"].to_numpy()
    opt_ends = _names(frame, "trainer.optimizer_step")["end_ns"].to_numpy()
    ends = steps["end_ns"].to_numpy()
    # inside a group a step ends where the next fetch begins; at its end, with the optimizer
    assert list(ends[[0, 1, 3, 4]]) == list(fetch_starts[[1, 2, 4, 5]])
    assert list(ends[[2, 5]]) == list(opt_ends)


def test_accumulation_over_a_summed_loss_steps_per_batch_from_the_first_group(
    tmp_path: Path, make_loader: Loader
) -> None:
    """One backward per group of 4 batches, over their summed losses: every batch is a
    step, each with its own fetch as data wait. Before, a batch without a backward was
    evaluation while its loader had not trained (the first group of each epoch) and no
    step at all after that: 8 of 32 steps, and two validations that were not."""
    model, data = _model(), make_loader(128, 8)  # 16 batches
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        _summed_loss_epochs(model, data, opt)
    assert (handle.steps, handle.global_step) == (32, 8)
    frame = _frame(tmp_path / "t.json")
    assert "trainer.validation" not in set(frame["name"])
    steps = _names(frame, "trainer.step")
    assert list(steps["step"]) == [s for s in range(8) for _ in range(4)]
    report = step_report(frame, warmup_steps=0)
    assert len(report.steps) == 32 and report.validation.empty
    fetches = _names(frame, "trainer.fetch_batch")
    assert len(fetches) == 32
    assert report.steps["data_wait_ns"].sum() == fetches["dur_ns"].sum()


def test_accumulation_over_a_summed_loss_with_summarised_steps(
    tmp_path: Path, make_loader: Loader
) -> None:
    """The batches that wait for their group's backward count in the schedule of detailed
    steps where they fall (every 4th step in full, from the 4th), and the aggregates of
    the summarised ones give every step's hooks."""
    model, data = _model(), make_loader(160, 8)  # 20 batches
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    detail = ppetrace.Schedule(wait=3, warmup=0, active=1, repeat=0)
    with ppetrace.instrument(trace_path=tmp_path / "t.json", trace_detail=detail) as handle:
        _summed_loss_epochs(model, data, opt)
    assert (handle.steps, handle.global_step) == (40, 10)
    report = step_report(_frame(tmp_path / "t.json"), warmup_steps=0)
    assert report.detail is not None
    assert (report.detail.detailed, report.detail.summarised) == (10, 30)
    assert [r[1] for r in report.detail.ranges] == list(range(3, 40, 4))
    events = report.events.set_index("event")
    assert events.loc["module.forward", "count"] == 40
    assert events.loc["trainer.backward", "count"] == 10


def test_a_fresh_iterator_each_step_is_an_epoch_each_and_ends_the_step_before(
    tmp_path: Path, make_loader: Loader
) -> None:
    """``next(iter(loader))`` each step: each iterator is an epoch left early, also when
    the loop lets it go at once (ppetrace holds iterators weakly); and the step open when
    the loop calls ``iter()`` ends where ``iter()`` began, so that a validation loader's
    start never lies inside the training step before it."""
    model, train, val = _model(), make_loader(64, 8), make_loader(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        for _ in range(5):
            x, y = next(iter(train))
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        x, y = next(iter(train))
        nn.functional.cross_entropy(model(x), y).backward()  # no optimizer step yet
        with torch.no_grad():
            for x, _y in val:
                model(x)
    assert (handle.steps, handle.epoch) == (6, 5)
    frame = _frame(tmp_path / "t.json")
    steps = _names(frame, "trainer.step")
    assert list(steps["epoch"]) == [0, 1, 2, 3, 4, 5]
    (validation,) = _names(frame, "trainer.validation").itertuples()
    starts = _names(frame, "trainer.loader_start")
    assert len(starts) == 7 and validation.start_ns == starts["start_ns"].iloc[-1]
    assert steps["end_ns"].iloc[-1] == validation.start_ns  # ends where iter(val) began
    assert (steps["end_ns"].to_numpy() <= starts["start_ns"].iloc[1:].to_numpy()).all()


def test_an_evaluation_on_tensors_after_the_optimizer_step_that_forgot_no_grad_is_validation(
    tmp_path: Path, make_loader: Loader
) -> None:
    """A forward with gradients after the batch's optimizer step that no backward follows
    (``model(val_x)`` on tensors, no loader, no ``no_grad``) is an evaluation: a
    ``trainer.validation`` from it to where the batch ends, left out of the next step's
    wall time. Before, it was a training forward between steps (its time in the next
    step's wall, and counted twice in the events table's self column)."""
    model, data = _model(), make_loader(64, 8)  # 8 batches
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    val_x = torch.randn(256, 16)
    with ppetrace.instrument(trace_path=tmp_path / "t.json"):
        for i, (x, y) in enumerate(data):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if i % 4 == 1:
                model(val_x).argmax(1)
    frame = _frame(tmp_path / "t.json")
    steps = _names(frame, "trainer.step")
    validations = _names(frame, "trainer.validation")
    assert len(steps) == 8 and list(validations["step"]) == [2, 6]
    forward = _names(frame, "module.forward")
    report = step_report(frame, warmup_steps=0)
    assert report.validation.set_index("event").loc["module.forward", "count"] == 2
    assert report.events.set_index("event").loc["module.forward", "count"] == 8
    for k, val in zip((1, 5), validations.itertuples(), strict=True):
        (inside,) = forward[
            (forward["start_ns"] >= val.start_ns) & (forward["end_ns"] <= val.end_ns)
        ].itertuples()
        assert val.start_ns == inside.start_ns and val.end_ns > inside.end_ns
        # the step after: its wall leaves the evaluation out
        since = steps["end_ns"].iloc[k + 1] - steps["end_ns"].iloc[k]
        assert report.steps["wall_ns"].iloc[k + 1] == since - val.dur_ns
    # a GAN: the generator's forward after the discriminator's optimizer step trains
    gen, disc = _model(), _model()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (gen, disc)]
    with ppetrace.instrument(trace_path=tmp_path / "g.json"):
        for x, y in data:
            nn.functional.cross_entropy(disc(x), y).backward()
            opts[1].step()
            nn.functional.cross_entropy(gen(x), y).backward()
            opts[0].step()
    assert "trainer.validation" not in set(_frame(tmp_path / "g.json")["name"])


def test_autograd_grad_is_backward_time_but_makes_no_training_step(
    tmp_path: Path, make_loader: Loader
) -> None:
    """``torch.autograd.grad`` (a gradient penalty, input gradients) is a
    ``trainer.backward`` span, in the step's backward part; it does not make an
    evaluation batch a training step."""
    model, train, val = _model(), make_loader(32, 8), make_loader(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        for x, y in train:
            x = x.requires_grad_(True)
            loss = nn.functional.cross_entropy(model(x), y)
            (g,) = torch.autograd.grad(loss, x, create_graph=True)  # a gradient penalty
            (loss + g.pow(2).sum()).backward()
            opt.step()
            opt.zero_grad()
        for x, _y in val:  # input gradients of an evaluation: no training
            x = x.requires_grad_(True)
            torch.autograd.grad(model(x).sum(), x)
    assert handle.steps == 4
    frame = _frame(tmp_path / "t.json")
    assert len(_names(frame, "trainer.backward")) == 4 * 2 + 2
    report = step_report(frame, warmup_steps=0)
    assert len(report.steps) == 4 and len(_names(frame, "trainer.validation")) == 1
    assert report.validation.set_index("event").loc["trainer.backward", "count"] == 2
    backward = _names(frame, "trainer.backward")
    in_steps = backward[backward["end_ns"] <= _names(frame, "trainer.step")["end_ns"].max()]
    assert report.steps["backward_ns"].sum() == in_steps["dur_ns"].sum()


def test_a_grad_enabled_evaluation_loader_without_backward_stays_evaluation(
    tmp_path: Path, make_loader: Loader
) -> None:
    """Forwards with gradients from a loader that never trains (an evaluation loop that
    forgot no_grad) are validation, also when a training loader's batch trains next."""
    model, train, val = _model(), make_loader(32, 8), make_loader(24, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        for x, _y in val:  # before any training
            model(x)
        _train(model, train, opt)
        for x, _y in val:  # after it
            model(x)
        _train(model, train, opt)
        x, _y = next(iter(val))  # one batch: decided when the next batch trains
        model(x)
        _train(model, train, opt)
    assert handle.steps == 12
    frame = _frame(tmp_path / "t.json")
    # each with the optimizer steps done when it ended, not when it was found to be one
    validations = _names(frame, "trainer.validation")
    assert list(validations["step"]) == [0, 4, 8]
    # and from its loader's iter() (val, train, val, train, val, train), also the one
    # whose iterator the loop let go at once
    starts = _names(frame, "trainer.loader_start")["start_ns"]
    assert list(validations["start_ns"]) == list(starts.iloc[[0, 2, 4]])
    assert len(step_report(frame, warmup_steps=0).steps) == 12


@pytest.mark.parametrize("no_grad", [True, False])
def test_an_evaluation_loaders_start_is_the_validations_with_or_without_no_grad(
    tmp_path: Path, make_loader: Loader, no_grad: bool
) -> None:
    """The evaluation loader's iter() (its workers' start-up) is validation time, as its
    end is, whether the evaluation runs under no_grad or forgot it. Before, without
    no_grad, it counted in the training table instead."""
    model, train, val = _model(), make_loader(32, 8), make_loader(24, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json"):
        for _ in range(2):
            _train(model, train, opt)
            with torch.set_grad_enabled(not no_grad):
                for x, _y in val:
                    model(x)
    frame = _frame(tmp_path / "t.json")
    validations = _names(frame, "trainer.validation")
    starts = _names(frame, "trainer.loader_start")
    assert len(validations) == 2 and len(starts) == 4  # train, val, train, val
    assert list(validations["start_ns"]) == list(starts["start_ns"].iloc[[1, 3]])
    report = step_report(frame, warmup_steps=0)
    val_events = report.validation.set_index("event")
    assert val_events.loc["trainer.loader_start", "count"] == 2
    assert report.events.set_index("event").loc["trainer.loader_start", "count"] == 2


def test_a_loop_without_a_dataloader_steps_once_per_optimizer_step(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        for _ in range(5):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():  # evaluation after training, no DataLoader either
            model(x)
    assert handle.steps == 5
    frame = _frame(tmp_path / "t.json")
    steps = _names(frame, "trainer.step")
    first_forward = _names(frame, "module.forward")["start_ns"].iloc[0]
    assert steps["start_ns"].iloc[0] <= first_forward  # the first step starts with the training
    assert _names(frame, "module.forward")["end_ns"].iloc[0] < steps["end_ns"].iloc[0]
    # later steps start where the previous one ended: they tile the loop
    assert list(steps["start_ns"].iloc[1:]) == list(steps["end_ns"].iloc[:-1])
    assert list(steps["end_ns"]) == list(_names(frame, "trainer.optimizer_step")["end_ns"])
    val = _names(frame, "trainer.validation")
    assert len(val) == 1 and val["start_ns"].iloc[0] >= steps["end_ns"].iloc[-1]
    assert list(_names(frame, "module.forward")["stage"].fillna("")) == [""] * 5 + ["val"]


def test_evaluation_between_epochs_is_val_and_left_out_of_step_time(
    tmp_path: Path, make_loader: Loader
) -> None:
    model, train, val = _model(), make_loader(32, 8), make_loader(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json", module_depth=2) as handle:
        for _ in range(2):
            _train(model, train, opt)
            model.eval()
            with torch.inference_mode():
                for x, _y in val:
                    model(x)
            model.train()
    assert handle.steps == 8
    frame = _frame(tmp_path / "t.json")
    forward = frame[frame["name"] == "module.forward"]
    val_fwd = forward[forward["stage"] == "val"]
    assert len(val_fwd) == 2 * 2 * 4  # 2 epochs x 2 batches x (Sequential and its 3 layers)
    assert set(val_fwd["ppetrace.module"]) == {
        "Sequential",
        "Sequential.0",
        "Sequential.1",
        "Sequential.2",
    }
    assert forward["stage"].isna().sum() == 8 * 4
    validations = _names(frame, "trainer.validation")
    assert len(validations) == 2 and set(validations["stage"]) == {"val"}
    # the optimizer steps done when each validation ended, not when the next step was recorded
    assert list(validations["step"]) == [4, 8]
    report = step_report(frame, warmup_steps=0)
    steps = report.steps
    # the step after the first validation does not count it as its own time, nor the
    # loaders' ends and starts between the epochs
    since = steps["end_ns"].iloc[4] - steps["end_ns"].iloc[3]
    first = validations.iloc[0]
    outside = frame[
        frame["name"].isin(["trainer.validation", "trainer.loader_start", "trainer.loader_end"])
        & (frame["start_ns"] >= steps["end_ns"].iloc[3])
        & (frame["end_ns"] <= steps["start_ns"].iloc[4])
        & ~(  # not the val loader's end, inside the validation (nested by time)
            (frame["name"] != "trainer.validation")
            & (frame["start_ns"] >= first["start_ns"])
            & (frame["end_ns"] <= first["end_ns"])
        )
    ]
    assert set(outside["name"]) == {
        "trainer.validation",
        "trainer.loader_start",
        "trainer.loader_end",
    }
    assert steps["wall_ns"].iloc[4] == since - outside["dur_ns"].sum()
    # the validation holds the evaluation batches' fetches, down to the loader's end
    inside = frame[frame["start_ns"].between(first["start_ns"], first["end_ns"])]
    assert (inside["name"] == "trainer.fetch_batch").sum() == 2
    # and its start: iter(val), the first thing in it
    (begun,) = inside.loc[inside["name"] == "trainer.loader_start", "start_ns"]
    assert begun == first["start_ns"]
    (end,) = inside.loc[inside["name"] == "trainer.loader_end", "end_ns"]
    assert end == validations["end_ns"].iloc[0]
    # validation is reported apart from the training steps, with its forwards
    assert "trainer.validation" not in set(report.events["event"])
    val_events = report.validation.set_index("event")
    assert val_events.loc["trainer.validation", "count"] == 2
    # the model's calls, and each submodule's as an event of its own
    assert val_events.loc["module.forward", "count"] == 2 * 2
    for part in ("Sequential.0", "Sequential.1", "Sequential.2"):
        assert val_events.loc[f"module.forward [{part}]", "count"] == 2 * 2


def test_submodule_forwards_are_events_of_their_own_in_the_report_and_compare(
    tmp_path: Path, make_loader: Loader
) -> None:
    """With module_depth=2 the submodules' module.forward spans run inside the model's:
    under one name, the report's inclusive total and compare's per-step sum counted their
    time twice."""
    model, loader = _model(), make_loader(48, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json", module_depth=2):
        _train(model, loader, opt)
    frame = _frame(tmp_path / "t.json")
    forward = frame[frame["name"] == "module.forward"]
    outer = forward[forward["ppetrace.module"] == "Sequential"]
    assert len(outer) == 6 and len(forward) == 6 * 4
    report = step_report(frame, warmup_steps=0)
    events = report.events.set_index("event")
    assert events.loc["module.forward", "count"] == 6
    assert events.loc["module.forward", "total_ns"] == outer["dur_ns"].sum()
    parts = [f"module.forward [Sequential.{i}]" for i in range(3)]
    for part in parts:
        assert events.loc[part, "count"] == 6
    # the parts lie inside the model's calls; the forward share is every call's self time
    assert events.loc[parts, "total_ns"].sum() <= events.loc["module.forward", "total_ns"]
    assert (
        events.loc[["module.forward", *parts], "self_ns"].sum() == report.steps["forward_ns"].sum()
    )
    samples = event_samples(frame, warmup_steps=0)
    assert sorted(samples["module.forward"]) == sorted(outer["dur_ns"])
    for part in parts:
        assert len(samples[part]) == 6


def test_a_validation_after_an_epochs_last_step_leaves_the_training_loaders_end_out(
    tmp_path: Path, make_loader: Loader
) -> None:
    # validation inside the loop, after the last batch's step: then the training loader
    # finds its end, which is no part of the validation
    model, train, val = _model(), make_loader(32, 8), make_loader(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json"):
        for i, (x, y) in enumerate(train):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if i == 3:  # the last of 4 batches
                with torch.no_grad():
                    for vx, _vy in val:
                        model(vx)
    frame = _frame(tmp_path / "t.json")
    (validation,) = _names(frame, "trainer.validation").itertuples()
    ends = _names(frame, "trainer.loader_end")
    inside = ends["end_ns"] <= validation.end_ns
    assert inside.sum() == 1  # the evaluation loader's end, not the training loader's
    assert validation.end_ns == ends.loc[inside, "end_ns"].iloc[0]
    assert ends.loc[~inside, "start_ns"].iloc[0] >= validation.end_ns


def test_an_evaluation_loop_without_no_grad_is_validation_not_the_next_steps_time(
    tmp_path: Path, make_loader: Loader
) -> None:
    # forwards with gradients enabled but no backward after them: evaluation that forgot
    # torch.no_grad(); before, they were the next training step's forward time
    model, train, val = _model(), make_loader(32, 8), make_loader(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        for _ in range(2):
            _train(model, train, opt)
            model.eval()
            for x, _y in val:
                model(x).argmax(1)
            model.train()
    assert handle.steps == 8
    frame = _frame(tmp_path / "t.json")
    validations = _names(frame, "trainer.validation")
    assert len(validations) == 2
    report = step_report(frame, warmup_steps=0)
    # the steps' forwards are their own: one per step, none of the evaluation's
    assert report.events.set_index("event").loc["module.forward", "count"] == 8
    assert report.validation.set_index("event").loc["module.forward", "count"] == 2 * 2


def test_an_inference_script_gets_forward_and_fetch_spans_and_no_steps(
    tmp_path: Path, make_loader: Loader
) -> None:
    model, data = _model(), make_loader(32, 8)
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle, torch.no_grad():
        for x, _y in data:
            model(x)
    assert handle.steps == 0
    frame = _frame(tmp_path / "t.json")
    assert set(frame["name"]) == {
        "trainer.loader_start",
        "trainer.fetch_batch",
        "module.forward",
        "trainer.loader_end",
    }
    assert set(_names(frame, "module.forward")["stage"]) == {"val"}
    report = step_report(frame)
    assert report.total_steps == 0 and report.events["count"].sum() == 1 + 4 + 1
    # the no_grad forwards are evaluation: reported apart, as validation
    assert report.validation.set_index("event").loc["module.forward", "count"] == 4


def test_a_no_grad_forward_inside_a_training_step_is_not_val(
    tmp_path: Path, make_loader: Loader
) -> None:
    student, teacher, data = _model(), _model(), make_loader(24, 8)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    # no scheduled flush in the middle: the first batch's tag is taken back when its step
    # ends, which a flush between the forward and the step's end would come before
    ppetrace.configure(flush_interval=3600.0)
    try:
        with ppetrace.instrument(trace_path=tmp_path / "t.json"):
            for x, _y in data:
                with torch.no_grad():
                    target = teacher(x).softmax(-1)  # before the student's forward
                nn.functional.cross_entropy(student(x), target).backward()
                opt.step()
                opt.zero_grad()
    finally:
        ppetrace.configure()
    frame = _frame(tmp_path / "t.json")
    assert frame["stage"].isin(["val"]).sum() == 0
    assert len(_names(frame, "trainer.validation")) == 0
    assert len(_names(frame, "trainer.step")) == 3


def test_module_depth_names_submodules_by_their_dotted_path(
    tmp_path: Path, make_loader: Loader
) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 8), nn.ReLU())
            self.head = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    model, (x, _y) = Net(), next(iter(make_loader(8, 8)))
    for depth, expected in (
        (0, set()),
        (1, {"Net"}),
        (2, {"Net", "Net.body", "Net.head"}),
        (3, {"Net", "Net.body", "Net.head", "Net.body.0", "Net.body.1"}),
    ):
        path = tmp_path / f"t{depth}.json"
        with ppetrace.instrument(trace_path=path, module_depth=depth):
            model(x)
        frame = _frame(path) if path.stat().st_size > 200 else pd.DataFrame({"name": []})
        got = (
            set(frame.loc[frame["name"] == "module.forward", "ppetrace.module"])
            if len(frame)
            else set()
        )
        assert got == expected, depth


def test_the_trainer_takes_precedence_so_nothing_is_traced_twice(
    tmp_path: Path, make_loader: Loader
) -> None:
    model, data = _model(), make_loader(32, 8)
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        trainer = ppetrace.Trainer(max_epochs=1, progress=False, val_every_n_epochs=None)
        trainer.fit(
            model,
            data,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=nn.functional.cross_entropy,
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train(model, data, opt)  # after the Trainer, the hooks trace again
    frame = _frame(tmp_path / "t.json")
    counts = frame["name"].value_counts()
    assert counts["module.train_step"] == 4  # the Trainer's own spans
    assert counts["trainer.step"] == 4 + 4 and handle.steps == 4
    assert counts["trainer.fetch_batch"] == 4 + 4  # a sized loader: the Trainer stops at 4
    assert counts["trainer.loader_start"] == counts["trainer.loader_end"] == 1 + 1
    assert counts["module.forward"] == 4  # from the hand loop only
    assert counts["trainer.backward"] == 4 + 4


def test_workers_forked_or_spawned_run_under_instrument(
    tmp_path: Path, make_loader: Loader
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for method in ("fork", "spawn"):
        data = make_loader(32, 8, num_workers=1, multiprocessing_context=method)
        path = tmp_path / f"{method}.json"
        with ppetrace.instrument(trace_path=path) as handle:
            _train(model, data, opt)
        assert handle.steps == 4, method
        counts = _frame(path)["name"].value_counts()
        assert counts["trainer.fetch_batch"] == 4 and counts["trainer.loader_end"] == 1, method


def test_a_break_shuts_the_workers_down_inside_loader_end(
    tmp_path: Path, make_loader: Loader
) -> None:
    """A loop that leaves an epoch with ``break`` lets its iterator go: the workers'
    shutdown (the iterator's ``__del__``) is ``trainer.loader_end``, not untraced time
    outside every span. Once per iterator: not again at its end."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = make_loader(64, 8, num_workers=1, multiprocessing_context="fork")
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        for _ in range(2):
            for i, (x, y) in enumerate(data):
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                if i == 2:
                    break
        _train(model, data, opt)  # a whole epoch: its end is the fetch that finds it
    assert handle.steps == 3 + 3 + 8
    frame = _frame(tmp_path / "t.json")
    ends = _names(frame, "trainer.loader_end")
    assert len(ends) == 3
    steps = _names(frame, "trainer.step")
    # the first two: after the third step of their epoch, before the loop went on
    for k, end in enumerate(ends.iloc[:2].itertuples()):
        assert end.start_ns >= steps["end_ns"].iloc[3 * k + 2]
        assert end.end_ns <= steps["start_ns"].iloc[3 * k + 3]
        # and not inside the next epoch's first fetch (its data wait): the iterator was let
        # go at the break, not kept alive by ppetrace until then
        (first,) = _names(frame, "trainer.loader_start")["start_ns"].iloc[[k + 1]]
        assert end.end_ns <= first
    # the hook is gone with close(): a shutdown after it is not traced
    it = iter(data)
    next(it)
    del it
    assert len(_names(_frame(tmp_path / "t.json"), "trainer.loader_end")) == 3


def test_torch_compile_gives_the_same_graphs_with_and_without_instrument() -> None:
    torch._dynamo.reset()

    def compiled_graphs(instrumented: bool) -> int:
        graphs: list[int] = []

        def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
            graphs.append(len(gm.graph.nodes))
            return gm.forward

        torch._dynamo.reset()
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        handle = ppetrace.instrument(module_depth=3) if instrumented else None
        try:
            fast = torch.compile(model, backend=backend)
            for _ in range(3):
                nn.functional.cross_entropy(fast(x), y).backward()
                opt.step()
                opt.zero_grad()
        finally:
            if handle is not None:
                handle.close()
        return len(graphs)

    plain = compiled_graphs(False)
    assert plain >= 1
    assert compiled_graphs(True) == plain


def test_a_compiled_module_is_traced_from_outside_under_its_own_name(tmp_path: Path) -> None:
    torch._dynamo.reset()
    model = _model()
    fast = torch.compile(model, backend="eager")
    with ppetrace.instrument(trace_path=tmp_path / "t.json", module_depth=3):
        for _ in range(2):
            fast(torch.randn(4, 16))
    frame = _frame(tmp_path / "t.json")
    assert list(frame.loc[frame["name"] == "module.forward", "ppetrace.module"]) == [
        "Sequential",
        "Sequential",
    ]


def test_a_failure_in_the_bookkeeping_never_breaks_the_loop(
    tmp_path: Path, make_loader: Loader, caplog: pytest.LogCaptureFixture
) -> None:
    model, data = _model(), make_loader(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        tracker = handle._tracker

        def broken(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("bookkeeping bug")

        tracker.prepare = broken  # type: ignore[method-assign]
        tracker.optimizer_end = broken  # type: ignore[method-assign]
        seen = []
        for x, y in data:
            seen.append(len(x))
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert seen == [8, 8]  # every batch went through, every step ran
    assert "the DataLoader hook of instrument() failed" in caplog.text
    assert "the optimizer step hook of instrument() failed" in caplog.text
    counts = _frame(tmp_path / "t.json")["name"].value_counts()
    assert counts["trainer.fetch_batch"] == 2 and counts["trainer.loader_end"] == 1


def test_evaluation_after_the_optimizer_step_without_a_loader_is_val(
    tmp_path: Path, make_loader: Loader
) -> None:
    """A no_grad forward on fixed tensors after a batch's optimizer step lies outside the
    step: it is val, and a validation between steps."""
    model, data = _model(), make_loader(24, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = torch.randn(4, 16)
    with ppetrace.instrument(trace_path=tmp_path / "t.json"):
        for x, y in data:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model(probe)
    frame = _frame(tmp_path / "t.json")
    forward = _names(frame, "module.forward")
    assert list(forward["stage"].fillna("")) == ["", "val"] * 3
    steps = _names(frame, "trainer.step")
    validations = _names(frame, "trainer.validation")
    assert len(validations) == 3  # between the steps, and after the last one
    assert (validations["start_ns"].to_numpy() >= steps["end_ns"].to_numpy()).all()


class _Recording:
    """A profiler that records its hook calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def setup(self, trainer: Any) -> None:
        self.calls.append(("setup", -1))

    def step_begin(self, step: int) -> None:
        self.calls.append(("begin", step))

    def step_end(self, step: int) -> None:
        self.calls.append(("end", step))

    def teardown(self) -> None:
        self.calls.append(("teardown", -1))


class _TransformedData(torch.utils.data.Dataset[Any]):
    """Samples passed through a module (a transform) while the loader fetches them."""

    def __init__(self) -> None:
        self.transform = nn.Linear(16, 16)

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(torch.ones(16)).detach(), torch.tensor(i % 4)


def test_profilers_step_once_per_batch_even_with_modules_inside_the_loader(
    tmp_path: Path,
) -> None:
    model, prof = _model(), _Recording()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.DataLoader(_TransformedData(), batch_size=8)
    with ppetrace.instrument(trace_path=tmp_path / "t.json", profilers=[prof]) as handle:
        for _ in range(2):
            _train(model, data, opt)
    assert handle.steps == 4
    assert prof.calls == [("setup", -1)] + [
        (kind, i) for i in range(4) for kind in ("begin", "end")
    ] + [("teardown", -1)]
    forward = _names(_frame(tmp_path / "t.json"), "module.forward")
    assert (forward["ppetrace.module"] == "Linear").sum() == 2 * 16  # the transform, traced


class _Stream(torch.utils.data.IterableDataset[Any]):
    """An iterable dataset: its iterator's end is known only when it is found."""

    def __iter__(self) -> Any:
        return iter((torch.ones(16), torch.tensor(i % 4)) for i in range(16))


def test_with_profilers_the_call_that_finds_a_map_style_loaders_end_is_loader_end(
    tmp_path: Path, make_loader: Loader
) -> None:
    # profilers step around each batch, so the fetch is a span named before it runs:
    # a map-style loader's end is known from its count, an iterable one's is not
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mapped = make_loader(32, 8)  # 4 batches
    stream = torch.utils.data.DataLoader(_Stream(), batch_size=8)  # 2 batches
    # per loader, over two epochs: steps, loader_end spans, fetch_batch spans
    for data, steps, ends, fetches in ((mapped, 8, 2, 8), (stream, 4, 0, 4 + 2)):
        path = tmp_path / "t.json"
        with ppetrace.instrument(trace_path=path, profilers=[_Recording()]) as handle:
            for _ in range(2):
                _train(model, data, opt)
        counts = _frame(path)["name"].value_counts()
        assert handle.steps == handle.global_step == steps
        assert counts.get("trainer.loader_end", 0) == ends, data.dataset
        assert counts["trainer.fetch_batch"] == fetches, data.dataset
        # the end's wait is no step's data wait: the report counts every step's fetch once
        report = step_report(_frame(path), warmup_steps=0)
        assert report.total_steps == handle.steps


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "persistent-worker"])
def test_an_epoch_left_early_ends_when_the_loader_is_iterated_again(
    tmp_path: Path, make_loader: Loader, workers: int
) -> None:
    # a loop that stops each epoch after two batches (break): no fetch finds the end,
    # so the epoch ends when the loop asks the loader for its next iterator (with
    # persistent workers, the same iterator object again)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"num_workers": 1, "persistent_workers": True} if workers else {}
    data = make_loader(32, 8, **options)
    with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
        for _ in range(3):
            for i, (x, y) in enumerate(data):
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                if i == 1:
                    break
        left_early = handle.epoch
        for x, y in data:  # a whole epoch after them: its end is found
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert left_early == 2  # the third epoch is still open: nothing iterated the loader since
    assert handle.epoch == 4 and handle.steps == 3 * 2 + 4
    steps = _names(_frame(tmp_path / "t.json"), "trainer.step")
    assert steps["epoch"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 3, 3]


TRAINER_AFTER_INSTRUMENT = """
import sys
import torch
from torch import nn
import ppetrace

handle = ppetrace.instrument(trace_path=sys.argv[1])
assert "ppetrace.training" not in sys.modules  # the Trainer comes after the hooks
from ppetrace import Trainer

torch.manual_seed(0)
net = nn.Linear(4, 2)
batches = [(torch.randn(2, 4), torch.randint(0, 2, (2,))) for _ in range(3)]
Trainer(max_epochs=1, progress=False, val_every_n_epochs=None).fit(
    net,
    batches,  # a list, not a DataLoader: no fetch hook runs to find the Trainer
    optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
    loss_fn=nn.functional.cross_entropy,
)
handle.close()
print(handle.steps)
"""


def test_a_trainer_imported_after_instrument_is_not_traced_twice(tmp_path: Path) -> None:
    script, path = tmp_path / "late.py", tmp_path / "t.json"
    script.write_text(TRAINER_AFTER_INSTRUMENT)
    done = subprocess.run(
        [sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"]  # the hooks counted no step of their own
    counts = _frame(path)["name"].value_counts()
    for name in ("trainer.step", "trainer.backward", "trainer.optimizer_step"):
        assert counts[name] == 3, name


def test_under_torchrun_each_rank_writes_its_own_file(
    tmp_path: Path, make_loader: Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, data = _model(), make_loader(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        with ppetrace.instrument(trace_path=tmp_path / "t.json") as handle:
            _train(model, data, opt)
        assert handle.trace_path == tmp_path / "t.ranks" / f"rank{rank}.json"
        assert _frame(handle.trace_path)["name"].value_counts()["trainer.step"] == 2
    assert not (tmp_path / "t.json").exists()


def test_closing_gives_the_step_buffers_back_and_keeps_their_rows(
    tmp_path: Path, make_loader: Loader
) -> None:
    from ppetrace.tracing._recorder import RECORDER

    def buffers() -> int:
        with RECORDER._buffers_lock:
            return len(RECORDER._buffers)

    ppetrace.flush()
    before = buffers()
    model, data = _model(), make_loader(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        with ppetrace.instrument(trace_path=tmp_path / f"t{i}.json"):
            _train(model, data, opt)
        assert len(_names(_frame(tmp_path / f"t{i}.json"), "trainer.step")) == 2
    ppetrace.flush()
    assert buffers() == before


class _Boom(nn.Module):
    """Raises in forward on the second call, or (``grad``) in backward on the second."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.lin, self.where, self.calls = nn.Linear(16, 4), where, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.where == "forward" and self.calls == 2:
            raise ValueError("bad batch 2")
        out = self.lin(x)
        if self.where == "backward" and self.calls == 2:
            out = _FailingGrad.apply(out)
        return out


class _FailingGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad gradient 2")


@pytest.mark.parametrize(
    ("where", "name", "text"),
    [
        ("forward", "module.forward", "bad batch 2"),
        ("backward", "trainer.backward", "bad gradient 2"),
    ],
)
def test_a_forward_or_backward_that_raises_leaves_an_error_span_and_the_exception(
    tmp_path: Path, make_loader: Loader, where: str, name: str, text: str
) -> None:
    model, data = _Boom(where), make_loader(32, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=text), ppetrace.instrument(trace_path=tmp_path / "t.json"):
        _train(model, data, opt)
    spans = _names(_frame(tmp_path / "t.json"), name)
    assert list(spans["status"]) == ["UNSET", "ERROR"]  # the first call, then the one that raised
    failed = spans.iloc[1]
    assert text in failed["error"] and "ValueError" in failed["error"]
    assert failed["end_ns"] >= failed["start_ns"] > spans.iloc[0]["end_ns"]
