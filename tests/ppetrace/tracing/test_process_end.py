"""Issue 11 case 2: a process that is killed keeps its spans. SIGKILL loses at most about
one flush interval (the background flusher); SIGTERM flushes, closes the file (strict
JSON) and then does what the previous handler or the default would have done."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

import ppetrace
from exporters import read_chrome_trace
from ppetrace.tracing import _signals

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")

INTERVAL_S = 0.2
# scheduling on a loaded 2-core CI machine: what the bound allows beyond one interval
SLACK_S = 2.0


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


def _spawn(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )


def _ticks(path: Path) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a cut-off file is expected here
        try:
            frame = read_chrome_trace(path)
        except Exception:
            return []
    return sorted(int(i) for i in frame.loc[frame["name"] == "tick", "i"])


def test_sigkill_loses_at_most_about_one_flush_interval(tmp_path: Path) -> None:
    path = tmp_path / "killed.json"
    child = _spawn(
        f"""
        import sys, time
        import ppetrace
        from exporters import ChromeTraceExporter
        ppetrace.configure(exporters=[ChromeTraceExporter(sys.argv[1])],
                           flush_interval={INTERVAL_S}, buffer_spans=1 << 20)
        i = 0
        while True:  # no flush() call: only the flusher's schedule writes the file
            with ppetrace.trace("tick", {{"i": i}}):
                pass
            i += 1
            time.sleep(0.0005)
        """,
        str(path),
    )
    try:
        deadline = time.monotonic() + 120
        while len(_ticks(path)) < 50:  # the schedule has written some already
            assert child.poll() is None, child.stderr.read() if child.stderr else ""
            assert time.monotonic() < deadline, "no span reached the file without a flush"
            time.sleep(0.05)
    finally:
        killed_ns = time.time_ns()
        child.kill()
        child.wait()
    ticks = _ticks(path)
    assert ticks == list(range(len(ticks)))  # what reached the file has no hole
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frame = read_chrome_trace(path)
    last_end_ns = int(frame["end_ns"].max())
    lost_s = (killed_ns - last_end_ns) / 1e9
    assert lost_s <= INTERVAL_S + SLACK_S, f"lost the last {lost_s:.2f} s of spans"


_TERM_CHILD = """
import signal, sys, time
import ppetrace
from exporters import ChromeTraceExporter
if sys.argv[2] == "user":
    def user(signum, frame):
        print("user handler", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, user)
ppetrace.configure(exporters=[ChromeTraceExporter(sys.argv[1])], flush_interval=3600)
for i in range(100):
    with ppetrace.trace("tick", {"i": i}):
        pass
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("previous", ["default", "user"])
def test_sigterm_flushes_closes_the_file_and_chains(tmp_path: Path, previous: str) -> None:
    path = tmp_path / "term.json"
    child = _spawn(_TERM_CHILD, str(path), previous)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready", child.stderr.read() if child.stderr else ""
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=120)
    if previous == "default":
        assert child.returncode == -signal.SIGTERM, err
    else:
        assert child.returncode == 3 and "user handler" in out, err
    with path.open() as f:
        trace = json.load(f)  # closed: strict JSON, for any viewer
    ticks = sorted(e["attrs"]["i"] for e in trace["traceEvents"] if e.get("name") == "tick")
    assert ticks == list(range(100))


def _is_ours(handler: object) -> bool:
    return getattr(handler, "__module__", "") == _signals.__name__


def test_handle_sigterm_false_installs_no_handler() -> None:
    try:
        ppetrace.configure(handle_sigterm=False)
        original = signal.getsignal(signal.SIGTERM)
        assert not _is_ours(original)
        ppetrace.configure()
        assert _is_ours(signal.getsignal(signal.SIGTERM))
        ppetrace.configure(handle_sigterm=False)  # removes it: the previous one is back
        assert signal.getsignal(signal.SIGTERM) is original
    finally:
        ppetrace.configure()
