"""The command line's messages for the cases a new user met: empty traces, negative
thresholds, too few samples, all-warmup runs, counts and the same file twice."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli import _one_error_line, run, write_run

import exporters


@pytest.mark.parametrize("text", ["[]", '{"traceEvents": []}'])
def test_a_trace_with_no_events_is_an_empty_frame_and_one_sentence(
    tmp_path: Path, text: str
) -> None:
    path = tmp_path / "empty.json"
    path.write_text(text)
    assert len(exporters.read_chrome_trace(path)) == 0
    for argv in (("report", str(path)), ("compare", str(path), str(path))):
        code, _, err = run(*argv)
        assert code == 2
        assert _one_error_line(err) == (
            f"ppetrace {argv[0]}: error: Expected spans (complete 'X' events) in {path}, but "
            "the trace has no span events. Pass a trace written by a run that recorded spans."
        )


@pytest.mark.parametrize("form", [("--threshold", "-5%"), ("--threshold=-5%",)])
def test_a_negative_threshold_is_refused_in_a_sentence(tmp_path: Path, form: tuple[str]) -> None:
    base = write_run(tmp_path / "base.json", [1_000_000] * 8)
    code, _, err = run("compare", str(base), str(base), *form)
    assert code == 2
    assert _one_error_line(err) == (
        "ppetrace compare: error: Expected a non-negative --threshold (it applies to slowdowns "
        "and speedups alike), but received '-5%'. Pass its size, such as 5%."
    )
    code, _, err = run("compare", str(base), str(base), "--min-effect-abs", "-1us")
    assert code == 2 and "Expected a non-negative duration" in _one_error_line(err)


def test_only_compares_negative_values_are_joined_to_their_option() -> None:
    from ppetrace.cli._args import join_negative_values

    assert join_negative_values(["compare", "a", "b", "--noise-floor", "-.5", "--", "-1"]) == [
        "compare",
        "a",
        "b",
        "--noise-floor=-.5",
        "--",
        "-1",
    ]
    script = ["run", "train.py", "--threshold", "-5%"]  # the script's own arguments
    assert join_negative_values(script) == script


def test_too_few_step_samples_and_all_warmup_steps_are_said_as_such(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base.json", [1_000_000] * 8)
    code, out, err = run("compare", str(base), str(base), "--min-samples", "1000")
    # nothing gated can be decided: such a comparison cannot fail, so it is an error
    assert code == 2 and "so this comparison cannot catch a regression" in err.splitlines()[-1]
    # the headline says so too, not "no gated regression" above an exit code of 2
    assert out.startswith("ppetrace compare: no verdict (no gated event could be decided)")
    assert "(trainer.step has fewer than 1000 samples in every base run, at least" in out
    assert "no trainer.step" not in out
    code, out, _ = run("compare", str(base), str(base), "--warmup", "500", "--allow-no-verdict")
    assert code == 0
    assert (
        "note: trainer.step is not in both runs (all 8 steps of the base are warmup and all 8 "
        "steps of the candidate are warmup: lower the warmup, warmup_steps or --warmup), so "
        "nothing is gated" in out
    )
    assert "(no trainer.step sample in the base, at least" in out


def test_merge_counts_a_folders_files_and_counts_are_singular_for_one(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    write_run(runs / "a.json", [1_000] * 3, pid=1)
    write_run(runs / "b.json", [1_000] * 3, pid=2)
    code, out, err = run("merge", str(tmp_path / "m.json"), str(runs))
    assert code == 0 and out.startswith("Merged 2 traces (") and "2 processes)" in out, err
    one = write_run(tmp_path / "one.json", [1_000])
    code, out, _ = run("report", str(one))
    assert code == 0
    assert "The only step is warmup: no per-step table or throughput (lower warmup_steps)." in out
    one_event = exporters.RunSummary.from_samples({"user.a": [1.0, 2.0]})
    with pytest.raises(exporters.TraceError, match=r"the candidate has 1 event \(user\.b\)\."):
        exporters.compare(one_event, exporters.RunSummary.from_samples({"user.b": [1.0]}))
    code, out, _ = run("compare", str(one), str(one))
    assert "the only step of the base is warmup and the only step of the candidate" in out


def test_the_same_file_on_both_sides_is_warned_about(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base.json", [1_000_000] * 8)
    code, out, err = run("compare", str(base), str(tmp_path / "." / "base.json"))
    assert code == 0 and out.startswith("ppetrace compare: no gated regression")
    assert err == (
        f"ppetrace: warning: BASE and CAND are the same file {base}, so they can only match.\n"
    )
    other = write_run(tmp_path / "other.json", [1_000_000] * 8, pid=1235)  # another process
    code, _, err = run("compare", str(base), str(other))
    assert code == 0 and err == ""
    # a run on both sides among others: said too
    third = write_run(tmp_path / "third.json", [1_000_000] * 8, pid=1236)
    code, _, err = run("compare", str(tmp_path / "[bo]*.json"), str(tmp_path / "[ot]*.json"))
    assert code == 0
    assert err == (
        f"ppetrace: warning: BASE and CAND share 1 run ({other}): the same run on both sides "
        "makes them look alike.\n"
    )
    # an unquoted glob: more than one BASE and CAND, and a hint
    code, _, err = run("compare", str(base), str(other), str(third))
    assert code == 2 and "quote a glob so that ppetrace expands it" in err


def test_report_writes_into_a_new_folder_and_counts_one_step_in_the_singular(
    tmp_path: Path,
) -> None:
    trace = write_run(tmp_path / "one.json", [1_000_000, 2_000_000])  # a warmup step, then one
    out = tmp_path / "new" / "folder" / "report.txt"
    code, _, err = run("report", str(trace), "-o", str(out))
    assert code == 0, err
    text = out.read_text()
    assert text.startswith("1 step (1 warmup step excluded") or "\n1 step (1 warmup" in text
    assert "1 steps" not in text


def test_an_argument_left_over_is_reported_by_its_command_with_its_help(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a.json", [1_000_000] * 4)
    code, _, err = run("report", str(a), str(a))
    line = _one_error_line(err)
    assert code == 2 and line.startswith("ppetrace report: error: unrecognized arguments: ")
    assert "use ppetrace compare BASE NEW" in line and line.endswith(
        "(see 'ppetrace report --help')"
    )
    code, _, err = run("report", str(a), "--json")  # an unknown option: no compare hint
    line = _one_error_line(err)
    assert line == (
        "ppetrace report: error: unrecognized arguments: --json (see 'ppetrace report --help')"
    )
    code, _, err = run("compare", str(a), str(a), str(a))
    assert code == 2 and _one_error_line(err).endswith("(see 'ppetrace compare --help')")
    code, _, err = run("report", str(tmp_path))  # a folder (of rank files): merge it first
    assert code == 2 and _one_error_line(err) == (
        f"ppetrace report: error: Expected a trace file for TRACE, but {tmp_path} is a folder. "
        f"Pass one file; for a folder of rank files, merge them first (ppetrace merge "
        f"merged.json {tmp_path}) and report on the merged file."
    )
    code, _, err = run("--bogus")
    assert code == 2 and _one_error_line(err) == (
        "ppetrace: error: unrecognized arguments: --bogus (see 'ppetrace --help')"
    )


def test_a_zero_noise_floor_is_accepted_and_a_negative_one_is_called_negative(
    tmp_path: Path,
) -> None:
    base = write_run(tmp_path / "base.json", [1_000_000] * 8)
    code, _, err = run("compare", str(base), str(base), "--noise-floor", "0%")
    assert code == 0, err
    code, _, err = run("compare", str(base), str(base), "--noise-floor", "-1%")
    assert code == 2 and _one_error_line(err).startswith(
        "ppetrace compare: error: Expected a non-negative --noise-floor"
    )


def test_a_negative_duration_is_called_negative_and_html_makes_its_folder(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base.json", [1_000_000] * 8)
    code, _, err = run("compare", str(base), str(base), "--min-effect-abs=-1us")
    assert code == 2 and _one_error_line(err) == (
        "ppetrace compare: error: Expected a non-negative duration for --min-effect-abs (it "
        "applies to slowdowns and speedups alike), but received '-1us'. Pass its size, such "
        "as '1us'."
    )
    pytest.importorskip("plotly")
    page = tmp_path / "new" / "folder" / "r.html"
    code, _, err = run("report", str(base), "--html", str(page))
    assert code == 0, err
    assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_a_file_where_an_output_folder_must_be_is_named_as_the_problem(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base.json", [1_000_000] * 8)
    other = write_run(tmp_path / "other.json", [1_000_000] * 8, pid=2)
    for argv in (
        ("report", str(base), "-o", str(base / "r.txt")),
        ("report", str(base), "--html", str(base / "deeper" / "r.html")),
        ("merge", str(base / "m.json"), str(base), str(other)),
    ):
        code, _, err = run(*argv)
        line = _one_error_line(err)
        assert code == 2, argv
        assert f"but {base} is a file, so " in line and "Pass a path whose folders" in line
    assert exporters.read_chrome_trace(base)["name"].tolist()  # the input is untouched


def test_a_copy_of_a_run_counts_once_and_on_both_sides_is_warned_about(tmp_path: Path) -> None:
    """Five copies of one recording are one run, not five samples (they made identical code
    a significant regression); a copy in CAND of a BASE run is the same run on both sides."""
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    base = write_run(tmp_path / "b" / "r.json", [1_000_000] * 8)
    cand = write_run(tmp_path / "c" / "r.json", [1_010_000] * 8, pid=99)
    for k in range(2, 5):
        (tmp_path / "b" / f"r{k}.json").write_bytes(base.read_bytes())
    _, out, err = run("compare", str(tmp_path / "b"), str(cand))
    assert "(1 run vs 1 run)" in out.splitlines()[0]
    assert err.count("is a copy of") == 3 and f"{tmp_path / 'b' / 'r2.json'} is a copy" in err
    (tmp_path / "c" / "copy.json").write_bytes(base.read_bytes())
    _, _, err = run("compare", str(base), str(tmp_path / "c" / "copy.json"))
    assert "BASE and CAND share 1 run (copies of one recording under other names)" in err


def test_a_merged_trace_beside_its_rank_files_counts_as_one_run(tmp_path: Path) -> None:
    """``ppetrace merge run/merged.json run/`` leaves the rank files beside the merged
    trace: a folder of them is one run, not three (the merged trace holds the others)."""
    folder = tmp_path / "run"
    folder.mkdir()
    write_run(folder / "rank0.json", [1_000_000] * 8, pid=11, rank=0)
    write_run(folder / "rank1.json", [1_000_000] * 8, pid=12, rank=1)
    assert run("merge", str(folder / "merged.json"), str(folder))[0] == 0
    cand = write_run(tmp_path / "cand.json", [1_000_000] * 8, pid=99)
    _, out, err = run("compare", str(folder), str(cand))
    assert "(1 run vs 1 run)" in out.splitlines()[0], out
    assert err.count("is a copy of") == 2 and "or a rank file that merged trace holds" in err


def test_a_reader_that_goes_away_is_no_regression_exit_code(tmp_path: Path) -> None:
    """``ppetrace compare ... 2>&1 | head`` once exited 1 (a regression, to a CI script)
    from the BrokenPipeError of its last message: it now exits 141, as SIGPIPE would."""
    import subprocess
    import sys

    base = write_run(tmp_path / "base.json", [1_000_000] * 8)
    command = [sys.executable, "-m", "ppetrace", "compare", str(base), str(base)]
    for err in (subprocess.STDOUT, subprocess.DEVNULL):  # both streams gone, or stdout
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err)
        assert proc.stdout is not None
        proc.stdout.close()  # the reader is gone before the first line is written
        assert proc.wait(timeout=120) == 141


def test_merging_an_empty_rank_file_says_to_leave_it_out(tmp_path: Path) -> None:
    folder = tmp_path / "trace.ranks"
    folder.mkdir()
    write_run(folder / "rank0.json", [1_000_000] * 8, pid=11, rank=0)
    (folder / "rank1.json").write_bytes(b"")  # a rank killed in its first second
    code, _, err = run("merge", str(tmp_path / "m.json"), str(folder))
    assert code == 2
    assert _one_error_line(err).endswith(
        "the file is empty. A process killed as it started leaves an empty file: merge the "
        "other files by name, leaving that one out."
    )
