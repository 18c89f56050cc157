"""The command line's messages for the cases a new user met: empty traces, negative
thresholds, too few samples, all-warmup runs, counts and the same file twice."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli import _one_error_line, run

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
