"""torch.distributed: clocks aligned to rank 0, explicit collectives traced, one file per rank.

Takes in: an initialized ``torch.distributed`` process group (torchrun's, or any
other). Gives out:

- :func:`sync_clock`: this rank's clock offset to rank 0, measured NTP-style
  over the group. Rank 0 pings every other rank in turn, ``rounds`` times;
  each ping gives an offset estimate ``((t2 - t1) + (t3 - t4)) / 2`` from the
  four timestamps of the round trip, whose true value lies within half the
  round trip minus the peer's turnaround. The round with the smallest round
  trip is kept, and its half round trip is the recorded error bound. The clock
  is the one ppetrace stamps spans with (``perf_counter_ns`` anchored to the
  epoch), so the offset applies to the spans as recorded. Ranks on rank 0's
  host (the same host name and Linux ``boot_id``) share its monotonic clock:
  their offset is the difference of the two processes' epoch anchors, exact
  (error 0), with no ping; a ping's error bound (half a round trip, often
  hundreds of µs at start-up) would only blur it.
- :func:`trace_collectives`: ``dist.all_reduce``, ``all_gather``,
  ``all_gather_into_tensor``, ``broadcast``, ``reduce_scatter``,
  ``reduce_scatter_tensor`` and ``barrier`` called as attributes of
  ``torch.distributed`` are traced as ``dist.<name>`` spans with
  ``ppetrace.bytes``, the bytes of the tensors this rank hands in
  (``ppetrace.async_op`` is set for ``async_op=True``, whose span covers the
  launch only). Collectives that torch issues itself (DDP's gradient
  all-reduce, ``all_gather_object``) are not traced, nor are ppetrace's own
  (checkpoint barriers, clock pings, the merge): they call :func:`untraced`.
- :func:`rank_trace_path`: ``trace.json`` -> ``trace.ranks/rank<R>.json``, the
  per-rank layout HolisticTraceAnalysis reads as a folder, and :class:`RankTraces`:
  each rank's ``ChromeTraceExporter`` options (times on rank 0's clock,
  ``distributedInfo``, the clock fields) and, at the end, the second clock
  measurement and rank 0's merge, with the files rank 0 cannot see sent to it.

The Trainer uses them under torchrun (see :mod:`ppetrace.training._distributed`);
anything else that writes one trace per rank (``ppetrace run``) can too.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..tracing._recorder import RECORDER, random_bits, trace
from ._detail import TRACE_PART_BYTES
from ._join import RankJoinError, join_ranks
from ._ranks import rank_trace_path

_log = logging.getLogger("ppetrace")

__all__ = [
    "COLLECTIVES",
    "MERGE_MAX_RANKS",
    "ClockSync",
    "RankJoinError",
    "RankTraces",
    "clock_ns",
    "host_key",
    "rank_trace_path",
    "rank_traces",
    "share_trace_id",
    "sync_clock",
    "trace_collectives",
    "untraced",
]

#: The ``torch.distributed`` functions :func:`trace_collectives` traces.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "barrier",
)
#: Ping rounds per rank in :func:`sync_clock`.
DEFAULT_ROUNDS = 16
#: spaces left after each rank file's otherData for the end-of-run clock measurement
HEADER_RESERVE = 1024
#: beyond this many ranks rank 0 does not merge at the end of a call (README: at scale)
MERGE_MAX_RANKS = 64
_perf_ns = time.perf_counter_ns


def clock_ns() -> int:
    """The span clock now: ``perf_counter_ns`` plus the recorder's anchor to the epoch."""
    return _perf_ns() + RECORDER.offset_ns


@dataclass(frozen=True)
class ClockSync:
    """One clock measurement of this rank against rank 0.

    ``offset_ns``: add it to this rank's times to get rank 0's clock.
    ``error_ns``: the true offset lies within ``offset_ns +- error_ns`` (half the
    kept round trip, minus the peer's turnaround). ``rtt_ns``: that round trip.
    ``at_ns``: this rank's clock when it was measured. ``rounds``: pings per rank.
    Rank 0 has offset and error 0; a rank on its host, error 0 and no rounds.
    """

    offset_ns: int
    error_ns: int
    rtt_ns: int
    at_ns: int
    rounds: int

    def as_dict(self) -> dict[str, int]:
        """The fields as a dict (what the trace files record)."""
        return asdict(self)


def host_key() -> str | None:
    """What identifies this host's monotonic clock: the host name and the Linux
    ``boot_id`` (a new one at each boot); None where there is no ``boot_id`` (not
    Linux), and then no two processes are taken to share a clock."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        return None
    return f"{socket.gethostname()}/{boot}" if boot else None


def sync_clock(
    group: Any = None,
    *,
    rounds: int = DEFAULT_ROUNDS,
    clock: Callable[[], int] = clock_ns,
    same_host: bool = True,
) -> ClockSync:
    """Measure this rank's clock offset to rank 0 over ``group`` (collective: every rank
    of the group calls it). ``group`` must take CPU tensors (gloo); ``clock`` is
    injectable for tests. Costs ``rounds`` round trips per rank, one rank after the other,
    except for ranks on rank 0's host (:func:`host_key`), whose offset is the difference
    of the epoch anchors (``rounds`` 0, error 0); ``same_host=False`` pings them too.
    With an injected ``clock`` every rank is pinged."""
    import torch
    import torch.distributed as dist

    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(
            f"Expected a positive int for rounds, but received {rounds!r}. Pass 1 or more "
            f"(default {DEFAULT_ROUNDS}: more rounds find a shorter round trip, a tighter bound)."
        )
    rank = dist.get_rank()
    size = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    root = ranks[0]
    # who shares rank 0's monotonic clock (the span clock is it plus each process's anchor)
    shared: set[int] = set()
    if same_host and clock is clock_ns and size > 1:
        mine = (host_key(), RECORDER.offset_ns)
        everyone: list[Any] = [None] * size
        dist.all_gather_object(everyone, mine, group=group)
        root_key, root_anchor = everyone[0]
        shared = {r for r, (key, _) in zip(ranks, everyone, strict=True) if key and key == root_key}
        if rank != root and rank in shared:
            # span clock = monotonic + anchor on both: rank 0's = mine + (its anchor - mine)
            return ClockSync(root_anchor - mine[1], 0, 0, clock(), 0)
    ping = torch.zeros(1, dtype=torch.int64)
    reply = torch.zeros(2, dtype=torch.int64)
    result = torch.zeros(5, dtype=torch.int64)
    if rank == root:
        now = clock()
        for peer in ranks[1:]:
            if peer in shared:
                continue  # on this host: no ping (see above)
            best: tuple[int, int, int] | None = None  # (rtt, offset, at)
            for _ in range(rounds):
                t1 = clock()
                dist.send(ping, dst=peer, group=group)
                dist.recv(reply, src=peer, group=group)
                t4 = clock()
                t2, t3 = int(reply[0]), int(reply[1])
                rtt = (t4 - t1) - (t3 - t2)
                if best is None or rtt < best[0]:
                    # peer clock - root clock; the peer adds its negative
                    best = (rtt, ((t2 - t1) + (t3 - t4)) // 2, (t2 + t3) // 2)
            assert best is not None
            rtt, ahead, at = best
            result.copy_(torch.tensor([-ahead, (max(rtt, 0) + 1) // 2, rtt, at, rounds]))
            dist.send(result, dst=peer, group=group)
        return ClockSync(0, 0, 0, now, rounds)
    for _ in range(rounds):
        dist.recv(ping, src=root, group=group)
        t2 = clock()
        t3 = clock()
        reply[0] = t2
        reply[1] = t3
        dist.send(reply, dst=root, group=group)
    dist.recv(result, src=root, group=group)
    offset, error, rtt, at, n = (int(v) for v in result.tolist())
    return ClockSync(offset, error, rtt, at, n)


class RankTraces:
    """One trace file per rank of a process group, merged by rank 0 (collective methods:
    every rank calls them, in the same order). ``group`` takes CPU tensors (gloo)."""

    def __init__(self, group: Any, backend: str) -> None:
        import torch.distributed as dist

        self.group = group
        self.backend = backend
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._start: dict[str, int] | None = None

    def exporter_options(self) -> dict[str, Any]:
        """Measure the clock against rank 0 and return the ``ChromeTraceExporter`` options
        of this rank's file: times on rank 0's clock from a common origin, the clock
        fields, ``distributedInfo``, room for the end measurement, and ``run_id``: rank 0's
        id of this call, new for each call (the calls of one job share the trace id, so
        the id tells the rank files of two ``fit`` calls apart)."""
        import torch

        join_ranks("the clock measurement of its trace file")  # every rank traces alike
        sync = self.measure_start()
        origin = torch.zeros(2, dtype=torch.int64)  # the origin, and the call's id
        if self.rank == 0:
            origin[0] = clock_ns() // 1_000_000_000 * 1_000_000_000
            origin[1] = random_bits(63) or 1  # not the script's seeded random module
        untraced("broadcast")(origin, src=0, group=self.group)
        return {
            "origin_ns": int(origin[0]) - sync.offset_ns,
            "clock_offset_ns": sync.offset_ns,
            "distributed_info": {
                "rank": self.rank,
                "world_size": self.world_size,
                "backend": self.backend,
            },
            "header_reserve": HEADER_RESERVE,
            "max_part_bytes": TRACE_PART_BYTES,
            "metadata": {
                "trace_id": f"{RECORDER.trace_id:032x}",
                "run_id": f"{int(origin[1]):016x}",
                "clock_error_ns": sync.error_ns,
                "clock_sync": {"reference_rank": 0, "start": self._start},
            },
        }

    def measure_start(self) -> ClockSync:
        """The first clock measurement (collective), which :meth:`finish` records beside
        its own; :meth:`exporter_options` takes it."""
        sync = sync_clock(self.group)
        self._start = sync.as_dict()
        return sync

    def rank_path(self, path: Path) -> Path:
        """This rank's file for the merged trace ``path``."""
        return rank_trace_path(path, self.rank)

    def finish(self, merged: Path) -> bool:
        """At the end of a call (every rank, its file closed): measure the clock again,
        record it in this rank's file, and let rank 0 merge every rank's file into
        ``merged`` (files it cannot see are sent over the group); every rank returns once
        the merged file is written. Beyond :data:`MERGE_MAX_RANKS` ranks nothing is
        merged (returns ``False``): the rank files stay for ``ppetrace merge`` or HTA."""

        from exporters.chrome import merge_traces
        from exporters.chrome._split import update_run_other_data

        end = sync_clock(self.group)
        mine = rank_trace_path(merged, self.rank)
        update_run_other_data(  # every part of this rank's file
            mine, {"clock_sync": {"reference_rank": 0, "start": self._start, "end": end.as_dict()}}
        )
        if self.world_size > MERGE_MAX_RANKS:
            if self.rank == 0:
                _log.warning(
                    "ppetrace: %d ranks: the rank traces stay in %s (merge a few of them with "
                    "'ppetrace merge OUT FILES...', or read the folder with HTA)",
                    self.world_size,
                    mine.parent,
                )
            return False
        import torch

        files = self._collect(mine, merged)
        written = torch.ones(1, dtype=torch.int64)
        failure: Exception | None = None
        if self.rank == 0:
            try:
                merge_traces(merged, files, max_part_bytes=TRACE_PART_BYTES)
                _log.info("ppetrace: merged %d rank traces into %s", len(files), merged)
            except Exception as exc:  # every rank still meets the broadcast below
                failure, written[0] = exc, 0
        # every rank returns once the merged file is written (or failed): no rank waits
        # in a collective that rank 0 skipped
        untraced("broadcast")(written, src=0, group=self.group)
        if failure is not None:
            raise failure
        return bool(written[0])

    def _collect(self, mine: Path, merged: Path) -> list[Path]:
        """Rank 0: every rank's file (its part 0: merging brings the later parts), the
        files it cannot see on its filesystem (a missing part, or a size other than the
        writer's) received over the group into its rank folder, one after the other."""
        import torch
        import torch.distributed as dist

        from exporters.chrome._split import part_path, run_parts

        parts = [(str(p), p.stat().st_size) for p in run_parts(mine)]
        info: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        untraced("gather_object")(parts, info, dst=0, group=self.group)
        wanted: list[Any] = [None]
        if self.rank == 0:
            assert info is not None
            wanted[0] = [
                r
                for r, files in enumerate(info)
                if not all(os.path.isfile(p) and os.path.getsize(p) == n for p, n in files)
            ]
        untraced("broadcast_object_list")(wanted, src=0, group=self.group)
        files = [rank_trace_path(merged, r) for r in range(self.world_size)]
        for r in wanted[0]:  # one file at a time: rank 0 holds at most one in memory
            count = len(parts) if self.rank == r else 0
            if self.rank == 0:
                assert info is not None
                count = len(info[r])
            for k in range(count):
                length = torch.zeros(1, dtype=torch.int64)
                if self.rank == r:
                    data = torch.frombuffer(
                        bytearray(Path(parts[k][0]).read_bytes()), dtype=torch.uint8
                    )
                    length[0] = data.numel()
                    dist.send(length, dst=0, group=self.group)
                    dist.send(data, dst=0, group=self.group)
                elif self.rank == 0:
                    dist.recv(length, src=r, group=self.group)
                    data = torch.empty(int(length[0]), dtype=torch.uint8)
                    dist.recv(data, src=r, group=self.group)
                    target = part_path(files[r], k)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(data.numpy().tobytes())
        return files


# -- collectives ----------------------------------------------------------------------


def _nbytes(value: Any) -> int:
    """Bytes of a tensor, or of the tensors in a list or tuple (0 for anything else)."""
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    numel = getattr(value, "numel", None)
    size = getattr(value, "element_size", None)
    if numel is None or size is None:
        return 0
    return int(numel()) * int(size())


def _arg(args: Sequence[Any], kwargs: dict[str, Any], index: int, name: str) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name)


#: name -> (position, keyword) of the argument whose bytes the span records
_INPUTS: dict[str, tuple[int, str] | None] = {
    "all_reduce": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "broadcast": (0, "tensor"),
    "reduce_scatter": (1, "input_list"),
    "reduce_scatter_tensor": (1, "input"),
    "barrier": None,
}
_lock = threading.Lock()
_installed = 0  # nesting depth of trace_collectives()
_originals: dict[str, Any] = {}


def _traced(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    event = "dist." + name
    where = _INPUTS[name]

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        attrs: dict[str, Any] = {
            "ppetrace.bytes": 0 if where is None else _nbytes(_arg(args, kwargs, *where))
        }
        if kwargs.get("async_op"):
            attrs["ppetrace.async_op"] = True
        with trace(event, attrs):
            return fn(*args, **kwargs)

    traced.__ppetrace_original__ = fn  # type: ignore[attr-defined]
    return traced


def rank_traces(made: tuple[Any, str] | None = None) -> RankTraces | None:
    """A :class:`RankTraces` for the process group that is up (collective: every rank
    calls it at the same point), with rank 0's trace id on every rank; None without one.
    ``made``: the ``(gloo group, backend)`` of an earlier call, to reuse (a gloo group
    beside a NCCL one is made once: making one is collective too)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    join_ranks("ppetrace's trace id (ppetrace run)")  # a rank not traced: an error, no hang
    if made is None:
        backend = str(dist.get_backend())
        made = (None if "gloo" in backend else dist.new_group(backend="gloo"), backend)
    group, backend = made
    share_trace_id(group)
    return RankTraces(group, backend)


def share_trace_id(group: Any = None) -> None:
    """Every rank of ``group`` records into rank 0's trace id from now on: one run, one
    trace (collective; ``group`` takes CPU tensors)."""
    import torch
    import torch.distributed as dist

    halves = torch.zeros(2, dtype=torch.int64)
    if dist.get_rank() == 0:
        tid = RECORDER.trace_id
        halves[0] = (tid >> 64) - (1 << 64 if tid >> 127 else 0)
        low = tid & ((1 << 64) - 1)
        halves[1] = low - (1 << 64) if low >> 63 else low
    untraced("broadcast")(halves, src=0, group=group)
    hi, lo = (int(v) % (1 << 64) for v in halves.tolist())
    tid = (hi << 64) | lo
    if tid and tid != RECORDER.trace_id:
        RECORDER.trace_id = tid
        RECORDER.apply()


def untraced(name: str) -> Callable[..., Any]:
    """``torch.distributed.<name>`` without the span :func:`trace_collectives` adds: what
    ppetrace calls for itself, so that ``dist.<name>`` spans are the user's calls only."""
    import torch.distributed as dist

    fn = _originals.get(name) or getattr(dist, name)
    return getattr(fn, "__ppetrace_original__", fn)


@contextlib.contextmanager
def trace_collectives() -> Iterator[None]:
    """Trace the explicit collectives of :data:`COLLECTIVES` inside the block (see the
    module doc). Nests; the functions are restored exactly when the outermost block ends.
    Code that imported a function by name before the block (``from torch.distributed
    import all_reduce``) keeps the untraced one."""
    global _installed
    import torch.distributed as dist

    with _lock:
        if _installed == 0:
            for name in COLLECTIVES:
                fn = getattr(dist, name, None)
                if fn is not None:
                    _originals[name] = fn
                    setattr(dist, name, _traced(name, fn))
        _installed += 1
    try:
        yield
    finally:
        with _lock:
            _installed -= 1
            if _installed == 0:
                for name, fn in _originals.items():
                    setattr(dist, name, fn)
                _originals.clear()
