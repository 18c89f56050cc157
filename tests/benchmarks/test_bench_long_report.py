"""The long-run trace of benchmarks/bench_long_report.py, at a tiny size: it is what it
claims to be (parts, full-detail steps then one in ``window``), read as one run."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the repository, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_long_report import HOOKS, write_long_trace  # noqa: E402
from exporters import read_chrome_trace, step_report  # noqa: E402


def test_the_generated_long_run_reads_as_one_run_with_every_step_covered(
    tmp_path: Path,
) -> None:
    paths = write_long_trace(
        tmp_path / "long.json", detailed=10, summarised=20, window=5, part_bytes=4_000
    )
    assert len(paths) > 2
    frame = read_chrome_trace(paths[0])
    assert frame.attrs["parts"] == [str(p) for p in paths]
    report = step_report(frame, warmup_steps=1)
    assert report.detail is not None
    # steps 0-9 in full, then 14, 19, 24, 29 (the last of each window of 5)
    assert report.detail.ranges == (
        (4242, 0, 9),
        (4242, 14, 14),
        (4242, 19, 19),
        (4242, 24, 24),
        (4242, 29, 29),
    )
    assert report.detail.unknown == 0  # every part repeats the names list
    events = report.events.set_index("event")
    for hook in HOOKS:
        assert events.loc[hook, "count"] == 29, hook
        assert events.loc[hook, "detail_count"] == 13, hook
    steps = report.steps
    # the same layout in full and summarised: the parts agree (forward = train_step's
    # 40 µs with its forward inside; optimizer 15 µs)
    assert set(steps["forward_ns"]) == {40_000} and set(steps["optimizer_ns"]) == {15_000}
