"""The comparison's renderers: what was gated and why, and Markdown that span names
cannot inject markup into."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from exporters import (
    Comparison,
    RunSummary,
    compare,
    render_comparison,
    render_comparison_json,
    render_comparison_markdown,
    render_comparison_table,
)
from exporters._render import markdown, md_code, md_text

STEP = "trainer.step"
EVIL = "<img src=x onerror=alert(1)> # [click](http://evil.example) **bold** @team #123 `x` |\nY"


_SPREAD = np.array([0.99, 1.0, 1.01] * 20)  # per-step noise whose median is exactly 1


def _summary(step: float, **events: float) -> RunSummary:
    samples = {STEP: step * _SPREAD}
    samples.update({k: v * _SPREAD for k, v in events.items()})
    return RunSummary.from_samples(samples)


def _comparison() -> Comparison:
    base = RunSummary(
        _summary(1e6, **{EVIL: 2e5, "user.gone": 5e3}).events,
        {"torch_threads": 1, "cpu_model": "<b>cpu</b>"},
    )
    cand = RunSummary(_summary(1.5e6, **{EVIL: 2e5}).events, {"torch_threads": 4})
    return compare(base, cand)


def test_md_text_leaves_no_markup_and_one_line() -> None:
    out = md_text(EVIL)
    assert "\n" not in out
    assert "<img" not in out and "&lt;img src=x onerror=alert(1)&gt;" in out
    assert "\\[click\\](http://evil.example)" in out and "\\*\\*bold\\*\\*" in out
    assert "\\`x\\`" in out and "\\|" in out
    assert md_text("a & b") == "a &amp; b"
    # underscores inside words cannot emphasise and stay readable
    assert md_text("module.train_step") == "module.train_step"
    assert md_text("_private_") == "\\_private\\_"


def test_md_code_shows_any_name_verbatim_in_a_code_span() -> None:
    assert md_code("trainer.step") == "`trainer.step`"
    assert md_code("a`b") == "``a`b``"
    assert md_code("`x`", in_table=False) == "`` `x` ``"
    assert md_code("a|b") == "`a\\|b`" and md_code("a|b", in_table=False) == "`a|b`"
    assert md_code("one\ntwo\r\nthree") == "`one two three`"


def test_markdown_tables_escape_every_cell_and_keep_their_columns() -> None:
    table = markdown(["name", "n"], [[EVIL, "1"], ["plain", "2"]], code=(0,))
    lines = table.splitlines()
    assert len(lines) == 4
    # a GFM row splits at pipes that are not escaped: every row has 3 of them
    assert all(len(re.findall(r"(?<!\\)\|", line)) == 3 for line in lines)
    assert lines[2].startswith("| ``<img src=x")  # verbatim, inside a code span
    text_cells = markdown(["name"], [["<script>"]])
    assert "&lt;script&gt;" in text_cells


def test_markdown_comment_cannot_carry_markup_from_span_names() -> None:
    md = render_comparison_markdown(_comparison())
    outside_code = re.sub(r"(`+).*?\1", "", md)  # drop the code spans: what is left renders
    assert "<img" not in outside_code and "](" not in outside_code
    assert "@team" not in outside_code and "#123" not in outside_code
    assert "<b>" not in md  # the environment's values are escaped too
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert all(
        len(re.findall(r"(?<!\\)\|", r)) == len(re.findall(r"(?<!\\)\|", rows[0])) for r in rows
    )
    assert not any(line.startswith("#") for line in md.splitlines()[1:])  # one heading only


def test_the_table_says_what_was_gated_and_why() -> None:
    result = _comparison()
    text = render_comparison_table(result)
    lines = text.splitlines()
    assert lines[0] == "ppetrace compare: 1 gated regression (1 run vs 1 run)"
    assert "warning: environment differs: torch_threads: base 1, candidate 4" in text
    settings = next(line for line in lines if line.startswith("gate: "))
    assert "gate: trainer.step (Holm over 1 gated event, alpha 0.01)" in settings
    assert "threshold 3.0%" in settings and "noise floor 5.0% run-to-run" in settings
    assert "minimum effect 10.0 µs (1.0% of the base median step 1.00 ms" in settings
    gated = [line for line in lines if line.startswith("  trainer.step: ")]
    assert len(gated) == 1
    assert gated[0].startswith("  trainer.step: regression: 1.00 ms → 1.50 ms, +50.0%")
    assert "significant, beyond the threshold 3.0% and the minimum effect 10.0 µs" in gated[0]
    assert "removed (only in the base): user.gone" in text
    header = next(line for line in lines if line.startswith("event"))
    assert header.split()[:5] == ["event", "gate", "base", "candidate", "change"]


@pytest.mark.parametrize(
    ("base", "cand", "why"),
    [
        (1.0e6, 1.01e6, "not significant (p"),
        (1.0e6, 1.01e6, "significant, but within the threshold (+1.0% vs ±3.0%)"),
    ],
)
def test_each_gated_line_gives_its_reason(base: float, cand: float, why: str) -> None:
    floor = 0.05 if why.startswith("not") else 0.0001
    result = compare([_summary(base)] * 3, [_summary(cand)] * 3, noise_floor=floor)
    line = next(x for x in render_comparison_table(result).splitlines() if "trainer.step:" in x)
    assert why in line


def test_markdown_and_json_carry_the_same_verdicts() -> None:
    result = _comparison()
    md = render_comparison_markdown(result)
    assert md.startswith("### ppetrace compare: ❌ 1 gated regression")
    assert "> ⚠️ environment differs: torch\\_threads: base 1, candidate 4" not in md
    assert "> ⚠️ environment differs: torch_threads: base 1, candidate 4" in md
    assert "- `trainer.step`: regression: " in md
    assert "**Removed** (only in the base): `user.gone`" in md
    doc = json.loads(render_comparison_json(result))
    assert doc["has_regression"] is True and doc["regressions"] == [STEP]
    assert doc["gate"] == [STEP] and doc["noise_floor"] == result.noise_floor
    assert doc["environment_warnings"] == result.environment_warnings
    assert {e["event"] for e in doc["events"]} == set(result.events["event"])
    assert render_comparison(result, "md") == md
    with pytest.raises(ValueError, match="Unknown comparison format 'csv'; expected one of"):
        render_comparison(result, "csv")


def test_an_informational_event_that_slowed_never_reads_regression() -> None:
    """Only a gated event fails the comparison: a significant change of an informational
    one reads "slower (not gated)", in the text, Markdown and HTML tables alike."""
    from exporters import render_comparison_html

    result = compare(
        [_summary(1e6, **{"user.load": 1e5})] * 3,
        [_summary(1e6, **{"user.load": 2e5})] * 3,
        noise_floor=0.0001,
    )
    (row,) = [r for r in result.records if r["event"] == "user.load"]
    assert not row["gated"] and row["verdict"] == "regression"  # the data keeps the test's
    assert not result.has_regression
    text = render_comparison_table(result)
    (line,) = [x for x in text.splitlines() if x.startswith("user.load ")]
    assert line.split()[1] == "info" and "slower (not gated)" in line
    assert "regression" not in line
    md = render_comparison_markdown(result)
    (md_line,) = [x for x in md.splitlines() if "user.load" in x and x.startswith("|")]
    assert "slower (not gated)" in md_line and "regression" not in md_line
    html = render_comparison_html(result)
    assert "slower (not gated)" in html and 'class="verdict-info"' in html


def test_no_regression_headline() -> None:
    same = _summary(1e6)
    md = render_comparison_markdown(compare(same, same))
    assert md.startswith("### ppetrace compare: ✅ no gated regression")
