"""The pytest plugin: the ppetrace_benchmark fixture, --ppetrace-save and --ppetrace-compare."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Load pandas, scipy and every exporters module now: pytester's in-process runs restore
# sys.modules afterwards, and a module first imported inside one would be loaded twice.
import exporters.comparison
import exporters.report  # noqa: F401
from exporters import ChromeTraceExporter, SpanBatch, SpanRow, read_chrome_trace

pytest_plugins = ["pytester"]

BENCH = textwrap.dedent(
    """
    import ppetrace

    def work(n):
        return sum(range(n))

    def test_bench(ppetrace_benchmark):
        assert ppetrace_benchmark(work, 100, steps=12, warmup=1) == 4950
        frame = ppetrace_benchmark.frame
        assert (frame["name"] == "trainer.step").sum() == 13
        assert list(frame.loc[frame["name"] == "trainer.step", "step"]) == list(range(13))
    """
)
BASELINE_NAME = "test_bench.py_test_bench.json"


def _baseline(path: Path, step_ns: int, steps: int = 13) -> None:
    """A baseline whose trainer.step spans last ``step_ns`` each (exact, injected)."""
    t0 = 1_700_000_000_000_000_000
    rows = [SpanRow("trainer.run", 1, 0, 9, t0, t0 + steps * (step_ns + 10) + 10, 1, {})]
    for i in range(steps):
        start = t0 + 5 + i * (step_ns + 10)
        rows.append(
            SpanRow("trainer.step", 10 + i, 1, 9, start, start + step_ns, 1, {"ppetrace.step": i})
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    exporter = ChromeTraceExporter(path)
    exporter.export_batch(SpanBatch(rows))
    exporter.shutdown()


def test_save_writes_a_baseline_trace(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_bench=BENCH)
    out = pytester.path / "baselines"
    result = pytester.runpytest("--ppetrace-save", str(out), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    frame = read_chrome_trace(out / BASELINE_NAME)
    assert (frame["name"] == "trainer.step").sum() == 13
    assert (frame["name"] == "trainer.run").sum() == 1


def test_compare_fails_a_test_that_regressed_with_the_markdown_table(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_bench=BENCH)
    baseline = pytester.path / "base"
    _baseline(baseline / BASELINE_NAME, step_ns=1)  # nothing real is that fast
    result = pytester.runpytest("--ppetrace-compare", str(baseline), "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "significant regression against the baseline" in text
    assert "### ppetrace compare: ❌" in text
    assert "| trainer.step |" in text


def test_compare_passes_when_the_run_is_not_slower(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_bench=BENCH)
    baseline = pytester.path / "base"
    _baseline(baseline / BASELINE_NAME, step_ns=10**9)  # one second per step
    result = pytester.runpytest(
        "--ppetrace-compare",
        str(baseline),
        "--ppetrace-threshold",
        "10%",
        "-p",
        "no:cacheprovider",
    )
    result.assert_outcomes(passed=1)


def test_a_missing_baseline_warns_and_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_bench=BENCH)
    result = pytester.runpytest(
        "--ppetrace-compare", str(pytester.path / "empty"), "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1, warnings=1)
    assert "no baseline" in result.stdout.str()


def test_record_mode_collects_what_the_block_traces(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_rec="""
        import ppetrace

        def test_rec(ppetrace_benchmark, tmp_path):
            with ppetrace_benchmark.record(warmup_steps=0) as bench:
                for i in range(5):
                    with ppetrace.trace("trainer.step", {"ppetrace.step": i}):
                        with ppetrace.trace("user.inner"):
                            pass
            assert bench is ppetrace_benchmark
            names = sorted(ppetrace_benchmark.frame["name"])
            assert names == ["trainer.step"] * 5 + ["user.inner"] * 5
            assert ppetrace_benchmark.comparison is None
        """
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_bad_arguments_and_options_are_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_args="""
        import pytest

        def test_steps(ppetrace_benchmark):
            with pytest.raises(ValueError, match="Expected a positive int for steps, but rec"):
                ppetrace_benchmark(print, steps=0)
            with pytest.raises(ValueError, match="Expected a non-negative int for warmup"):
                ppetrace_benchmark(print, warmup=-1)
            with pytest.raises(TypeError, match="Expected a callable to benchmark"):
                ppetrace_benchmark(42)
        """
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    result = pytester.runpytest("--ppetrace-threshold", "lots", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "Expected a percentage such as '5%'" in result.stderr.str()


def test_importing_the_plugin_is_cheap() -> None:
    script = (
        "import sys, ppetrace.pytest_plugin; "
        "print(sorted(m for m in ('torch', 'pandas', 'scipy') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_benchmark_without_spans_fails_clearly(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_off="""
        import ppetrace

        def test_off(ppetrace_benchmark):
            ppetrace.configure(enabled=False)
            try:
                ppetrace_benchmark(print, steps=3)
            finally:
                ppetrace.configure()
        """
    )
    baseline = pytester.path / "base"
    _baseline(baseline / "test_off.py_test_off.json", step_ns=1_000)
    result = pytester.runpytest("--ppetrace-compare", str(baseline), "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert "the benchmark recorded no spans" in result.stdout.str()
