"""The ppetrace benchmark suite: one command, one table, every budget PASS or FAIL.

Run from the repository root (after ``pip install -e '.[bench]'``)::

    python -m benchmarks.run [--quick] [--json results.json] [--markdown table.md]

It runs every benchmark of ``benchmarks/``, all in this one process except
the memory benchmark, which gets a fresh one (RSS is the whole process's):

- hot path (``bench_hotpath``): ``ppetrace.trace`` against OpenTelemetry's
  ``start_as_current_span``, the two-timestamp floor, ``nullcontext``,
  ``torch.profiler.record_function`` and pytorch-pfn-extras
  ``ppe.profiler.record``;
- Trainer end to end (``bench_trainer``): a traced ``ppetrace.Trainer``
  writing a Chrome trace against a hand-written loop, on the tiny and the MLP
  workload, for each module kind (plain ``nn.Module``, PyMarlin
  ``ModuleInterface``, delira network, each against a hand loop of its own
  kind) with tracing on and off, the coverage of ``trainer.epoch`` and
  ``trainer.run`` by their children, and pytorch-pfn-extras (plain and
  profiling) and Lightning (simple profiler) beside it;
- export (``bench_export``): a million spans into a Chrome trace and a frame, and
  that trace file back into a frame (time, and peak RSS over the file's size);
- memory (``bench_memory``): RSS across a long traced run with streaming export;
- profilers off (``bench_profilers_off``): deep profilers configured but
  outside their windows;
- delivery (``bench_delivery``): every span to the SDK's ``SimpleSpanProcessor``
  against the SDK's own span, and the tiny Trainer through a default
  ``BatchSpanProcessor`` against the hand loop.

Every figure is a ratio of two measurements from the same run, with
interleaved repetitions, except the export budgets (seconds, DESIGN.md) and
the memory budget (MB). A Trainer row's µs/step are the median runs; its
ratio is the median over rounds of the paired ratio to the hand loop (of
the same module kind) of the same round, in wall time; its note adds the
bootstrap 95% interval, the µs per step above the hand loop with its
interval, the same two figures in CPU time (the process's, which a busy
machine disturbs less) and the fastest runs.
It prints one table (what, measured, reference,
ratio, budget, result) and writes the same rows to JSON. ``--quick`` runs
every benchmark at a tiny size in a few seconds: the table is complete, its
figures are not meaningful. Where a budget fails, the closing note profiles
it (pyinstrument for the Trainer, a null-sink run for memory) and names
the hot spots. Exit code: 0 when every budget passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import io
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ROW_IDS",
    "SECTIONS",
    "SIZES",
    "Row",
    "hot_spots",
    "main",
    "measure_ppe_record",
    "profile_export",
    "render_hot_spots",
    "render_markdown",
    "render_table",
    "run_memory",
    "run_suite",
]

#: benchmark sizes: "full" for the figures, "quick" for a smoke run
SIZES: dict[str, dict[str, int]] = {
    "full": {
        "hot_spans": 20_000,
        "hot_rounds": 15,
        "tiny_steps": 500,
        "mlp_steps": 200,
        "trainer_rounds": 21,
        "export_spans": 1_000_000,
        "memory_spans": 1_000_000,
        "memory_checkpoint": 100_000,
        "memory_flush_every": 50_000,
        "profilers_steps": 60,
        "profilers_rounds": 41,
        "profile_steps": 2_000,
        "profile_export_spans": 300_000,
        "delivery_spans": 20_000,
        "delivery_steps": 500,
        "delivery_rounds": 15,
        "instrument_tiny_steps": 500,
        "instrument_mlp_steps": 200,
        "instrument_rounds": 15,
        "instrument_lightning_steps": 200,
        "instrument_lightning_rounds": 11,
        "instrument_startup_rounds": 9,
        "instrument_truth_steps": 60,
    },
    "quick": {
        "hot_spans": 2_000,
        "hot_rounds": 3,
        "tiny_steps": 16,
        "mlp_steps": 8,
        "trainer_rounds": 2,
        "export_spans": 20_000,
        "memory_spans": 20_000,
        "memory_checkpoint": 5_000,
        "memory_flush_every": 5_000,
        "profilers_steps": 4,
        "profilers_rounds": 2,
        "profile_steps": 50,
        "profile_export_spans": 5_000,
        "delivery_spans": 500,
        "delivery_steps": 8,
        "delivery_rounds": 2,
        "instrument_tiny_steps": 16,
        "instrument_mlp_steps": 8,
        "instrument_rounds": 2,
        "instrument_lightning_steps": 8,
        "instrument_lightning_rounds": 1,
        "instrument_startup_rounds": 0,
        "instrument_truth_steps": 4,
    },
}

PASS, FAIL, INFO, MISSING, ERROR = "PASS", "FAIL", "info", "not installed", "error"


@dataclass
class Row:
    """One line of the table.

    ``status`` is ``PASS``/``FAIL`` for a budget, ``info`` for a figure
    without a budget, ``not installed`` for an absent peer and ``error``
    when the benchmark raised (``note`` then holds the error).
    """

    id: str
    what: str
    measured: str = "–"
    reference: str = "–"
    ratio: float | None = None
    budget: str = "–"
    status: str = INFO
    value: float | None = None
    reference_value: float | None = None
    unit: str = ""
    note: str = ""

    @property
    def cells(self) -> list[str]:
        """The row as table cells: what, measured, reference, ratio, budget, result."""
        ratio = "–" if self.ratio is None else f"{self.ratio:.3f}x"
        return [self.what, self.measured, self.reference, ratio, self.budget, self.status]


HEADER = ["what", "measured", "reference", "ratio", "budget", "result"]


def _gate(ratio: float, budget: float) -> str:
    return PASS if ratio <= budget else FAIL


def _ns(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:,.2f} ms"
    if value >= 1e3:
        return f"{value / 1e3:,.2f} µs"
    return f"{value:,.0f} ns"


def _say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# -- hot path ---------------------------------------------------------------------------


class _NullSink:
    def export_batch(self, batch: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass


def measure_ppe_record(n: int, rounds: int) -> dict[str, float] | None:
    """ns per span of ``ppe.profiler.record`` and of ``ppetrace.trace``, interleaved.

    ``None`` when pytorch-pfn-extras is not installed. The recorded spans go to
    a sink that keeps nothing and are flushed outside the timed region.
    """
    try:
        import pytorch_pfn_extras  # noqa: F401 - the package itself must import
        from pytorch_pfn_extras.profiler import record
    except ImportError:
        return None
    import ppetrace

    trace = ppetrace.trace

    def ppe() -> None:
        for _ in range(n):
            with record("bench.ppe"):
                pass

    def ours() -> None:
        for _ in range(n):
            with trace("bench.flat"):
                pass

    best = {"ppe.profiler.record": float("inf"), "trace": float("inf")}
    ppetrace.configure(buffer_spans=n + 1, exporters=[_NullSink()])
    try:
        for _ in range(rounds):
            for name, fn in (("ppe.profiler.record", ppe), ("trace", ours)):
                t0 = time.perf_counter_ns()
                fn()
                best[name] = min(best[name], (time.perf_counter_ns() - t0) / n)
                ppetrace.flush()
    finally:
        ppetrace.configure()
    return best


def hot_path_rows(size: dict[str, int], details: dict[str, Any]) -> list[Row]:
    from benchmarks import bench_hotpath

    n, rounds = size["hot_spans"], size["hot_rounds"]
    best = bench_hotpath.measure(n, rounds)
    details["hot_path_ns_per_span"] = best
    rows: list[Row] = []
    trace_ns = best["trace enabled, flat"]
    refs = {
        "trace / OTel start_as_current_span": ("otel start_as_current_span", "OTel span"),
        "trace / floor": ("floor", "floor"),
        "disabled trace / nullcontext": ("nullcontext", "nullcontext"),
    }
    for what, ratio, budget in bench_hotpath.budgets(best):
        ref_key, ref_label = refs.get(what, ("", "reference"))
        measured_key = "trace disabled" if what.startswith("disabled") else "trace enabled, flat"
        rows.append(
            Row(
                id="hotpath." + ref_key.split()[0].lower(),
                what=f"hot path: {what}",
                measured=_ns(best[measured_key]),
                reference=f"{_ns(best[ref_key])} ({ref_label})" if ref_key in best else "–",
                ratio=ratio,
                budget=f"<= {budget:.2f}x",
                status=_gate(ratio, budget),
                value=best[measured_key],
                reference_value=best.get(ref_key),
                unit="ns/span",
            )
        )
    all_in = best.get("trace enabled, all in (+flush to rows)")
    if all_in is not None:
        what = "hot path: trace all in (+ flush to rows) / floor"
        rows.append(_info_row("hotpath.all_in", what, all_in, best["floor"], "floor"))
    if "torch record_function" in best:
        what = "hot path: torch record_function / trace"
        rf = best["torch record_function"]
        rows.append(_info_row("hotpath.record_function", what, rf, trace_ns, "trace"))
    ppe = measure_ppe_record(n, rounds)
    details["hot_path_ppe_record"] = ppe
    if ppe is None:
        rows.append(
            Row(
                id="hotpath.ppe_record",
                what="hot path: ppe.profiler.record / trace",
                status=MISSING,
            )
        )
    else:
        what = "hot path: ppe.profiler.record / trace"
        rows.append(
            _info_row("hotpath.ppe_record", what, ppe["ppe.profiler.record"], ppe["trace"], "trace")
        )
    return rows


def _info_row(row_id: str, what: str, ns: float, ref_ns: float, ref_label: str) -> Row:
    """A hot-path figure without a budget: ``ns`` per span as a ratio to ``ref_ns``."""
    return Row(
        id=row_id,
        what=what,
        measured=_ns(ns),
        reference=f"{_ns(ref_ns)} ({ref_label})",
        ratio=ns / ref_ns,
        value=ns,
        reference_value=ref_ns,
        unit="ns/span",
    )


# -- Trainer ------------------------------------------------------------------------------

_PEER_LABELS = {
    "ppe": "pytorch-pfn-extras create_trainer",
    "ppe_profile": "pytorch-pfn-extras, profiling on",
    "lightning": 'Lightning Trainer(profiler="simple")',
}
#: module kind -> how the rows name it
_KIND_LABELS = {
    "plain": "plain nn.Module",
    "interface": "PyMarlin ModuleInterface",
    "network": "delira network",
}


def _trainer_note(res: Any, variant: str) -> str:
    """Paired ratio and µs/step above the hand loop, wall and CPU time, with intervals."""
    parts = [f"median of {res.rounds} paired rounds of {res.steps} steps against "]
    parts.append(f"{bench_reference(variant)}; ")
    for clock, label in (("wall", "wall time"), ("cpu", "CPU time (process)")):
        if clock == "cpu" and not res.cpu_ns:
            continue
        lo, hi = res.paired_ci(variant, clock=clock)
        olo, ohi = res.overhead_ci(variant, clock=clock)
        parts.append(
            f"{label} {res.paired_ratio(variant, clock=clock):.3f}x (95% CI {lo:.3f}-{hi:.3f}x), "
            f"{res.overhead_us(variant, clock=clock):+,.1f} µs/step above the hand loop "
            f"(95% CI {olo:+,.1f} to {ohi:+,.1f}); "
        )
    parts.append(
        f"fastest runs {res.us_per_step(variant):,.1f} µs/step, {res.best_ratio(variant):.3f}x"
    )
    return "".join(parts)


def bench_reference(variant: str) -> str:
    """The hand loop that ``variant`` is paired with (the plain one for a variant that
    ``bench_trainer`` does not know, as ``TrainerResult`` pairs it: ``instrument``'s)."""
    from benchmarks import bench_trainer

    return bench_trainer.REFERENCE.get(variant, "hand")


def _timed_row(
    res: Any, row_id: str, what: str, variant: str, budget: float | None, ci_budget: float | None
) -> Row:
    ref = bench_reference(variant)
    ratio = res.paired_ratio(variant)
    status = INFO
    budget_text = "–"
    if budget is not None:
        ok = ratio <= budget
        budget_text = f"<= {budget:.2f}x"
        if ci_budget is not None:
            ok = ok and res.paired_ci(variant)[1] <= ci_budget
            budget_text += f", CI <= {ci_budget:.2f}x"
        status = PASS if ok else FAIL
    return Row(
        id=row_id,
        what=what,
        measured=f"{res.median_us_per_step(variant):,.1f} µs/step",
        reference=f"{res.median_us_per_step(ref):,.1f} µs/step ({ref})",
        ratio=ratio,
        budget=budget_text,
        status=status,
        value=res.median_us_per_step(variant),
        reference_value=res.median_us_per_step(ref),
        unit="µs/step",
        note=_trainer_note(res, variant),
    )


def _coverage_rows(res: Any, name: str, gated: bool) -> list[Row]:
    from benchmarks import bench_trainer

    rows = []
    budget = bench_trainer.COVERAGE_BUDGET
    for span in ("epoch", "run"):
        low = res.min_coverage(span)
        row_id = f"trainer.{name}.coverage_{span}"
        what = f"Trainer {name}: children of trainer.{span} / trainer.{span} (lowest)"
        if low is None:
            rows.append(Row(id=row_id, what=what, status=ERROR, note="no traced run"))
            continue
        per = "; ".join(
            f"{variant} {min(values):.2%} (median {statistics.median(values):.2%})"
            for variant, by_span in res.coverage.items()
            if (values := by_span.get(span))
        )
        rows.append(
            Row(
                id=row_id,
                what=what,
                measured=f"{low:.2%}",
                reference="100% (no time outside a child)",
                ratio=low,
                budget=f">= {budget:.0%}" if gated else "–",
                status=(PASS if low >= budget else FAIL) if gated else INFO,
                value=low * 100,
                reference_value=100.0,
                unit="%",
                note=(
                    f"the share of trainer.{span}'s time covered by its direct children "
                    f"(1 - self time / duration), lowest over the traced module kinds and "
                    f"{res.rounds} rounds: {per}"
                ),
            )
        )
    return rows


def trainer_rows(
    size: dict[str, int], details: dict[str, Any], variants: Sequence[str] | None = None
) -> list[Row]:
    from benchmarks import bench_trainer

    rows: list[Row] = []
    for name, steps in (("tiny", size["tiny_steps"]), ("mlp", size["mlp_steps"])):
        wl = bench_trainer.WORKLOADS[name]
        label = (
            f"Linear {wl.in_features}->{wl.classes}, batch {wl.batch_size}"
            if wl.hidden is None
            else f"MLP {wl.in_features}-{wl.hidden}-{wl.classes}, batch {wl.batch_size}"
        )
        res = bench_trainer.measure(
            name,
            steps=steps,
            rounds=size["trainer_rounds"],
            variants=bench_trainer.VARIANTS if variants is None else variants,
            on_progress=_say,
        )
        details[f"trainer_{name}"] = res.to_json()
        budget = bench_trainer.BUDGETS[name]
        ci_budget = bench_trainer.CI_BUDGETS.get(name)
        off_budget = bench_trainer.BUDGETS_OFF.get(name)
        for kind, traced in bench_trainer.TRACED.items():
            kind_label = _KIND_LABELS[kind]
            if traced in res.times_ns:
                what = (
                    f"Trainer {name} ({label}): traced ppetrace.Trainer + Chrome trace"
                    if kind == "plain"
                    else f"Trainer {name}, {kind_label}: traced + Chrome trace"
                )
                rows.append(
                    _timed_row(res, f"trainer.{name}.{traced}", what, traced, budget, ci_budget)
                )
            if kind == "plain" and res.report_ns:
                hand = f"{res.median_us_per_step('hand'):,.1f} µs/step (hand)"
                with_report = statistics.median(
                    (t + rep) / h
                    for t, rep, h in zip(
                        res.times_ns["ppetrace"], res.report_ns, res.times_ns["hand"], strict=True
                    )
                )
                rows.append(
                    Row(
                        id=f"trainer.{name}.report",
                        what=f"Trainer {name}: + step report built from the trace afterwards",
                        measured=f"{min(res.report_ns) / 1e6:,.1f} ms per report",
                        reference=hand,
                        ratio=with_report,
                        value=min(res.report_ns) / 1e6,
                        unit="ms",
                        note=(
                            "step_report(read_chrome_trace(path)) after fit, timed on its own "
                            f"(outside the gated figure); {res.report_steps} steps in the report"
                        ),
                    )
                )
            if kind == "plain" and "ppetrace_nofile" in res.times_ns:
                what = f"Trainer {name}: {kind_label}, tracing on, no exporter"
                rows.append(
                    _timed_row(
                        res, f"trainer.{name}.ppetrace_nofile", what, "ppetrace_nofile", None, None
                    )
                )
            off = "ppetrace_off" if kind == "plain" else f"{traced}_off"
            if off in res.times_ns:
                what = f"Trainer {name}: {kind_label}, tracing disabled (the loop alone)"
                rows.append(_timed_row(res, f"trainer.{name}.{off}", what, off, off_budget, None))
        rows += _coverage_rows(res, name, gated=name == "mlp")
        for part_id, part, us, lo, hi in bench_trainer.cost_parts(res):
            rows.append(
                Row(
                    id=f"trainer.{name}.part.{part_id}",
                    what=f"Trainer {name}, where the time goes: {part}",
                    measured=f"{us:+,.1f} µs/step",
                    value=us,
                    unit="µs/step",
                    note=(
                        f"CPU time, median of {res.rounds} per-round differences, 95% CI "
                        f"{lo:+,.1f} to {hi:+,.1f} µs/step"
                    ),
                )
            )
        hand = f"{res.median_us_per_step('hand'):,.1f} µs/step (hand)"
        for variant in ("ppe", "ppe_profile", "lightning"):
            row_id = f"trainer.{name}.{variant}"
            what = f"Trainer {name}: {_PEER_LABELS[variant]}"
            if variant in res.missing:
                rows.append(Row(id=row_id, what=what, status=MISSING, note=res.missing[variant]))
            elif variant in res.times_ns:
                rows.append(_timed_row(res, row_id, what, variant, None, None))
    return rows


# -- export -------------------------------------------------------------------------------


def _run_captured(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def export_rows(size: dict[str, int], details: dict[str, Any]) -> list[Row]:
    from benchmarks import bench_export

    n = size["export_spans"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "export.json"
        _, text = _run_captured(bench_export.main, ["--spans", str(n), "--json", str(path)])
        res = json.loads(path.read_text())
    details["export"] = res
    details["export_output"] = text
    scale = 1_000_000 / n
    scaled = "" if n == 1_000_000 else f" (measured on {n:,} spans, scaled)"
    rows = []
    for key, label, budget_key, pass_key in (
        ("chrome_trace_s", "Chrome trace", "chrome_trace_budget_s", "chrome_trace_pass"),
        ("frame_s", "frame", "frame_budget_s", "frame_pass"),
    ):
        seconds = float(res[key]) * scale
        rows.append(
            Row(
                id=f"export.{'chrome' if key.startswith('chrome') else 'frame'}",
                what=f"export: 1,000,000 spans -> {label}{scaled}",
                measured=f"{seconds:.2f} s",
                reference=f"{seconds / 1e6 * 1e9:,.0f} ns/span",
                budget=f"<= {res[budget_key]:.1f} s",
                status=PASS if res[pass_key] else FAIL,
                value=seconds,
                unit="s",
            )
        )
    read_s = float(res["read_chrome_trace_s"]) * scale
    rows.append(
        Row(
            id="export.read",
            what=f"read: 1,000,000-span trace file -> frame{scaled}",
            measured=f"{read_s:.2f} s",
            reference=f"{res['chrome_trace_bytes'] / 1e6 * scale:,.0f} MB file",
            budget=f"<= {res['read_budget_s']:.1f} s",
            status=PASS if res["read_pass"] else FAIL,
            value=read_s,
            unit="s",
        )
    )
    rss = float(res["read_rss_over_file"])
    rows.append(
        Row(
            id="export.read_rss",
            what=f"read: its peak RSS over the file's size (fresh process){scaled}",
            measured=f"{rss:.2f}x",
            reference=f"{res['read_peak_rss_bytes'] / 1e6:,.0f} MB peak",
            budget=f"<= {res['read_rss_budget']:.1f}x",
            status=PASS if res["read_rss_pass"] else FAIL,
            value=rss,
            unit="x",
        )
    )
    return rows


# -- memory -------------------------------------------------------------------------------


def run_memory(size: dict[str, int], sink: str = "chrome") -> dict[str, Any]:
    """``bench_memory`` in a fresh Python process; its JSON results.

    RSS belongs to the whole process: in this one, the earlier sections have
    loaded torch and the peers and freed hundreds of MB (the export benchmark)
    that the allocator would hand back to the memory benchmark, hiding growth.
    A fresh process that imports only ppetrace and exporters measures the
    recorder and the exporter alone.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory.json"
        cmd = [
            sys.executable,
            str(Path(__file__).with_name("bench_memory.py")),
            "--spans",
            str(size["memory_spans"]),
            "--checkpoint",
            str(size["memory_checkpoint"]),
            "--flush-every",
            str(size["memory_flush_every"]),
            "--sink",
            sink,
            "--json",
            str(path),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if not path.exists():
            raise RuntimeError(
                f"Expected bench_memory.py to write {path.name}, but it exited with "
                f"{proc.returncode}: {proc.stderr.strip()[-2000:]}"
            )
        res: dict[str, Any] = json.loads(path.read_text())
    res["output"] = proc.stdout
    return res


def memory_rows(size: dict[str, int], details: dict[str, Any]) -> list[Row]:
    from benchmarks import bench_memory

    res = run_memory(size)
    details["memory"] = res
    mb = 1e6
    ok = bench_memory.verdict(res)
    cp, end = res["checkpoint_spans"], res["spans"]
    return [
        Row(
            id="memory.steady",
            what=f"memory: RSS growth {cp:,} -> {end:,} spans (streamed Chrome trace)",
            measured=f"{res['growth_steady'] / mb:+.1f} MB",
            reference=f"{res['rss_checkpoint'] / mb:.1f} MB at {cp:,}",
            ratio=res["rss_end"] / res["rss_checkpoint"],
            budget=f"< {bench_memory.BUDGET_MB:.0f} MB",
            status=PASS if ok else FAIL,
            value=res["growth_steady"] / mb,
            reference_value=res["rss_checkpoint"] / mb,
            unit="MB",
            note=(
                f"a fresh process; peak {res['rss_peak'] / mb:.1f} MB; "
                f"{res['dropped']} spans dropped"
            ),
        ),
        Row(
            id="memory.warmup",
            what=f"memory: RSS growth 0 -> {cp:,} spans (buffer, caches, first arenas)",
            measured=f"{res['growth_warmup'] / mb:+.1f} MB",
            reference=f"{res['rss_start'] / mb:.1f} MB at start",
            ratio=res["rss_checkpoint"] / res["rss_start"],
            value=res["growth_warmup"] / mb,
            reference_value=res["rss_start"] / mb,
            unit="MB",
        ),
    ]


# -- profilers off ------------------------------------------------------------------------


def profilers_rows(size: dict[str, int], details: dict[str, Any]) -> list[Row]:
    from benchmarks import bench_profilers_off

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profilers.json"
        _, text = _run_captured(
            bench_profilers_off.main,
            [
                "--steps",
                str(size["profilers_steps"]),
                "--rounds",
                str(size["profilers_rounds"]),
                "--json",
                str(path),
            ],
        )
        res = json.loads(path.read_text())
    details["profilers_off"] = res
    details["profilers_off_output"] = text
    med = {k: statistics.median(v) for k, v in res["times_ns"].items()}
    steps = res["steps"]
    return [
        Row(
            id="profilers.off",
            what="profilers configured, outside their windows / none (MLP Trainer)",
            measured=f"{med['profilers'] / steps / 1e3:,.1f} µs/step",
            reference=f"{med['baseline'] / steps / 1e3:,.1f} µs/step (no profilers)",
            ratio=float(res["ratio_paired_median"]),
            budget=f"<= {res['budget']:.2f}x",
            status=PASS if res["pass"] else FAIL,
            value=med["profilers"] / steps / 1e3,
            reference_value=med["baseline"] / steps / 1e3,
            unit="µs/step",
            note=(
                f"median of {res['rounds']} paired rounds; fastest runs {res['ratio_best']:.3f}x; "
                f"the 4 profilers' step hooks cost {res['hook_ns_per_step']:,.0f} ns/step "
                "measured alone"
            ),
        )
    ]


# -- delivery to OpenTelemetry ----------------------------------------------------------


def delivery_rows(size: dict[str, int], details: dict[str, Any]) -> list[Row]:
    from benchmarks import bench_delivery

    rounds = size["delivery_rounds"]
    simple = bench_delivery.measure_simple(size["delivery_spans"], rounds)
    batch = bench_delivery.measure_batch_trainer(size["delivery_steps"], rounds)
    details["delivery"] = {"simple": simple, "batch_trainer": batch}
    rows = []
    for row_id, what, res, measured, reference, unit in (
        (
            "delivery.simple",
            "delivery: trace -> SimpleSpanProcessor, all in with flush / SDK span to the same",
            simple,
            simple["ppetrace_ns_per_span"],
            f"{_ns(simple['sdk_ns_per_span'])} (SDK start_as_current_span)",
            "ns/span",
        ),
        (
            "delivery.batch_trainer",
            "delivery: Trainer tiny, every span through a default BatchSpanProcessor",
            batch,
            batch["ppetrace_us_per_step"],
            f"{batch['hand_us_per_step']:,.1f} µs/step (hand loop)",
            "µs/step",
        ),
    ):
        budget = bench_delivery.BUDGETS["simple" if row_id.endswith("simple") else "batch trainer"]
        rows.append(
            Row(
                id=row_id,
                what=what,
                measured=_ns(measured) if unit == "ns/span" else f"{measured:,.1f} µs/step",
                reference=reference,
                ratio=res["ratio"],
                budget=f"<= {budget:.2f}x",
                status=_gate(res["ratio"], budget),
                value=measured,
                unit=unit,
                note=(
                    f"median of {res['rounds']} paired interleaved rounds; bootstrap 95% "
                    f"interval {res['low']:.3f}-{res['high']:.3f}x"
                ),
            )
        )
    return rows


def instrument_rows(size: dict[str, int], details: dict[str, Any]) -> list[Row]:
    """instrument(), LightningProfiler, `ppetrace run` start-up and span truth
    (``bench_instrument``)."""
    from benchmarks import bench_instrument

    return list(bench_instrument.rows(size, details))


# -- the suite ----------------------------------------------------------------------------

#: the sections in order: name -> function(size, details) -> rows
SECTIONS: dict[str, Callable[[dict[str, int], dict[str, Any]], list[Row]]] = {
    "hot path": hot_path_rows,
    "trainer": trainer_rows,
    "export": export_rows,
    "memory": memory_rows,
    "profilers off": profilers_rows,
    "delivery": delivery_rows,
    "instrument": instrument_rows,
}
#: the row ids that each section yields, for checking that a run is complete
ROW_IDS: dict[str, tuple[str, ...]] = {
    "hot path": (
        "hotpath.otel",
        "hotpath.floor",
        "hotpath.nullcontext",
        "hotpath.all_in",
        "hotpath.record_function",
        "hotpath.ppe_record",
    ),
    "trainer": tuple(
        f"trainer.{w}.{v}"
        for w in ("tiny", "mlp")
        for v in (
            "ppetrace",
            "report",
            "ppetrace_nofile",
            "ppetrace_off",
            "ppetrace_interface",
            "ppetrace_interface_off",
            "ppetrace_network",
            "ppetrace_network_off",
            "coverage_epoch",
            "coverage_run",
            # bench_trainer.PARTS, in order
            "part.with_floor",
            "part.recording",
            "part.writing",
            "part.spans",
            "part.loop",
            "part.tracing",
            "part.all",
            "ppe",
            "ppe_profile",
            "lightning",
        )
    ),
    "export": ("export.chrome", "export.frame", "export.read", "export.read_rss"),
    "memory": ("memory.steady", "memory.warmup"),
    "profilers off": ("profilers.off",),
    "delivery": ("delivery.simple", "delivery.batch_trainer"),
    "instrument": (
        "instrument.tiny",
        "instrument.tiny.nofile",
        "instrument.tiny.spans",
        "instrument.tiny.rows",
        "instrument.tiny.hooks",
        "instrument.tiny.hooks_rows",
        "instrument.mlp",
        "instrument.mlp.nofile",
        "instrument.mlp.spans",
        "instrument.mlp.rows",
        "instrument.mlp.hooks",
        "instrument.mlp.hooks_rows",
        "instrument.lightning_simple",
        "instrument.lightning_none",
        "instrument.lightning_nofile",
        "instrument.startup",
        "instrument.startup_report",
        "instrument.truth.module.forward",
        "instrument.truth.trainer.backward",
        "instrument.truth.trainer.fetch_batch",
        "instrument.tiling",
    ),
}


def run_suite(
    size: dict[str, int], sections: Sequence[str] | None = None
) -> tuple[list[Row], dict[str, Any]]:
    """Run the sections (default: all) at ``size``; returns the rows and the raw details.

    A section that raises yields one ``error`` row (its traceback in
    ``details["errors"]``) and the suite goes on.
    """
    chosen = list(SECTIONS) if sections is None else list(sections)
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        raise ValueError(f"Unknown section {unknown[0]!r}; expected some of {', '.join(SECTIONS)}.")
    rows: list[Row] = []
    details: dict[str, Any] = {"errors": {}}
    for name in chosen:
        _say(f"{name} ...")
        t0 = time.perf_counter()
        try:
            rows += SECTIONS[name](size, details)
        except Exception as exc:
            details["errors"][name] = traceback.format_exc()
            rows.append(
                Row(
                    id=f"{name.replace(' ', '_')}.error",
                    what=f"{name}: the benchmark raised",
                    status=ERROR,
                    note=f"{type(exc).__name__}: {exc}",
                )
            )
        _say(f"{name} done in {time.perf_counter() - t0:.1f} s")
    return rows, details


def _widths(table: list[list[str]]) -> list[int]:
    return [max(len(r[i]) for r in table) for i in range(len(table[0]))]


def render_table(rows: Sequence[Row]) -> str:
    """The rows as a plain-text table."""
    table = [HEADER] + [r.cells for r in rows]
    widths = _widths(table)
    lines = []
    for i, cells in enumerate(table):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown(rows: Sequence[Row]) -> str:
    """The rows as a GitHub-flavoured Markdown table."""

    def esc(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join(["---", "---:", "---:", "---:", "---:", "---"]) + "|",
    ]
    for r in rows:
        cells = [esc(c) for c in r.cells]
        if r.status in (PASS, FAIL):
            cells[-1] = f"**{cells[-1]}**"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": 1,
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    for module, key in (("pytorch_pfn_extras", "pytorch_pfn_extras"), ("lightning", "lightning")):
        try:
            env[key] = __import__(module).__version__
        except ImportError:
            env[key] = "not installed"
    with contextlib.suppress(OSError):
        env["load_average"] = list(os.getloadavg())
    return env


def hot_spots(
    rows: Sequence[Row], size: dict[str, int], details: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Profile every failing budget that has a profiler here; returns the findings."""
    found: dict[str, Any] = {}
    failing = {r.id for r in rows if r.status == FAIL}
    for name in ("tiny", "mlp"):
        if f"trainer.{name}.ppetrace" in failing:
            from benchmarks import bench_trainer

            _say(f"profiling the traced Trainer ({name}) with pyinstrument ...")
            found[f"trainer.{name}.ppetrace"] = bench_trainer.profile_traced(
                name, steps=size["profile_steps"]
            )
    for what in ("chrome", "frame"):
        if f"export.{what}" in failing:
            _say(f"profiling the export to a {what} with pyinstrument ...")
            found[f"export.{what}"] = profile_export(what, size["profile_export_spans"])
    if "memory.steady" in failing:
        _say("memory: the same run with a sink that keeps nothing (recorder alone) ...")
        found["memory.steady"] = {
            "recorder_only": run_memory(size, sink="null"),
            "chrome_series": (details or {}).get("memory", {}).get("rss_series", []),
        }
    return found


def profile_export(what: str, spans: int, *, top: int = 12) -> dict[str, Any]:
    """Where exporting ``spans`` synthetic spans (``bench_export.make_batches``) goes.

    ``what`` is ``"chrome"`` (a ``ChromeTraceExporter`` writing a file) or
    ``"frame"`` (``spans_to_frame``). Returns the ``top`` functions by self
    time (pyinstrument), each with ``ns_per_span``, and the sampled total.
    """
    from benchmarks import bench_export
    from benchmarks.bench_trainer import sampled_self_times
    from exporters import ChromeTraceExporter, spans_to_frame

    batches = bench_export.make_batches(spans)
    with tempfile.TemporaryDirectory() as tmp:

        def chrome() -> None:
            exporter = ChromeTraceExporter(Path(tmp) / "profile.json")
            for batch in batches:
                exporter.export_batch(batch)
            exporter.shutdown()

        def frame() -> None:
            spans_to_frame(batches)

        times = sampled_self_times(chrome if what == "chrome" else frame, 0.001)
    ranked = sorted(times.items(), key=lambda kv: kv[1], reverse=True)[:top]
    return {
        "spans": spans,
        "total_ns_per_span": sum(times.values()) / spans * 1e9,
        "functions": [
            {"function": f, "file": file, "line": line, "ns_per_span": t / spans * 1e9}
            for (f, file, line), t in ranked
        ],
    }


def render_hot_spots(found: dict[str, Any]) -> str:
    """The closing note: where the time (or memory) of each failing budget goes."""
    if not found:
        return ""
    lines = ["Where failing budgets go:"]
    for row_id, data in found.items():
        if row_id.startswith("trainer."):
            lines.append(
                f"  {row_id}: pyinstrument over {data['steps']} steps: ppetrace's own code "
                f"{data['library_us_per_step']:.1f} µs/step of {data['traced_us_per_step']:.1f} "
                f"sampled (hand loop {data['hand_us_per_step']:.1f}; the rest of the gap, "
                f"{data['other_delta_us_per_step']:+.1f} µs/step, is torch/DataLoader and noise)"
            )
            for f in data["functions"]:
                lines.append(
                    f"    {f['us_per_step']:8.2f} µs/step  {f['function']}  "
                    f"({f['file']}:{f['line']})"
                )
        elif row_id.startswith("export."):
            lines.append(
                f"  {row_id}: pyinstrument over {data['spans']:,} spans, "
                f"{data['total_ns_per_span']:,.0f} ns/span sampled; top functions by self time"
            )
            for f in data["functions"]:
                where = f"{f['file']}:{f['line']}"
                lines.append(f"    {f['ns_per_span']:8.0f} ns/span  {f['function']}  ({where})")
        elif row_id == "memory.steady":
            alone = data["recorder_only"]
            series = ", ".join(f"{r / 1e6:.0f}" for _, r in alone["rss_series"])
            lines.append(
                f"  memory.steady: the same run in a fresh process with a sink that keeps "
                f"nothing (the recorder alone) grows {alone['growth_steady'] / 1e6:+.1f} MB "
                f"over the same phase (RSS after each flush, MB: {series}); the rest of the "
                "growth is the Chrome exporter's"
            )
            if data.get("chrome_series"):
                lines.append(
                    "    with the Chrome trace (MB): "
                    + ", ".join(f"{r / 1e6:.0f}" for _, r in data["chrome_series"])
                )
    return "\n".join(lines)


def _preload() -> None:
    """Import everything the suite uses, so that no section pays for imports.

    ``main`` then freezes the heap for the garbage collector (see
    ``bench_trainer.gc_frozen``) for the whole suite.
    """
    import pandas  # noqa: F401
    import torch  # noqa: F401

    import exporters  # noqa: F401
    import ppetrace.training  # noqa: F401

    for module in ("pytorch_pfn_extras", "lightning"):
        with contextlib.suppress(ImportError):
            __import__(module)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes: a smoke run, figures not meaningful"
    )
    parser.add_argument("--json", dest="json_path", help="write the rows and raw results here")
    parser.add_argument("--markdown", dest="md_path", help="write the table as Markdown here")
    parser.add_argument(
        "--only",
        action="append",
        choices=list(SECTIONS),
        help="run only this section (repeatable)",
    )
    parser.add_argument("--no-profile", action="store_true", help="do not profile failing budgets")
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "full"
    size = SIZES[mode]
    started = _dt.datetime.now(_dt.timezone.utc)
    _say("importing torch, pandas and the peers ...")
    _preload()
    env = _environment()
    from benchmarks.bench_trainer import gc_frozen

    with gc_frozen():
        rows, details = run_suite(size, args.only)
        found = {} if args.no_profile else hot_spots(rows, size, details)
    env["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    command = "python -m benchmarks.run" + (
        " " + shlex.join(argv if argv is not None else sys.argv[1:])
        if (argv if argv is not None else sys.argv[1:])
        else ""
    )
    print(f"ppetrace benchmarks ({mode}), {started:%Y-%m-%d %H:%M} UTC: {command}")
    print(
        f"python {env['python']}, torch {env['torch']} (1 thread), {env['cpus']} CPUs, "
        f"pytorch-pfn-extras {env['pytorch_pfn_extras']}, lightning {env['lightning']}"
    )
    if args.quick:
        print("--quick: tiny sizes; the figures below are not meaningful.")
    print()
    print(render_table(rows))
    notes = [f"  {r.id}: {r.note}" for r in rows if r.note]
    if notes:
        print("\nnotes:")
        print("\n".join(notes))
    closing = render_hot_spots(found)
    if closing:
        print()
        print(closing)
    failed = [r.id for r in rows if r.status in (FAIL, ERROR)]
    print()
    print(
        "every budget PASS"
        if not failed
        else f"{len(failed)} budget(s) FAIL or error: {', '.join(failed)}"
    )
    markdown = render_markdown(rows)
    if args.md_path:
        Path(args.md_path).write_text(markdown, encoding="utf-8")
    if args.json_path:
        out = {
            "command": command,
            "date": started.isoformat(timespec="seconds"),
            "mode": mode,
            "sizes": size,
            "environment": env,
            "rows": [asdict(r) for r in rows],
            "failed": failed,
            "hot_spots": found,
            "markdown": markdown,
            "details": details,
        }
        Path(args.json_path).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
