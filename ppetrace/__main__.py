"""``python -m ppetrace``: the same command as ``ppetrace``."""

from __future__ import annotations

import sys

from ppetrace.cli import main

if __name__ == "__main__":
    sys.exit(main())
