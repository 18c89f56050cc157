"""trace_detail and max_trace_bytes: every step's step level, the hooks in full or summarised."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ppetrace
from exporters import read_chrome_trace

HOOKS, NAMES = "ppetrace.hooks", "ppetrace.hook_names"
BATCHES = 12  # per epoch


@pytest.fixture
def quiet_flusher() -> Iterator[None]:
    """No background flush: the trace grows only at the flushes a test asks for."""
    ppetrace.configure(flush_interval=3600)
    yield
    ppetrace.configure()


class FlushAtEpochEnd(ppetrace.CallbackInterface):
    """Writes the epoch's spans before the next epoch: the trace size is known then."""

    def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
        ppetrace.flush()


def _fit(path: Path, epochs: int = 2, **options: Any) -> ppetrace.Trainer:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(BATCHES * 2, 16, generator=g), torch.randint(0, 4, (24,)))
    net = torch.nn.Linear(16, 4)
    trainer = ppetrace.Trainer(
        max_epochs=epochs,
        progress=False,
        trace_path=path,
        val_every_n_epochs=None,
        callbacks=[FlushAtEpochEnd()],
        **options,
    )
    trainer.fit(
        net,
        DataLoader(ds, batch_size=2),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss_fn=F.cross_entropy,
    )
    return trainer


def _steps(path: Path) -> Any:
    frame = read_chrome_trace(path)
    steps = frame[frame["name"] == "trainer.step"].sort_values("start_ns")
    summarised = [isinstance(v, str) for v in steps.get(HOOKS, [None] * len(steps))]
    return frame, steps, summarised


def _final(path: Path) -> dict[str, Any]:
    events = json.loads(path.read_text())["traceEvents"]
    return dict(next(e for e in events if e.get("name") == "ppetrace.final")["args"])


def test_auto_switches_at_the_volume_budget_with_one_notice(
    tmp_path: Path, quiet_flusher: None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.json"
    trainer = _fit(path, epochs=3, max_trace_bytes=1)
    frame, steps, summarised = _steps(path)
    assert len(steps) == 3 * BATCHES  # every step is in the trace
    # the first epoch is written at its end: the first step after that is summarised,
    # and (1 step in 1,000 in full) every later one
    assert summarised == [False] * BATCHES + [True] * 2 * BATCHES
    captured = capsys.readouterr()
    assert "ppetrace:" not in captured.out  # the notice goes to stderr
    lines = [x for x in captured.err.splitlines() if x.startswith("ppetrace:")]
    assert len(lines) == 1
    held = trainer.trace_exporter.bytes_written if trainer.trace_exporter else 0
    assert "bytes (max_trace_bytes=1, checked as spans are written)" in lines[0]
    assert f"at training batch {BATCHES} (optimizer steps" in lines[0] and held > 1
    assert "trace_detail='all'" in lines[0] and "larger max_trace_bytes" in lines[0]
    other = frame.attrs["metadata"]["ppetrace.detail"]
    assert other == {
        "policy": "auto",
        "max_trace_bytes": 1,
        "schedule": {"wait": 999, "warmup": 0, "active": 1, "repeat": 0, "skip_first": 0},
    }
    final = _final(path)
    assert frame.attrs["metadata"]["ppetrace.final"] == final  # the reader gives it too
    assert final["switched_at_step"] == BATCHES
    assert final["steps_summarised"] == 2 * BATCHES
    # the hooks of a summarised step: every hook that ran, once each
    names = steps[NAMES].dropna().iloc[0].split(";")
    assert {"module.train_step", "trainer.backward", "trainer.optimizer_step"} <= set(names)
    hooks = frame[frame["name"].isin(names)]
    assert len(hooks) == BATCHES * len(names)  # only the detailed steps' hook spans
    assert not set(names) & ppetrace_step_level()
    stats = ppetrace.stats().sinks
    assert trainer.trace_exporter.spans_summarised == final["spans_summarised"] > 0
    assert all(s.name != repr(trainer.trace_exporter) for s in stats)  # detached at the end


def test_the_notice_names_the_rank_in_a_multi_process_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ppetrace.integrations._detail import StepDetail

    class Exporter:  # what StepDetail asks of ChromeTraceExporter
        bytes_written = 10

        def add_final_metadata(self, **values: Any) -> None:
            pass

        def summarise_step(self, tid: int, start_ns: int) -> None:
            pass

        def step_summariser(self, tid: int) -> Any:
            return lambda start_ns: None

    lines: list[str] = []
    for env, who in (
        ({}, ""),
        ({"RANK": "0", "WORLD_SIZE": "1"}, ""),
        ({"RANK": "3", "WORLD_SIZE": "4"}, "rank 3: "),
    ):
        for key in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        detail = StepDetail.create(Exporter(), "auto", 5, lines.append)
        assert detail is not None and detail.due(7)
        assert lines.pop().startswith(f"ppetrace: {who}the trace held 10 bytes")


def ppetrace_step_level() -> frozenset[str]:
    from exporters import STEP_LEVEL_EVENTS

    return STEP_LEVEL_EVENTS


def test_all_never_switches(tmp_path: Path, quiet_flusher: None) -> None:
    path = tmp_path / "trace.json"
    _fit(path, epochs=2, trace_detail="all", max_trace_bytes=1)
    frame, steps, summarised = _steps(path)
    assert len(steps) == 2 * BATCHES and not any(summarised)
    assert "ppetrace.final" not in path.read_text()
    assert frame.attrs["metadata"]["ppetrace.detail"]["policy"] == "all"


def test_a_schedule_summarises_from_the_start_and_matches_full_detail(
    tmp_path: Path, quiet_flusher: None, event_counts: Callable[[Any], dict[str, int]]
) -> None:
    """The per-event count and total over the run are the same with and without windows
    (two runs of the same model: the counts exactly, the totals are times)."""
    full_path, summ_path = tmp_path / "full.json", tmp_path / "summ.json"
    _fit(full_path, epochs=1, trace_detail="all")
    schedule = ppetrace.Schedule(wait=3, warmup=0, active=1, repeat=0)
    _fit(summ_path, epochs=1, trace_detail=schedule)
    full, _, _ = _steps(full_path)
    frame, _, summarised = _steps(summ_path)
    assert summarised == [i % 4 != 3 for i in range(BATCHES)]
    assert event_counts(frame) == full["name"].value_counts().to_dict()
    assert frame.attrs["metadata"]["ppetrace.detail"]["policy"] == "schedule"


def test_the_trace_stays_far_smaller_after_the_switch(tmp_path: Path, quiet_flusher: None) -> None:
    full_path, summ_path = tmp_path / "full.json", tmp_path / "summ.json"
    every = ppetrace.Schedule(wait=999, warmup=0, active=1, repeat=0, skip_first=10_000)
    full = _fit(full_path, epochs=1, trace_detail="all").trace_exporter.bytes_written
    summ = _fit(summ_path, epochs=1, trace_detail=every).trace_exporter.bytes_written
    assert summ < 0.6 * full  # the step level and the aggregates only


def test_stats_count_the_summarised_spans(tmp_path: Path, quiet_flusher: None) -> None:
    every = ppetrace.Schedule(wait=999, warmup=0, active=1, repeat=0, skip_first=10_000)
    exporter = None

    class Look(ppetrace.CallbackInterface):
        def on_end_train(self, global_step: int) -> None:
            nonlocal exporter
            ppetrace.flush()
            exporter = trainer_ref[0].trace_exporter
            sink = ppetrace.stats().sink(repr(exporter))
            assert sink.recorded == sink.delivered + sink.dropped_total + sink.buffered
            seen.append((sink.summarised, exporter.spans_summarised, sink.delivered))

    seen: list[tuple[int, int, int]] = []
    trainer_ref: list[Any] = []
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,)))
    net = torch.nn.Linear(16, 4)
    trainer = ppetrace.Trainer(
        progress=False, trace_path=tmp_path / "t.json", trace_detail=every, callbacks=[Look()]
    )
    trainer_ref.append(trainer)
    trainer.fit(
        net,
        DataLoader(ds, batch_size=2),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss_fn=F.cross_entropy,
    )
    ((summarised, counted, delivered),) = seen
    # the summarised steps are light steps (the exporter is the only sink): their hook
    # spans were never rows, so they count as summarised and not as delivered
    assert summarised == counted > 0 and delivered > 0
    assert trainer.trace_exporter is not None and trainer.trace_exporter.light_spans_lost == 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"trace_detail": "some"}, r"Expected 'auto', 'all' or a ppetrace.Schedule for "),
        ({"trace_detail": 5}, r"but received 5\. Pass trace_detail='all'"),
        ({"max_trace_bytes": 0}, r"Expected a positive int number of bytes for max_trace_bytes"),
        ({"max_trace_bytes": True}, r"max_trace_bytes, but received True\."),
        ({"max_trace_bytes": 1.5e9}, r"but received 1500000000\.0\. Pass e\.g\."),
    ],
)
def test_bad_options_are_refused_in_full_sentences(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ppetrace.Trainer(**options)


def test_auto_asks_no_step_before_the_exporter_reaches_the_budget(tmp_path: Path) -> None:
    from exporters import ChromeTraceExporter, SpanBatch, SpanRow
    from ppetrace.integrations._detail import StepDetail

    exporter = ChromeTraceExporter(tmp_path / "armed.json")
    notices: list[str] = []
    detail = StepDetail.create(exporter, "auto", 100, notices.append)
    assert detail is not None and not detail.armed  # the loops skip due() until the alarm
    row = SpanRow("trainer.fetch_batch", 1, 0, 7, 10, 20, 3, {"pad": "x" * 200})
    exporter.export_batch(SpanBatch([row], {"service.name": "t"}))
    assert exporter.bytes_written >= 100 and detail.armed
    assert detail.due(5) and detail.switched_at == 5 and len(notices) == 1
    exporter.shutdown()
    assert StepDetail.create(exporter, ppetrace.Schedule(wait=1, active=1), 100, print).armed


@pytest.mark.parametrize(
    "schedule",
    [
        ppetrace.Schedule(wait=999, warmup=0, active=1, repeat=0),
        ppetrace.Schedule(wait=3, warmup=1, active=2, repeat=2, skip_first=5),
        ppetrace.Schedule(wait=0, warmup=0, active=1, repeat=0),
        ppetrace.Schedule(wait=2, warmup=0, active=3, repeat=1, skip_first=1),
    ],
)
def test_the_stretch_of_due_steps_agrees_with_the_schedule_step_by_step(
    tmp_path: Path, schedule: ppetrace.Schedule
) -> None:
    """The loops ask ``due_from <= step < due_below`` before calling ``due``: for every
    step, that shortcut or ``due`` says what the schedule does (a step is summarised
    exactly when the schedule's action does not record), also for steps asked out of
    order (``instrument()``'s threads)."""
    from exporters import ChromeTraceExporter
    from ppetrace.integrations._detail import StepDetail

    exporter = ChromeTraceExporter(tmp_path / "t.json")
    detail = StepDetail.create(exporter, schedule, 100, print)
    assert detail is not None
    order = [*range(3_000), 7, 2_999, 0, 1_500, 6, 1]
    for step in order:
        fast = detail.due_from <= step < detail.due_below or detail.due(step)
        assert fast == (not schedule.action(step).records), step
    exporter.shutdown()
