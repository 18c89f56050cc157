"""The tests' 2-process torchrun launcher (the ``torchrun_two`` and ``torchrun_run``
fixtures of tests/conftest.py use it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings

import pytest

__all__ = ["EXIT_ABORT", "TORCHRUN_TIMEOUT_S", "torchrun_two_processes"]

#: Seconds a torchrun launch of the tests may take before it counts as hung.
TORCHRUN_TIMEOUT_S = 240


#: What a rank prints when torch's gloo threads abort the process at its exit (a C++
#: thread still joinable when the interpreter ends: pytorch#179291, #190489). Seen twice
#: in about fifteen CI runs, after every output of the run was written.
EXIT_ABORT = "terminate called without an active exception"


def torchrun_two_processes(*argv: str, timeout: float = TORCHRUN_TIMEOUT_S) -> str:
    """``torchrun --standalone --nproc_per_node 2 ARGV...`` (gloo over loopback, one torch
    thread each); its stderr, after checking that it ended with exit code 0 within
    ``timeout`` s (a run that hangs is killed with its workers). Skips without gloo. A run
    that torch's exit abort (:data:`EXIT_ABORT`) failed runs once more, with a warning:
    any other failure, or that abort twice, fails the test."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    for attempt in (1, 2):
        code, stdout, stderr = _torchrun_once(argv, timeout)
        if code == 0:
            return stderr
        if attempt == 1 and EXIT_ABORT in stderr:
            warnings.warn(
                f"the torchrun run ended in torch's exit abort ({EXIT_ABORT!r}); run again",
                stacklevel=2,
            )
            continue
        break
    pytest.fail(
        f"the torchrun run failed with exit code {code}:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    )


def _torchrun_once(argv: tuple[str, ...], timeout: float) -> tuple[int, str, str]:
    """One launch: its exit code, stdout and stderr (a hang fails the test)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1",
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc_per_node", "2", *argv,
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # torchrun and its workers: one process group to end
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the torchrun run did not end in {timeout:g} s:\n{stderr[-6000:]}")
    return proc.returncode, stdout, stderr
