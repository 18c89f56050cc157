"""Smoke tests of the benchmark suite at tiny size: every row is there; no timing is asserted."""

from __future__ import annotations

import collections
import itertools
import json
import statistics
import sys
from pathlib import Path

import pytest

import ppetrace

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the repository, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import (  # noqa: E402
    bench_instructions,
    bench_instrument,
    bench_memory,
    bench_trainer,
    bench_writer,
    bench_writer_instructions,
    run,
)

BUDGETED = {
    "hotpath.otel",
    "hotpath.floor",
    "hotpath.nullcontext",
    *(f"trainer.{w}.ppetrace{k}" for w in ("tiny", "mlp") for k in ("", "_interface", "_network")),
    *(f"trainer.tiny.ppetrace{k}_off" for k in ("", "_interface", "_network")),
    "trainer.mlp.coverage_epoch",
    "trainer.mlp.coverage_run",
    "export.chrome",
    "export.frame",
    "export.read",
    "export.read_rss",
    "memory.steady",
    "profilers.off",
    "delivery.simple",
    "delivery.batch_trainer",
    *bench_instrument.BUDGETED,
}
PEER_ROWS = {
    f"trainer.{w}.{v}" for w in ("tiny", "mlp") for v in ("ppe", "ppe_profile", "lightning")
}


def test_quick_run_writes_every_row_to_json_and_markdown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, md = tmp_path / "results.json", tmp_path / "table.md"
    code = run.main(["--quick", "--no-profile", "--json", str(out), "--markdown", str(md)])
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    rows = {r["id"]: r for r in data["rows"]}
    expected = set(itertools.chain.from_iterable(run.ROW_IDS.values()))
    assert set(rows) == expected, data["details"]["errors"]
    assert run.ROW_IDS["instrument"] == bench_instrument.ROW_IDS
    parts = [i for i in run.ROW_IDS["trainer"] if i.startswith("trainer.tiny.part.")]
    assert parts == [f"trainer.tiny.part.{p[0]}" for p in bench_trainer.PARTS]
    assert expected >= BUDGETED
    assert code == (1 if data["failed"] else 0)
    for row_id, row in rows.items():
        if row_id in BUDGETED:
            assert row["status"] in ("PASS", "FAIL"), row
            assert row["budget"] != "–"
        elif row_id in PEER_ROWS:
            variant = row_id.rsplit(".", 1)[1]
            installed = bench_trainer.peer_available(variant)
            assert row["status"] == ("info" if installed else "not installed"), row
        else:
            assert row["status"] in ("info", "not installed"), row
        if row["status"] in ("PASS", "FAIL", "info"):
            assert row["measured"] != "–", row
    # one table, printed and in Markdown, with one line per row
    assert printed.count("\n") > len(rows)
    for row in data["rows"]:
        assert row["what"] in printed
    table = md.read_text().splitlines()
    assert len(table) == len(rows) + 2 and table[0].startswith("| what | measured |")
    assert data["markdown"] == md.read_text()
    assert data["mode"] == "quick" and data["command"].startswith("python -m benchmarks.run")
    assert data["date"] and data["environment"]["torch"]
    # the traced run's trace was read back into a report with every step
    tiny = data["details"]["trainer_tiny"]
    assert tiny["report_steps"] == run.SIZES["quick"]["tiny_steps"]
    assert len(tiny["times_ns"]["hand"]) == run.SIZES["quick"]["trainer_rounds"]
    assert ppetrace.stats().buffered == 0


def test_a_missing_peer_is_reported_not_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("lightning", "pytorch_pfn_extras"):
        monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError
    res = bench_trainer.measure("tiny", steps=3, rounds=1)
    assert res.missing == {
        "ppe": "not installed",
        "ppe_profile": "not installed",
        "lightning": "not installed",
    }
    assert set(res.times_ns) == set(bench_trainer.VARIANTS) - set(res.missing)
    assert res.report_steps == 3
    # every traced kind's file gave the coverage of trainer.epoch and trainer.run
    assert set(res.coverage) == set(bench_trainer.TRACED.values())
    for per in res.coverage.values():
        assert all(0.0 < c <= 1.0 for c in per["epoch"] + per["run"]), per

    details: dict[str, object] = {}
    size = dict(run.SIZES["quick"], tiny_steps=3, mlp_steps=2, trainer_rounds=1)
    rows = {r.id: r for r in run.trainer_rows(size, details)}
    for row_id in PEER_ROWS:
        assert rows[row_id].status == "not installed"
    table = run.render_table(list(rows.values()))
    assert table.count("not installed") == len(PEER_ROWS)
    assert run.measure_ppe_record(10, 1) is None


def test_trainer_measure_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"Expected a positive int for steps, but received 0\."):
        bench_trainer.measure("tiny", steps=0, rounds=1)
    with pytest.raises(ValueError, match=r"Unknown workload 'huge'; expected one of tiny, mlp\."):
        bench_trainer.measure("huge", steps=1, rounds=1)
    with pytest.raises(ValueError, match=r"Expected 'hand' among the variants"):
        bench_trainer.measure("tiny", steps=1, rounds=1, variants=["ppetrace"])
    with pytest.raises(ValueError, match=r"Unknown variant 'keras'"):
        bench_trainer.measure("tiny", steps=1, rounds=1, variants=["hand", "keras"])
    with pytest.raises(ValueError, match=r"Expected the reference 'hand_network' among"):
        bench_trainer.measure("tiny", steps=1, rounds=1, variants=["hand", "ppetrace_network"])


def test_trainer_result_ratios_pair_rounds() -> None:
    res = bench_trainer.TrainerResult("tiny", steps=10, rounds=3, threads=1)
    res.times_ns = {"hand": [100, 200, 100], "ppetrace": [110, 300, 120]}
    assert res.paired_ratio("ppetrace") == pytest.approx(1.2)  # median of 1.1, 1.5, 1.2
    assert res.best_ratio("ppetrace") == pytest.approx(1.1)
    assert res.us_per_step("hand") == pytest.approx(0.01)
    lo, hi = res.paired_ci("ppetrace")
    assert 1.1 <= lo <= 1.2 <= hi <= 1.5  # within the spread of the paired ratios
    # µs per step above the hand loop: (110-100, 300-200, 120-100) ns over 10 steps
    assert res.overhead_us("ppetrace") == pytest.approx(0.002)
    olo, ohi = res.overhead_ci("ppetrace")
    assert 0.001 <= olo <= 0.002 <= ohi <= 0.01


def test_trainer_result_pairs_each_kind_with_its_own_hand_loop_in_both_clocks() -> None:
    res = bench_trainer.TrainerResult("tiny", steps=2, rounds=2, threads=1)
    res.times_ns = {"hand": [100, 100], "hand_network": [200, 200], "ppetrace_network": [220, 240]}
    res.cpu_ns = {"hand": [90, 90], "hand_network": [100, 100], "ppetrace_network": [105, 105]}
    assert res.paired_ratio("ppetrace_network") == pytest.approx(1.15)  # against hand_network
    assert res.paired_ratio("ppetrace_network", clock="cpu") == pytest.approx(1.05)
    assert res.paired_ratio("ppetrace_network", "hand") == pytest.approx(2.3)
    assert res.overhead_us("ppetrace_network", clock="cpu") == pytest.approx(0.0025)
    with pytest.raises(ValueError, match=r"Expected clock 'wall' or 'cpu', but received 'gpu'"):
        res.paired_ratio("ppetrace_network", clock="gpu")
    data = res.to_json()
    assert data["reference"]["ppetrace_network"] == "hand_network"
    assert data["cpu"]["ratio_paired_median"]["ppetrace_network"] == pytest.approx(1.05)


def test_cost_parts_are_paired_differences_and_add_up() -> None:
    res = bench_trainer.TrainerResult("tiny", steps=10, rounds=3, threads=1)
    # CPU ns per run in three rounds. The rounds are noisy in ways that make the median of
    # the per-round differences differ from the difference of the medians (what an
    # unpaired figure would give)
    hand = [1000, 1500, 3000]
    above = {  # ns above the hand loop of the same round, per round
        "hand": (0, 0, 0),
        "hand_spans_off": (30, 900, 20),
        "hand_spans_nofile": (100, 1000, 90),
        "hand_spans": (150, 1100, 140),
        "ppetrace_off": (90, 960, 80),
        "ppetrace": (260, 1200, 250),
    }
    res.cpu_ns = {v: [h + d for h, d in zip(hand, ds, strict=True)] for v, ds in above.items()}
    res.times_ns = {v: [10 * t for t in ts] for v, ts in res.cpu_ns.items()}  # not the default
    found = {part_id: us for part_id, _part, us, _lo, _hi in bench_trainer.cost_parts(res)}
    # µs per step: the median of the per-round ns differences / 10 steps / 1000
    assert found == pytest.approx(
        {
            "with_floor": 0.003,
            "recording": 0.007,
            "writing": 0.005,
            "spans": 0.015,
            "loop": 0.006,
            "tracing": 0.017,
            "all": 0.026,
        }
    )
    assert statistics.median(res.cpu_ns["hand_spans_off"]) - statistics.median(hand) != 30
    del res.cpu_ns["hand_spans"], res.times_ns["hand_spans"]  # a part whose variant did not run
    assert "writing" not in {p[0] for p in bench_trainer.cost_parts(res)}
    assert "where the traced Trainer's time above the hand loop goes" in (
        bench_trainer.render_results([res])
    )


def test_instrument_spans_by_hand_both_ways_give_one_layout(tmp_path: Path) -> None:
    """``spans`` (trace blocks) and ``rows`` (after the fact) record the same spans under
    the same parents: the two ways of recording compare like with like."""
    import torch

    from benchmarks.trainer_variants import LR, WORKLOADS
    from exporters import read_chrome_trace
    from exporters.chrome import ChromeTraceExporter

    wl = WORKLOADS["tiny"]
    layouts = []
    for loop in (bench_instrument._spans_loop, bench_instrument._rows_loop):
        model = wl.model()
        exporter = ChromeTraceExporter(tmp_path / f"{loop.__name__}.json")
        ppetrace.tracing.add_exporter(exporter)
        try:
            loop(model, torch.optim.SGD(model.parameters(), lr=LR), wl.loader(4))
        finally:
            ppetrace.tracing.remove_exporter(exporter)
        frame = read_chrome_trace(exporter.path)
        names = dict(zip(frame["span_id"], frame["name"], strict=True))
        layouts.append(
            collections.Counter(
                (name, names.get(parent, "-"))
                for name, parent in zip(frame["name"], frame["parent_id"], strict=True)
            )
        )
    assert layouts[0] == layouts[1]
    assert layouts[0][("module.forward", "trainer.step")] == 4


def test_pass_through_hooks_put_everything_back_also_after_an_error() -> None:
    import torch
    import torch.utils.data.dataloader as dl
    from torch.optim import optimizer as optim

    points = [
        (torch.nn.Module, "__call__"),
        (dl._BaseDataLoaderIter, "__next__"),
        (torch.autograd, "backward"),
    ]

    def own(owner: object, name: str) -> object:
        return owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)

    before = [own(o, n) for o, n in points]
    hooks_before = (len(optim._global_optimizer_pre_hooks), len(optim._global_optimizer_post_hooks))
    with pytest.raises(RuntimeError, match="inside"), bench_instrument._pass_through_hooks():
        assert all(own(o, n) is not b for (o, n), b in zip(points, before, strict=True))
        assert len(optim._global_optimizer_pre_hooks) == hooks_before[0] + 1
        raise RuntimeError("inside")
    assert [own(o, n) for o, n in points] == before
    assert (
        len(optim._global_optimizer_pre_hooks),
        len(optim._global_optimizer_post_hooks),
    ) == hooks_before


def test_hand_spans_record_what_the_trainer_records_per_step(tmp_path: Path) -> None:
    """The hand loop that prices the Trainer's spans opens the same spans per step, with the
    same parents, as the Trainer does (so that the parts compare like with like)."""
    from benchmarks.trainer_variants import CLASSES, WORKLOADS
    from exporters import read_chrome_trace

    wl = WORKLOADS["tiny"]
    layouts = []
    for variant in ("hand_spans", "ppetrace"):
        runner = CLASSES[variant](wl, wl.loader(6), tmp_path)
        runner.run()
        path = tmp_path / "_HandSpans.json" if variant == "hand_spans" else runner.trace_path
        frame = read_chrome_trace(path)
        names = dict(zip(frame["span_id"], frame["name"], strict=True))
        pairs = collections.Counter(
            (name, names.get(parent, "-"))
            for name, parent in zip(frame["name"], frame["parent_id"], strict=True)
        )
        layouts.append({pair: n for pair, n in pairs.items() if n == 6})  # one per step
    assert layouts[0] == layouts[1]
    assert layouts[0][("trainer.backward", "trainer.step")] == 6
    assert layouts[0][("trainer.fetch_batch", "trainer.epoch")] == 6


def test_profile_export_names_the_exporter_functions() -> None:
    found = run.profile_export("chrome", 10_000, top=4)
    assert found["spans"] == 10_000 and found["total_ns_per_span"] > 0
    assert len(found["functions"]) == 4
    # the exporters' own functions, or their C helpers (shown as built-ins)
    helpers = {"encode_x_events", "span_columns", "encode_attrs"}
    assert any(
        f["file"].startswith("exporters/") or f["function"] in helpers for f in found["functions"]
    ), found
    assert "export.chrome: pyinstrument over 10,000 spans" in run.render_hot_spots(
        {"export.chrome": found}
    )


def test_profile_names_ppetrace_functions() -> None:
    found = bench_trainer.profile_traced("tiny", steps=150, top=5)
    assert found["steps"] == 150 and 0 < len(found["functions"]) <= 5
    for f in found["functions"]:
        assert f["file"].startswith(("ppetrace/", "exporters/", "opentelemetry/")), f
    assert found["library_us_per_step"] >= found["functions"][0]["us_per_step"] > 0
    text = run.render_hot_spots({"trainer.tiny.ppetrace": found})
    assert found["functions"][0]["function"] in text


def test_memory_phases_with_an_injected_rss() -> None:
    readings = iter([100, 150, 160, 175, 170])  # start, 3 flushes, end
    calls: list[int] = []

    def rss() -> int:
        calls.append(1)
        return next(readings)

    res = bench_memory.measure(200, checkpoint=50, flush_every=100, rss=rss)
    assert len(calls) == 5  # flushes at 50 (checkpoint), 100 and 200 spans
    assert (res["rss_start"], res["rss_checkpoint"], res["rss_end"]) == (100, 150, 170)
    assert res["growth_warmup"] == 50 and res["growth_steady"] == 20 and res["rss_peak"] == 175
    assert [s for s, _ in res["rss_series"]] == [0, 50, 100, 200]
    assert res["exported"] == 200 and res["dropped"] == 0 and res["trace_bytes"] > 0
    assert bench_memory.verdict(res, budget_mb=1e-4) is True  # 20 B < 100 B
    assert bench_memory.verdict(res, budget_mb=1e-5) is False


def test_memory_measure_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"Expected checkpoint < spans, but received"):
        bench_memory.measure(100, checkpoint=100)
    with pytest.raises(ValueError, match=r"Expected an int of at least 10 for spans"):
        bench_memory.measure(5, checkpoint=1)
    with pytest.raises(ValueError, match=r"Expected sink 'chrome' or 'null'"):
        bench_memory.measure(100, checkpoint=50, sink="disk")  # type: ignore[arg-type]


def test_run_suite_rejects_an_unknown_section() -> None:
    with pytest.raises(ValueError, match=r"Unknown section 'gpu'; expected some of hot path"):
        run.run_suite(run.SIZES["quick"], ["gpu"])


def test_markdown_marks_budgets_and_escapes_pipes() -> None:
    rows = [
        run.Row(id="a", what="x | y", measured="1 ns", ratio=1.5, budget="<= 2.00x", status="PASS"),
        run.Row(id="b", what="peer", status="not installed"),
    ]
    md = run.render_markdown(rows).splitlines()
    assert md[2] == "| x \\| y | 1 ns | – | 1.500x | <= 2.00x | **PASS** |"
    assert md[3] == "| peer | – | – | – | – | not installed |"
    text = run.render_table(rows).splitlines()
    assert text[0].split() == ["what", "measured", "reference", "ratio", "budget", "result"]
    assert text[2].startswith("x | y") and text[2].endswith("PASS")


def test_instruction_counts_per_step_drop_what_a_run_costs_once(tmp_path: Path) -> None:
    order = [["hand", 20], ["hand", 120], ["ppetrace", 20], ["ppetrace", 120]]
    counts = [1_000 + 20 * 800, 1_000 + 120 * 800, 9_000 + 20 * 880, 9_000 + 120 * 880]
    res = bench_instructions.per_step(order, counts)
    assert res == {
        "hand": {"per_step": 800.0, "once": 1_000.0},
        "ppetrace": {"per_step": 880.0, "once": 9_000.0},
    }
    # warm-up runs take their dumps and are left out
    warm = [["warm-hand", 20], ["warm-hand", 120]]
    assert bench_instructions.per_step(warm + order, [9, 99_999, *counts]) == res
    with pytest.raises(ValueError, match=r"Expected one callgrind dump per run \(4\), but found 3"):
        bench_instructions.per_step(order, counts[:3])
    for i, total in enumerate((123, 456), start=1):  # callgrind's dumps, in dump order
        (tmp_path / f"cg.out.{i}").write_text(f"events: Ir\nfn=(1) f\n0 {total}\ntotals: {total}\n")
    assert bench_instructions.totals(tmp_path) == [123, 456]


def test_writer_instructions_per_row_use_the_last_round() -> None:
    order = [["full", 100], ["full", 300], ["full", 100], ["full", 300]]
    order += [["summarised", 100], ["summarised", 300]]
    counts = [50_000, 70_000, 1_000 + 100 * 20, 1_000 + 300 * 20, 500 + 100 * 15, 500 + 300 * 15]
    assert bench_writer_instructions.per_row(order, counts) == {"full": 20.0, "summarised": 15.0}
    with pytest.raises(ValueError, match=r"Expected one callgrind dump per run \(6\), but found 5"):
        bench_writer_instructions.per_row(order, counts[:5])


def test_writer_bench_shares_one_mapping_per_step_and_measures_both_costs(tmp_path: Path) -> None:
    from exporters import SpanRow, read_chrome_trace

    template = [
        SpanRow("module.a", 11, 10, 7, 100, 150, 3, {"ppetrace.step": 0, "s": "x"}),
        SpanRow("trainer.step", 10, 0, 7, 90, 200, 3, {"ppetrace.step": 0, "s": "x"}),
    ]
    rows = bench_writer.step_rows(template, 1_000, 300)
    assert len(rows) == 600 and rows[2].start_ns == 1_100 and rows[3].parent_id == 0
    assert rows[2].parent_id == rows[3].span_id and rows[2].attributes is rows[3].attributes
    assert rows[3].attributes["ppetrace.step"] == 1 and rows[0].attributes is not rows[2].attributes
    cpu = bench_writer.cpu_cost(rows, 256, tmp_path, reps=1)
    assert set(cpu) == {"cpu", "user", "system"} and cpu["cpu"] > 0
    gil = bench_writer.gil_cost(rows, 256, tmp_path, rounds=1)
    assert gil["min"] <= gil["median"] <= gil["max"] and gil["rounds"] == 1
    frame = read_chrome_trace(tmp_path / "gil.json")
    assert len(frame) == 600 and frame["step"].max() == 299 and set(frame["s"]) == {"x"}


def test_long_run_cost_pairs_each_round_against_the_untraced_loop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 19 (c)'s arithmetic on a fake clock: median(summarised - off) / median(all -
    off) and summarised / all, the rounds in the six orders in turn; a noisy round whose
    all - off is negative moves the medians, not the sign."""
    from benchmarks import bench_long_run

    clock = [0]
    cost = {"all": 120_000, "summarised": 115_000, "off": 100_000}
    noisy = {"all": 99_000, "summarised": 101_000, "off": 100_000}  # a round's noise
    order: list[str] = []

    def fit_variant(name: str, steps: int, path: Path) -> None:
        order.append(name)
        round_ = (len(order) - 4) // 3  # after the three warm-ups
        clock[0] += (noisy if round_ == 1 else cost)[name] * steps

    monkeypatch.setattr(bench_long_run, "_fit_variant", fit_variant)
    monkeypatch.setattr(bench_long_run.time, "process_time_ns", lambda: clock[0])
    monkeypatch.setattr(bench_long_run.time, "perf_counter_ns", lambda: clock[0])
    res = bench_long_run.paired_cost(10, 7, tmp_path)
    orders = list(itertools.permutations(["all", "summarised", "off"]))
    assert order[3:] == [name for r in range(7) for name in orders[r % 6]]
    for label in ("cpu", "wall"):
        x = res[label]
        assert x["overhead_ratio"] == pytest.approx(0.75)  # (that round alone: -1.0)
        assert x["run_ratio"] == pytest.approx(115 / 120)
        lo, hi = x["overhead_ci95"]
        assert hi == pytest.approx(0.75) and lo <= 0.75
        assert x["us_per_step_off"] == pytest.approx(100.0)


def test_instrument_instruction_variants_each_run_and_the_unknown_is_refused(
    tmp_path: Path,
) -> None:
    """Every variant that bench_instrument_instructions counts runs (two steps, no
    valgrind); the ones that write a trace write it."""
    from benchmarks import bench_instrument_instructions as bii

    for kind in bii.VARIANTS:
        bii.runner(kind, "tiny", 2, tmp_path)()
    written = {p.name for p in tmp_path.iterdir()}
    assert {"rows-2.json", "hooks_rows-2.json", "instrument-2.json"} <= written
    assert "nofile-2.json" not in written
    with pytest.raises(ValueError, match="Expected a variant"):
        bii.runner("nope", "tiny", 2, tmp_path)
