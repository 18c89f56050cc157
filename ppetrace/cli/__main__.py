"""``python -m ppetrace.cli``: the same command as ``ppetrace``."""

from __future__ import annotations

import sys

from . import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
