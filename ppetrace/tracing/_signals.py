"""SIGTERM: deliver what is recorded and close the files, then do what was going to happen.

Schedulers and ``kill`` stop a job with SIGTERM, which runs no ``atexit``
hook. :func:`install` (called by ``configure(handle_sigterm=True)``, the
default, from the main thread) puts a handler in front of the one that was
there. On SIGTERM it runs ``on_term`` (flush and shut down the exporters) on
a helper thread, waits for it at most ``timeout`` seconds (the signal
handler runs in the main thread between two bytecodes, maybe while that
thread holds a lock the flush needs), then chains: it calls the previous
handler if it was a function, returns if it was ``SIG_IGN``, and otherwise
restores the default action and raises the signal again, so the process ends
as it would have without ppetrace. ``configure(handle_sigterm=False)``
removes it and installs nothing.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["active", "install", "uninstall"]

_previous: Any = None
_installed: Callable[[int, Any], None] | None = None


def active() -> bool:
    """Whether ppetrace's SIGTERM handler is the one installed now."""
    return (
        _installed is not None
        and hasattr(signal, "SIGTERM")
        and signal.getsignal(signal.SIGTERM) is _installed
    )


def install(on_term: Callable[[], None], timeout: Callable[[], float]) -> bool:
    """Install the handler (once); False where it cannot be (not the main thread, no
    SIGTERM on this platform)."""
    global _previous, _installed
    if not hasattr(signal, "SIGTERM") or threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGTERM)
    if _installed is not None and current is _installed:
        return True

    def handler(signum: int, frame: Any) -> None:
        helper = threading.Thread(target=on_term, name="ppetrace-sigterm", daemon=True)
        helper.start()
        helper.join(timeout())
        previous = _previous
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):  # not the main interpreter, or not allowed here
        return False
    _previous = current
    _installed = handler
    return True


def uninstall() -> None:
    """Put back the handler that was there before :func:`install`, if ours is current."""
    global _previous, _installed
    if _installed is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _installed:
        signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
    _previous = _installed = None
