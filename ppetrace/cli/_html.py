"""``--html OUT.html`` of ``ppetrace report`` and ``ppetrace compare``: the page of
:func:`exporters.render_html` / :func:`exporters.render_comparison_html`, written
beside the text output. Without plotly (the ``ppetrace[html]`` extra) it is a
one-line error naming the extra, exit code 2."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import IO

from ._io import _BadInput, check_parent

__all__ = ["add_html_option", "write_html"]


def add_html_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--html OUT.html`` to a subcommand's parser."""
    parser.add_argument(
        "--html",
        metavar="OUT.html",
        default=None,
        help="also write a self-contained HTML page with charts (needs ppetrace[html])",
    )


def write_html(path: str | None, render: Callable[[], str], err: IO[str]) -> None:
    """Write ``render()`` to ``path`` (nothing when ``path`` is None) and say so on
    ``err``; a missing plotly or an unwritable path is a :class:`_BadInput`."""
    if path is None:
        return
    from exporters._html import HtmlDependencyError

    try:
        page = render()
    except HtmlDependencyError as exc:
        raise _BadInput(str(exc)) from None
    check_parent(path, "--html")
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # as --output does
        Path(path).write_text(page, encoding="utf-8")
    except OSError as exc:
        raise _BadInput(
            f"Expected a writable file path for --html, but writing {path} failed: "
            f"{exc.strerror or exc}. Pass a file path in a folder you can write to."
        ) from None
    err.write(f"ppetrace: wrote {path} ({len(page) / 1e6:.1f} MB)\n")
