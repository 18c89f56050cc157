"""What a run ran on: the environment record that goes into a trace's ``otherData``.

:func:`capture_environment` returns a flat, JSON-safe dict with the fields
below; ``ppetrace compare`` warns about each one that differs between the
base and the candidate runs. The Trainer, the pytest plugin and any other
writer of ppetrace traces call this one function, so every trace records the
same fields.

torch is read through ``sys.modules`` only: tracing never imports torch, and
a process that has not imported torch records ``torch: None``.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from functools import lru_cache
from typing import Any

from .._version import __version__

__all__ = ["ENVIRONMENT_FIELDS", "capture_environment", "refresh_environment"]

#: The fields of :func:`capture_environment`, in the order they are shown.
ENVIRONMENT_FIELDS = (
    "python",
    "torch",
    "cpu_model",
    "cpu_count",
    "torch_threads",
    "device",
    "ppetrace",
)


@lru_cache(maxsize=1)
def _cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("model name", "Hardware", "Processor", "cpu model"):
                    return " ".join(value.split()) or None
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def _cgroup_cpus(root: str = "/sys/fs/cgroup") -> int | None:
    """The CPUs a cgroup quota allows this process (rounded up), or None without a quota:
    cgroup v2's ``cpu.max`` (``"150000 100000"``), else v1's ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``."""
    try:
        with open(os.path.join(root, "cpu.max"), encoding="ascii") as f:
            quota, _, period = f.read().strip().partition(" ")
    except OSError:
        try:
            with open(os.path.join(root, "cpu", "cpu.cfs_quota_us"), encoding="ascii") as f:
                quota = f.read().strip()
            with open(os.path.join(root, "cpu", "cpu.cfs_period_us"), encoding="ascii") as f:
                period = f.read().strip()
        except OSError:
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    if q <= 0 or p <= 0:
        return None
    return max(1, -(-q // p))


#: pid -> its cgroup's CPU quota (:func:`_cgroup_cpus`), read once per process
_quota: dict[int, int | None] = {}


def _cpu_count(cgroup_root: str | None = None) -> int | None:
    """The CPUs this process may run on: its affinity where the OS has one, and no more
    than its cgroup's CPU quota allows (containers). The quota of ``/sys/fs/cgroup``
    (``cgroup_root`` None) is read once per process: its files cost 50-250 µs, which
    every ``instrument()`` paid."""
    count = os.cpu_count()
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        with contextlib.suppress(OSError):
            count = len(affinity(0))
    if cgroup_root is None:
        pid = os.getpid()
        if pid not in _quota:
            _quota.clear()  # a forked child's own
            _quota[pid] = _cgroup_cpus()
        quota = _quota[pid]
    else:
        quota = _cgroup_cpus(cgroup_root)
    if quota is not None and count is not None:
        return min(count, quota)
    return count


def _device_name(torch: Any, device: str) -> str:
    """``device``, with the GPU's name for a CUDA device once CUDA is initialized."""
    if not device.startswith("cuda"):
        return device
    try:
        cuda = torch.cuda
        if not cuda.is_initialized():
            return device
        index = int(device.split(":", 1)[1]) if ":" in device else cuda.current_device()
        return f"{device} ({cuda.get_device_name(index)})"
    except Exception:  # telemetry never breaks the run
        return device


def capture_environment(*, device: object = None) -> dict[str, Any]:
    """The environment of this process, as recorded in a trace's ``otherData.environment``.

    Fields (:data:`ENVIRONMENT_FIELDS`): ``python`` (version), ``torch``
    (version, or ``None`` when torch is not imported), ``cpu_model``,
    ``cpu_count`` (CPUs this process may use: its affinity, within its cgroup's CPU
    quota, read once per process), ``torch_threads``
    (``torch.get_num_threads()``, or ``None``), ``device`` (``str(device)``,
    with the GPU's name once CUDA is initialized; ``None`` when not given) and
    ``ppetrace`` (version). Never imports torch and never raises.
    """
    machine = {
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_count": _cpu_count(),
        "ppetrace": __version__,
    }
    return refresh_environment(machine, device=device)


def refresh_environment(environment: dict[str, Any], *, device: object = None) -> dict[str, Any]:
    """``environment`` (from :func:`capture_environment`) with the fields that a running
    script changes read again: ``torch`` (imported since), ``torch_threads``
    (``torch.set_num_threads``) and ``device`` (the GPU's name once CUDA is initialized).
    The machine's fields are kept: reading the cgroup quota again opens files (tens of
    µs each), which ``instrument()`` would pay at every drain before the header is
    written. Never raises."""
    fields = {**environment, **_torch_fields(device)}
    ordered = {key: fields.pop(key, None) for key in ENVIRONMENT_FIELDS}
    return {**ordered, **fields}


def _torch_fields(device: object) -> dict[str, Any]:
    """``torch``, ``torch_threads`` and ``device`` of :func:`capture_environment`."""
    torch = sys.modules.get("torch")
    torch_version = getattr(torch, "__version__", None) if torch is not None else None
    threads: int | None = None
    if torch is not None:
        try:
            threads = int(torch.get_num_threads())
        except Exception:
            threads = None
    device_text = None if device is None else str(device)
    if device_text is not None and torch is not None:
        device_text = _device_name(torch, device_text)
    return {
        "torch": None if torch_version is None else str(torch_version),
        "torch_threads": threads,
        "device": device_text,
    }
