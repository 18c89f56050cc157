"""The HTML pages: what their charts hold (read back from the page's figure data), that they
request nothing, escape trace text, downsample long runs, and name the extra without plotly.
Drawing them in a browser is tests/exporters/test_html_browser.py."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import exporters
from exporters import _html as html_module
from exporters import compare, render_comparison_html, render_html, spans_to_frame, step_report
from ppetrace.cli import main

pytest.importorskip("plotly", reason="the HTML pages need plotly: pip install 'ppetrace[html]'")

RunBuilder = Any
EVIL = "</script><img src=x onerror=alert(1)>"


def _run(rb: RunBuilder, steps: list[int], *, fetch: int = 200, evil: bool = False) -> None:
    t = 0
    for i, dur in enumerate(steps):
        rb.span("trainer.fetch_batch", t, t + fetch)
        t += fetch
        step = rb.span("trainer.step", t, t + dur, 0, {"ppetrace.step": i})
        rb.span("module.train_step", t + 10, t + dur // 3, step)
        rb.span("trainer.backward", t + dur // 3, t + 2 * dur // 3, step)
        rb.span("trainer.optimizer_step", t + 2 * dur // 3, t + dur - 10, step)
        if evil:
            rb.span(EVIL, t + 1, t + 5, step)
        t += dur + 30


SCALE = {"ns": 1.0, "µs": 1e3, "ms": 1e6, "s": 1e9}


def scale(axis: dict[str, Any]) -> float:
    """ns per unit of a chart axis titled with its unit."""
    return SCALE[axis["title"]["text"].split(",")[0]]


def figures(page: str) -> dict[str, Any]:
    """The page's figure data (``const FIGURES=...``), as plotly.js receives it."""
    found = re.search(r"const FIGURES=(.*?);\n", page, re.S)
    assert found is not None
    return dict(json.loads(found.group(1).replace("<\\/", "</")))


def _report_page(run_builder: Callable[..., RunBuilder], steps: list[int]) -> tuple[Any, str]:
    rb = run_builder()
    _run(rb, steps, evil=True)
    frame = spans_to_frame(rb.batch())
    frame.attrs["metadata"] = {"environment": {"device": "cpu", "torch_threads": 2, "cpu_count": 2}}
    report = step_report(frame, warmup_steps=1)
    return report, render_html(report)


def test_the_report_page_is_self_contained_and_its_charts_hold_the_report(
    run_builder: Callable[..., RunBuilder],
) -> None:
    steps = [3_000 * (1 + i % 4) for i in range(40)]
    report, page = _report_page(run_builder, steps)
    assert page.startswith("<!DOCTYPE html>")
    assert "default-src 'none'" in page  # the browser may fetch nothing for it
    outside = re.sub(r"<script>.*?</script>", "", page, flags=re.S)  # the markup itself
    assert outside.count("<table") == 2 and "<script" not in outside
    assert not re.search(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=", outside)
    assert "Plotly.newPlot" in page and "plotly.js v" in page  # the bundle, inline
    assert EVIL not in page and "&lt;/script&gt;&lt;img src=x" in page  # escaped in the table
    for fact in ("39 counted of 40", "1 step (warmup_steps=1)", "torch threads", "cpu"):
        assert fact in page
    figs = figures(page)
    assert {"step-time", "step-histogram", "self-share"} <= set(figs)
    # stacked parts: every step, adding up to its wall time
    line = figs["step-time"]["data"]
    assert [t["name"] for t in line] == ["data wait", "forward", "backward", "optimizer", "other"]
    unit = scale(figs["step-time"]["layout"]["yaxis"])
    assert unit == 1e3  # steps of 3 to 12 µs are drawn in µs
    stacked = np.sum([t["y"] for t in line], axis=0)
    np.testing.assert_allclose(stacked, report.steps["wall_ns"] / unit, rtol=1e-5)
    assert len(line[0]["x"]) == 39
    # the histogram counts every step; p50/p90/p99 are marked where they are
    hist = figs["step-histogram"]
    assert sum(hist["data"][0]["y"]) == 39
    wall = report.steps["wall_ns"].to_numpy() / scale(hist["layout"]["xaxis"])
    marks = [s["x0"] for s in hist["layout"]["shapes"]]
    np.testing.assert_allclose(marks, np.percentile(wall, [50, 90, 99]), rtol=1e-5)
    # self time per event, summing to 100% of step time
    share = figs["self-share"]["data"][0]
    assert sum(share["x"]) == pytest.approx(100.0, abs=0.01)
    assert "trainer.backward" in share["y"]


def test_long_runs_are_downsampled_and_the_page_says_so(
    run_builder: Callable[..., RunBuilder],
) -> None:
    report, _ = _report_page(run_builder, [1_000] * 3)
    n = 25_001
    rng = np.random.default_rng(0)
    parts = {c: rng.integers(1_000, 5_000, n) for c in exporters.report.PART_COLUMNS}
    steps = pd.DataFrame(
        {
            "pid": 1,
            "rank": 0,
            "start_ns": np.arange(n) * 100_000,
            **parts,
            "wall_ns": np.sum(list(parts.values()), axis=0),
        }
    )
    page = render_html(dataclasses.replace(report, steps=steps))
    assert "Downsampled: 25,001 steps are more than 20,000, so each point is the mean of 2" in page
    fig = figures(page)["step-time"]
    line, unit = fig["data"], scale(fig["layout"]["yaxis"])
    assert len(line[0]["x"]) == 12_501
    means = np.sum([t["y"] for t in line], axis=0)
    np.testing.assert_allclose(means[0], steps["wall_ns"][:2].mean() / unit, rtol=1e-5)
    np.testing.assert_allclose(means[-1], steps["wall_ns"].iloc[-1] / unit, rtol=1e-5)


def test_several_ranks_and_device_time_get_their_charts(
    run_builder: Callable[..., RunBuilder],
) -> None:
    a, b = run_builder(pid=1, rank=0), run_builder(pid=2, rank=1)
    _run(a, [2_000] * 8)
    _run(b, [6_000] * 8)
    frame = spans_to_frame([a.batch(), b.batch()])
    frame["device_dur_ns"] = np.where(frame["name"] == "trainer.backward", 500.0, np.nan)
    figs = figures(render_html(step_report(frame)))
    boxes = figs["rank-steps"]["data"]
    assert [b["name"] for b in boxes] == ["rank 0", "rank 1"]
    assert boxes[0]["median"][0] < boxes[1]["median"][0]
    device = figs["device-time"]["data"][0]
    unit = scale(figs["device-time"]["layout"]["xaxis"])
    assert device["y"] == ["trainer.backward"] and device["x"] == [2 * 7 * 500 / unit]


def test_the_comparison_page_shows_changes_with_their_intervals_and_both_distributions(
    run_builder: Callable[..., RunBuilder],
) -> None:
    runs = []
    for scale in (1.0, 1.0, 1.6, 1.6):
        rb = run_builder()
        rng = np.random.default_rng(len(runs))
        _run(rb, [int(scale * 10_000 * (1 + 0.02 * rng.standard_normal())) for _ in range(30)])
        runs.append(spans_to_frame(rb.batch()))
    comparison = compare(runs[:2], runs[2:])
    page = render_comparison_html(comparison)
    assert "default-src 'none'" in page and "2 gated regressions" in page
    figs = figures(page)
    (regressed,) = [t for t in figs["changes"]["data"] if t["name"] == "regression"]
    row = comparison.events.set_index("event").loc["trainer.step"]
    i = regressed["y"].index("⚑ trainer.step")
    assert regressed["x"][i] == pytest.approx(row["change"] * 100, rel=1e-5)
    assert regressed["error_x"]["array"][i] == pytest.approx(
        (row["ci_high"] - row["change"]) * 100, rel=1e-4
    )
    assert regressed["marker"]["color"] == "#b00020"
    dist = figs["step-distributions"]["data"]
    assert [d["name"] for d in dist] == ["base (58 steps)", "candidate (58 steps)"]
    assert sum(dist[0]["y"]) == pytest.approx(1.0)
    assert len(figs["step-runs"]["data"]) == 4
    assert 'class="verdict-regression"' in page


def test_without_plotly_the_error_names_the_extra(
    run_builder: Callable[..., RunBuilder],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    report, _ = _report_page(run_builder, [1_000] * 3)
    monkeypatch.setattr(html_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"install it with: pip install 'ppetrace\[html\]'"):
        render_html(report)
    trace = tmp_path / "t.json"
    rb = run_builder()
    _run(rb, [1_000] * 3)
    exporter = exporters.ChromeTraceExporter(trace)
    exporter.export_batch(rb.batch())
    exporter.shutdown()
    err = io.StringIO()
    argv = ["report", str(trace), "--html", str(tmp_path / "r.html")]
    code = main(argv, stdout=io.StringIO(), stderr=err)
    assert code == 2
    assert err.getvalue().count("\n") == 1
    assert "ppetrace report: error: Expected the plotly package for HTML pages" in err.getvalue()
    assert not (tmp_path / "r.html").exists()
