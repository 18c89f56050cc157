"""pytest plugin: a project's own test suite becomes its CI benchmark.

Loaded through the ``pytest11`` entry point, so importing it stays cheap: it
imports neither torch nor pandas; the exporters load on first use.

- The fixture ``ppetrace_benchmark`` records a benchmark, either by calling a
  function for N steps (each call is one ``trainer.step`` span) or by
  recording whatever the code in a ``with ppetrace_benchmark.record():``
  block traces (for example a short ``Trainer.fit``).
- ``--ppetrace-save DIR`` writes each benchmark as a Chrome trace baseline,
  ``DIR/<test id>.json``, with the environment in its ``otherData``. The test
  id is the node id relative to the project root (the nearest folder above
  the test file with a ``pyproject.toml``, ``setup.py``, ``setup.cfg``,
  ``tox.ini``, ``pytest.ini`` or ``.git``), percent-encoded, so names never
  collide and do not depend on pytest's rootdir (:func:`baseline_name`).
- ``--ppetrace-compare DIR`` compares each benchmark with the baseline of the
  same name in ``DIR`` with :func:`exporters.compare` (the same method and
  defaults as ``ppetrace compare``: one run per side, judged against the
  noise floor) and fails the test on a gated regression, with compare's text
  table in the failure message. ``--ppetrace-threshold``,
  ``--ppetrace-alpha``, ``--ppetrace-noise-floor`` and ``--ppetrace-gate``
  tune that verdict; environment differences are warnings
  (:class:`EnvironmentMismatchWarning`), or failures with
  ``--ppetrace-strict-env``. A comparison that cannot decide (no gated event
  with enough steps on both sides) fails the test, as ``ppetrace compare``
  exits 2, unless ``--ppetrace-allow-no-verdict``; so does a failed run on
  either side (:func:`exporters.run_failure`: a ``trainer.step`` or ``trainer.run``
  that ended with an error, inside the benchmark's own ``record()`` block or in the
  baseline), and a failed run is not saved as a baseline, unless
  ``--ppetrace-allow-failed-runs``. A benchmark without a
  baseline in the folder warns (:class:`BaselineMissingWarning`) and passes; a
  folder that does not exist is a usage error, unless it is also the
  ``--ppetrace-save`` folder (the first run of a new baseline folder).
- With both options the comparison comes first, against the baseline saved
  before; then the run is saved. When both name one folder, a failed
  comparison keeps the old baseline there (a slower run never becomes the
  baseline it failed against).

Example::

    def test_train_step_speed(ppetrace_benchmark):
        ppetrace_benchmark(train_one_step, model, batch, steps=30)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import sys
import urllib.parse
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from exporters._defaults import (
    DEFAULT_ALPHA,
    DEFAULT_GATE,
    DEFAULT_NOISE_FLOOR,
    DEFAULT_THRESHOLD,
)
from ppetrace.cli import fraction_note, parse_gate, parse_percent, parse_threshold

if TYPE_CHECKING:
    import pandas as pd

    from exporters import Comparison
    from exporters._spans import SpanBatch

__all__ = [
    "BaselineMissingWarning",
    "Benchmark",
    "EnvironmentMismatchWarning",
    "baseline_name",
    "project_root",
]


class BaselineMissingWarning(UserWarning):
    """``--ppetrace-compare`` found no baseline for a benchmark; it was not compared."""


class EnvironmentMismatchWarning(UserWarning):
    """The baseline was recorded in another environment (Python, torch, CPU, threads,
    device or ppetrace version): the comparison measures that difference too."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ppetrace", "ppetrace benchmarks")
    group.addoption(
        "--ppetrace-save",
        metavar="DIR",
        default=None,
        help="save each ppetrace_benchmark run as a Chrome trace baseline in DIR",
    )
    group.addoption(
        "--ppetrace-compare",
        metavar="DIR",
        default=None,
        help="compare each ppetrace_benchmark run with its baseline in DIR; "
        "fail the test on a gated regression",
    )
    group.addoption(
        "--ppetrace-threshold",
        metavar="PCT",
        default=f"{DEFAULT_THRESHOLD:.0%}",
        help="smallest relative change that counts as a regression (default: %(default)s)",
    )
    group.addoption(
        "--ppetrace-alpha",
        metavar="P",
        type=float,
        default=DEFAULT_ALPHA,
        help="significance level after Holm correction (default: %(default)s)",
    )
    group.addoption(
        "--ppetrace-noise-floor",
        metavar="PCT",
        default=f"{DEFAULT_NOISE_FLOOR:.1%}",
        help="run-to-run CV of the median step assumed at least (default: %(default)s)",
    )
    group.addoption(
        "--ppetrace-gate",
        metavar="EVENTS",
        default=None,
        help="events that can fail the test, separated by commas, or 'all' "
        f"(default: {','.join(sorted(DEFAULT_GATE))})",
    )
    group.addoption(
        "--ppetrace-allow-no-verdict",
        action="store_true",
        default=False,
        help="pass a compared benchmark that no gated event could decide (too few steps, "
        "or no gated event on both sides); by default it fails",
    )
    group.addoption(
        "--ppetrace-allow-failed-runs",
        action="store_true",
        default=False,
        help="compare and save benchmark runs that failed (a trainer.step or trainer.run "
        "span that ended with an error) as any other; by default such a run fails the test "
        "and is not saved, and so does a baseline that records one",
    )
    group.addoption(
        "--ppetrace-strict-env",
        action="store_true",
        default=False,
        help="fail a compared benchmark whose baseline was recorded in another environment",
    )


def pytest_configure(config: pytest.Config) -> None:
    for option, parse in (
        ("--ppetrace-threshold", parse_threshold),
        ("--ppetrace-noise-floor", lambda t: parse_percent(t, option="--ppetrace-noise-floor")),
    ):
        text = config.getoption(option, default="5%")
        try:
            parse(text)
        except ValueError as exc:
            raise pytest.UsageError(f"{option}: {exc}") from None
        note = fraction_note(text, option=option)  # 0.5 is 50%: said, as by the CLI
        if note is not None:
            config.issue_config_time_warning(pytest.PytestConfigWarning(note.strip()), 2)
    alpha = config.getoption("--ppetrace-alpha", default=DEFAULT_ALPHA)
    if not (0.0 < alpha < 1.0):
        raise pytest.UsageError(
            f"--ppetrace-alpha: Expected a probability between 0 and 1, but received {alpha}."
        )
    gate = config.getoption("--ppetrace-gate", default=None)
    if gate is not None:
        try:
            parse_gate(gate)
        except ValueError as exc:
            raise pytest.UsageError(f"--ppetrace-gate: {exc}") from None
    compare = config.getoption("--ppetrace-compare", default=None)
    save = config.getoption("--ppetrace-save", default=None)
    if compare and not Path(compare).is_dir() and not _same_folder(compare, save):
        raise pytest.UsageError(
            f"--ppetrace-compare: Expected a folder of baselines written by --ppetrace-save, "
            f"but {compare} is {'not a folder' if Path(compare).exists() else 'missing'}. "
            f"Run once with --ppetrace-save {compare} to create it, or check the path."
        )


def _same_folder(a: str | Path | None, b: str | Path | None) -> bool:
    """Whether ``a`` and ``b`` name one folder (existing or not)."""
    if not a or not b:
        return False
    return Path(a).resolve() == Path(b).resolve()


def _warn(message: str, category: type[Warning]) -> None:
    """Warn with the location of the test's code: the first frame outside this module and
    contextlib (``record``'s block ends in contextlib)."""
    frame: Any = sys._getframe(0)
    level = 1
    while frame is not None and frame.f_code.co_filename in (__file__, contextlib.__file__):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


class _Collector:
    """A ppetrace sink that keeps every batch it receives."""

    def __init__(self) -> None:
        self.batches: list[SpanBatch] = []

    def export_batch(self, batch: SpanBatch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        return None


_PROJECT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", "tox.ini", "pytest.ini", ".git")
_MAX_NAME = 180  # bytes of a baseline's file stem; longer ids are cut and hashed


def project_root(path: Path, fallback: Path) -> Path:
    """The nearest folder at or above ``path``'s folder that holds a ``pyproject.toml``,
    ``setup.py``, ``setup.cfg``, ``tox.ini``, ``pytest.ini`` or ``.git``; else
    ``fallback`` (pytest's rootdir)."""
    start = path.resolve()
    for folder in (start, *start.parents) if start.is_dir() else start.parents:
        if any((folder / marker).exists() for marker in _PROJECT_MARKERS):
            return folder
    return fallback


def baseline_name(test_id: str) -> str:
    """The file stem of a test's baseline: ``test_id`` percent-encoded (everything but
    letters, digits, ``-_.~`` and ``[]``), so two ids never share a name and no id
    makes a folder. An id longer than 180 bytes once encoded is cut, and ``+`` and a
    hash of the whole id are added (``+`` never appears in an encoded id)."""
    encoded = urllib.parse.quote(test_id, safe="[]", errors="surrogatepass")
    if len(encoded) <= _MAX_NAME:
        return encoded
    digest = hashlib.sha256(test_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    cut = encoded[: _MAX_NAME - 17]
    escape = cut.find("%", len(cut) - 2)  # do not cut an escape in two
    return f"{cut[:escape] if escape >= 0 else cut}+{digest}"


def _test_id(item: pytest.Item) -> str:
    """The node id of ``item`` with its file part relative to the project root."""
    rest = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else ""
    path = Path(item.path)
    root = project_root(path, Path(item.config.rootpath))
    try:
        file_part = path.resolve().relative_to(root).as_posix()
    except ValueError:  # the test file is outside the project root
        file_part = item.nodeid.split("::", 1)[0]
    return f"{file_part}::{rest}" if rest else file_part


class Benchmark:
    """What the ``ppetrace_benchmark`` fixture gives a test.

    Call it with a function to trace ``warmup + steps`` calls, each inside a
    ``trainer.step`` span, or use :meth:`record` around code that traces its
    own spans. Each recording is saved and/or compared as the command line
    asked; after it, :attr:`frame` holds its spans and :attr:`comparison` the
    comparison with the baseline (``None`` when there was none). ``name`` is
    the baseline's file stem (:func:`baseline_name`); a test's second and
    later recordings add ``+2``, ``+3``, ...
    """

    def __init__(
        self,
        name: str,
        *,
        save_dir: Path | None = None,
        compare_dir: Path | None = None,
        threshold: float = DEFAULT_THRESHOLD,
        alpha: float = DEFAULT_ALPHA,
        noise_floor: float = DEFAULT_NOISE_FLOOR,
        gate: str | Sequence[str] | None = None,
        strict_env: bool = False,
        allow_no_verdict: bool = False,
        allow_failed_runs: bool = False,
    ) -> None:
        self.name = name
        self.save_dir = save_dir
        self.compare_dir = compare_dir
        self.threshold = threshold
        self.alpha = alpha
        self.noise_floor = noise_floor
        self.gate = gate
        self.strict_env = strict_env
        self.allow_no_verdict = allow_no_verdict
        self.allow_failed_runs = allow_failed_runs
        self.frame: pd.DataFrame | None = None
        self.comparison: Comparison | None = None
        self.saved_path: Path | None = None
        self._runs = 0

    def __call__(
        self, func: Callable[..., Any], *args: Any, steps: int = 20, warmup: int = 1, **kwargs: Any
    ) -> Any:
        """Trace ``warmup + steps`` calls of ``func(*args, **kwargs)``; return the last result.

        Each call runs inside a ``trainer.step`` span whose ``ppetrace.step``
        is the call's index; the first ``warmup`` calls are left out of the
        comparison.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"Expected a positive int for steps, but received {steps!r}.")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"Expected a non-negative int for warmup, but received {warmup!r}.")
        if not callable(func):
            raise TypeError(
                f"Expected a callable to benchmark, but received {type(func).__name__}."
            )
        import ppetrace

        result: Any = None
        with self.record(warmup_steps=warmup), ppetrace.trace("trainer.run"):
            for i in range(warmup + steps):
                with ppetrace.trace("trainer.step", {"ppetrace.step": i, "ppetrace.batch_idx": i}):
                    result = func(*args, **kwargs)
        return result

    @contextmanager
    def record(self, *, warmup_steps: int = 1) -> Iterator[Benchmark]:
        """Record every span that ends inside the block, then save and/or compare them.

        Spans already buffered when the block starts are flushed to the
        current exporters first and are not part of the benchmark. The code
        inside must not call ``ppetrace.configure`` (that drops the recorder's
        exporters, this one included).
        """
        from ppetrace import tracing

        collector = _Collector()
        tracing.add_exporter(collector)
        try:
            yield self
        finally:
            tracing.remove_exporter(collector, shutdown=False)
        self._finish(collector.batches, warmup_steps)

    def _finish(self, batches: list[SpanBatch], warmup_steps: int) -> None:
        import exporters
        from ppetrace.tracing import capture_environment

        environment = capture_environment()
        self.frame = exporters.spans_to_frame(batches)
        self._runs += 1
        file_name = (self.name if self._runs == 1 else f"{self.name}+{self._runs}") + ".json"
        # compare first: with one folder for both options, against the baseline saved before
        failure = None
        if self.compare_dir is not None:
            failure = self._compare(self.compare_dir / file_name, environment, warmup_steps)
        if self.save_dir is not None:
            path = self.save_dir / file_name
            how = None if self.allow_failed_runs else exporters.run_failure(self.frame)
            if how is not None:  # a failed run is no baseline
                failure = (failure + "\n\n" if failure else "") + (
                    f"ppetrace: this run failed ({how}), so it was not saved as the baseline "
                    f"{path}: its steps are no measure of the code's speed. Pass "
                    "--ppetrace-allow-failed-runs to save it all the same."
                )
            elif failure is not None and _same_folder(self.save_dir, self.compare_dir):
                if path.exists():
                    failure += (
                        f"\n\nThe baseline {path} was kept: --ppetrace-save names the folder "
                        "compared with, and a failed run does not replace its baseline."
                    )
            else:
                self.save_dir.mkdir(parents=True, exist_ok=True)
                writer = exporters.ChromeTraceExporter(path, metadata={"environment": environment})
                for batch in batches:
                    writer.export_batch(batch)
                writer.shutdown()
                self.saved_path = path
        if failure is not None:
            pytest.fail(failure, pytrace=False)

    def _compare(self, baseline: Path, environment: Any, warmup_steps: int) -> str | None:
        """Compare :attr:`frame` with ``baseline``; the test's failure message, or None."""
        import exporters

        assert self.frame is not None
        if len(self.frame) == 0:
            return (
                "ppetrace: the benchmark recorded no spans, so there is nothing to compare. "
                "Is tracing disabled (ppetrace.configure(enabled=False)), or did the code "
                "call ppetrace.configure inside the benchmark?"
            )
        if not baseline.exists():
            saving = _same_folder(self.save_dir, baseline.parent)
            _warn(
                f"ppetrace: no baseline {baseline} for this benchmark"
                + (
                    "; this run is saved as its baseline (--ppetrace-save names the folder)."
                    if saving
                    else f"; run once with --ppetrace-save {baseline.parent} to create it."
                ),
                BaselineMissingWarning,
            )
            return None
        try:
            base = exporters.summarize_run(
                exporters.read_chrome_trace(baseline), warmup_steps=warmup_steps
            )
            candidate = dataclasses.replace(
                exporters.summarize_run(self.frame, warmup_steps=warmup_steps),
                environment=environment,
            )
            self.comparison = exporters.compare(
                base,
                candidate,
                threshold=self.threshold,
                alpha=self.alpha,
                noise_floor=self.noise_floor,
                gate=self.gate,
            )
        except (exporters.TraceError, ValueError) as exc:
            return f"ppetrace: comparing with the baseline {baseline} failed: {exc}"
        except OSError as exc:  # a folder, a file we may not read
            return (
                f"ppetrace: the baseline {baseline} cannot be read: {exc.strerror or exc}. "
                "Expected a trace file written by --ppetrace-save."
            )
        env = self.comparison.environment_warnings
        for line in env:
            _warn(f"ppetrace: {line}", EnvironmentMismatchWarning)
        if self.strict_env and env:
            return (
                f"ppetrace: the baseline {baseline} was recorded in another environment "
                "(--ppetrace-strict-env):\n" + "\n".join(env)
            )
        table = exporters.render_comparison_table(self.comparison)
        failed = self.comparison.failed_runs
        if failed and not self.allow_failed_runs:
            lines = "\n".join(f"{side}: {line}" for side, runs in failed.items() for line in runs)
            advice = []
            if "candidate" in failed:
                advice.append("this benchmark's run failed: fix what raised inside its steps")
            if "base" in failed:
                advice.append(
                    "the baseline records a failed run: save it again with --ppetrace-save "
                    "from a run that ends without an error"
                )
            said = "; ".join(advice)
            return (
                f"ppetrace: a run compared with the baseline {baseline} failed, so its steps "
                f"are no measure of the code's speed:\n{lines}\n{said[0].upper()}{said[1:]} "
                f"(or pass --ppetrace-allow-failed-runs to compare it all the same).\n\n{table}"
            )
        if self.comparison.has_regression:
            return f"ppetrace: gated regression against the baseline {baseline}\n\n{table}"
        if not self.comparison.decided and not self.allow_no_verdict:
            gated = ", ".join(self.comparison.gated) or "none"
            return (
                f"ppetrace: no verdict against the baseline {baseline}: no gated event "
                f"({gated}) has enough steps after the warmup on both sides to decide on, "
                "so this comparison cannot catch a regression. Run more steps, lower the "
                f"warmup, or pass --ppetrace-allow-no-verdict to accept it.\n\n{table}"
            )
        return None


@pytest.fixture
def ppetrace_benchmark(request: pytest.FixtureRequest) -> Benchmark:
    """A :class:`Benchmark` named after the test (:func:`baseline_name` of its
    project-relative node id), set up from the ``--ppetrace-*`` options."""
    config = request.config
    save = config.getoption("--ppetrace-save")
    comp = config.getoption("--ppetrace-compare")
    gate = config.getoption("--ppetrace-gate")
    return Benchmark(
        baseline_name(_test_id(request.node)),
        save_dir=Path(save) if save else None,
        compare_dir=Path(comp) if comp else None,
        threshold=parse_threshold(config.getoption("--ppetrace-threshold")),
        alpha=float(config.getoption("--ppetrace-alpha")),
        noise_floor=parse_percent(
            config.getoption("--ppetrace-noise-floor"), option="--ppetrace-noise-floor"
        ),
        gate=None if gate is None else parse_gate(gate),
        strict_env=bool(config.getoption("--ppetrace-strict-env")),
        allow_no_verdict=bool(config.getoption("--ppetrace-allow-no-verdict")),
        allow_failed_runs=bool(config.getoption("--ppetrace-allow-failed-runs")),
    )
