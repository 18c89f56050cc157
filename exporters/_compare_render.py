"""Renderers of a :class:`~exporters.comparison.Comparison`: a terminal table, Markdown
for a CI comment (span names escaped), and JSON.

Each says what was gated and why: the settings used (noise floor, threshold,
minimum effect, alpha), one line per gated event with the reason for its
verdict, and a warning line per environment field that differs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from ._compare_result import Comparison, Verdict, is_inconclusive, within
from ._render import fmt_ns, fmt_pct, json_records, markdown, md_code, md_text, text_table
from ._steps import STEP

__all__ = [
    "COMPARE_FORMATS",
    "render_comparison",
    "render_comparison_json",
    "render_comparison_markdown",
    "render_comparison_table",
]

_MARK = {
    Verdict.REGRESSION: "❌ regression",
    Verdict.IMPROVEMENT: "✅ improvement",
    Verdict.BELOW_NOISE: "below noise",
    Verdict.UNCHANGED: "unchanged",
    Verdict.INSUFFICIENT: "insufficient data",
}


#: what an informational (not gated) event's significant change reads as: it fails nothing
_INFO = {Verdict.REGRESSION: "slower (not gated)", Verdict.IMPROVEMENT: "faster (not gated)"}


def shown_verdict(
    record: dict[str, Any], *, marks: bool = True, comparison: Comparison | None = None
) -> str:
    """The verdict of a row of :attr:`Comparison.records` as the tables show it: a gated
    event's (with its mark), or for an informational event a change that fails nothing
    (``slower (not gated)``), never ``regression``. With ``comparison``, ``unchanged``
    is told apart: ``inconclusive`` (beyond the threshold, not significant: the runs
    cannot tell), ``within threshold`` (significant, but small), ``not significant``
    (small, but its interval reaches beyond the threshold) or ``unchanged`` (its
    interval within ±threshold)."""
    verdict = str(record["verdict"])
    if not record["gated"] and verdict in _INFO:
        return _INFO[verdict]
    if verdict == Verdict.UNCHANGED and comparison is not None:
        return _unchanged(record, comparison, marks=marks)
    return _MARK[verdict] if marks else verdict


def _unchanged(record: Mapping[str, Any], c: Comparison, *, marks: bool) -> str:
    """The label of an ``unchanged`` verdict (:func:`shown_verdict`)."""
    if is_inconclusive(record, alpha=c.alpha, threshold=c.threshold):
        return f"{'⚠️ ' if marks else ''}inconclusive"
    if float(record["p_holm"]) < c.alpha:
        return "within threshold"
    return "unchanged" if within(record, c.threshold) else "not significant"


def _p(value: float) -> str:
    if value != value:
        return "–"
    return f"{value:.2g}" if value >= 1e-4 else "<1e-4"


def _noise(r: Mapping[str, Any]) -> str:
    if r["noise"] != r["noise"]:
        return "–"
    return f"{fmt_pct(r['noise'])} {r['noise_source']}"


def _rows(comparison: Comparison, *, marks: bool) -> tuple[list[str], list[list[str]]]:
    level = f"{comparison.confidence * 100:.0f}% CI"
    header = [
        "event",
        "gate",
        "base",
        "candidate",
        "change",
        level,
        "p (Holm)",
        "noise",
        "verdict",
        "runs",
        "n",
    ]
    rows = []
    for r in comparison.records:
        ci = (
            "–"
            if r["ci_low"] != r["ci_low"]
            else f"{fmt_pct(r['ci_low'], signed=True)} … {fmt_pct(r['ci_high'], signed=True)}"
        )
        rows.append(
            [
                str(r["event"]),
                "gated" if r["gated"] else "info",
                fmt_ns(r["base_median_ns"]),
                fmt_ns(r["cand_median_ns"]),
                fmt_pct(r["change"], signed=True),
                ci,
                _p(float(r["p_holm"])),
                _noise(r),
                shown_verdict(r, marks=marks, comparison=comparison),
                f"{r['base_runs']}/{r['cand_runs']}",
                f"{r['base_n']}/{r['cand_n']}",
            ]
        )
    return header, rows


def _headline(comparison: Comparison) -> str:
    failed = _failed_sides(comparison)
    return failed + ", " + _verdicts(comparison) if failed else _verdicts(comparison)


def _failed_sides(comparison: Comparison) -> str:
    """``"a candidate run failed"``, ``"1 base run and 2 candidate runs failed"``, or
    ``""`` when no run failed: it comes first in the headline."""
    counts = [(side, len(comparison.failed_runs.get(side, ()))) for side in ("base", "candidate")]
    counts = [(side, n) for side, n in counts if n]
    if not counts:
        return ""
    if len(counts) == 1:
        side, n = counts[0]
        return f"{'a' if n == 1 else n} {side} run{'s' if n != 1 else ''} failed"
    return " and ".join(f"{n} {side} run{'s' if n != 1 else ''}" for side, n in counts) + " failed"


def _verdicts(comparison: Comparison) -> str:
    n = len(comparison.regressions)
    if n:
        return f"{n} gated regression{'s' if n != 1 else ''}"
    if not comparison.decided:  # (ppetrace compare exits 2: it cannot catch a regression)
        return "no verdict (no gated event could be decided)"
    unsure = len(comparison.inconclusive)
    if unsure:
        return f"no gated regression, {unsure} gated event{'s' if unsure != 1 else ''} inconclusive"
    return "no gated regression"


def _runs(comparison: Comparison) -> str:
    def runs(k: int) -> str:
        return f"{k} run{'s' if k != 1 else ''}"

    return f"{runs(comparison.base_runs)} vs {runs(comparison.cand_runs)}"


def _settings(comparison: Comparison) -> str:
    c = comparison
    gate = ", ".join(c.gate) if c.gate else "nothing"
    family = len(c.gate)
    if c.step_median_ns is not None:
        step = f"{fmt_pct(c.min_effect)} of the base median step {fmt_ns(c.step_median_ns)}, "
    elif STEP in c.removed or any(r["event"] == STEP for r in c.records):
        step = f"trainer.step has fewer than {c.min_samples} samples in every base run, "
    else:
        step = "no trainer.step sample in the base, "
    return (
        f"gate: {gate} (Holm over {family} gated event{'s' if family != 1 else ''}, "
        f"alpha {c.alpha:g}); threshold {fmt_pct(c.threshold)}; minimum effect "
        f"{fmt_ns(c.min_effect_abs_ns)} ({step}at least {fmt_ns(c.min_effect_ns)}); "
        f"noise floor {fmt_pct(c.noise_floor)} run-to-run (the runs' own scatter where "
        "larger); runs are the samples (median per run)"
    )


def _why(r: Mapping[str, Any], c: Comparison) -> str:
    """Why a gated event got its verdict, in one line."""
    verdict = str(r["verdict"])
    if verdict == Verdict.INSUFFICIENT:
        return f"{verdict}: fewer than {c.min_samples} samples in every run of a side"
    change = fmt_pct(r["change"], signed=True)
    delta = float(r["cand_median_ns"] - r["base_median_ns"])
    shown_delta = ("+" if delta >= 0 else "") + fmt_ns(delta)
    p = _p(float(r["p_holm"]))
    if p == f"{c.alpha:g}":  # rounded onto alpha: show which side it is on
        p = f"{float(r['p_holm']):.3g}"
    head = (
        f"{fmt_ns(r['base_median_ns'])} → {fmt_ns(r['cand_median_ns'])}, {change} "
        f"({c.confidence * 100:.0f}% CI {fmt_pct(r['ci_low'], signed=True)} … "
        f"{fmt_pct(r['ci_high'], signed=True)}), p {p}, noise {_noise(r)}"
    )
    if not float(r["p_holm"]) < c.alpha:
        verdict = _unchanged(r, c, marks=False)
        reason = f"not significant (p {p} ≥ {c.alpha:g})"
        if verdict == "inconclusive":
            reason += (
                f": the change is beyond the threshold {fmt_pct(c.threshold)}, but the runs "
                "cannot tell it from noise"
            )
        elif verdict == "unchanged":
            reason += f", and the interval lies within ±{fmt_pct(c.threshold)}"
    elif abs(float(r["change"])) <= c.threshold:
        verdict = "within threshold"
        reason = f"significant, but within the threshold ({change} vs ±{fmt_pct(c.threshold)})"
    elif verdict == Verdict.BELOW_NOISE:
        reason = (
            f"significant and beyond the threshold, but {shown_delta} is below the minimum "
            f"effect {fmt_ns(c.min_effect_abs_ns)}"
        )
    else:
        reason = (
            f"significant, beyond the threshold {fmt_pct(c.threshold)} and the minimum "
            f"effect {fmt_ns(c.min_effect_abs_ns)} ({shown_delta})"
        )
    return f"{verdict}: {head}; {reason}"


def _gated_lines(comparison: Comparison) -> list[tuple[str, str]]:
    return [(str(r["event"]), _why(r, comparison)) for r in comparison.records if r["gated"]]


def render_comparison_table(comparison: Comparison) -> str:
    """The comparison as aligned plain text for a terminal."""
    header, rows = _rows(comparison, marks=False)
    parts = [f"ppetrace compare: {_headline(comparison)} ({_runs(comparison)})"]
    parts += [f"warning: {w}" for w in comparison.environment_warnings]
    parts.append(_settings(comparison))
    parts += [f"  {event}: {why}" for event, why in _gated_lines(comparison)]
    parts += [f"note: {n}" for n in comparison.notes]
    parts += ["", text_table(header, rows, left=(0, 1, 8))]
    if comparison.added:
        parts.append(f"\nadded (only in the candidate): {', '.join(comparison.added)}")
    if comparison.removed:
        parts.append(
            f"{'' if comparison.added else chr(10)}removed (only in the base): "
            f"{', '.join(comparison.removed)}"
        )
    return "\n".join(parts) + "\n"


def render_comparison_markdown(comparison: Comparison) -> str:
    """The comparison as Markdown, ready to post as a CI comment. Span names are code
    spans and every other text from the traces is escaped, so a name cannot inject
    HTML, links, headings, mentions or table cells."""
    n_reg = len(comparison.regressions)
    mark = "❌" if n_reg or comparison.runs_failed else ("⚠️" if comparison.inconclusive else "✅")
    title = f"{mark} {_headline(comparison)}"
    header, rows = _rows(comparison, marks=True)
    parts = [f"### ppetrace compare: {title}", "", f"{_runs(comparison)}.", ""]
    if comparison.environment_warnings:
        parts += [f"> ⚠️ {md_text(w)}  " for w in comparison.environment_warnings]
        parts.append("")
    parts += [f"<sub>{md_text(_settings(comparison))}</sub>", ""]
    gated = _gated_lines(comparison)
    if gated:
        parts += [f"- {md_code(event, in_table=False)}: {md_text(why)}" for event, why in gated]
        parts.append("")
    if comparison.notes:
        parts += [f"> {md_text(n)}" for n in comparison.notes]
        parts.append("")
    parts.append(markdown(header, rows, left=(0, 1, 8), code=(0,)))
    if comparison.added:
        names = ", ".join(md_code(e, in_table=False) for e in comparison.added)
        parts += ["", "**Added** (only in the candidate): " + names]
    if comparison.removed:
        names = ", ".join(md_code(e, in_table=False) for e in comparison.removed)
        parts += ["", "**Removed** (only in the base): " + names]
    return "\n".join(parts) + "\n"


def render_comparison_json(comparison: Comparison) -> str:
    """The comparison as a JSON document (medians in ns, changes as fractions)."""
    c = comparison
    doc = {
        "threshold": c.threshold,
        "alpha": c.alpha,
        "min_samples": c.min_samples,
        "confidence": c.confidence,
        "noise_floor": c.noise_floor,
        "gate": c.gate,
        "min_effect": c.min_effect,
        "min_effect_ns": c.min_effect_ns,
        "min_effect_abs_ns": c.min_effect_abs_ns,
        "step_median_ns": c.step_median_ns,
        "base_runs": c.base_runs,
        "cand_runs": c.cand_runs,
        "has_regression": c.has_regression,
        "regressions": c.regressions,
        "improvements": c.improvements,
        "inconclusive": c.inconclusive,
        "failed_runs": c.failed_runs,
        "added": c.added,
        "removed": c.removed,
        "environment_warnings": c.environment_warnings,
        "notes": c.notes,
        "events": json_records(c.events),
    }
    return json.dumps(doc, indent=2) + "\n"


#: Comparison renderers by format name (the CLI's ``--format``).
COMPARE_FORMATS: dict[str, Callable[[Comparison], str]] = {
    "table": render_comparison_table,
    "md": render_comparison_markdown,
    "json": render_comparison_json,
}


def render_comparison(comparison: Comparison, fmt: str = "table") -> str:
    """Render ``comparison`` in the format ``fmt``: one of ``table``, ``md``, ``json``."""
    renderer = COMPARE_FORMATS.get(fmt)
    if renderer is None:
        raise ValueError(
            f"Unknown comparison format {fmt!r}; expected one of {', '.join(COMPARE_FORMATS)}."
        )
    return renderer(comparison)
