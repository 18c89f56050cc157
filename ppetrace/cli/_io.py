"""Output helpers of the ``ppetrace`` command line (:mod:`ppetrace.cli`): the one-line
user error and writing text to a stream or a file."""

from __future__ import annotations

from pathlib import Path
from typing import IO

__all__ = ["_BadInput", "_emit", "_write"]


class _BadInput(Exception):
    """A user error: printed as one line, exit code 2."""


def _write(stream: IO[str], text: str) -> None:
    """Write ``text``; characters the stream cannot encode (a lone surrogate in a
    span name, an emoji on a Latin-1 terminal) are written as backslash escapes."""
    try:
        stream.write(text)
    except UnicodeEncodeError:
        encoding = getattr(stream, "encoding", None) or "utf-8"
        stream.write(text.encode(encoding, "backslashreplace").decode(encoding))


def _emit(text: str, output: str | None, out: IO[str]) -> None:
    if output is None:
        _write(out, text)
        return
    try:
        Path(output).parent.mkdir(parents=True, exist_ok=True)  # as run --trace and merge do
        Path(output).write_text(text, encoding="utf-8", errors="backslashreplace")
    except OSError as exc:
        raise _BadInput(
            f"Expected a writable file path for --output, but writing {output} failed: "
            f"{exc.strerror or exc}. Pass a file path in a folder you can write to."
        ) from None
