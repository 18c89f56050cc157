"""LightningProfiler: a Lightning fit as ppetrace spans, with the Trainer's event names."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("lightning")

import lightning as L

import ppetrace
from exporters import compare, read_chrome_trace, render, step_report, summarize_run
from ppetrace.integrations import _precedence
from ppetrace.integrations.lightning import LightningProfiler, ppetrace_event
from ppetrace.profilers import CudaTimer
from ppetrace.tracing import capture_environment

FORWARD_NS, BACKWARD_NS, OPTIMIZER_NS = 1_000, 10_000, 100_000


class _Module(L.LightningModule):
    def __init__(self, source: Any = None) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.source = source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.source is not None:
            self.source.advance(FORWARD_NS)
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.source is not None:
            self.source.advance(BACKWARD_NS)
        loss.backward(*args, **kwargs)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.source is not None:
            opt.register_step_pre_hook(lambda *_: self.source.advance(OPTIMIZER_NS))
        return opt


def _loader(n: int = 32) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))
    return DataLoader(data, batch_size=4)


def _trainer(profiler: Any, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        profiler=profiler,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        **kwargs,
    )


@pytest.fixture(autouse=True)
def _quiet_lightning() -> Any:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_lightning_actions_map_onto_ppetrace_event_names() -> None:
    assert ppetrace_event("run_training_batch") == "trainer.step"
    assert ppetrace_event("[Strategy]DDPStrategy.training_step") == "module.train_step"
    assert ppetrace_event("[LightningModule]Net.training_step") == "module.train_step"
    assert ppetrace_event("[Strategy]SingleDeviceStrategy.backward") == "trainer.backward"
    assert ppetrace_event("[LightningModule]Net.optimizer_step") == "trainer.optimizer_step"
    assert ppetrace_event("optimizer_step") == "trainer.optimizer_step"
    assert ppetrace_event("[_TrainingEpochLoop].train_dataloader_next") == "trainer.fetch_batch"
    for kept in ("[_EvaluationLoop].val_next", "[Callback]X.backward", "run_training_epoch"):
        assert ppetrace_event(kept) == kept


def test_a_lightning_fit_gives_the_trainer_spans_and_report(tmp_path: Path) -> None:
    profiler = LightningProfiler(tmp_path / "trace.json")
    trainer = _trainer(profiler, max_epochs=2, accumulate_grad_batches=2, limit_val_batches=2)
    # under instrument(), the global hooks stand aside while the profiler traces
    with ppetrace.instrument() as handle:
        trainer.fit(_Module(), _loader(), _loader(16))
        assert _precedence.drivers[0] == 0  # torn down
    assert handle.steps == 0
    assert profiler.trace_paths == [tmp_path / "trace.json"]
    assert (profiler.global_step, profiler.batches, profiler.epoch) == (8, 16, 1)
    frame = read_chrome_trace(tmp_path / "trace.json")
    counts = frame["name"].value_counts()
    assert counts["trainer.step"] == counts["module.train_step"] == 16
    assert counts["trainer.backward"] == 16 and counts["trainer.optimizer_step"] == 8
    assert counts["trainer.fetch_batch"] == 16
    assert counts["trainer.validation"] == 3  # the sanity check and one per epoch
    # from the evaluation loop's first hooks: none of its actions is training time
    report = step_report(frame, warmup_steps=1)
    action = "[LightningModule]_Module.on_validation_model_eval"
    assert action in set(report.validation["event"]) and action not in set(report.events["event"])
    assert "module.forward" not in counts  # instrument()'s hooks stood aside
    steps = frame[frame["name"] == "trainer.step"].sort_values("start_ns")
    assert set(steps["lightning.action"]) == {"run_training_batch"}
    assert list(steps["step"]) == [i // 2 for i in range(16)]
    assert (
        list(steps["batch_idx"]) == list(range(8)) * 2 and list(steps["epoch"]) == [0] * 8 + [1] * 8
    )
    backward = frame[frame["name"] == "trainer.backward"]
    assert set(backward["lightning.action"]) == {"[Strategy]SingleDeviceStrategy.backward"}
    # every other action is a span of its own name
    assert counts["[LightningModule]_Module.on_train_batch_start"] == 16
    report = step_report(frame, warmup_steps=1)
    assert report.total_steps == 16 and len(report.steps) == 15
    assert (report.steps["data_wait_ns"] > 0).all()
    # validation runs inside Lightning's epoch: it is left out of the step after it
    val = frame[frame["name"] == "trainer.validation"].sort_values("start_ns")
    first_val = val.iloc[1]
    ends = steps["end_ns"].to_numpy()
    after = int((ends > first_val["end_ns"]).argmax())
    wall = report.steps.set_index("start_ns").loc[steps["start_ns"].iloc[after], "wall_ns"]
    assert wall < ends[after] - ends[after - 1] - first_val["dur_ns"] + 1
    assert "ppetrace report" in profiler.summary()
    # a later stage writes its own file beside the first
    trainer.test(_Module(), _loader(8))
    assert profiler.trace_paths[-1] == tmp_path / "trace.test.json"
    tested = read_chrome_trace(tmp_path / "trace.test.json")
    assert "[Strategy]SingleDeviceStrategy.test_step" in set(tested["name"])
    # a stage that does not train: every action is test time, none is training time
    assert set(tested["stage"]) == {"test"}
    report = step_report(tested, warmup_steps=0)
    assert report.total_steps == 0 and report.events.empty
    text = render(report, "table")  # no empty training table; one for the evaluation
    assert "No training events: the run did not train" in text
    assert "Training events (" not in text and "Validation and test events (" in text
    assert "[Strategy]SingleDeviceStrategy.test_step" in set(report.validation["event"])
    assert "--warmup" not in profiler.summary() and profiler.summary().endswith("\n")
    # each stage's file says what it ran on, as the Trainer's, and which stage it is
    for path, stage in ((tmp_path / "trace.json", "fit"), (tmp_path / "trace.test.json", "test")):
        metadata = read_chrome_trace(path).attrs["metadata"]
        assert metadata["environment"] == capture_environment(device="cpu")
        assert metadata["ppetrace.stage"] == stage
    # so compare --strict-env of two Lightning runs has environments to compare
    result = compare(summarize_run(frame), summarize_run(frame))
    assert result.environment_recorded and not result.environment_warnings


def test_cuda_timer_gives_device_time_under_the_lightning_profiler(
    tmp_path: Path, fake_source: Any
) -> None:
    timer = CudaTimer(source=fake_source)
    profiler = LightningProfiler(tmp_path / "trace.json", profilers=[timer], report=True)
    _trainer(profiler, max_epochs=1, limit_val_batches=0).fit(_Module(fake_source), _loader(16))
    assert timer.pending == 0
    frame = read_chrome_trace(tmp_path / "trace.json")
    assert "ppetrace step report" in profiler.summary()

    def device(name: str) -> list[float]:
        return list(frame.loc[frame["name"] == name, "device_dur_ns"])

    all_three = FORWARD_NS + BACKWARD_NS + OPTIMIZER_NS
    assert device("trainer.step") == [all_three] * 4
    assert device("module.train_step") == [FORWARD_NS] * 4
    assert device("trainer.backward") == [BACKWARD_NS] * 4
    # Lightning runs training_step and backward inside the optimizer step's closure
    assert device("trainer.optimizer_step") == [all_three] * 4


def test_out_of_order_stops_close_what_was_opened_inside(tmp_path: Path) -> None:
    profiler = LightningProfiler(tmp_path / "t.json")
    profiler.setup("fit")
    profiler.start("outer")
    profiler.start("inner")
    profiler.stop("outer")  # before inner: inner ends with it
    profiler.stop("inner")  # already closed: nothing happens
    profiler.stop("never started")
    profiler.start("left open")
    profiler.teardown("fit")  # closes it
    frame = read_chrome_trace(tmp_path / "t.json")
    spans = frame.set_index("name")
    assert set(spans.index) == {"outer", "inner", "left open"}
    assert spans.loc["inner", "end_ns"] <= spans.loc["outer", "end_ns"]
    assert spans.loc["inner", "parent_id"] == spans.loc["outer", "span_id"]


def test_profile_gives_the_action_and_stops_it_also_when_the_block_raises(
    tmp_path: Path,
) -> None:
    profiler = LightningProfiler(tmp_path / "t.json")
    profiler.setup("fit")
    with profiler.profile("outer") as name:
        assert name == "outer"
        with pytest.raises(ValueError, match="inside"), profiler.profile("inner"):
            raise ValueError("raised inside")
        with profiler.profile("inner"):  # the same action again, after it ended
            pass
    profiler.teardown("fit")
    frame = read_chrome_trace(tmp_path / "t.json")
    assert sorted(frame["name"]) == ["inner", "inner", "outer"]
    outer = frame.loc[frame["name"] == "outer"].iloc[0]
    inner = frame.loc[frame["name"] == "inner"]
    assert (inner["parent_id"] == outer["span_id"]).all()
    assert (inner["end_ns"] <= outer["end_ns"]).all()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(
        TypeError, match=r"Expected a str or os.PathLike for trace_path .* but received int 3\."
    ):
        LightningProfiler(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative int for warmup_steps"):
        LightningProfiler(warmup_steps=-1)
    with pytest.raises(TypeError, match=r"profiler 0 \(object\) lacks setup"):
        LightningProfiler(profilers=[object()])


def test_each_stage_gives_its_row_buffer_back_to_the_recorder(tmp_path: Path) -> None:
    from ppetrace.tracing._recorder import RECORDER

    def buffers() -> int:
        with RECORDER._buffers_lock:
            return len(RECORDER._buffers)

    ppetrace.flush()
    before = buffers()
    profiler = LightningProfiler(tmp_path / "trace.json")
    for _ in range(3):
        _trainer(profiler, max_epochs=1, limit_val_batches=0).fit(_Module(), _loader(8))
    ppetrace.flush()  # the drain takes the retired buffers' rows, then forgets them
    assert buffers() == before
    counts = read_chrome_trace(tmp_path / "trace.json")["name"].value_counts()
    assert counts["trainer.step"] == 2  # nothing left behind in a forgotten buffer


def test_a_schedule_summarises_the_batches_between_its_windows(tmp_path: Path) -> None:
    from exporters import step_report

    path = tmp_path / "trace.json"
    every_fourth = ppetrace.Schedule(wait=3, warmup=0, active=1, repeat=0)
    profiler = LightningProfiler(path, trace_detail=every_fourth)
    _trainer(profiler, max_epochs=1, limit_val_batches=0).fit(_Module(), _loader(32))
    frame = read_chrome_trace(path)
    steps = frame[frame["name"] == "trainer.step"].sort_values("start_ns")
    summarised = [isinstance(v, str) for v in steps["ppetrace.hooks"]]
    assert summarised == [i % 4 != 3 for i in range(8)]  # batches 3 and 7 in full
    counts = frame["name"].value_counts()
    assert counts["trainer.backward"] == 2  # the others are in the aggregates
    report = step_report(frame, warmup_steps=0)
    events = report.events.set_index("event")
    assert events.loc["trainer.backward", "count"] == 8  # every batch, from both
    assert report.detail is not None and (report.detail.detailed, report.detail.summarised) == (
        2,
        6,
    )
    assert report.detail.policy is not None and report.detail.policy["policy"] == "schedule"


def test_trace_detail_is_checked_like_the_trainers() -> None:
    with pytest.raises(ValueError, match=r"Expected 'auto', 'all' or a ppetrace\.Schedule"):
        LightningProfiler(trace_detail="some")
    with pytest.raises(ValueError, match="Expected a positive int number of bytes"):
        LightningProfiler(max_trace_bytes=0)


def test_a_bad_trace_path_is_refused_at_once_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc
    import subprocess
    import sys
    import textwrap

    unraisable: list[Any] = []  # what Lightning's Profiler.__del__ raises, caught here
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(ValueError, match=r"Expected a file for trace_path, but .* is a directory"):
        LightningProfiler(trace_path=tmp_path)
    with pytest.raises(ValueError, match=r"Expected 'auto', 'all' or a ppetrace.Schedule"):
        LightningProfiler(trace_detail="full")
    gc.collect()  # the half-made profilers' __del__ (Lightning's) ran teardown
    assert [u.exc_type for u in unraisable] == []
    # a profiler whose fit failed, torn down by its __del__ at interpreter exit, must not
    # hang the exit (no thread can start then)
    script = textwrap.dedent(
        f"""
        import ppetrace
        from ppetrace.integrations.lightning import LightningProfiler
        prof = LightningProfiler(trace_path={str(tmp_path / "t.json")!r})
        prof._active = True  # as if fit had failed midway
        with ppetrace.trace("x"):
            pass
        """
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


class _TracedItems(torch.utils.data.Dataset[Any]):
    """Items whose __getitem__ records a span, in the DataLoader worker that loads it."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        import ppetrace

        with ppetrace.trace("user.getitem", {"i": i}):
            return torch.full((4,), float(i)), torch.tensor(i % 2)


def test_the_workers_of_lightnings_loaders_trace_into_the_profilers_trace(
    tmp_path: Path,
) -> None:
    from torch.utils.data import DataLoader as _DL

    before = _DL.__dict__["__iter__"]
    loader = _DL(_TracedItems(), batch_size=4, num_workers=2, multiprocessing_context="fork")
    profiler = LightningProfiler(tmp_path / "trace.json")
    _trainer(profiler, max_epochs=1).fit(_Module(), loader)
    frame = read_chrome_trace(tmp_path / "trace.json")
    got = frame[frame["name"] == "user.getitem"]
    assert sorted(got["i"].astype(int)) == list(range(16))  # no trace_workers call needed
    assert _DL.__dict__["__iter__"] is before  # the patch is out again after the stage


def test_dirpath_and_filename_without_trace_path_put_the_trace_there(tmp_path: Path) -> None:
    profiler = LightningProfiler(dirpath=tmp_path / "prof", filename="run")
    _trainer(profiler, max_epochs=1, limit_val_batches=0).fit(_Module(), _loader(8))
    trace = tmp_path / "prof" / "run.json"
    assert profiler.trace_paths == [trace]
    assert read_chrome_trace(trace)["name"].value_counts()["trainer.step"] == 2
    summary = (tmp_path / "prof" / "fit-run.txt").read_text()  # Lightning's file, not empty
    assert f"ppetrace report {trace}" in summary


def test_a_filename_alone_writes_no_trace_in_the_log_folder_and_says_how(tmp_path: Path) -> None:
    profiler = LightningProfiler(filename="run")
    trainer = L.Trainer(
        profiler=profiler,
        default_root_dir=tmp_path,
        logger=L.pytorch.loggers.CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        max_epochs=1,
        limit_val_batches=0,
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(_Module(), _loader(8))
    assert profiler.trace_paths == [] and not list(tmp_path.rglob("run.json"))
    assert not [w for w in seen if "will be deleted" in str(w.message)]
    (summary,) = tmp_path.rglob("fit-run.txt")  # Lightning's file, in the log folder
    assert "ppetrace: no trace was written. Pass LightningProfiler(trace_path=" in (
        summary.read_text()
    )


def test_rank_files_are_merged_only_in_the_teardown_that_describe_runs(tmp_path: Path) -> None:
    """A teardown from ``__del__`` or after a failed stage must not start the merge's
    collectives (the other ranks may be gone: it would wait for them); only the one that
    Lightning's ``describe`` runs at the end of a stage that ended well merges."""
    merged: list[Path] = []

    class Traces:  # RankTraces.finish: the collective end of the stage
        def finish(self, path: Path) -> bool:
            merged.append(path)
            return True

    profiler = LightningProfiler(tmp_path / "trace.json")
    for describing in (False, True):
        profiler._rank_traces, profiler._merged = Traces(), tmp_path / "trace.json"
        profiler._merging = describing
        profiler._merge_ranks()
    assert merged == [tmp_path / "trace.json"]
    assert profiler.last_trace_path == tmp_path / "trace.json"


def test_a_validation_loop_without_batches_opens_no_validation(tmp_path: Path) -> None:
    """Lightning runs ``on_validation_model_zero_grad`` before its evaluation loop finds it
    has no batches and returns: the span opens only inside the loop, so no validation span
    is left open over the next epoch (and the later epochs' validations are not lost)."""
    g = torch.Generator().manual_seed(0)
    empty = DataLoader(
        TensorDataset(torch.randn(3, 4, generator=g), torch.randint(0, 2, (3,), generator=g)),
        batch_size=4,
        drop_last=True,
    )
    profiler = LightningProfiler(tmp_path / "t.json")
    _trainer(profiler, max_epochs=2, num_sanity_val_steps=0).fit(_Module(), _loader(), empty)
    frame = read_chrome_trace(tmp_path / "t.json")
    assert "trainer.validation" not in set(frame["name"])
    assert (frame["name"] == "trainer.step").sum() == 16


class _Crashing(_Module):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 3:
            raise ValueError("a bad batch")
        return super().training_step(batch, batch_idx)


def test_a_fit_that_raises_is_a_failed_run_in_its_trace(tmp_path: Path) -> None:
    """Lightning tears nothing down when the fit raises: the exception that left an action
    is the trace's run_error, so compare does not take the crashed run for a fast one, and
    the trace is written as it leaves the outermost action (before: when the profiler was
    collected, often at exit; here the Trainer and the profiler are still alive)."""
    from exporters import run_failure

    path = tmp_path / "crash.json"
    profiler = LightningProfiler(trace_path=path)
    trainer = _trainer(profiler, max_epochs=1)
    with pytest.raises(ValueError, match="a bad batch"):
        trainer.fit(_Crashing(), _loader())
    frame = read_chrome_trace(path)
    assert not frame.attrs.get("truncated")  # closed, not cut off
    assert run_failure(frame) == "it ended with an error (ValueError: a bad batch)"
    assert (frame["name"] == "trainer.step").sum() == 4  # batches 0 to 3, the last raised
    assert trainer.profiler is profiler and profiler.trace_exporter.spans_lost == 0
    clean = tmp_path / "clean.json"
    _trainer(LightningProfiler(trace_path=clean), max_epochs=1).fit(_Module(), _loader())
    assert run_failure(read_chrome_trace(clean)) is None


def test_a_fit_that_raises_with_loader_workers_alive_keeps_their_spans(tmp_path: Path) -> None:
    """DataLoader workers alive as the error leaves Lightning's actions send their spans
    as they exit: the profiler shuts them down before it writes the trace, so it holds
    every item's span (closed with them alive, it held none and no count said so)."""
    from exporters import run_failure

    path = tmp_path / "crash.json"
    loader = DataLoader(_TracedItems(), batch_size=4, num_workers=2, multiprocessing_context="fork")
    profiler = LightningProfiler(trace_path=path)
    trainer = _trainer(profiler, max_epochs=1)
    with pytest.raises(ValueError, match="a bad batch"):
        trainer.fit(_Crashing(), loader)
    assert trainer.profiler is profiler  # alive: the file was written at the error
    frame = read_chrome_trace(path)
    got = frame[frame["name"] == "user.getitem"]
    assert sorted(got["i"].astype(int)) == list(range(16))
    assert run_failure(frame) == "it ended with an error (ValueError: a bad batch)"


class _BadItem(torch.utils.data.Dataset[Any]):
    """Eight items; item 5 raises as it is fetched (no Lightning action sees it)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == 5:
            raise ValueError("a bad item")
        return torch.zeros(4), torch.tensor(i % 2)


def test_an_error_no_action_saw_fails_its_stage_and_leaves_the_next_its_own_file(
    tmp_path: Path,
) -> None:
    """Lightning fetches validation batches with start/stop, not profile(): an error in the
    fetch left no action, so the stage was never torn down. Its trace got no run_error,
    and the next stage was written into its file."""
    from exporters import run_failure

    profiler = LightningProfiler(trace_path=tmp_path / "t.json")
    trainer = _trainer(profiler)
    with pytest.raises(ValueError, match="a bad item"):
        trainer.validate(_Module(), DataLoader(_BadItem(), batch_size=2))
    trainer.validate(_Module(), _loader())  # the next stage ends the one that never ended
    first, second = profiler.trace_paths
    assert (first.name, second.name) == ("t.json", "t.validate2.json")
    failure = run_failure(read_chrome_trace(first))
    assert failure is not None and "without Lightning's end of a stage" in failure
    assert run_failure(read_chrome_trace(second)) is None


def test_a_tuners_run_is_no_failed_run(tmp_path: Path) -> None:
    """Lightning ends a tuner's run by raising _TunerExitException, and treats it as
    a normal end: so does the trace."""
    from lightning.pytorch.tuner import Tuner

    from exporters import run_failure

    class Tunable(_Module):
        def __init__(self) -> None:
            super().__init__()
            self.lr = 0.1

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    profiler = LightningProfiler(trace_path=tmp_path / "t.json")
    trainer = _trainer(profiler, max_epochs=1)
    Tuner(trainer).lr_find(Tunable(), train_dataloaders=_loader(64), num_training=5)
    (path,) = profiler.trace_paths
    assert run_failure(read_chrome_trace(path)) is None


def test_an_error_no_action_saw_fails_its_stage_when_the_profiler_is_collected(
    tmp_path: Path,
) -> None:
    """The same error with no next stage: the profiler's collection (Lightning's own
    teardown after an error) writes the trace with run_error. A teardown called directly
    (a profiler driven by hand) adds none."""
    import gc

    from exporters import run_failure

    profiler = LightningProfiler(trace_path=tmp_path / "t.json")
    trainer = _trainer(profiler)
    with pytest.raises(ValueError, match="a bad item"):
        trainer.validate(_Module(), DataLoader(_BadItem(), batch_size=2))
    del trainer, profiler
    gc.collect()
    failure = run_failure(read_chrome_trace(tmp_path / "t.json"))
    assert failure is not None and "without Lightning's end of a stage" in failure
    by_hand = LightningProfiler(trace_path=tmp_path / "h.json")
    by_hand.setup("fit")
    with by_hand.profile("run_training_batch"):
        pass
    by_hand.teardown("fit")
    assert run_failure(read_chrome_trace(tmp_path / "h.json")) is None
