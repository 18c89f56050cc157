"""The profilers driven by the real Trainer: one trace with every CPU track, and resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import ppetrace
from exporters.chrome import load_chrome_trace, read_chrome_trace
from ppetrace.profilers import CudaTimer, Pyinstrument, Schedule, SystemCounters, TorchProfiler
from ppetrace.profilers._base import DEVICE_TID, PYTHON_TID, TORCH_TID_BASE


def _setup() -> tuple[torch.nn.Module, torch.utils.data.DataLoader[Any], torch.optim.Optimizer]:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 16), torch.randn(48, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, loader, torch.optim.SGD(model.parameters(), lr=0.05)


def _ns(ts: float) -> int:
    return round(ts * 1000)


def test_a_trainer_run_has_hooks_stacks_ops_and_counters_on_one_clock(tmp_path: Path) -> None:
    schedule = Schedule(wait=1, warmup=1, active=2)
    pyi = Pyinstrument(interval=0.0005, schedule=schedule, output_dir=tmp_path / "prof")
    torch_prof = TorchProfiler(schedule=schedule, output_dir=tmp_path / "prof")
    counters = SystemCounters(schedule=schedule)
    trainer = ppetrace.Trainer(
        device="cpu",
        max_epochs=1,
        profilers=[pyi, torch_prof, CudaTimer(), counters],
        progress=False,
        trace_path=tmp_path / "trace.json",
    )
    model, loader, opt = _setup()
    trainer.fit(model, loader, optimizer=opt, loss_fn=torch.nn.functional.mse_loss)
    trace = load_chrome_trace(tmp_path / "trace.json")
    events = trace.events
    assert trace.metadata["service_name"]  # the spans' header came first

    steps = {
        e["attrs"]["ppetrace.batch_idx"]: (_ns(e["ts"]), _ns(e["ts"] + e["dur"]))
        for e in events
        if e.get("name") == "trainer.step" and "span_id" in e
    }
    assert sorted(steps) == list(range(6))

    # torch.profiler: every operator of a recorded step lies inside that step's span
    error = torch_prof.windows[0].info["alignment_error_ns"]
    ops = [
        e
        for e in events
        if e.get("ph") == "X"
        and str(e.get("name")).startswith("aten::linear")
        and e.get("tid", 0) >= TORCH_TID_BASE
    ]
    owners = set()
    for e in ops:
        start, end = _ns(e["ts"]), _ns(e["ts"] + e["dur"])
        inside = [b for b, (s, t) in steps.items() if s - error <= start and end <= t + error]
        assert len(inside) == 1, (start, end, steps)
        owners.add(inside[0])
    assert owners == {2, 3}

    # pyinstrument: the sampled track exists and sits inside its window
    py = [e for e in events if e.get("tid") == PYTHON_TID and e.get("ph") == "X"]
    assert py
    window = pyi.windows[0]
    assert (window.first_step, window.last_step) == (2, 3)
    assert all(window.start_ns - trace.origin_ns <= _ns(e["ts"]) for e in py)
    assert Path(window.files["html"]).exists()
    assert not pyi.top_functions().empty

    # counters: samples at setup, the recorded steps' boundaries and teardown
    frame = counters.counters_frame()
    assert frame["step"].dropna().tolist() == [2, 2, 3, 3, 5]
    assert len([e for e in events if e.get("ph") == "C" and e["name"] == "rss_bytes"]) == len(frame)


def test_after_resume_the_schedule_continues_the_runs_step_count(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = Pyinstrument(schedule=Schedule(skip_first=8, warmup=0, active=2), output_dir=tmp_path)
    model, loader, opt = _setup()
    ppetrace.Trainer(
        device="cpu", max_epochs=1, profilers=[first], progress=False, checkpoint_dir=ckpt
    ).fit(model, loader, optimizer=opt, loss_fn=torch.nn.functional.mse_loss)
    assert first.windows == []  # steps 0-5 are before the window

    resumed = Pyinstrument(schedule=Schedule(skip_first=8, warmup=0, active=2), output_dir=tmp_path)
    model, loader, opt = _setup()
    trainer = ppetrace.Trainer(device="cpu", max_epochs=2, profilers=[resumed], progress=False)
    trainer.fit(
        model,
        loader,
        optimizer=opt,
        loss_fn=torch.nn.functional.mse_loss,
        resume_from=ckpt / "last.pt",
    )
    # the resumed run's steps are 6-11: the window is steps 8-9 of the whole run
    assert [(w.first_step, w.last_step) for w in resumed.windows] == [(8, 9)]


def test_profilers_pass_the_trainers_protocol_check() -> None:
    from ppetrace.training import StepProfiler

    for prof in (Pyinstrument(), TorchProfiler(), CudaTimer(), SystemCounters()):
        assert isinstance(prof, StepProfiler)


class _CountingSource:
    """A fake device: every recorded event is 1 µs after the previous one."""

    def __init__(self) -> None:
        self.events = 0

    def record(self) -> int:
        self.events += 1
        return self.events * 1000

    def query(self, event: int) -> bool:
        return True  # the fake device is never behind

    def elapsed_ns(self, start: int, end: int) -> int:
        return end - start


def test_trainer_spans_carry_device_time_through_the_timer(tmp_path: Path) -> None:
    source = _CountingSource()
    trainer = ppetrace.Trainer(
        device="cpu",
        max_epochs=1,
        val_every_n_epochs=1,
        profilers=[CudaTimer(source=source)],
        progress=False,
        trace_path=tmp_path / "trace.json",
    )
    model, loader, opt = _setup()
    val = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(4, 16), torch.randn(4, 4)), batch_size=2
    )
    trainer.fit(model, loader, val, optimizer=opt, loss_fn=torch.nn.functional.mse_loss)
    frame = read_chrome_trace(tmp_path / "trace.json")
    dev = frame.groupby("name")["device_dur_ns"].agg(list).to_dict()
    # events per step: step start, train_step pair, backward pair, optimizer_step pair, step end
    assert dev["trainer.step"] == [7000.0] * 6
    assert dev["module.train_step"] == [1000.0] * 6
    assert dev["trainer.backward"] == [1000.0] * 6
    assert dev["trainer.optimizer_step"] == [1000.0] * 6
    assert dev["evaluator.step"] == [1000.0] * 2  # module.val_step is not timed
    assert frame.loc[frame["name"] == "trainer.fetch_batch", "device_dur_ns"].isna().all()
    device = [
        e for e in load_chrome_trace(tmp_path / "trace.json").events if e.get("tid") == DEVICE_TID
    ]
    assert len([e for e in device if e.get("ph") == "X"]) == 26


def test_the_report_and_compare_leave_the_profiled_steps_out(tmp_path: Path) -> None:
    from exporters import compare, render, step_report
    from exporters._compare_runs import event_samples

    schedule = Schedule(wait=1, warmup=1, active=2)
    pyi = Pyinstrument(
        interval=0.0005, schedule=schedule, output_dir=tmp_path, html=False, speedscope=False
    )
    torch_prof = TorchProfiler(schedule=schedule, output_dir=tmp_path)  # warmup step 1 too
    path = tmp_path / "trace.json"
    model, loader, opt = _setup()
    ppetrace.Trainer(
        device="cpu", max_epochs=1, profilers=[pyi, torch_prof], progress=False, trace_path=path
    ).fit(model, loader, optimizer=opt, loss_fn=torch.nn.functional.mse_loss)
    frame = read_chrome_trace(path)
    windows = sorted(
        (w["profiler"], w["first_step"], w["last_step"]) for w in frame.attrs["profile_windows"]
    )
    assert windows == [("Pyinstrument", 2, 3), ("TorchProfiler", 1, 3)]
    report = step_report(frame, warmup_steps=1)
    assert (report.total_steps, report.excluded_steps, report.profiled_steps) == (6, 1, 3)
    assert report.steps["batch_idx"].tolist() == [4, 5]  # outside every window
    assert report.profilers == ("Pyinstrument", "TorchProfiler")
    assert (
        "3 profiled steps excluded (inside the windows of Pyinstrument, TorchProfiler, whose "
        "profiling slows steps down; their spans stay in the trace)." in render(report, "table")
    )
    assert len(event_samples(frame, warmup_steps=1)["trainer.step"]) == 2  # compare's too
    notes = compare(frame, frame, warmup_steps=1, min_samples=2).notes
    assert "3 profiled steps of the base and 3 of the candidate are no samples" in " ".join(notes)
    doc = json.loads(render(report, "json"))
    assert doc["profiled_steps"] == 3 and doc["profilers"] == ["Pyinstrument", "TorchProfiler"]
    assert (frame["name"] == "trainer.step").sum() == 6
    # the windows' files were made between steps 3 and 4, in spans of their own, which
    # the step after them does not count (TorchProfiler's take milliseconds)
    saves = frame[frame["name"] == "profiler.save_window"]
    assert sorted(saves["ppetrace.profiler"]) == ["Pyinstrument", "TorchProfiler"]
    after = report.steps.iloc[0]  # batch 4
    assert after["between_ns"] < saves["dur_ns"].max()
    assert (saves["end_ns"] <= after["start_ns"]).all()


def test_a_resumed_runs_window_is_found_by_time_not_by_step_count(tmp_path: Path) -> None:
    from exporters import step_report

    ckpt = tmp_path / "ckpt"
    model, loader, opt = _setup()
    ppetrace.Trainer(device="cpu", max_epochs=1, progress=False, checkpoint_dir=ckpt).fit(
        model, loader, optimizer=opt, loss_fn=torch.nn.functional.mse_loss
    )
    prof = Pyinstrument(schedule=Schedule(skip_first=8, warmup=0, active=2), output_dir=tmp_path)
    model, loader, opt = _setup()
    path = tmp_path / "resumed.json"
    ppetrace.Trainer(
        device="cpu", max_epochs=2, profilers=[prof], progress=False, trace_path=path
    ).fit(
        model,
        loader,
        optimizer=opt,
        loss_fn=torch.nn.functional.mse_loss,
        resume_from=ckpt / "last.pt",
    )
    report = step_report(read_chrome_trace(path), warmup_steps=0)
    # the run's steps 8-9 are the resumed trace's third and fourth
    assert (report.total_steps, report.profiled_steps) == (6, 2)
    assert report.steps["batch_idx"].tolist() == [0, 1, 4, 5]
