"""Issue 11 case 5: spans recorded in DataLoader worker processes (fork and spawn) land in
the parent's trace, each worker on its own track, for a plain loop and for the Trainer."""

from __future__ import annotations

import multiprocessing
import os
import signal
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import ppetrace
from exporters import read_chrome_trace
from exporters._spans import SpanBatch
from ppetrace.integrations.dataloader import trace_workers
from ppetrace.tracing._recorder import RECORDER

METHODS = [m for m in ("fork", "spawn") if m in multiprocessing.get_all_start_methods()]


class Items(Dataset[Any]):
    """Items that trace themselves; item ``die_at`` kills its worker once the spans before
    it have left the worker (they must survive it)."""

    def __init__(self, n: int, die_at: int = -1) -> None:
        self.n, self.die_at = n, die_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # the worker's own sinks: only the queue to the parent, never the parent's exporters
        sinks = ",".join(s.name for s in ppetrace.stats().sinks)
        with ppetrace.trace("user.getitem", {"i": i, "sinks": sinks}):
            x = torch.full((4,), float(i))
        if i == self.die_at:
            # every span recorded so far, this item's too, has left: the collate spans
            # count as well, so "i + 1 delivered" could hold before this item's span left
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                (s,) = ppetrace.stats().sinks
                if s.delivered >= s.recorded:
                    break
                time.sleep(0.005)  # the worker's flusher sends on its schedule
            os.kill(os.getpid(), signal.SIGKILL)
        return x, x.sum(0, keepdim=True)


def collate(items: list[Any]) -> Any:
    with ppetrace.trace("user.collate"):
        return torch.utils.data.default_collate(items)


class Rows:
    def __init__(self) -> None:
        self.batches: list[SpanBatch] = []

    def export_batch(self, batch: SpanBatch) -> None:
        self.batches.append(batch)

    def rows(self, name: str) -> list[tuple[Any, str | None, int]]:
        return [
            (r, b.thread_names.get(r.tid), b.pid)
            for b in self.batches
            for r in b.rows
            if r.name == name
        ]


@pytest.fixture
def rows() -> Any:
    sink = Rows()
    ppetrace.configure(exporters=[sink], flush_interval=0.05)
    yield sink
    ppetrace.configure()


@pytest.mark.parametrize("method", METHODS)
def test_worker_spans_of_a_plain_loop_land_in_the_parent_trace(rows: Rows, method: str) -> None:
    loader = DataLoader(
        Items(8), batch_size=2, num_workers=2, collate_fn=collate, multiprocessing_context=method
    )
    with ppetrace.trace("epoch") as epoch:
        for _ in trace_workers(loader):
            pass
    ppetrace.flush()
    items = rows.rows("user.getitem")
    assert sorted(r.attributes["i"] for r, _, _ in items) == list(range(8))
    assert len(rows.rows("user.collate")) == 4
    assert {r.attributes["sinks"] for r, _, _ in items} == {"_QueueExporter"}
    tracks = Counter(track for _, track, _ in items)
    assert tracks == {"dataloader worker 0": 4, "dataloader worker 1": 4}
    for r, _, pid in items + rows.rows("user.collate"):
        assert r.trace_id == RECORDER.trace_id and pid == os.getpid()
        assert r.parent_id == epoch.span_id  # the span open when iteration started
    (s,) = ppetrace.stats().sinks
    assert s.delivered == s.recorded == 8 + 4 + 1


def _fit_two_epochs(loader: DataLoader[Any], path: Path) -> Any:
    """The trace frame of a 2-epoch Trainer fit on ``loader``."""
    model = torch.nn.Linear(4, 1)
    trainer = ppetrace.Trainer(max_epochs=2, progress=False, trace_path=path)
    trainer.fit(
        model,
        loader,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        loss_fn=torch.nn.functional.mse_loss,
    )
    return read_chrome_trace(path)


def test_worker_spans_of_the_trainer_reach_its_trace_file(rows: Rows, tmp_path: Path) -> None:
    loader = DataLoader(Items(8), batch_size=4, num_workers=2, multiprocessing_context="fork")
    frame = _fit_two_epochs(loader, tmp_path / "t.json")
    got = frame[frame["name"] == "user.getitem"]
    assert sorted(got["i"].astype(int)) == sorted(list(range(8)) * 2)
    assert set(got["pid"]) == {os.getpid()}  # under the main process, on tracks of its own
    assert got["tid"].nunique() >= 2 and not set(got["tid"]) & set(
        frame.loc[frame["name"] == "trainer.step", "tid"]
    )


@pytest.mark.parametrize("method", METHODS)
def test_persistent_workers_spans_all_reach_the_trainers_trace(tmp_path: Path, method: str) -> None:
    """Persistent workers live on after fit (their spans were lost: they sent once a
    second, and the run's last flush came first)."""
    loader = DataLoader(
        Items(16),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context=method,
    )
    frame = _fit_two_epochs(loader, tmp_path / "t.json")  # the workers are still alive
    got = frame[frame["name"] == "user.getitem"]
    assert sorted(got["i"].astype(int)) == sorted(list(range(16)) * 2)
    del loader


def _loaded(path: Path) -> list[int]:
    """The items whose ``user.getitem`` span the trace at ``path`` holds, in order."""
    frame = read_chrome_trace(path)
    return sorted(frame.loc[frame["name"] == "user.getitem", "i"].astype(int))


def _held_items(got: list[int], consumed: int) -> None:
    """Every item of the ``consumed`` first items is there, and none twice (the workers
    may have loaded more ahead)."""
    assert got[:consumed] == list(range(consumed)) and len(got) == len(set(got)), got


def _loss_failing_at(call: int) -> Any:
    """MSE that raises "a bad loss" at its ``call``-th call (1-based)."""
    calls = [0]

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError("a bad loss")
        return torch.nn.functional.mse_loss(out, target)

    return loss


def test_a_fit_that_raises_keeps_the_spans_its_loaders_workers_hold(tmp_path: Path) -> None:
    """A fit that raises: the traceback keeps the DataLoader iterator, and its workers
    send their spans as they exit. The Trainer shuts them down before it closes the
    trace (before: the file had none of them, and ppetrace.stats() counted nothing lost)."""
    loss = _loss_failing_at(4)  # batch 3
    loader = DataLoader(Items(16), batch_size=2, num_workers=2, multiprocessing_context="fork")
    model = torch.nn.Linear(4, 1)
    trainer = ppetrace.Trainer(max_epochs=1, progress=False, trace_path=tmp_path / "t.json")
    with pytest.raises(RuntimeError, match="a bad loss"):
        trainer.fit(model, loader, optimizer=torch.optim.SGD(model.parameters()), loss_fn=loss)
    _held_items(_loaded(tmp_path / "t.json"), 8)  # batches 0 to 3


_CRASHING_SCRIPT = """
import torch
import ppetrace
from torch.utils.data import DataLoader, Dataset

class Items(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        with ppetrace.trace("user.getitem", {"i": i}):
            return torch.full((4,), float(i))

it = iter(DataLoader(Items(), batch_size=2, num_workers=2, multiprocessing_context="fork"))
for k in range(8):
    next(it)
    if k == 3:
        raise RuntimeError("a bad batch 3")
"""


def test_a_script_that_raises_under_ppetrace_run_keeps_its_workers_spans(tmp_path: Path) -> None:
    """The same for ``ppetrace run``: the script's iterator, in a variable, lives on in
    the traceback (a ``for`` loop's own iterator goes as the error leaves it)."""
    import io

    from ppetrace.cli import main

    script = tmp_path / "crash.py"
    script.write_text(_CRASHING_SCRIPT)
    trace = tmp_path / "t.json"
    err = io.StringIO()
    argv = ["run", "--no-report", "--trace", str(trace), str(script)]
    assert main(argv, stdout=io.StringIO(), stderr=err) == 1, err.getvalue()
    _held_items(_loaded(trace), 8)


def test_persistent_workers_are_not_stopped_and_their_loader_goes_on(tmp_path: Path) -> None:
    """A failed fit leaves a loader with persistent workers usable: it reuses its
    iterator, and those workers send their spans on their own (every 10 ms)."""
    loader = DataLoader(
        Items(8), batch_size=2, num_workers=2, persistent_workers=True,
        multiprocessing_context="fork",
    )  # fmt: skip
    loss = _loss_failing_at(2)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters())
    trainer = ppetrace.Trainer(max_epochs=1, progress=False, trace_path=tmp_path / "a.json")
    with pytest.raises(RuntimeError, match="a bad loss"):
        trainer.fit(model, loader, optimizer=opt, loss_fn=loss)
    again = ppetrace.Trainer(max_epochs=1, progress=False, trace_path=tmp_path / "b.json")
    again.fit(model, loader, optimizer=opt, loss_fn=torch.nn.functional.mse_loss)
    assert sorted(_loaded(tmp_path / "b.json")) == list(range(8))
    del loader


def test_stop_workers_stops_only_this_threads_iterators_after_the_mark() -> None:
    """Another thread's run (a Trainer fitting beside it) keeps its loader's workers."""
    import threading

    from ppetrace.integrations import dataloader as dl

    class FakeIter:
        _persistent_workers = False

        def __init__(self) -> None:
            self.stopped = 0

        def _shutdown_workers(self) -> None:
            self.stopped += 1

    before = FakeIter()
    dl.tracked(before)
    mark = dl.workers_mark()
    mine, theirs, persistent = FakeIter(), FakeIter(), FakeIter()
    persistent._persistent_workers = True  # type: ignore[misc]
    dl.tracked(mine)
    dl.tracked(persistent)
    other = threading.Thread(target=dl.tracked, args=(theirs,))
    other.start()
    other.join()
    dl.stop_workers(mark)
    assert (before.stopped, mine.stopped, theirs.stopped, persistent.stopped) == (0, 1, 0, 0)


@pytest.mark.parametrize("method", METHODS)
def test_instrument_traces_the_workers_of_a_plain_loop_with_no_code_change(
    tmp_path: Path, method: str
) -> None:
    """Under instrument() (and so ppetrace run), no trace_workers call is needed."""
    loader = DataLoader(
        Items(8), batch_size=2, num_workers=2, collate_fn=collate, multiprocessing_context=method
    )
    with ppetrace.instrument(trace_path=tmp_path / "t.json"):
        for _ in loader:
            pass
    frame = read_chrome_trace(tmp_path / "t.json")
    got = frame[frame["name"] == "user.getitem"]
    assert sorted(got["i"].astype(int)) == list(range(8))
    assert (frame["name"] == "user.collate").sum() == 4


def test_a_worker_that_dies_loses_at_most_its_last_flush_interval(rows: Rows) -> None:
    loader = DataLoader(
        Items(20, die_at=5),
        batch_size=1,
        num_workers=1,
        collate_fn=collate,
        multiprocessing_context="fork" if "fork" in METHODS else "spawn",
    )
    with pytest.raises(RuntimeError, match="worker"):
        for _ in trace_workers(loader):
            pass
    ppetrace.flush()
    got = sorted(r.attributes["i"] for r, _, _ in rows.rows("user.getitem"))
    assert got[:6] == list(range(6))  # sent before the worker was killed


class Big(Dataset[Any]):
    """Items whose worker dies in the middle of a message to the parent: item 1 writes the
    first part of a 400 kB message into the pipe (as a write cut by SIGKILL leaves it),
    then kills its worker."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 1:
            from ppetrace.tracing._setup import FLUSHER

            (sink,) = FLUSHER.sinks  # the worker's one exporter: the queue to the parent
            writer = sink.target.queue._writer.fileno()
            os.write(writer, struct.pack("!i", 400_000) + b"x" * 30_000)
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.zeros(1)


def test_a_worker_killed_while_sending_never_blocks_the_parent(
    rows: Rows, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The parent reads the workers' pipe without blocking: a worker killed in the middle
    of a message larger than the pipe's buffer (the OOM killer) leaves a part of one, on
    which the parent's flush waited forever, holding the flusher's lock (a trial's
    training hung, and its trace was lost). The part is given up once stalled, with a
    warning, and later loaders get a new channel."""
    from ppetrace.integrations import dataloader

    loader = DataLoader(
        Big(),
        batch_size=1,
        num_workers=1,
        multiprocessing_context="fork" if "fork" in METHODS else "spawn",
    )
    with pytest.raises(RuntimeError, match="worker"):
        for _ in trace_workers(loader):
            pass
    channel = loader.worker_init_fn.queue  # type: ignore[union-attr]
    (chan,) = [c for c in dataloader._channels.values() if c.queue is channel]
    started = time.monotonic()
    ppetrace.flush()  # returns: the part of the last message waits in the buffer
    assert time.monotonic() - started < 60 and chan._buf  # (a hang) a part of it was read
    with caplog.at_level("WARNING", logger="ppetrace"):
        dataloader.settle_workers()  # a run's end says so, once
        dataloader.settle_workers()
    assert caplog.text.count("bytes of a message from the DataLoader workers") == 1
    monkeypatch.setattr(dataloader, "STALLED_AFTER", 0.0)
    with caplog.at_level("WARNING", logger="ppetrace"):
        ppetrace.flush()
        ppetrace.flush()
    assert "stopped while sending its spans" in caplog.text
    assert chan.retired and chan.lost_messages == 1 and not chan._buf
    assert chan not in dataloader._channels.values()


def test_the_channel_hands_over_whole_messages_only() -> None:
    """Messages in multiprocessing's framing, one cut: the whole ones are read, the cut one
    waits for its rest, and a message over 2 GiB's 12-byte header is read too."""
    import pickle
    import struct

    from ppetrace.integrations.dataloader import _Channel

    chan = _Channel(multiprocessing.get_context())
    one, two = pickle.dumps((0, [], [])), pickle.dumps((1, [], []))
    long_header = struct.pack("!i", -1) + struct.pack("!Q", len(two))
    data = struct.pack("!i", len(one)) + one + long_header + two
    chan._buf += data + struct.pack("!i", 1_000)[:3]
    assert chan._messages() == [(0, [], []), (1, [], [])]
    assert bytes(chan._buf) == struct.pack("!i", 1_000)[:3]
    chan.queue.close()


@pytest.mark.parametrize("method", METHODS)
def test_a_loader_whose_channel_was_retired_gets_a_new_one(
    rows: Rows, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same loader's next epoch after its channel was given up: its workers send
    through a new channel (with spawn, the retired queue's closed reader made iter()
    raise into the loop; with fork, the next workers' spans were lost)."""
    from ppetrace.integrations import dataloader

    loader = DataLoader(Items(4), batch_size=2, num_workers=1, multiprocessing_context=method)
    trace_workers(loader)
    old = loader.worker_init_fn.queue  # type: ignore[union-attr]
    (chan,) = [c for c in dataloader._channels.values() if c.queue is old]
    chan._buf += b"\x00\x00\x10\x00partial"  # a message cut off: 4,096 bytes announced
    monkeypatch.setattr(dataloader, "STALLED_AFTER", 0.0)
    chan.drain()
    chan.drain()
    assert chan.retired
    for _ in trace_workers(loader):
        pass
    assert loader.worker_init_fn.queue is not old  # type: ignore[union-attr]
    ppetrace.flush()
    assert sorted(r.attributes["i"] for r, _, _ in rows.rows("user.getitem")) == [0, 1, 2, 3]


def test_a_ctrl_c_while_workers_shut_down_still_closes_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt in stop_workers (torch waits up to 5 s for a busy worker) goes
    on to the caller, and the trace is still written and its exporter removed."""
    from ppetrace.training import _session

    def interrupted(after: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_session, "stop_workers", interrupted)
    model = torch.nn.Linear(4, 1)
    trainer = ppetrace.Trainer(max_epochs=1, progress=False, trace_path=tmp_path / "t.json")

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a bad loss")

    loader = DataLoader(Items(4), batch_size=2)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(model, loader, optimizer=torch.optim.SGD(model.parameters()), loss_fn=loss)
    assert not ppetrace.stats().sinks  # the trace's exporter is gone: the file is closed
    frame = read_chrome_trace(tmp_path / "t.json")
    assert not frame.attrs.get("truncated") and (frame["name"] == "trainer.step").sum() == 1


class _ModuleItems(Dataset[Any]):
    """Items made by an ``nn.Module``: a worker's module calls are data code."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.make = torch.nn.Linear(4, 4)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.make(torch.full((4,), float(i))).detach()


@pytest.mark.skipif("fork" not in METHODS, reason="needs the fork start method")
def test_a_worker_forked_mid_step_records_its_own_spans_not_the_parents(tmp_path: Path) -> None:
    """A worker forked while the parent's forward waits to be recorded does not record it
    again, and records every module call of its own (as data code, a span each)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    items = DataLoader(_ModuleItems(4), batch_size=2, num_workers=1, multiprocessing_context="fork")
    path = tmp_path / "trace.json"
    with ppetrace.instrument(trace_path=path):
        for _ in range(2):
            loss = model(torch.randn(8, 4)).sum()
            for _batch in items:  # the forward's span waits for the next hook meanwhile
                pass
            loss.backward()
            opt.step()
            opt.zero_grad()
    frame = read_chrome_trace(path)
    forwards = frame[frame["name"] == "module.forward"]
    assert len(forwards) == 2 + 2 * 4  # the loop's, and one per item in the worker
    assert not forwards.duplicated(["start_ns", "end_ns"]).any()  # (a copy has its own tid)
    assert (frame["name"] == "trainer.step").sum() == 2
