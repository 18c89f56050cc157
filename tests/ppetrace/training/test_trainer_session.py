"""What surrounds a run: profilers, the trace exporter, the progress bar, flushing."""

from __future__ import annotations

import io
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch.utils.data import DataLoader, TensorDataset

import ppetrace
from ppetrace.training import StepProfiler
from ppetrace.training._progress import ProgressBar, progress_wanted


def loader(n: int = 24, batch_size: int = 8) -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))
    return DataLoader(ds, batch_size=batch_size)


def fit(trainer: ppetrace.Trainer, **kwargs: Any) -> torch.nn.Module:
    net = torch.nn.Linear(8, 4)
    trainer.fit(
        net,
        loader(),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss_fn=F.cross_entropy,
        **kwargs,
    )
    return net


class Profiler:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def setup(self, trainer: ppetrace.Trainer) -> None:
        self.calls.append(("setup", trainer.global_step))

    def step_begin(self, step: int) -> None:
        current = otel_trace.get_current_span()
        self.calls.append(("begin", step, getattr(current, "name", None)))

    def step_end(self, step: int) -> None:
        current = otel_trace.get_current_span()
        self.calls.append(("end", step, getattr(current, "name", None)))

    def teardown(self) -> None:
        self.calls.append(("teardown",))


def test_profilers_wrap_each_training_batch_outside_its_step_span() -> None:
    prof = Profiler()
    assert isinstance(prof, StepProfiler)
    fit(ppetrace.Trainer(max_epochs=2, profilers=[prof], progress=False))
    expected: list[Any] = [("setup", 0)]
    for step in range(6):
        expected += [("begin", step, "trainer.epoch"), ("end", step, "trainer.epoch")]
    assert prof.calls == [*expected, ("teardown",)]


def test_profiler_steps_continue_after_a_resume(tmp_path: Path) -> None:
    fit(ppetrace.Trainer(max_epochs=1, checkpoint_dir=tmp_path, progress=False))
    prof = Profiler()
    fit(
        ppetrace.Trainer(max_epochs=2, profilers=[prof], progress=False),
        resume_from=tmp_path / "last.pt",
    )
    assert [c[1] for c in prof.calls if c[0] == "begin"] == [3, 4, 5]


def test_profiler_teardown_runs_when_the_run_fails_and_the_error_is_unchanged() -> None:
    prof = Profiler()

    class Broken(Profiler):
        def teardown(self) -> None:
            raise RuntimeError("teardown failed too")

    class Fail(ppetrace.CallbackInterface):
        def on_end_backward(self, global_step: int, loss_tensor: torch.Tensor) -> None:
            raise ValueError("callback failed")

    trainer = ppetrace.Trainer(profilers=[prof, Broken()], callbacks=[Fail()], progress=False)
    with pytest.raises(ValueError, match="callback failed"):
        fit(trainer)
    assert prof.calls[0] == ("setup", 0)
    assert prof.calls[-1] == ("teardown",)
    assert ("end", 0, "trainer.epoch") not in prof.calls  # the step never ended


def test_a_profiler_without_the_protocol_is_rejected() -> None:
    with pytest.raises(
        TypeError, match=r"Expected profilers with setup\(trainer\), .* but profiler 0 is int\."
    ):
        ppetrace.Trainer(profilers=[3])  # type: ignore[list-item]


class FakeChrome:
    instances: ClassVar[list[FakeChrome]] = []

    def __init__(self, path: Any, *, metadata: Any = None, max_part_bytes: Any = None) -> None:
        self.path = path
        self.metadata = metadata
        self.max_part_bytes = max_part_bytes
        self.rows: list[str] = []
        self.shut = False
        FakeChrome.instances.append(self)

    def export_batch(self, batch: Any) -> None:
        self.rows.extend(row.name for row in batch.rows)

    def shutdown(self) -> None:
        self.shut = True


@pytest.fixture
def fake_chrome(monkeypatch: pytest.MonkeyPatch) -> type[FakeChrome]:
    FakeChrome.instances = []
    module = types.ModuleType("exporters.chrome")
    module.ChromeTraceExporter = FakeChrome  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "exporters.chrome", module)
    return FakeChrome


def test_trace_path_attaches_a_chrome_exporter_for_the_run(
    fake_chrome: type[FakeChrome], tmp_path: Path, span_exporter: InMemorySpanExporter
) -> None:
    trainer = ppetrace.Trainer(max_epochs=2, trace_path=tmp_path / "t.json", progress=False)
    fit(trainer)
    (exp,) = fake_chrome.instances
    assert trainer.trace_exporter is exp and exp.path == tmp_path / "t.json"
    assert exp.metadata["environment"]["device"] == "cpu"  # capture_environment's record
    assert exp.metadata["ppetrace.detail"]["policy"] == "auto"
    assert exp.max_part_bytes == 1 << 28  # the file in parts of 256 MiB
    assert exp.shut
    assert exp.rows.count("trainer.step") == 6 and exp.rows.count("trainer.run") == 1
    with ppetrace.trace("after.run"):
        pass
    ppetrace.flush()
    assert "after.run" not in exp.rows  # removed at the end of the run


def _trace_run(trainer: ppetrace.Trainer, calls: str) -> None:
    net = torch.nn.Linear(8, 4)
    for call in calls.split():
        if call == "fit":
            fit(trainer)
        elif call == "validate":
            trainer.validate(net, loader(), loss_fn=F.cross_entropy)
        else:
            trainer.test(net, loader(), loss_fn=F.cross_entropy)


def test_fit_validate_and_test_on_one_trainer_each_keep_their_trace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from exporters import read_chrome_trace

    trainer = ppetrace.Trainer(max_epochs=1, trace_path=tmp_path / "trace.json", progress=False)
    assert trainer.last_trace_path is None and trainer.trace_paths == []
    with caplog.at_level("INFO", logger="ppetrace"):
        _trace_run(trainer, "fit validate test")
    paths = [
        tmp_path / "trace.json",
        tmp_path / "trace.validate.json",
        tmp_path / "trace.test.json",
    ]
    assert trainer.trace_paths == paths
    assert trainer.last_trace_path == paths[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)
    fit_names, val_names, test_names = (set(read_chrome_trace(p)["name"]) for p in paths)
    assert {"trainer.run", "trainer.step"} <= fit_names
    assert "trainer.validation" in val_names and "trainer.step" not in val_names
    assert "evaluator.step" in test_names and "trainer.validation" not in test_names
    assert [r.getMessage() for r in caplog.records if "trace to" in r.getMessage()] == [
        f"ppetrace: writing the fit trace to {paths[0]}",
        f"ppetrace: writing the validate trace to {paths[1]}",
        f"ppetrace: writing the test trace to {paths[2]}",
    ]


def test_later_calls_never_overwrite_a_trace_and_gzip_stays_gzip(tmp_path: Path) -> None:
    from exporters import read_chrome_trace

    trainer = ppetrace.Trainer(max_epochs=1, trace_path=tmp_path / "t.json.gz", progress=False)
    _trace_run(trainer, "validate fit fit validate")
    assert [p.name for p in trainer.trace_paths] == [
        "t.json.gz",
        "t.fit.json.gz",
        "t.fit2.json.gz",
        "t.validate2.json.gz",
    ]
    for path in trainer.trace_paths:
        assert path.read_bytes()[:2] == b"\x1f\x8b"  # gzip
        assert len(read_chrome_trace(path)) > 0
    assert "trainer.step" not in set(read_chrome_trace(trainer.trace_paths[0])["name"])
    assert "trainer.step" in set(read_chrome_trace(trainer.trace_paths[2])["name"])


def test_trace_exporter_is_removed_when_the_run_fails(fake_chrome: type[FakeChrome]) -> None:
    class Fail(ppetrace.CallbackInterface):
        def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
            raise KeyError("nope")

    trainer = ppetrace.Trainer(trace_path="unused.json", callbacks=[Fail()], progress=False)
    with pytest.raises(KeyError):
        fit(trainer)
    (exp,) = fake_chrome.instances
    assert exp.shut
    assert "trainer.run" in exp.rows and "callback.on_begin_train_epoch" in exp.rows


def test_the_epoch_end_flush_delivers_the_epochs_spans_before_the_next_epoch(
    span_exporter: InMemorySpanExporter,
) -> None:
    # the flusher thread also drains every flush_interval, so what is exported during an
    # epoch depends on time; what does not: the epoch's end takes all of its spans, and
    # the sinks deliver them once asked to (waited for here without draining again)
    from ppetrace.tracing._setup import FLUSHER

    steps_seen: list[int] = []

    class Probe(ppetrace.CallbackInterface):
        def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
            for sink in FLUSHER.all_sinks():
                assert sink.wait(sink.request("flush"))
            names = [s.name for s in span_exporter.get_finished_spans()]
            steps_seen.append(names.count("trainer.step"))

    fit(ppetrace.Trainer(max_epochs=2, callbacks=[Probe()], progress=False))
    # before epoch 1: every step of epoch 0 (3 batches), and none of epoch 1 yet
    assert steps_seen == [0, 3]
    names = [s.name for s in span_exporter.get_finished_spans()]
    assert names.count("trainer.step") == 6  # and the run's end flushed the rest


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_is_off_when_the_stream_is_not_a_terminal() -> None:
    stream = io.StringIO()
    fit(ppetrace.Trainer(progress_stream=stream))
    assert stream.getvalue() == ""
    assert not progress_wanted(True, stream)
    assert not progress_wanted(False, Tty())
    assert progress_wanted(True, Tty())


def test_progress_bar_shows_step_loss_and_rate_on_a_terminal() -> None:
    stream = Tty()
    fit(ppetrace.Trainer(max_epochs=2, progress_stream=stream))
    text = stream.getvalue()
    assert "6/6" in text and "step=6" in text and "loss=" in text


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Loss:
    """A loss whose value is read only when the bar redraws."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.reads = 0

    def __float__(self) -> float:
        self.reads += 1
        return self.value


def test_progress_bar_redraws_at_most_once_per_interval() -> None:
    clock = Clock()
    bar = ProgressBar(10, stream=Tty(), clock=clock, interval=0.5)
    loss = Loss(0.25)
    bar.update(1, 1, loss)
    clock.now += 0.2
    bar.update(2, 2, loss)
    assert loss.reads == 0 and bar.postfix == {}
    clock.now += 0.3
    bar.update(3, 3, loss)
    assert loss.reads == 1
    assert bar.postfix == {"step": 3, "loss": "0.25", "steps/s": "6"}  # 3 steps in 0.5 s
    assert bar.bar.n == 3
    clock.now += 1.0
    bar.close(5, 5, Loss(0.125))
    assert bar.postfix == {"step": 5, "loss": "0.125", "steps/s": "2"}
    assert bar.bar.n == 5
