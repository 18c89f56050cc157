"""Training under torch.distributed: the process group, DDP, samplers, gathers, checkpoints.

Takes in: a Trainer call running under torchrun (or in any process group) and
its adapter. Hands on, through :class:`Distributed`:

- the process group: with ``distributed="auto"``, torchrun's environment
  (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) starts one
  when none exists (gloo on CPU, nccl on CUDA; ``"cuda"`` becomes
  ``"cuda:<LOCAL_RANK>"``); an existing group is used as it is. Object
  gathers and the clock pings run on a gloo group (the default one, or one
  made for them when the default is nccl);
- the module in ``DistributedDataParallel`` (or the user's own wrapper),
  with the batches of an accumulation group that do not step run under
  ``no_sync()``;
- samplers: a DataLoader with the default sampler is re-created with a
  ``DistributedSampler`` for training (seed 0, shuffled when its sampler
  was a ``RandomSampler``) and a :class:`ShardSampler` for evaluation, as
  Lightning does; a ModuleInterface gets those classes from the Trainer in
  ``get_*_dataloader(sampler, batch_size)``, as PyMarlin's DDP backend passes them;
- outputs gathered from every rank, in rank order (:meth:`Distributed.gather`);
- checkpoints written by rank 0 only, atomically, with every rank's RNG states,
  then a barrier; a resumed rank takes its own RNG states back;
- per-rank trace files on rank 0's clock, merged by rank 0 at the end of the
  call (:class:`ppetrace.integrations.distributed.RankTraces`).
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)
from torch.utils.data.distributed import DistributedSampler

from ..integrations.distributed import RankTraces, rank_trace_path, share_trace_id, untraced
from ._adapters import Adapter, InterfaceAdapter
from ._checkpoint import save_atomic

__all__ = ["Distributed", "ShardSampler", "check_mode", "set_epoch"]

_log = logging.getLogger("ppetrace")
_dist = torch.distributed
#: torchrun's variables that ``distributed="auto"`` needs to start a process group
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_gloo_groups: dict[int, Any] = {}  # id of the default group -> its gloo twin


def check_mode(value: Any) -> str | None:
    """Validate ``Trainer(distributed=...)``: ``"auto"`` or ``None``."""
    if value is None or value == "auto":
        return value
    raise ValueError(
        f"Expected 'auto' or None for distributed, but received {value!r}. Pass "
        "distributed='auto' (torchrun's process group, the default) or None (no "
        "torch.distributed at all)."
    )


def _wants_cuda(device: Any) -> bool:
    kind = getattr(device, "device_type", None) or getattr(device, "type", None)
    if kind is None:
        kind = str(device).split(":", 1)[0]
    return kind == "cuda"


class ShardSampler(Sampler[int]):
    """Rank ``r`` of ``N`` takes a contiguous ``1/N`` of the indices, in order, unpadded (the
    shards differ by at most one index): for evaluation, where every sample counts once and
    the gathered outputs, in rank order, come back in dataset order. Built like
    ``DistributedSampler`` (``ShardSampler(dataset)`` reads the group)."""

    def __init__(
        self, data_source: Any, num_replicas: int | None = None, rank: int | None = None
    ) -> None:
        self.n = len(data_source)
        self.num_replicas = _dist.get_world_size() if num_replicas is None else num_replicas
        self.rank = _dist.get_rank() if rank is None else rank
        self.start = self.n * self.rank // self.num_replicas
        self.end = self.n * (self.rank + 1) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))

    def __len__(self) -> int:
        return self.end - self.start


def set_epoch(loader: Any, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on the loader's sampler and batch sampler's sampler, where
    they have one (``DistributedSampler``): each epoch its own shuffle, a resumed epoch the
    same one."""
    for sampler in (
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ):
        fn = getattr(sampler, "set_epoch", None)
        if callable(fn):
            fn(epoch)


def _recreate(loader: DataLoader, sampler: Sampler[int]) -> DataLoader:
    """A DataLoader like ``loader`` with ``sampler`` instead of its default one."""
    kwargs: dict[str, Any] = {
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    return DataLoader(loader.dataset, sampler=sampler, **kwargs)


def distributed_loader(loader: Any, *, train: bool, rank: int, world_size: int) -> Any:
    """``loader`` with a rank's share of the data (see the module doc); loaders that are not
    DataLoaders, iterable datasets and loaders that already shard are returned as they are;
    a custom sampler is kept with a warning."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    sampler = loader.sampler
    if isinstance(sampler, (DistributedSampler, ShardSampler)):
        return loader
    default = type(sampler) in (RandomSampler, SequentialSampler) and (
        type(loader.batch_sampler) is BatchSampler or loader.batch_sampler is None
    )
    if not default:
        warnings.warn(
            f"ppetrace: the {'training' if train else 'evaluation'} DataLoader has its own "
            f"sampler ({type(sampler).__name__}), which the Trainer keeps: every rank may see "
            "the same data. Give it a DistributedSampler, or pass use_distributed_sampler="
            "False to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return loader
    if type(loader) is not DataLoader:
        raise ValueError(
            f"Expected a torch.utils.data.DataLoader to re-create with a DistributedSampler, "
            f"but received a subclass ({type(loader).__name__}), which the Trainer cannot "
            "rebuild. Pass sampler=DistributedSampler(dataset) when you build it, or "
            "Trainer(use_distributed_sampler=False) to shard the data yourself."
        )
    if train:
        new: Sampler[int] = DistributedSampler(
            loader.dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=isinstance(sampler, RandomSampler),
            seed=0,
        )
    else:
        new = ShardSampler(loader.dataset, world_size, rank)
    return _recreate(loader, new)


def _gloo_group(backend: str) -> Any:
    """A gloo group over every rank: the default group when it is gloo, else one made once."""
    if "gloo" in backend:
        return None
    key = id(_dist.distributed_c10d._get_default_group())
    if key not in _gloo_groups:
        _gloo_groups[key] = _dist.new_group(backend="gloo")
    return _gloo_groups[key]


class _DDP(torch.nn.parallel.DistributedDataParallel):
    """DDP whose unknown attributes are the wrapped module's, for code (a delira closure)
    that reads ``model.<attr>`` from the model it is given."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


class Distributed:
    """The process group of a Trainer call and what the Trainer does with it."""

    def __init__(self, *, backend: str, created: bool) -> None:
        self.rank = _dist.get_rank()
        self.world_size = _dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.backend = backend
        #: whether ppetrace started the process group
        self.created = created
        self.cpu_group = _gloo_group(backend)
        self._share_trace_id()
        #: the per-rank trace files of this group's calls
        self.traces = RankTraces(self.cpu_group, backend)

    @classmethod
    def resolve(cls, mode: str | None, device: Any) -> Distributed | None:
        """The group for ``Trainer(distributed=mode)``, started from torchrun's environment
        when needed; ``None`` when off or alone (world size 1)."""
        if mode is None or not _dist.is_available():
            return None
        created = False
        if not _dist.is_initialized():
            if any(v not in os.environ for v in LAUNCH_VARIABLES):
                return None
            if int(os.environ["WORLD_SIZE"]) < 2:
                return None
            backend = "gloo"
            if _wants_cuda(device) and torch.cuda.is_available() and _dist.is_nccl_available():
                backend = "nccl"
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            _dist.init_process_group(backend=backend)
            created = True
            _log.info("ppetrace: started a %s process group from torchrun's environment", backend)
        if _dist.get_world_size() < 2:
            return None
        return cls(backend=str(_dist.get_backend()), created=created)

    def _share_trace_id(self) -> None:
        """Every rank records into rank 0's trace id: one run, one trace."""
        share_trace_id(self.cpu_group)

    # -- device and module ------------------------------------------------------------

    def local_device(self, device: Any) -> Any:
        """``"cuda"`` (no index) -> ``"cuda:<LOCAL_RANK>"``; anything else as it is."""
        if isinstance(device, str) and device == "cuda":
            return f"cuda:{self.local_rank}"
        if isinstance(device, torch.device) and device.type == "cuda" and device.index is None:
            return torch.device("cuda", self.local_rank)
        return device

    def wrap(self, adapter: Adapter, runtime: Any) -> torch.nn.Module:
        """The module the training step calls: the user's DDP wrapper, or a new one."""
        if adapter.ddp is not None:
            return adapter.ddp
        spec = torch.device(runtime.device_spec) if runtime.device_type == "cuda" else None
        ids = [spec.index] if spec is not None and spec.index is not None else None
        return _DDP(adapter.module, device_ids=ids)

    def unsynced(self, step: Callable[..., Any], ddp: Any) -> Callable[..., Any]:
        """``step`` run under ``ddp.no_sync()``: a batch that accumulates without stepping."""
        no_sync = getattr(ddp, "no_sync", None)
        if no_sync is None:
            return step

        def quiet(*args: Any) -> Any:
            with no_sync():
                return step(*args)

        return quiet

    def average_gradients(self, module: torch.nn.Module) -> None:
        """All-reduce and average the gradients (a last partial group of a loader without
        ``len()`` ran under ``no_sync``)."""
        all_reduce = untraced("all_reduce")
        for p in module.parameters():
            if p.grad is not None:
                all_reduce(p.grad)
                p.grad.div_(self.world_size)

    # -- data ---------------------------------------------------------------------------

    def shard(self, adapter: Adapter) -> None:
        """Give every loader of ``adapter`` this rank's share (see the module doc)."""
        if isinstance(adapter, InterfaceAdapter):
            adapter.train_sampler = DistributedSampler
            adapter.eval_sampler = ShardSampler
        kw = {"rank": self.rank, "world_size": self.world_size}
        if adapter._train_loader is not None:
            adapter._train_loader = distributed_loader(adapter._train_loader, train=True, **kw)
        for attr in ("_val_loaders", "_test_loaders"):
            loaders = getattr(adapter, attr)
            if isinstance(loaders, Mapping):
                shared = {k: distributed_loader(v, train=False, **kw) for k, v in loaders.items()}
                setattr(adapter, attr, shared)
            elif loaders is not None:
                setattr(adapter, attr, distributed_loader(loaders, train=False, **kw))

    def full_batches(self, adapter: Adapter, loader: Any) -> int | None:
        """Batches per epoch over the whole dataset (PyMarlin's step estimate divides them by
        the world size): a ModuleInterface's loader built with ``SequentialSampler`` (as
        PyMarlin), a sharded DataLoader's dataset in batches, else the loader's length."""
        if isinstance(adapter, InterfaceAdapter) and adapter._train_loader is None:
            whole = adapter.module.get_train_dataloader(SequentialSampler, adapter.batch_size)
            loader = whole if whole is not None else loader
        if isinstance(loader, DataLoader) and isinstance(
            loader.sampler, (DistributedSampler, ShardSampler)
        ):
            if loader.batch_size is None:
                return len(loader.dataset)  # type: ignore[arg-type]
            n = len(loader.dataset)  # type: ignore[arg-type]
            size = loader.batch_size
            return n // size if loader.drop_last else math.ceil(n / size)
        try:
            return len(loader)
        except TypeError:
            return None

    # -- outputs ----------------------------------------------------------------------

    def gather(self, outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        """Every rank's collated outputs joined in rank order (tensors concatenated on
        dim 0, dicts key by key, lists joined); every rank gets the same result."""
        parts: list[Any] = [None] * self.world_size
        untraced("all_gather_object")(parts, tuple(outputs), group=self.cpu_group)
        parts = [p for p in parts if p]
        if not parts:
            return ()
        width = max(len(p) for p in parts)
        parts = [p for p in parts if len(p) == width]
        return tuple(_join([p[i] for p in parts]) for i in range(width))

    # -- checkpoints ----------------------------------------------------------------

    def save(self, state: dict[str, Any], path: Path) -> None:
        """Rank 0 writes ``state`` (with every rank's RNG states under ``"ranks"``)
        atomically; every rank then waits for it at a barrier."""
        own = {"rng": state["rng"], "epoch_rng": state["trainer"].get("epoch_rng")}
        ranks: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        untraced("gather_object")(own, ranks, dst=0, group=self.cpu_group)
        if self.rank == 0:
            save_atomic({**state, "ranks": ranks}, path)
        untraced("barrier")(group=self.cpu_group)

    def own_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` with this rank's RNG states in place of rank 0's, when it has
        every rank's (a checkpoint of another world size keeps rank 0's, with a warning)."""
        ranks = checkpoint.get("ranks")
        if not isinstance(ranks, list):
            return checkpoint
        if len(ranks) != self.world_size:
            warnings.warn(
                f"ppetrace: the checkpoint holds the RNG states of {len(ranks)} ranks, but "
                f"this run has {self.world_size}; every rank resumes with rank 0's, so the "
                "run is not bit-identical to an uninterrupted one.",
                RuntimeWarning,
                stacklevel=3,
            )
            return checkpoint
        mine = ranks[self.rank]
        trainer = {**checkpoint["trainer"], "epoch_rng": mine["epoch_rng"]}
        return {**checkpoint, "rng": mine["rng"], "trainer": trainer}

    # -- traces ---------------------------------------------------------------------

    def trace_options(self) -> dict[str, Any]:
        """This rank's ``ChromeTraceExporter`` options (see :class:`RankTraces`)."""
        return self.traces.exporter_options()

    def rank_path(self, path: Path) -> Path:
        """This rank's file for the merged trace ``path``."""
        return rank_trace_path(path, self.rank)

    def finish_trace(self, merged: Path) -> bool:
        """End of a call: the end clock measurement and rank 0's merge (:class:`RankTraces`)."""
        return self.traces.finish(merged)


def _join(values: list[Any]) -> Any:
    """One output over the ranks: tensors concatenated, dicts key by key, lists joined."""
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.cat([v.reshape(1) if v.dim() == 0 else v for v in values], dim=0)
    if all(type(v) is dict for v in values) and all(v.keys() == values[0].keys() for v in values):
        return {k: _join([v[k] for v in values]) for k in values[0]}
    if all(isinstance(v, list) for v in values):
        return [x for v in values for x in v]
    return list(values)
