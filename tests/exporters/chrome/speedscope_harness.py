"""Load a trace in speedscope (its npm package) in headless Chromium; read what it shows.

speedscope is served from 127.0.0.1 with the trace (``#profileURL=``), Chromium
renders it headless (``--dump-dom``), and its console messages come back on
stderr (``--enable-logging``). The viewers are installed by
``bash .ci/install-viewers`` (Debian's ``chromium``; ``speedscope`` into
``build/viewers``); where they are missing the tests skip and say so.
"""

from __future__ import annotations

import functools
import html
import http.server
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RELEASE = ROOT / "build" / "viewers" / "node_modules" / "speedscope" / "dist" / "release"
INSTALL = "bash .ci/install-viewers"
_CONSOLE = re.compile(r':CONSOLE(?:\(\d+\)|:\d+)\] "(.*?)", source: ', re.S)


def viewers() -> tuple[str, Path]:
    """Chromium's executable and speedscope's release folder; skips the test where one is
    missing, naming the command that installs both."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    release = Path(os.environ.get("PPETRACE_SPEEDSCOPE", RELEASE))
    if chromium is None:
        pytest.skip(f"headless Chromium is not installed (Debian's chromium): run {INSTALL}")
    if not (release / "index.html").is_file():
        pytest.skip(f"speedscope's npm package is not in {release}: run {INSTALL}")
    return chromium, release


@dataclass
class Shown:
    """What speedscope showed: its console messages, the text of the page and the
    Sandwich view's rows ``(total, self, symbol)``."""

    console: list[str]
    text: list[str]
    rows: list[tuple[str, str, str]]

    @property
    def warnings(self) -> list[str]:
        """Messages about frames that did not nest, and errors."""
        words = ("Tried to end", "still open", "rror", "Unrecognized", "Failed")
        return [m for m in self.console if any(w in m for w in words)]

    @property
    def symbols(self) -> list[str]:
        return [r[2] for r in self.rows]


def show(trace: Path, *, view: str = "sandwich", timeout: float = 90.0) -> Shown:
    """Load ``trace`` in speedscope in headless Chromium and read the page."""
    chromium, release = viewers()
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        site.mkdir()
        for item in release.iterdir():
            (site / item.name).symlink_to(item)
        shutil.copy(trace, site / "trace.json")
        handler = functools.partial(_Quiet, directory=str(site))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        port = server.server_address[1]
        url = f"http://127.0.0.1:{port}/index.html#profileURL=/trace.json&view={view}"
        try:
            done = subprocess.run(
                [
                    chromium,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--no-first-run",
                    f"--user-data-dir={tmp}/profile",
                    "--enable-logging=stderr",
                    "--v=0",
                    "--virtual-time-budget=20000",
                    "--dump-dom",
                    url,
                ],
                capture_output=True,
                text=True,
                timeout=timeout,
                env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
            )
        finally:
            server.shutdown()
            server.server_close()
    console = [html.unescape(m) for m in _CONSOLE.findall(done.stderr)]
    text = [html.unescape(t.strip()) for t in re.sub(r"<[^>]+>", "\n", done.stdout).split("\n")]
    text = [t for t in text if t]
    rows: list[tuple[str, str, str]] = []
    if "Symbol Name" in text:
        cells = text[text.index("Symbol Name") + 1 :]
        rows = [tuple(cells[i : i + 3]) for i in range(0, len(cells) - 2, 3)]  # type: ignore[misc]
    return Shown(console, text, rows)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass
