"""Errors raised by the exporters."""

from __future__ import annotations

__all__ = ["TraceError"]


class TraceError(ValueError):
    """A file that is not a readable trace, or traces that cannot be analysed together."""
