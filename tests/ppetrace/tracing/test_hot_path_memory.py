"""The hot path's confirmed memory errors (issue 18), each run where a crash cannot take
the suite down: in a subprocess, under Python's debug allocator (freed memory is
overwritten, so a use after free shows), on the C path and on the pure-Python path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ppetrace.tracing import _recorder

IMPLEMENTATIONS = ["c", "python"]


def _run(code: str, implementation: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    # the debug allocator overwrites freed memory; the sanitizer job runs with malloc
    env["PYTHONMALLOC"] = os.environ.get("PYTHONMALLOC") or "debug"
    env.pop("PPETRACE_PURE_PYTHON", None)
    if implementation == "python":
        env["PPETRACE_PURE_PYTHON"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"exit code {proc.returncode} (a negative code is the signal that killed it)\n"
        + proc.stdout[-2000:]
        + proc.stderr[-4000:]
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # "c" runs the C hot path wherever this process does
    expected = implementation if _recorder.IMPLEMENTATION == "c" else "python"
    assert result.pop("impl") == expected
    return result


_SINK = """
import ppetrace
from ppetrace.tracing import _recorder

class Sink:
    def __init__(self):
        self.rows = []
    def export_batch(self, batch):
        self.rows.extend(batch.rows)
    def shutdown(self):
        pass

sink = Sink()
ppetrace.configure(exporters=[sink])
"""


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_span_made_current_without_being_entered_is_no_parent(implementation: str) -> None:
    """Confirmed case 1: the child copied a NULL trace id and crashed (SIGSEGV) on exit."""
    result = _run(
        _SINK
        + """
import json
from opentelemetry import trace as ot

never = ppetrace.trace("never.entered")
ppetrace.configure(exporters=[sink], enabled=False)
disabled = ppetrace.trace("entered.while.disabled")
with disabled:
    pass
ppetrace.configure(exporters=[sink])
for parent in (never, disabled):
    assert ot.get_current_span() is not parent
    with ot.use_span(parent, end_on_exit=False):
        assert not parent.get_span_context().is_valid
        with ppetrace.trace("child"):
            pass
ppetrace.flush()
print(json.dumps({
    "impl": _recorder.IMPLEMENTATION,
    "rows": [[r.name, r.parent_id, r.trace_id == _recorder.RECORDER.trace_id] for r in sink.rows],
}))
""",
        implementation,
    )
    assert result["rows"] == [["child", 0, True], ["child", 0, True]]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_fork_in_a_finalizer_while_a_span_ends_loses_nothing(implementation: str) -> None:
    """Confirmed case 5: a GC finalizer that forks while the row is made. The child's
    at-fork hook dropped the thread's record list, which C then appended to (freed
    memory; the child's span was lost). Now the row goes to the child's fresh buffer."""
    result = _run(
        _SINK
        + """
import gc, json, os

with ppetrace.trace("warm"):
    pass
state = {"armed": False, "child": None}
read_end, write_end = os.pipe()

class Forker:
    def __del__(self):
        if state["armed"] and state["child"] is None:
            state["armed"] = False
            state["child"] = os.fork()

gc.collect()
gc.disable()
with ppetrace.trace("outer"):
    f = Forker()
    f.cycle = f
    del f
    state["armed"] = True
    gc.enable()
    gc.set_threshold(1)  # the next GC allocation (the row) collects the cycle
gc.set_threshold(700)
pid = state["child"]
if pid == 0:  # the child: its own recorder holds the span that ended here
    os.write(write_end, str(ppetrace.stats().recorded).encode())
    os._exit(0)
os.close(write_end)
_, status = os.waitpid(pid, 0)
child_recorded = int(os.read(read_end, 100) or b"-1")
ppetrace.flush()
print(json.dumps({
    "impl": _recorder.IMPLEMENTATION,
    "forked": pid is not None,
    "child_exit": os.waitstatus_to_exitcode(status),
    "child_recorded": child_recorded,
    "parent": [r.name for r in sink.rows],
}))
""",
        implementation,
    )
    assert result["forked"] and result["child_exit"] == 0
    assert result["child_recorded"] == 1
    assert result["parent"] == ["warm", "outer"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_an_absurd_clock_offset_gives_exact_epoch_times(implementation: str) -> None:
    """Confirmed case 6 (hot path): monotonic + offset overflowed int64 in C (undefined
    behaviour; it wrapped to a negative time). Both paths now give the exact sum."""
    result = _run(
        _SINK
        + """
import json, time

rec = _recorder.RECORDER
rec.offset_ns = 2**63 - 1  # the largest offset set_state accepts
rec.apply()
before = time.perf_counter_ns()
with ppetrace.trace("absurd"):
    pass
after = time.perf_counter_ns()
ppetrace.flush()  # to the collecting sink: the rows are checked here
rows = sink.rows
(row,) = [r for r in rows if r.name == "absurd"]
print(json.dumps({
    "impl": _recorder.IMPLEMENTATION,
    "start_minus_offset": row.start_ns - (2**63 - 1),
    "end_minus_offset": row.end_ns - (2**63 - 1),
    "before": before,
    "after": after,
}))
""",
        implementation,
    )
    assert result["before"] <= result["start_minus_offset"] <= result["end_minus_offset"]
    assert result["end_minus_offset"] <= result["after"]
