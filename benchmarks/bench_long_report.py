"""``ppetrace report`` on a long run's trace: full-detail steps, then summarised steps.

Issue 19's budget: ``ppetrace report`` on a simulated 1,000,000-step tiny run
at default settings in <= 10 s. At default settings (``trace_detail="auto"``,
``max_trace_bytes`` about 1 GB) that trace holds about 330,000 steps in full
detail (8 spans each: ``trainer.fetch_batch``, ``trainer.step`` and six hooks)
and 670,000 summarised steps (2 rows each: ``trainer.fetch_batch`` and a
``trainer.step`` whose ``ppetrace.hooks`` holds the six hooks' aggregates),
with one step in 1,000 in full among them, written in parts.

The trace is generated here, line by line in the writer's format (no torch,
no training: seconds), unless ``--trace`` names an existing one (such as the
real run that ``benchmarks/bench_long_run.py`` writes). Then it times, each
``--repeat`` times: the CLI as a fresh process (``python -m ppetrace report
TRACE``, what a user waits for, interpreter start included) and, in this
process, its stages: the generic reader (``read_chrome_trace``), the
aggregates' parse (``exporters._aggregates``, timed alone; ``step_report``
parses them as part of its own time) and the rendering. ``--sizes`` repeats it
at smaller sizes so that the scaling is visible (each size keeps the 33/67
split).

Run::

    python benchmarks/bench_long_report.py                      # 1,000,000 steps
    python benchmarks/bench_long_report.py --steps 100000 --sizes 10000,30000
    python benchmarks/bench_long_report.py --trace /path/trace.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 10.0
#: The share of a default 1M-step run's steps kept in full before the switch.
DETAILED_SHARE = 0.33
PART_BYTES = 1 << 28  # the Trainer's part size (256 MiB)
WINDOW = 1000  # one step in full in this many, after the switch
PID, TID = 4242, 11
HOOKS = (
    "runtime.train_pre_step",
    "runtime.convert_batch",
    "module.train_step",
    "module.forward",
    "trainer.backward",
    "trainer.optimizer_step",
)
# each hook's (start offset, duration) in ns inside a 100 µs step; forward in train_step
_LAYOUT = (
    (1_000, 2_000, 2),  # (start, dur, parent: 2 = the step, 3 = train_step)
    (4_000, 3_000, 2),
    (8_000, 40_000, 2),
    (9_000, 30_000, 3),
    (50_000, 30_000, 2),
    (82_000, 15_000, 2),
)
STEP_NS, FETCH_NS, GAP_NS = 100_000, 5_000, 1_000
T0 = 1_700_000_000_000_000_000


class _Parts:
    """Writes a run's parts in the writer's line format, a new part past PART_BYTES."""

    def __init__(self, path: Path, part_bytes: int) -> None:
        self.path, self.part_bytes, self.index = path, part_bytes, -1
        self.out: IO[str] | None = None
        self.size = 0
        self._next()

    def _name(self, index: int) -> Path:
        if index == 0:
            return self.path
        return self.path.with_name(f"{self.path.name[: -len('.json')]}.{index}.json")

    def _next(self) -> None:
        self.close()
        self.index += 1
        self.out = open(self._name(self.index), "w", encoding="utf-8")  # noqa: SIM115
        part = f',"part":{self.index},"first_part":"{self.path.name}"'
        self.out.write(
            '{"displayTimeUnit":"ns","otherData":{"service_name":"bench","trace_id":'
            f'"{7:032x}","ppetrace_version":null,"host":null,"pid":{PID},"rank":0,'
            f'"start_time_ns":{T0},"origin_ns":{T0},"clock_offset_ns":0,"resource":{{}}{part}'
            '},"traceEvents":[\n'
            f'{{"ph":"M","name":"process_name","pid":{PID},"tid":0,"args":{{"name":"bench"}}}},\n'
            f'{{"ph":"M","name":"thread_name","pid":{PID},"tid":{TID},"args":{{"name":"Main"}}}}'
        )
        self.size = 0
        self.new_part = True

    def write(self, text: str) -> None:
        assert self.out is not None
        self.out.write(text)
        self.size += len(text)
        if self.size >= self.part_bytes:
            self._next()

    def close(self) -> None:
        if self.out is not None:
            self.out.write("\n]}\n")
            self.out.close()
            self.out = None


def _x(name: str, ts_ns: int, dur_ns: int, sid: int, parent: int, attrs: str = "") -> str:
    a = f',"attrs":{{{attrs}}}' if attrs else ""
    return (
        f',\n{{"ph":"X","cat":"{name.split(".")[0]}","name":"{name}","pid":{PID},"tid":{TID},'
        f'"ts":{ts_ns / 1000:.3f},"dur":{dur_ns / 1000:.3f},"span_id":"{sid:016x}",'
        f'"parent_id":"{parent:016x}","status":"UNSET"{a}}}'
    )


def write_long_trace(
    path: Path,
    *,
    detailed: int,
    summarised: int,
    window: int = WINDOW,
    part_bytes: int = PART_BYTES,
) -> list[Path]:
    """Write a run of ``detailed`` full-detail steps followed by ``summarised`` steps of
    which one in ``window`` is in full, in parts; return the parts' paths."""
    parts = _Parts(path, part_bytes)
    names = ";".join(HOOKS)
    sid = 0x100
    t = 0
    epoch = 0x10
    announce = True
    for i in range(detailed + summarised):
        full = i < detailed or (i - detailed) % window == window - 1
        jitter = (i * 7919) % 997  # deterministic variety in the durations
        t += GAP_NS
        sid += 1
        parts.write(_x("trainer.fetch_batch", t, FETCH_NS, sid, epoch, f'"ppetrace.batch_idx":{i}'))
        t += FETCH_NS
        step = sid = sid + 1
        attrs = f'"ppetrace.batch_idx":{i},"ppetrace.step":{i}'
        if full:
            parts.write(_x("trainer.step", t, STEP_NS + jitter, step, epoch, attrs))
            train = 0
            for k, (off, dur, par) in enumerate(_LAYOUT):
                sid += 1
                parent = step if par == 2 else train
                if k == 2:
                    train = sid
                parts.write(_x(HOOKS[k], t + off, dur + (jitter if k == 4 else 0), sid, parent))
            announce = True
        else:
            entries = []
            for k, (_, dur, _) in enumerate(_LAYOUT):
                total = dur + (jitter if k == 4 else 0)
                entries.append(f"{total}/{total - 30_000}" if k == 2 else str(total))
            attrs += f',"ppetrace.hooks":"{";".join(entries)}"'
            if announce or parts.new_part:
                attrs += f',"ppetrace.hook_names":"{names}"'
                announce = parts.new_part = False
            parts.write(_x("trainer.step", t, STEP_NS + jitter, step, epoch, attrs))
        t += STEP_NS + jitter
    parts.write(_x("trainer.epoch", 0, t + 10, epoch, 0x1))
    parts.write(_x("trainer.run", 0, t + 20, 0x1, 0))
    parts.close()
    return [parts._name(i) for i in range(parts.index + 1)]


def _stages(path: Path) -> dict[str, float]:
    """Seconds of each stage of ``ppetrace report``, in this process."""
    import exporters
    from exporters._aggregates import parse_aggregates

    t0 = time.perf_counter()
    frame = exporters.read_chrome_trace(path)
    t1 = time.perf_counter()
    parse_aggregates(frame)
    t2 = time.perf_counter()
    report = exporters.step_report(frame)
    t3 = time.perf_counter()
    exporters.render(report, "table")
    t4 = time.perf_counter()
    return {"read": t1 - t0, "aggregates": t2 - t1, "step_report": t3 - t2, "render": t4 - t3}


def _cli(path: Path) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "ppetrace", "report", str(path), "-o", os.devnull],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    elapsed = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"ppetrace report failed ({done.returncode}):\n{done.stderr}")
    return elapsed


def measure(path: Path, repeat: int, label: str) -> float:
    """Print the CLI's time and the stages' for the trace at ``path``; the CLI's median."""
    import exporters

    cli = [_cli(path) for _ in range(repeat)]
    stages = [_stages(path) for _ in range(repeat)]
    med = {k: statistics.median(s[k] for s in stages) for k in stages[0]}
    total = med["read"] + med["step_report"] + med["render"]  # what the CLI runs
    size = sum(Path(p).stat().st_size for p in exporters.trace_parts(path))
    print(
        f"{label}: {size / 1e6:,.0f} MB; ppetrace report (fresh process) median "
        f"{statistics.median(cli):.2f} s (min {min(cli):.2f}, max {max(cli):.2f}, "
        f"n={repeat}); in process {total:.2f} s: read_chrome_trace {med['read']:.2f} s "
        f"({med['read'] / total:.0%}), step_report {med['step_report']:.2f} s (of which "
        f"parsing the aggregates {med['aggregates']:.2f} s), render {med['render']:.2f} s",
        flush=True,
    )
    return statistics.median(cli)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1_000_000, help="steps of the run")
    parser.add_argument(
        "--detailed-share",
        type=float,
        default=DETAILED_SHARE,
        help="share of the steps in full before the switch (default 0.33)",
    )
    parser.add_argument("--sizes", default="", help="smaller step counts, comma-separated")
    parser.add_argument("--trace", help="an existing trace to report on instead")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", help="a folder to write the generated traces in (kept)")
    args = parser.parse_args(argv)
    if args.trace:
        measure(Path(args.trace).resolve(), args.repeat, args.trace)
        return 0
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()} | {args.steps})
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        last = 0.0
        for steps in sizes:
            detailed = round(steps * args.detailed_share)
            path = folder / f"long_{steps}.json"
            t0 = time.perf_counter()
            paths = write_long_trace(path, detailed=detailed, summarised=steps - detailed)
            print(
                f"generated {steps:,} steps ({detailed:,} in full, then 1 in {WINDOW}) in "
                f"{len(paths)} part(s) in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
            last = measure(path, args.repeat, f"{steps:,} steps")
    if args.steps >= 1_000_000:
        verdict = "PASS" if last <= BUDGET_S else "FAIL"
        print(f"budget: ppetrace report <= {BUDGET_S:.0f} s on 1,000,000 steps: {verdict}")
        return 0 if last <= BUDGET_S else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
