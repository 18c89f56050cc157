"""The CLI reads a run written in parts (max_part_bytes) as one run."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest

from exporters import ChromeTraceExporter, SpanBatch, SpanRow, read_chrome_trace
from ppetrace.cli import main

T0 = 1_700_000_000_000_000_000
STEPS = 30


def write_parts(
    path: Path,
    median_ns: int,
    seed: int,
    pid: int = 1234,
    steps: int = STEPS,
    part_bytes: int | None = 600,
) -> list[Path]:
    """A run of ``steps`` steps (a fetch and a step each), one batch per step, in parts of
    about 2 steps (``part_bytes``; None: one file)."""
    rng = np.random.default_rng(seed)
    exporter = ChromeTraceExporter(path, max_part_bytes=part_bytes, _min_part_bytes=1)
    t = T0 + seed * 10**9  # runs of different seeds start apart, as real runs do
    resource = {"service.name": "cli", "ppetrace.rank": 0}
    for i in range(steps):
        dur = int(rng.lognormal(np.log(median_ns), 0.05))
        rows = [
            SpanRow("trainer.fetch_batch", 2 * i + 10, 0, 7, t, t + 200, 1, {}),
            SpanRow(
                "trainer.step", 2 * i + 11, 0, 7, t + 300, t + 300 + dur, 1, {"ppetrace.step": i}
            ),
        ]
        exporter.export_batch(SpanBatch(rows, resource, pid))
        t += 300 + dur
    exporter.shutdown()
    assert len(exporter.parts) >= (steps // 3 if part_bytes == 600 else 1)
    return exporter.parts


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_report_and_compare_count_a_run_in_parts_once(tmp_path: Path) -> None:
    base = write_parts(tmp_path / "base" / "run.json", 1_000_000, 1)
    write_parts(tmp_path / "cand" / "run.json.gz", 1_400_000, 2)
    code, out, err = run("report", str(base[0]), "--warmup", "0")
    assert code == 0 and err == "", err
    assert f"{STEPS} steps" in out
    code, out, err = run("compare", str(tmp_path / "base"), str(tmp_path / "cand"))
    assert code == 1, err
    assert out.startswith("ppetrace compare: 2 gated regressions (1 run vs 1 run)")
    code, out, _ = run("compare", str(tmp_path / "base" / "*.json"), str(base[0]))
    assert code == 0 and "(1 run vs 1 run)" in out


def test_merge_of_a_run_in_parts(tmp_path: Path) -> None:
    parts = write_parts(tmp_path / "run.json", 1_000_000, 1)
    out_file = tmp_path / "merged.json"
    code, out, err = run("merge", str(out_file), str(parts[0]))
    assert code == 0 and out.startswith("Merged 1 trace (") and "1 process)" in out, err
    frame = read_chrome_trace(out_file)
    assert len(frame) == 2 * STEPS and frame["span_id"].is_unique
    assert (frame["name"] == "trainer.step").sum() == STEPS


def test_merge_writes_parts_with_max_part_bytes(tmp_path: Path) -> None:
    first = write_parts(tmp_path / "a.json", 1_000_000, 1, pid=1, steps=4_000, part_bytes=None)[0]
    write_parts(tmp_path / "b.json", 1_000_000, 2, pid=2, steps=4_000, part_bytes=None)
    out_file = tmp_path / "merged.json"
    code, out, err = run(
        "merge",
        str(out_file),
        str(first),
        str(tmp_path / "b.json"),
        "--max-part-bytes",
        str(1 << 20),
    )
    assert code == 0, err
    parts = sorted(tmp_path.glob("merged*.json"))
    assert len(parts) >= 2 and f"into {out_file} and {len(parts) - 1} more part" in out
    frame = read_chrome_trace(out_file)
    assert len(frame) == 2 * 2 * 4_000
    assert frame.groupby("pid")["span_id"].nunique().to_dict() == {1: 8_000, 2: 8_000}
    code, _, err = run("merge", str(out_file), str(first), "--max-part-bytes", "1000")
    assert code == 2 and "expected an integer of at least 1,048,576 for --max-part-bytes" in err


def test_a_stale_later_part_in_a_folder_is_left_out_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "base"
    old = write_parts(folder / "run.json", 1_000_000, 1)
    new = write_parts(folder / "run.json", 1_000_000, 3, steps=12)  # fewer parts
    assert len(new) < len(old)  # the old run's last parts are still there
    write_parts(tmp_path / "cand" / "run.json", 1_000_000, 2)
    _code, out, err = run("compare", str(folder), str(tmp_path / "cand"))
    assert "(1 run vs 1 run)" in out, out
    assert capsys.readouterr().err == ""  # on the CLI's own stderr, once per stale part
    stale = f"part {len(new)} of a run named run.json"
    assert err.count(stale) == 1 and "left out" in err, err


@pytest.mark.parametrize("lost", [[2], [3, 4, 5, 6, 7]])
def test_a_folder_whose_run_lost_a_part_says_so_once_and_fails_the_gate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lost: list[int]
) -> None:
    """Parts deleted from a run in a folder: its later parts are that run's, not left
    over from another (before: called "left over", and warned of twice), however many
    went (the reader looked three parts past the gap, and a folder then lost the rest
    without a word)."""
    folder = tmp_path / "base"
    parts = write_parts(folder / "run.json", 1_000_000, 1)
    assert len(parts) > 8
    for i in lost:
        parts[i].unlink()
    write_parts(tmp_path / "cand" / "run.json", 1_000_000, 2)
    code, out, err = run("compare", str(folder), str(tmp_path / "cand"))
    assert capsys.readouterr().err == ""  # every warning on the CLI's own stderr
    assert code == 2 and "a base run failed" in out, out
    assert "left over" not in err and "left out" not in err, err
    assert err.count(f"Part {lost[0]} of the run") == 1, err


def test_only_the_reading_commands_run_as_the_process_tune_the_allocator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ppetrace.cli import _main

    calls: list[str] = []
    monkeypatch.setattr(_main, "keep_freed_memory", lambda: calls.append("tuned") or True)
    first = write_parts(tmp_path / "run.json", 1_000_000, 1)[0]
    assert run("report", str(first))[0] == 0 and calls == []  # argv given: a caller's process
    monkeypatch.setattr("sys.argv", ["ppetrace", "report", str(first)])
    assert main(stdout=io.StringIO(), stderr=io.StringIO()) == 0 and calls == ["tuned"]
    monkeypatch.setattr("sys.argv", ["ppetrace", "run", str(tmp_path / "missing.py")])
    assert main(stdout=io.StringIO(), stderr=io.StringIO()) == 2 and calls == ["tuned"]


def test_keep_freed_memory_takes_glibcs_settings() -> None:
    import subprocess
    import sys

    code = "from ppetrace.cli._memory import keep_freed_memory as k; print(k())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    libc = __import__("platform").libc_ver()[0]
    assert out.stdout.strip() == (
        "True" if sys.platform == "linux" and libc == "glibc" else "False"
    )


def test_repair_points_at_a_cut_off_later_part_and_closes_parts_in_place(
    tmp_path: Path,
) -> None:
    """A killed run's cut-off part is its last: repairing part 0 names it, and a copy of
    a part (which the run's reader never reads) says how to close the part in place."""
    parts = write_parts(tmp_path / "run.json", 100_000, seed=1)
    assert len(parts) > 3
    last = parts[-1]
    data = last.read_bytes()
    last.write_bytes(data[: len(data) * 2 // 3])
    code, out, _ = run("repair", str(parts[0]))
    assert code == 0
    assert out.splitlines()[1] == (
        f"but {last}, a later part of its run, is cut off: `ppetrace repair {last} {last}` "
        "closes it in place (the run's parts are read by their names)"
    )
    code, out, _ = run("repair", str(last))
    assert code == 0 and out.splitlines()[1].startswith(
        f"{last} is part {len(parts) - 1} of a run, whose parts are read by their names"
    )
    code, out, _ = run("repair", str(last), str(last))
    assert code == 0 and len(out.splitlines()) == 1  # in place: nothing more to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the run reads whole again, without a warning
        assert not read_chrome_trace(parts[0]).attrs["truncated"]
    code, out, _ = run("repair", str(parts[0]))
    assert len(out.splitlines()) == 1  # nothing cut any more
