"""The reading commands' memory allocator settings.

Reading a long run's trace builds and frees many arrays of tens of MB. glibc's
``malloc`` serves each one with a fresh ``mmap`` and returns it at ``free``, so the
kernel zeroes every page again on the next one: on a 1.5 GB trace, 5.5 of the 21 s of
CPU that ``ppetrace report`` took were the kernel's (3.8-4.5 s with these settings).
:func:`keep_freed_memory` lets the heap serve every block (no ``mmap`` at all: pandas
joins a frame's columns of one type into 2-D blocks of hundreds of MB) and keep up to
1 GiB of freed memory for the next ones. That took the kernel's share of ``ppetrace
report`` on the same trace from 2.2-3.7 s to 1.5-1.8 s, and its wall time from
9.8-11.1 s to 8.6-9.6 s (four runs each, interleaved). It is for a short-lived process
that reads and exits
(``ppetrace report``, ``compare``, ``merge`` run from the command line), never for a
training process (``ppetrace run``), whose memory it would hold on to.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["keep_freed_memory"]

# glibc's malloc.h
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -2, -3, -4


def keep_freed_memory() -> bool:
    """Tune glibc's ``malloc`` for this process as the module doc says; True when it
    took the settings, False elsewhere (another C library or platform: nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = (
        (_M_MMAP_THRESHOLD, 32 << 20),
        (_M_MMAP_MAX, 0),  # (a thread's arena still maps what its heap cannot hold)
        (_M_TRIM_THRESHOLD, 1 << 30),
        (_M_TOP_PAD, 64 << 20),
    )
    return all(mallopt(option, value) == 1 for option, value in settings)
