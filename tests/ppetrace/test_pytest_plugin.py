"""The pytest plugin: the ppetrace_benchmark fixture, --ppetrace-save and --ppetrace-compare."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from import_probe import loaded_after

# Load pandas, scipy and every exporters module now: pytester's in-process runs restore
# sys.modules afterwards, and a module first imported inside one would be loaded twice.
import exporters.comparison
import exporters.report  # noqa: F401
from exporters import ChromeTraceExporter, SpanBatch, SpanRow, read_chrome_trace
from ppetrace.pytest_plugin import baseline_name, project_root
from ppetrace.tracing import capture_environment

pytest_plugins = ["pytester"]

BENCH = textwrap.dedent(
    """
    import ppetrace

    def work(n):
        return sum(range(n))

    def test_bench(ppetrace_benchmark):
        # about 0.2 ms a step: far above compare's minimum effect of 1 µs (sum(range(100)),
        # about 1 µs on a slow machine, sometimes fell under it)
        assert ppetrace_benchmark(work, 20_000, steps=12, warmup=1) == 199_990_000
        frame = ppetrace_benchmark.frame
        assert (frame["name"] == "trainer.step").sum() == 13
        assert list(frame.loc[frame["name"] == "trainer.step", "step"]) == list(range(13))
    """
)
BASELINE_NAME = "test_bench.py%3A%3Atest_bench.json"


def _baseline(
    path: Path,
    step_ns: int,
    steps: int = 13,
    environment: dict[str, object] | None = None,
    error: str = "",
) -> None:
    """A baseline whose trainer.step spans last ``step_ns`` each (exact, injected); with
    ``error``, its ``trainer.run`` ended with that error (a fit that raised)."""
    t0 = 1_700_000_000_000_000_000
    end = t0 + steps * (step_ns + 10) + 10
    status = "ERROR" if error else "UNSET"
    rows = [SpanRow("trainer.run", 1, 0, 9, t0, end, 1, {}, status, error)]
    for i in range(steps):
        start = t0 + 5 + i * (step_ns + 10)
        rows.append(
            SpanRow("trainer.step", 10 + i, 1, 9, start, start + step_ns, 1, {"ppetrace.step": i})
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = None if environment is None else {"environment": environment}
    exporter = ChromeTraceExporter(path, metadata=metadata)
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
    environment = frame.attrs["metadata"]["environment"]
    assert environment == capture_environment()  # same process kind, same machine


def test_compare_fails_a_test_that_regressed_with_the_text_table(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_bench=BENCH)
    baseline = pytester.path / "base"
    _baseline(baseline / BASELINE_NAME, step_ns=1)  # nothing real is that fast
    result = pytester.runpytest("--ppetrace-compare", str(baseline), "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "gated regression against the baseline" in text
    # the text table, for a terminal: no Markdown, no HTML entities (p "<1e-4")
    assert "ppetrace compare: 2 gated regressions" in text and "###" not in text
    # the table is in the failure and again in the short summary when pytest does not
    # shorten it there (it does not when the CI variable is set)
    rows = [line for line in text.splitlines() if line.startswith("trainer.step ")]
    assert rows and len(set(rows)) == 1
    assert rows[0].split()[1] == "gated" and "<1e-4" in rows[0]
    assert "&lt;" not in text and "`" not in text


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


def test_a_baseline_of_a_failed_run_fails_the_test_with_how_it_failed(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_bench=BENCH)
    baseline = pytester.path / "base"
    # a second per step: compared on its steps alone, the run would pass
    _baseline(baseline / BASELINE_NAME, step_ns=10**9, error="RuntimeError: out of memory")
    args = ("--ppetrace-compare", str(baseline), "--ppetrace-threshold", "10%")
    result = pytester.runpytest(*args, "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "failed, so its steps are no measure of the code's speed" in text
    assert "base: " in text
    assert "1 trainer.run span ended with an error (RuntimeError: out of" in text
    assert "The baseline records a failed run: save it again with --ppetrace-save" in text
    assert "ppetrace compare: a base run failed, " in text
    result = pytester.runpytest(*args, "--ppetrace-allow-failed-runs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


FLAKY = textwrap.dedent(
    """
    import ppetrace

    def test_bench(ppetrace_benchmark):
        with ppetrace_benchmark.record(warmup_steps=1):
            for i in range(13):
                try:
                    with ppetrace.trace("trainer.step", {"ppetrace.step": i}):
                        sum(range(20_000))
                        if i == 5:
                            raise RuntimeError("a flaky step")
                except RuntimeError:
                    pass  # the loop goes on: the step still ended with an error
    """
)


def test_a_benchmark_run_with_a_failed_step_fails_and_is_not_saved(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_bench=FLAKY)
    baseline = pytester.path / "base"
    _baseline(baseline / BASELINE_NAME, step_ns=10**9)
    args = ["--ppetrace-compare", str(baseline), "--ppetrace-threshold", "10%"]
    result = pytester.runpytest(*args, "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "candidate: the run: 1 trainer.step span ended with an error (RuntimeError: a" in text
    assert "This benchmark's run failed: fix what raised inside its steps" in text
    saved = pytester.path / "saved"
    result = pytester.runpytest("--ppetrace-save", str(saved), "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert "so it was not saved as the baseline" in result.stdout.str()
    assert not (saved / BASELINE_NAME).exists()
    allowed = ("--ppetrace-save", str(saved), "--ppetrace-allow-failed-runs")
    pytester.runpytest(*allowed, "-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert (saved / BASELINE_NAME).exists()


def test_a_missing_baseline_warns_at_the_test_and_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_bench=BENCH)
    (pytester.path / "empty").mkdir()
    result = pytester.runpytest(
        "--ppetrace-compare", str(pytester.path / "empty"), "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1, warnings=1)
    text = result.stdout.str()
    assert "no baseline" in text
    assert "test_bench.py:" in text and "contextlib" not in text  # where the test is


def test_a_missing_baseline_folder_is_a_usage_error_unless_it_is_saved_to(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_bench=BENCH)
    missing = str(pytester.path / "no_such_dir")
    result = pytester.runpytest("--ppetrace-compare", missing, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "Expected a folder of baselines written by --ppetrace-save" in result.stderr.str()
    # the first run of a new baseline folder: compared with nothing, then saved there
    args = ("--ppetrace-compare", missing, "--ppetrace-save", missing, "-p", "no:cacheprovider")
    result = pytester.runpytest(*args)
    result.assert_outcomes(passed=1, warnings=1)
    assert "this run is saved as its baseline" in result.stdout.str()
    assert (Path(missing) / BASELINE_NAME).is_file()


def test_one_folder_for_save_and_compare_compares_first_and_keeps_a_failed_runs_baseline(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_bench=BENCH)
    folder = pytester.path / "base"
    _baseline(folder / BASELINE_NAME, step_ns=1)  # nothing real is that fast: it fails
    before = (folder / BASELINE_NAME).read_bytes()
    args = ("--ppetrace-compare", str(folder), "--ppetrace-save", str(folder))
    result = pytester.runpytest(*args, "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert "gated regression" in result.stdout.str() and "was kept" in result.stdout.str()
    assert (folder / BASELINE_NAME).read_bytes() == before
    # a run that passes replaces it (after the comparison, with the old one)
    _baseline(folder / BASELINE_NAME, step_ns=10**9)  # one second a step: not slower
    result = pytester.runpytest(*args, "--ppetrace-threshold", "10%", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    steps = read_chrome_trace(folder / BASELINE_NAME).query("name == 'trainer.step'")
    assert len(steps) == 13 and steps["dur_ns"].max() < 10**9


def test_no_verdict_fails_unless_allowed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_bench="""
        def test_bench(ppetrace_benchmark):
            ppetrace_benchmark(sum, range(20_000), steps=3, warmup=1)
        """
    )
    baseline = pytester.path / "base"
    _baseline(baseline / BASELINE_NAME, step_ns=1, steps=4)  # far faster, but 3 steps
    args = ("--ppetrace-compare", str(baseline), "-p", "no:cacheprovider")
    result = pytester.runpytest(*args)
    result.assert_outcomes(failed=1)
    assert "no verdict against the baseline" in result.stdout.str()
    assert "--ppetrace-allow-no-verdict" in result.stdout.str()
    pytester.runpytest(*args, "--ppetrace-allow-no-verdict").assert_outcomes(passed=1)


def test_a_baseline_that_cannot_be_read_fails_with_a_message_not_a_traceback(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_bench=BENCH)
    baseline = pytester.path / "base"
    baseline.mkdir()
    (baseline / BASELINE_NAME).write_text("garbage")
    result = pytester.runpytest("--ppetrace-compare", str(baseline), "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "ppetrace: comparing with the baseline" in text and "failed:" in text
    assert "_parse.py" not in text  # no traceback into the reader
    (baseline / BASELINE_NAME).unlink()
    (baseline / BASELINE_NAME).mkdir()  # not a file at all
    result = pytester.runpytest("--ppetrace-compare", str(baseline), "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert "but it is a directory" in result.stdout.str()
    assert "Traceback" not in result.stdout.str()


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
    result = pytester.runpytest("--ppetrace-threshold", "0.5", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, warnings=1)  # read as 50%, and said
    assert "--ppetrace-threshold 0.5 is read as a fraction, 0.5 = 50%" in result.stdout.str()


def test_importing_the_plugin_is_cheap() -> None:
    assert loaded_after("ppetrace.pytest_plugin", ("torch", "pandas", "scipy")) == []


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
    _baseline(baseline / "test_off.py%3A%3Atest_off.json", step_ns=1_000)
    result = pytester.runpytest("--ppetrace-compare", str(baseline), "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert "the benchmark recorded no spans" in result.stdout.str()


def test_baseline_names_are_percent_encoded_ids_that_never_collide() -> None:
    slash = baseline_name("tests/test_b.py::test_bench[a/b]")
    space = baseline_name("tests/test_b.py::test_bench[a b]")
    under = baseline_name("tests/test_b.py::test_bench[a_b]")
    assert slash == "tests%2Ftest_b.py%3A%3Atest_bench[a%2Fb]"
    assert space == "tests%2Ftest_b.py%3A%3Atest_bench[a%20b]"
    assert len({slash, space, under}) == 3
    assert "/" not in slash and "+" not in baseline_name("t.py::x[a+b]")  # '+' is encoded
    long_a, long_b = "t.py::x[" + "a" * 300 + "1]", "t.py::x[" + "a" * 300 + "2]"
    assert len(baseline_name(long_a)) <= 180 and baseline_name(long_a) != baseline_name(long_b)
    assert "+" in baseline_name(long_a)  # cut, then '+' and a hash of the whole id
    cut_escape = baseline_name("t.py::x[" + "/" * 100 + "]")
    assert cut_escape.split("+")[0].endswith("%2F")  # no escape cut in two


def test_project_root_is_the_nearest_folder_with_a_project_file(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    (project / "tests" / "unit").mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    test_file = project / "tests" / "unit" / "test_x.py"
    test_file.write_text("")
    assert project_root(test_file, tmp_path) == project
    assert project_root(tmp_path / "loose.py", tmp_path / "fallback") == tmp_path / "fallback"


PARAMETRIZED = textwrap.dedent(
    """
    import pytest

    @pytest.mark.parametrize("case", ["a/b", "a b"])
    def test_bench(ppetrace_benchmark, case):
        ppetrace_benchmark(sum, range(10), steps=6, warmup=1)
    """
)


def test_parametrized_benchmarks_get_one_baseline_each(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_bench=PARAMETRIZED)
    out = pytester.path / "baselines"
    result = pytester.runpytest("--ppetrace-save", str(out), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert sorted(p.name for p in out.iterdir()) == [
        "test_bench.py%3A%3Atest_bench[a%20b].json",
        "test_bench.py%3A%3Atest_bench[a%2Fb].json",
    ]


def test_baselines_are_found_whatever_pytests_rootdir(pytester: pytest.Pytester) -> None:
    project = pytester.path / "proj"
    (project / "tests").mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    (project / "tests" / "test_bench.py").write_text(BENCH)
    base = project / "base"
    saved = pytester.runpytest(
        str(project / "tests"), "--rootdir", str(project), "--ppetrace-save", str(base)
    )
    saved.assert_outcomes(passed=1)
    assert [p.name for p in base.iterdir()] == ["tests%2Ftest_bench.py%3A%3Atest_bench.json"]
    # from another folder, with another rootdir: the same name, found, compared
    elsewhere = pytester.path / "elsewhere"
    elsewhere.mkdir()
    compared = pytester.runpytest(
        str(project / "tests" / "test_bench.py"),
        "--rootdir",
        str(elsewhere),
        "--ppetrace-compare",
        str(base),
        "--ppetrace-threshold",
        "1000%",
        "-W",
        "error::ppetrace.pytest_plugin.BaselineMissingWarning",
    )
    compared.assert_outcomes(passed=1)


def test_a_baseline_from_another_environment_warns_or_fails_when_strict(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_bench=BENCH)
    baseline = pytester.path / "base"
    other = {**capture_environment(), "torch_threads": 99, "cpu_model": "another CPU"}
    _baseline(baseline / BASELINE_NAME, step_ns=10**9, environment=other)
    result = pytester.runpytest("--ppetrace-compare", str(baseline), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, warnings=2)
    text = result.stdout.str()
    assert "EnvironmentMismatchWarning" in text
    assert "environment differs: cpu_model: base another CPU" in text
    strict = pytester.runpytest(
        "--ppetrace-compare", str(baseline), "--ppetrace-strict-env", "-p", "no:cacheprovider"
    )
    strict.assert_outcomes(failed=1)
    assert "was recorded in another environment (--ppetrace-strict-env)" in strict.stdout.str()
