"""The ppetrace command line: report, compare, merge, exit codes and bad-input messages."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from exporters import ChromeTraceExporter, SpanBatch, SpanRow, read_chrome_trace
from ppetrace import __version__
from ppetrace.cli import main, parse_threshold

T0 = 1_700_000_000_000_000_000


def write_run(
    path: Path,
    step_ns: Sequence[int],
    *,
    name: str = "trainer.step",
    pid: int = 1234,
    rank: int = 0,
    environment: dict[str, object] | None = None,
) -> Path:
    """A trace of ``len(step_ns)`` steps, each with a fetch and a backward, exact times."""
    rows: list[SpanRow] = []
    t, sid = T0, 100
    for i, dur in enumerate(step_ns):
        sid += 1
        rows.append(SpanRow("trainer.fetch_batch", sid, 1, 7, t, t + 200, 1, {}))
        t += 300
        sid += 1
        rows.append(
            SpanRow(name, sid, 1, 7, t, t + dur, 1, {"ppetrace.step": i, "ppetrace.batch_size": 8})
        )
        rows.append(SpanRow("trainer.backward", sid + 1000, sid, 7, t + 5, t + 5 + dur // 2, 1, {}))
        t += dur
    rows.append(SpanRow("trainer.epoch", 1, 0, 7, T0 - 10, t + 10, 1, {"ppetrace.epoch": 0}))
    rows.sort(key=lambda r: r.start_ns)
    metadata = None if environment is None else {"environment": environment}
    exporter = ChromeTraceExporter(path, metadata=metadata)
    exporter.export_batch(SpanBatch(rows, {"service.name": "cli", "ppetrace.rank": rank}, pid))
    exporter.shutdown()
    return path


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def _steps(seed: int, median: float, n: int = 25) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.lognormal(np.log(median), 0.05, n)]


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return write_run(tmp_path / "base.json", _steps(1, 1_000_000))


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ppetrace {__version__}"
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(cmd in text for cmd in ("report", "compare", "merge"))
    assert main(["compare", "--help"]) == 0
    assert "--threshold" in capsys.readouterr().out


def test_report_prints_the_tables(base: Path) -> None:
    code, out, err = run("report", str(base))
    assert code == 0 and err == ""
    assert "24 steps (1 warmup step excluded; warmup_steps=1)" in out
    assert "trainer.backward" in out and "samples/s" in out
    code, out, _ = run("report", str(base), "--warmup", "0", "--top", "2")
    assert "25 steps" in out and "more events not shown" in out


@pytest.mark.parametrize("fmt", ["md", "csv", "json"])
def test_report_formats_carry_the_numbers(base: Path, tmp_path: Path, fmt: str) -> None:
    out_file = tmp_path / f"report.{fmt}"
    code, out, err = run("report", str(base), "--format", fmt, "--output", str(out_file))
    assert code == 0 and out == "" and err == f"ppetrace: wrote {out_file}\n"
    text = out_file.read_text()
    steps = _steps(1, 1_000_000)[1:]
    if fmt == "json":
        events = {e["event"]: e for e in json.loads(text)["events"]}
        assert events["trainer.step"]["total_ns"] == sum(steps)
        assert events["trainer.step"]["count"] == 24
    elif fmt == "csv":
        line = next(x for x in text.splitlines() if x.startswith("trainer.step,"))
        assert line.split(",")[1:3] == ["24", str(sum(steps))]
    else:
        assert "| trainer.step | 24 |" in text


def test_compare_same_run_exits_0(base: Path) -> None:
    code, out, err = run("compare", str(base), str(base))
    assert code == 0, err
    assert out.startswith("ppetrace compare: no gated regression (1 run vs 1 run)")
    assert (
        "\ngate: step.wall, trainer.step (Holm over 2 gated events, alpha 0.01); threshold 3.0%"
        in out
    )


def test_a_bare_number_for_a_percentage_is_read_as_a_fraction_and_said_so(base: Path) -> None:
    # "--threshold 0.5" meant as half a percent would make a gate a hundred times laxer
    code, _, err = run("compare", str(base), str(base), "--threshold", "0.5")
    assert code == 0
    assert err.splitlines()[0] == (
        "ppetrace: note: --threshold 0.5 is read as a fraction, 0.5 = 50%; for 0.5 percent "
        "write '0.5%'."
    )
    code, _, err = run(
        "compare", str(base), str(base), "--threshold", "0.5%", "--min-effect", ".02"
    )
    assert code == 0
    assert "--threshold" not in err
    assert "ppetrace: note: --min-effect .02 is read as a fraction, 0.02 = 2%" in err


def test_compare_a_slower_run_exits_1_with_a_markdown_comment(base: Path, tmp_path: Path) -> None:
    slow = write_run(tmp_path / "slow.json", _steps(2, 1_300_000))
    report = tmp_path / "comment.md"
    code, out, err = run("compare", str(base), str(slow), "--format", "md", "--output", str(report))
    assert code == 1
    assert out == "" and err == f"ppetrace: wrote {report} (gated regression)\n"
    md = report.read_text()
    assert md.startswith("### ppetrace compare: ❌ 2 gated regressions")
    assert "| `trainer.step` | gated |" in md and "❌ regression" in md
    # the same slowdown under a 50% threshold is not a regression
    code, _, _ = run("compare", str(base), str(slow), "--threshold", "50%")
    assert code == 0
    # nor against a noise floor of 20% run-to-run
    code, _, _ = run("compare", str(base), str(slow), "--noise-floor", "20%")
    assert code == 0
    code, out, _ = run("compare", str(base), str(slow), "--format", "json")
    assert code == 1
    doc = json.loads(out)
    # trainer.backward is informational; the slower step is slower wall time too
    assert doc["regressions"] == ["trainer.step", "step.wall"]
    assert {e["event"]: e["verdict"] for e in doc["events"]}["trainer.backward"] == "regression"
    code, out, _ = run("compare", str(base), str(slow), "--format", "json", "--gate", "all")
    assert sorted(json.loads(out)["regressions"]) == [
        "step.wall",
        "trainer.backward",
        "trainer.step",
    ]


def _runs(folder: Path, seeds: Sequence[int], median: float) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    return [write_run(folder / f"run-{s}.json", _steps(s, median)) for s in seeds]


def test_compare_takes_folders_and_quoted_globs_of_runs(tmp_path: Path) -> None:
    _runs(tmp_path / "base", [10, 11, 12], 1_000_000)
    _runs(tmp_path / "cand", [13, 14, 15], 1_150_000)
    (tmp_path / "base" / "notes.txt").write_text("not a trace")  # left out
    code, out, err = run("compare", str(tmp_path / "base"), str(tmp_path / "cand"))
    assert code == 1, err
    assert out.startswith("ppetrace compare: 2 gated regressions (3 runs vs 3 runs)")
    code, out, _ = run(
        "compare", str(tmp_path / "base" / "run-1[01].json"), str(tmp_path / "cand" / "*.json")
    )
    assert code == 1 and "(2 runs vs 3 runs)" in out
    # runs of the same code: the runs' own scatter or the floor, never a regression
    code, out, _ = run("compare", str(tmp_path / "base"), str(tmp_path / "base" / "run-1*"))
    assert code == 0 and "no gated regression (3 runs vs 3 runs)" in out


def test_compare_names_environment_differences_and_strict_env_exits_2(tmp_path: Path) -> None:
    env = {"python": "3.11.7", "torch": "2.13.0", "torch_threads": 1, "ppetrace": "0.1.0"}
    base = write_run(tmp_path / "base.json", _steps(1, 1_000_000), environment=env)
    same = write_run(tmp_path / "same.json", _steps(2, 1_000_000), environment=env)
    other = write_run(
        tmp_path / "other.json", _steps(3, 1_000_000), environment={**env, "torch_threads": 8}
    )
    code, out, err = run("compare", str(base), str(same), "--strict-env")
    assert code == 0 and "warning" not in out + err
    code, out, err = run("compare", str(base), str(other))
    assert code == 0 and err == ""
    assert "warning: environment differs: torch_threads: base 1, candidate 8" in out
    code, out, err = run("compare", str(base), str(other), "--format", "md", "--strict-env")
    assert code == 2
    lines = err.splitlines()
    assert lines[0] == "ppetrace: warning: environment differs: torch_threads: base 1, candidate 8"
    assert lines[1].startswith(
        "ppetrace compare: error: Expected runs from one environment (--strict-env), but 1 "
        "environment field differs"
    )
    assert "> ⚠️ environment differs: torch_threads: base 1, candidate 8" in out
    # in the table format the warning is on stdout: the error names the field itself
    code, out, err = run("compare", str(base), str(other), "--strict-env")
    assert code == 2
    assert _one_error_line(err).endswith(
        "1 environment field differs (environment differs: torch_threads: base 1, candidate "
        "8). Run both sides on the same machine and settings, or drop --strict-env."
    )
    # traces without any environment record cannot pass --strict-env
    bare = write_run(tmp_path / "bare.json", _steps(4, 1_000_000))
    bare2 = write_run(tmp_path / "bare2.json", _steps(5, 1_000_000))
    code, _, err = run("compare", str(bare), str(bare2), "--strict-env")
    assert code == 2
    assert _one_error_line(err).startswith(
        "ppetrace compare: error: Expected environment records in the traces (--strict-env), "
        "but no run has one"
    )


def test_compare_options_that_are_not_understood_exit_2(base: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        ("--noise-floor", "lots"): "Expected a percentage such as '5%' (or a fraction below 1 "
        "such as 0.05) for --noise-floor, but received 'lots'.",
        ("--threshold", "1"): "but received '1', which could mean 1% or 100%. Write the percent "
        "sign: '1%'.",
        ("--min-effect-abs", "3 parsecs"): "Expected a duration with a unit such as '1us'",
        ("--gate", " , "): "Expected event names separated by commas (or 'all') for --gate",
        ("--gate", "trainer.step,user.nope"): "Expected the gated events to be in both the "
        "base and the candidate runs, but user.nope is not; the events in both are",
    }
    for options, message in cases.items():
        code, _, err = run("compare", str(base), str(base), *options)
        assert code == 2, options
        assert message in _one_error_line(err), (options, err)
    code, _, err = run("compare", str(base), str(tmp_path / "nothing-*.json"))
    assert code == 2
    assert _one_error_line(err) == (
        "ppetrace compare: error: Expected CAND to be a trace file, a folder of traces or a "
        f"glob that matches trace files, but the glob '{tmp_path / 'nothing-*.json'}' "
        "matches no file."
    )
    code, _, err = run("compare", str(empty), str(base))
    assert code == 2
    assert "Expected trace files (*.json or *.json.gz) in the folder" in _one_error_line(err)


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_bad_inputs_exit_2_with_one_line(base: Path, tmp_path: Path) -> None:
    not_json = tmp_path / "notes.json"
    not_json.write_text("these are notes\n")
    not_trace = tmp_path / "config.json"
    not_trace.write_text('{"lr": 0.1}')
    other = write_run(tmp_path / "other.json", [1_000] * 5, name="user.other")
    cases = {
        ("report", str(tmp_path / "missing.json")): "no such file",
        ("report", str(not_json)): "the file is not JSON",
        ("report", str(not_trace)): "'traceEvents' list), but its keys are ['lr']",
        ("compare", str(base), str(not_trace)): "'traceEvents' list",
        ("compare", str(base), str(base), "--threshold", "5"): "Expected a percentage",
        ("compare", str(base), str(base), "--threshold", "fast"): "Expected a percentage",
        ("compare", str(base), str(base), "--alpha", "2"): "probability between 0 and 1",
        ("report", str(base), "--top", "0"): "positive integer for --top",
        ("report", str(base), "--format", "xml"): "invalid choice",
        ("report",): "required: TRACE",
        ("merge", str(tmp_path / "m.json"), str(tmp_path / "missing.json")): "no such file",
        ("frobnicate",): "invalid choice",
    }
    for argv, message in cases.items():
        code, _, err = run(*argv)
        assert code == 2, argv
        assert message in _one_error_line(err), (argv, err)
    # two runs with no event in common (other only has user.other + fetch/backward/epoch)
    lonely = tmp_path / "lonely.json"
    exporter = ChromeTraceExporter(lonely)
    exporter.export_batch(SpanBatch([SpanRow("user.alone", 5, 0, 1, T0, T0 + 10, 1, {})]))
    exporter.shutdown()
    code, _, err = run("compare", str(other), str(lonely))
    assert code == 2
    assert "at least one event in common" in _one_error_line(err)


def test_a_truncated_trace_is_read_with_a_warning(base: Path, tmp_path: Path) -> None:
    data = base.read_bytes()
    cut = tmp_path / "cut.json"
    cut.write_bytes(data[: len(data) * 2 // 3])
    code, out, err = run("report", str(cut))
    assert code == 0
    assert "warning" in _one_error_line(err) and "cut off" in err
    assert "trainer.step" in out
    code, _, err = run("merge", str(tmp_path / "merged.json"), str(cut))  # warned once
    assert code == 0 and "cut off" in _one_error_line(err)
    header_only = tmp_path / "header.json"
    header_only.write_bytes(data[:150])
    code, _, err = run("report", str(header_only))
    assert code == 2 and "cut off" in _one_error_line(err)


def test_merge_writes_one_timeline(base: Path, tmp_path: Path) -> None:
    second = write_run(tmp_path / "rank1.json", [2_000] * 3, rank=1)  # same pid 1234
    out_file = tmp_path / "merged.json"
    code, out, err = run("merge", str(out_file), str(base), str(second))
    assert code == 0, err
    assert out.startswith("Merged 2 traces") and "2 processes" in out
    code, out, err = run("merge", str(tmp_path / "one.json"), str(base))
    assert code == 0 and out.startswith("Merged 1 trace (") and "1 process)" in out, err
    frame = read_chrome_trace(out_file)
    assert sorted(set(frame["pid"])) == [1234, 1235]
    assert sorted(set(frame["rank"])) == [0, 1]


def test_threshold_parsing() -> None:
    assert parse_threshold("5%") == pytest.approx(0.05)
    assert parse_threshold(" 12.5% ") == pytest.approx(0.125)
    assert parse_threshold("0.05") == pytest.approx(0.05)
    for bad in ("5", "abc", "-5%", "2000%", "nan%"):
        with pytest.raises(ValueError, match="Expected a"):
            parse_threshold(bad)


def test_python_m_ppetrace_runs_without_importing_torch(base: Path) -> None:
    version = subprocess.run(
        [sys.executable, "-m", "ppetrace", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert version.returncode == 0 and version.stdout.strip() == f"ppetrace {__version__}"
    script = textwrap.dedent(
        f"""
        import sys
        from ppetrace.cli import main
        code = main(["compare", {str(base)!r}, {str(base)!r}, "--format", "md"])
        print("torch" in sys.modules, code, file=sys.stderr)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "False 0"
    assert "### ppetrace compare" in result.stdout


def _odd_trace(path: Path, *, span_id: str = "0000000000000001", origin_ns: int = 0) -> Path:
    event = {
        "ph": "X",
        "name": "trainer.step",
        "pid": 1,
        "tid": 1,
        "ts": 1.0,
        "dur": 2.0,
        "args": {"span_id": span_id, "parent_id": "0000000000000000", "ppetrace.step": 0},
    }
    path.write_text(json.dumps({"otherData": {"origin_ns": origin_ns}, "traceEvents": [event]}))
    return path


def test_out_of_range_ids_and_origins_exit_2_with_one_line(base: Path, tmp_path: Path) -> None:
    negative = _odd_trace(tmp_path / "negative.json", span_id="-1")
    too_long = _odd_trace(tmp_path / "long.json", span_id="123456789012345678")
    far = _odd_trace(tmp_path / "far.json", origin_ns=10**23)
    ids = r"Expected span ids of at most 16 hex digits \(0 to ffffffffffffffff\) in args\.span_id"
    cases = {
        ("report", str(negative)): rf"^ppetrace report: error: In .*negative\.json: {ids}, "
        r"but received '-1'\. Fix the ids",
        ("report", str(too_long)): rf"{ids}, but received '123456789012345678'\.",
        ("report", str(far)): r"In .*far\.json: Expected otherData\.origin_ns to be epoch "
        r"nanoseconds within the int64 range \(\|origin_ns\| < 2\*\*63\), but received "
        r"100000000000000000000000\. Fix origin_ns",
        # exit code 1 would mean "regression": a bad candidate must give 2
        ("compare", str(base), str(negative)): rf"^ppetrace compare: error: .*negative.* {ids}",
    }
    for argv, pattern in cases.items():
        code, _, err = run(*argv)
        assert code == 2, (argv, err)
        assert re.search(pattern, _one_error_line(err)), (argv, err)


def test_an_unexpected_error_exits_2_with_one_line(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import exporters

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("pandas changed its mind\nsecond line")

    monkeypatch.setattr(exporters, "step_report", broken)
    code, _, err = run("report", str(base))
    assert code == 2
    assert _one_error_line(err) == (
        "ppetrace: error: RuntimeError: pandas changed its mind second line"
    )
    monkeypatch.setattr(exporters, "compare", broken)
    code, _, err = run("compare", str(base), str(base))
    assert code == 2  # never 1, which means "significant regression"
    assert _one_error_line(err).startswith("ppetrace: error: RuntimeError: ")


def test_merge_into_a_directory_says_out_must_be_a_file(base: Path, tmp_path: Path) -> None:
    code, _, err = run("merge", str(tmp_path), str(base))
    assert code == 2
    assert re.fullmatch(
        r"ppetrace merge: error: Expected a file path for OUT \(the merged trace to write\), "
        rf"but {re.escape(str(tmp_path))} is a directory\. Pass a file name, such as "
        rf"{re.escape(str(tmp_path / 'merged.json'))}\.",
        _one_error_line(err),
    )
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, _, err = run("merge", str(blocker / "merged.json"), str(base))
    assert code == 2
    assert _one_error_line(err) == (
        f"ppetrace merge: error: Expected a path in a folder for OUT, but {blocker} is a file, "
        f"so {blocker / 'merged.json'} cannot be written. Pass a path whose folders are folders."
    )
    assert "Errno" not in err


def test_output_a_stream_cannot_encode_is_written_as_escapes(tmp_path: Path) -> None:
    """A lone surrogate in a span name, and the emoji of compare, on an ASCII terminal."""
    name = "user.\ud800step"
    base = write_run(tmp_path / "base.json", _steps(1, 1_000_000), name=name)
    slow = write_run(tmp_path / "slow.json", _steps(2, 1_500_000), name=name)
    for argv, expected in (
        (["report", str(base), "--format", "table"], 0),
        (["report", str(base), "--format", "csv"], 0),
        (["compare", str(base), str(slow), "--format", "md", "--gate", "all"], 1),
    ):
        raw = io.BytesIO()
        out = io.TextIOWrapper(raw, encoding="ascii")
        err = io.StringIO()
        assert main(argv, stdout=out, stderr=err) == expected, err.getvalue()
        out.flush()
        text = raw.getvalue().decode("ascii")
        assert "user.\\ud800step" in text
    assert "\\u274c regression" in text  # compare's mark, escaped
    report = tmp_path / "report.md"
    assert run("report", str(base), "--format", "md", "--output", str(report))[0] == 0
    assert "user.\\ud800step" in report.read_text(encoding="utf-8")
