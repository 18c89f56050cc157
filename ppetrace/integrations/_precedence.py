"""Who traces the loop: ppetrace's own drivers take precedence over instrument()'s hooks.

While a ``ppetrace.Trainer`` call (``fit``, ``validate``, ``test``) runs, its
spans describe the loop exactly, and while a :class:`LightningProfiler` is set
up, Lightning's actions do. The global hooks of ``instrument()`` then stand
aside (call through, record nothing), so no fetch, forward, backward or
optimizer step is traced twice. The Trainer's flag is read from
``ppetrace.training._session.running`` without importing the training package
(which ``instrument()`` does not need): until a script imports it, no Trainer
can be running, and when it does, ``_session`` puts itself in :data:`session`,
so hooks installed before the import see its Trainer calls too.
"""

from __future__ import annotations

import sys
from types import ModuleType

__all__ = ["drivers", "standing_aside"]

_SESSION = "ppetrace.training._session"
#: ``ppetrace.training._session`` once it is imported (its ``running`` counts Trainer
#: calls): it registers itself here on import (and :func:`standing_aside` looks it up
#: if it was imported some other way); the hooks read it directly
session: list[ModuleType | None] = [None]
#: LightningProfiler sessions set up and not torn down yet
drivers = [0]


def standing_aside() -> bool:
    """Whether a Trainer call or a LightningProfiler is tracing the loop right now.

    The DataLoader hook calls this once per batch (a Trainer's loop fetches a batch
    before it runs a module, a backward or an optimizer step); the other hooks read
    :data:`session` and :data:`drivers` inline, which is cheaper."""
    if drivers[0]:
        return True
    current = session[0]
    if current is None:
        current = sys.modules.get(_SESSION)
        if current is None:
            return False
        session[0] = current
    return bool(getattr(current, "running", 0))
