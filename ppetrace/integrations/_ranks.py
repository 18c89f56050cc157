"""Where each rank of a distributed run writes its trace: the per-rank layout.

Under torchrun every process gets ``RANK`` and ``WORLD_SIZE``. A run whose trace
is ``trace.json`` then writes rank R's spans to ``trace.ranks/rank<R>.json``
(the folder HolisticTraceAnalysis loads as it is; the Trainer's distributed
training merges them into ``trace.json`` beside it, see :mod:`.distributed`).
Nothing here creates or needs a process group: the rank comes from the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "RankInfo",
    "check_trace_path",
    "file_in_the_way",
    "profiler_device",
    "rank_info",
    "rank_now",
    "rank_trace_path",
    "split_suffix",
    "stage_path",
    "this_rank_path",
]


class RankInfo:
    """``rank`` and ``world_size`` of this process, as torchrun set them."""

    __slots__ = ("rank", "world_size")

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def __repr__(self) -> str:
        return f"RankInfo(rank={self.rank}, world_size={self.world_size})"


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo | None:
    """This process's rank from ``RANK`` and ``WORLD_SIZE`` (both set, as under torchrun),
    else None; None too for a world of one process (``torchrun --nproc-per-node 1``),
    which writes its trace where asked, as the Trainer does, not a rank folder of one.
    Values that are not non-negative ints raise ``ValueError``."""
    env = os.environ if environ is None else environ
    rank, world = env.get("RANK"), env.get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    if not (rank.strip().isdigit() and world.strip().isdigit()) or int(world) < 1:
        raise ValueError(
            "Expected RANK and WORLD_SIZE to be non-negative integers (WORLD_SIZE >= 1), as "
            f"torchrun sets them, but received RANK={rank!r}, WORLD_SIZE={world!r}. Start "
            "the script with torchrun, or unset both for a single process."
        )
    if int(world) == 1:
        return None
    return RankInfo(int(rank), int(world))


def rank_now() -> int | None:
    """This process's rank in a run of several: torchrun's ``RANK``, else the process
    group's (Lightning's own launcher starts the ranks without ``RANK``); None alone."""
    info = rank_info()
    if info is not None:
        return info.rank
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return int(dist.get_rank())
    return None


def split_suffix(path: str | os.PathLike[str]) -> tuple[Path, str]:
    """``trace.json`` -> (``trace``, ``.json``); ``t.json.gz`` -> (``t``, ``.json.gz``);
    any other name keeps its last suffix, or gets ``.json`` when it has none."""
    p = Path(path)
    name = p.name
    for suffix in (".json.gz", ".json"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return p.with_name(name[: -len(suffix)]), suffix
    if p.suffix:
        return p.with_name(p.stem), p.suffix
    return p, ".json"


def rank_trace_path(path: str | os.PathLike[str], rank: int) -> Path:
    """Rank ``rank``'s file for the run whose trace is ``path``:
    ``trace.json`` -> ``trace.ranks/rank<rank>.json``, next to it. A ``.json.gz`` path's
    rank files are plain JSON: rank 0 writes the clock offsets into each file's header
    in place before it merges them. The merged file stays outside that folder, because
    HolisticTraceAnalysis takes a file without ``distributedInfo`` for rank 0."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(
            f"Expected a non-negative int for rank, but received {rank!r}. Pass this "
            "process's rank: torch.distributed.get_rank(), or int(os.environ['RANK'])."
        )
    stem, _ = split_suffix(path)
    return stem.with_name(stem.name + ".ranks") / f"rank{rank}.json"


def this_rank_path(path: Path) -> Path:
    """This process's file for the run whose trace is ``path``: ``path`` itself, or under
    torchrun its rank file (:func:`rank_trace_path`)."""
    rank = rank_now()
    return path if rank is None else rank_trace_path(path, rank)


def stage_path(
    trace_path: Path, stage: str, calls: dict[str, int], written: Sequence[Path]
) -> Path:
    """The trace file of a stage of a ``LightningProfiler``: ``trace_path`` for the first
    stage, ``<stem>.<stage>[n]<suffix>`` after it, not yet among the files ``written``
    (under torchrun, the merged file, whose per-rank path is :func:`this_rank_path`).
    ``calls`` counts the stages by name (updated)."""
    count = calls[stage] = calls.get(stage, 0) + 1
    if not written:
        return trace_path
    stem, suffix = split_suffix(trace_path)
    taken, n = set(written), count
    while True:
        candidate = stem.with_name(f"{stem.name}.{stage}{'' if n == 1 else n}{suffix}")
        if this_rank_path(candidate) not in taken:
            return candidate
        n += 1


def profiler_device(device: Any) -> str:
    """The device that profilers are told (``device`` of ``instrument()`` and
    ``LightningProfiler``): ``"cuda"`` when CUDA is available and none is given, else
    ``"cpu"``; a CUDA device on a machine without CUDA raises ``ValueError`` (its
    profilers would time nothing)."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    text = str(device)
    if text.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"Expected a device this machine has, but received device={device!r} and CUDA "
            "is not available here. Pass device='cpu', or leave device out to use CUDA "
            "where there is a GPU."
        )
    return text


def check_trace_path(trace_path: Any) -> None:
    """``trace_path`` must be None, or a ``str``/``os.PathLike`` naming a file that can be
    made: not a directory, and no folder on its way an existing file."""
    if trace_path is None:
        return
    if not isinstance(trace_path, (str, os.PathLike)):
        raise TypeError(
            "Expected a str or os.PathLike for trace_path (the Chrome trace file, e.g. "
            f"'trace.json'), but received {type(trace_path).__name__} {trace_path!r}."
        )
    text = os.fspath(trace_path)
    if not str(text).strip():
        raise ValueError(
            "Expected a file name for trace_path, but received an empty path. Pass e.g. "
            "trace_path='trace.json'."
        )
    if Path(text).is_dir():
        raise ValueError(
            f"Expected a file for trace_path, but {str(text)!r} is a directory. Pass a file in "
            f"it, e.g. trace_path={str(Path(text) / 'trace.json')!r}."
        )
    folder = file_in_the_way(text)
    if folder is not None:
        raise ValueError(
            f"Expected a file path for trace_path whose folders can be made, but "
            f"{str(folder)!r} on its way is a file. Pass a path in a folder, e.g. "
            f"trace_path={str(Path(text).name)!r}."
        )


def file_in_the_way(path: str | os.PathLike[str]) -> Path | None:
    """The existing file that stands where one of ``path``'s folders has to be, or None
    (``mkdir`` would say only "File exists")."""
    for folder in Path(path).parents:
        if folder.exists():
            return None if folder.is_dir() else folder
    return None
