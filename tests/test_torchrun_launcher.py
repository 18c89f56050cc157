"""The tests' torchrun launcher runs again only after torch's exit abort, and only once."""

from __future__ import annotations

import contextlib

import pytest
import torchrun_launch as launch


def _launches(monkeypatch: pytest.MonkeyPatch, results: list[tuple[int, str]]) -> list[int]:
    calls: list[int] = []

    def once(argv: tuple[str, ...], timeout: float) -> tuple[int, str, str]:
        calls.append(1)
        code, err = results[len(calls) - 1]
        return code, "", err

    monkeypatch.setattr(launch, "_torchrun_once", once)
    return calls


def test_an_exit_abort_runs_once_more_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _launches(monkeypatch, [(1, launch.EXIT_ABORT), (0, "done")])
    with pytest.warns(UserWarning, match="exit abort"):
        assert launch.torchrun_two_processes("x.py") == "done"
    assert len(calls) == 2


@pytest.mark.parametrize(
    "results",
    [
        [(1, launch.EXIT_ABORT), (1, launch.EXIT_ABORT)],  # twice: fails
        [(1, "Traceback: an error of the script")],  # any other failure: no second run
    ],
)
def test_any_other_failure_or_a_second_abort_fails(
    monkeypatch: pytest.MonkeyPatch, results: list[tuple[int, str]]
) -> None:
    calls = _launches(monkeypatch, results)
    warned = pytest.warns(UserWarning) if len(results) == 2 else contextlib.nullcontext()
    with pytest.raises(pytest.fail.Exception, match="failed with exit code 1"), warned:
        launch.torchrun_two_processes("x.py")
    assert len(calls) == len(results)
