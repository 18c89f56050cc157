"""The HTML pages in headless Chromium: every chart drew, the console stayed silent, and a
screenshot of each page is kept in build/artifacts/ (git-ignored).

Chromium is Debian's ``chromium`` (``bash .ci/install-viewers``); without it the tests
skip and say so. A control page with one external image proves that the console check
sees a blocked request.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from exporters import compare, render_comparison_html, render_html, spans_to_frame, step_report

pytest.importorskip("plotly", reason="the HTML pages need plotly: pip install 'ppetrace[html]'")

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "build" / "artifacts"
_CONSOLE = re.compile(r':CONSOLE(?:\(\d+\)|:\d+)\] "(.*?)", source: ', re.S)
RunBuilder = Any


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip(
            "headless Chromium is not installed (Debian's chromium): run bash .ci/install-viewers"
        )
    return found


def _load(page: Path, screenshot: Path, tmp: Path) -> tuple[str, list[str]]:
    """Open ``page`` in headless Chromium: the DOM once scripts ran, and the console."""
    done = subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={tmp / 'profile'}",
            "--hide-scrollbars",
            "--window-size=1280,2400",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=15000",
            f"--screenshot={screenshot}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
    )
    return done.stdout, [html.unescape(m) for m in _CONSOLE.findall(done.stderr)]


def _charts(dom: str) -> dict[str, str]:
    """Each chart's markup, by the id of its div."""
    ids = re.findall(r'<div id="([\w-]+)" class="chart', dom)
    out = {}
    for i, ident in enumerate(ids):
        start = dom.index(f'<div id="{ident}"')
        end = dom.index(f'<div id="{ids[i + 1]}"') if i + 1 < len(ids) else len(dom)
        out[ident] = dom[start:end]
    return out


def _drew(chart: str) -> bool:
    """plotly drew an SVG with at least one trace shape (a path with a drawing)."""
    return 'class="main-svg"' in chart and bool(re.search(r'<path[^>]* d="M[^"]*[0-9]', chart))


def _run(rb: RunBuilder, steps: list[int]) -> None:
    t = 0
    for i, dur in enumerate(steps):
        rb.span("trainer.fetch_batch", t, t + 300)
        t += 300
        step = rb.span("trainer.step", t, t + dur, 0, {"ppetrace.step": i})
        rb.span("module.train_step", t + 10, t + dur // 3, step)
        rb.span("trainer.backward", t + dur // 3, t + 2 * dur // 3, step)
        rb.span("trainer.optimizer_step", t + 2 * dur // 3, t + dur - 10, step)
        t += dur + 40


def test_both_pages_draw_every_chart_with_a_silent_console(
    run_builder: Callable[..., RunBuilder], tmp_path: Path
) -> None:
    _chromium()
    rng = np.random.default_rng(0)
    frames = []
    for scale in (1.0, 1.0, 1.3, 1.3):
        a, b = run_builder(pid=1, rank=0), run_builder(pid=2, rank=1)
        for rb in (a, b):
            _run(rb, [int(scale * 20_000 * (1 + 0.05 * rng.standard_normal())) for _ in range(40)])
        frame = spans_to_frame([a.batch(), b.batch()])
        frame["device_dur_ns"] = np.where(frame["name"] == "trainer.backward", 4_000.0, np.nan)
        frames.append(frame)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    pages = {
        "report": render_html(step_report(frames[0])),
        "compare": render_comparison_html(compare(frames[:2], frames[2:])),
    }
    expected = {
        "report": {"step-time", "step-histogram", "self-share", "device-time", "rank-steps"},
        "compare": {"changes", "step-distributions", "step-runs"},
    }
    for name, text in pages.items():
        path = tmp_path / f"{name}.html"
        path.write_text(text, encoding="utf-8")
        shot = ARTIFACTS / f"html_{name}.png"
        shot.unlink(missing_ok=True)
        dom, console = _load(path, shot, tmp_path)
        charts = _charts(dom)
        assert set(charts) == expected[name], name
        assert all(_drew(c) for c in charts.values()), [
            k for k, c in charts.items() if not _drew(c)
        ]
        assert console == [], console
        assert shot.stat().st_size > 20_000  # a page with charts, not a blank one


def test_the_console_check_sees_a_blocked_request(tmp_path: Path) -> None:
    """The control: our page frame (its Content-Security-Policy), without the plotly
    bundle to keep it quick, plus one external image: the console logs the refusal."""
    _chromium()
    from exporters._html import Page, plotly_js

    page = Page("control")
    page.paragraph("control")
    text = page.html().replace(plotly_js().replace("</script", "<\\/script"), "")
    assert "Plotly" not in text.split("<body>")[0]
    text = text.replace("<body>", '<body><img src="https://example.invalid/x.png">', 1)
    path = tmp_path / "control.html"
    path.write_text(text, encoding="utf-8")
    dom, console = _load(path, tmp_path / "control.png", tmp_path)
    assert "control" in dom
    assert any("example.invalid" in m and "Content Security Policy" in m for m in console)
