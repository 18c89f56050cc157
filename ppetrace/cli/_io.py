"""Output helpers of the ``ppetrace`` command line (:mod:`ppetrace.cli`): the one-line
user error and writing text to a stream or a file."""

from __future__ import annotations

from pathlib import Path
from typing import IO

__all__ = ["_BadInput", "_emit", "_write", "check_parent"]


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


def check_parent(path: str, option: str) -> None:
    """A :class:`_BadInput` when a file stands where ``path``'s folder, or a folder above
    it, has to be."""
    from ..integrations._ranks import file_in_the_way

    blocker = file_in_the_way(path)
    if blocker is not None:
        raise _BadInput(
            f"Expected a path in a folder for {option}, but {blocker} is a file, so "
            f"{path} cannot be written. Pass a path whose folders are folders."
        )


def _emit(text: str, output: str | None, out: IO[str]) -> None:
    if output is None:
        _write(out, text)
        return
    check_parent(output, "--output")
    try:
        Path(output).parent.mkdir(parents=True, exist_ok=True)  # as run --trace and merge do
        Path(output).write_text(text, encoding="utf-8", errors="backslashreplace")
    except OSError as exc:
        raise _BadInput(
            f"Expected a writable file path for --output, but writing {output} failed: "
            f"{exc.strerror or exc}. Pass a file path in a folder you can write to."
        ) from None
