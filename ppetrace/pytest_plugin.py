"""pytest plugin: a project's own test suite becomes its CI benchmark.

Loaded through the ``pytest11`` entry point, so importing it stays cheap: it
imports neither torch nor pandas; the exporters load on first use.

- The fixture ``ppetrace_benchmark`` records a benchmark, either by calling a
  function for N steps (each call is one ``trainer.step`` span) or by
  recording whatever the code in a ``with ppetrace_benchmark.record():``
  block traces (for example a short ``Trainer.fit``).
- ``--ppetrace-save DIR`` writes each benchmark as a Chrome trace baseline,
  ``DIR/<test id>.json``.
- ``--ppetrace-compare DIR`` compares each benchmark with the baseline of the
  same name in ``DIR`` (:func:`exporters.compare`) and fails the test on a
  significant regression, with the Markdown table in the failure message.
  ``--ppetrace-threshold`` (default ``5%``) and ``--ppetrace-alpha`` (default
  0.01) tune that verdict.

Example::

    def test_train_step_speed(ppetrace_benchmark):
        ppetrace_benchmark(train_one_step, model, batch, steps=30)
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ppetrace.cli import parse_threshold

if TYPE_CHECKING:
    import pandas as pd

    from exporters import Comparison
    from exporters._spans import SpanBatch

__all__ = ["BaselineMissingWarning", "Benchmark"]


class BaselineMissingWarning(UserWarning):
    """``--ppetrace-compare`` found no baseline for a benchmark; it was not compared."""


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
        "fail the test on a significant regression",
    )
    group.addoption(
        "--ppetrace-threshold",
        metavar="PCT",
        default="5%",
        help="smallest relative change that counts as a regression (default: 5%%)",
    )
    group.addoption(
        "--ppetrace-alpha",
        metavar="P",
        type=float,
        default=0.01,
        help="significance level after Holm correction (default: 0.01)",
    )


def pytest_configure(config: pytest.Config) -> None:
    threshold = config.getoption("--ppetrace-threshold", default="5%")
    try:
        parse_threshold(threshold)
    except ValueError as exc:
        raise pytest.UsageError(f"--ppetrace-threshold: {exc}") from None
    alpha = config.getoption("--ppetrace-alpha", default=0.01)
    if not (0.0 < alpha < 1.0):
        raise pytest.UsageError(
            f"--ppetrace-alpha: Expected a probability between 0 and 1, but received {alpha}."
        )


class _Collector:
    """A ppetrace sink that keeps every batch it receives."""

    def __init__(self) -> None:
        self.batches: list[SpanBatch] = []

    def export_batch(self, batch: SpanBatch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        return None


def _safe_name(nodeid: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("._")
    return name or "benchmark"


class Benchmark:
    """What the ``ppetrace_benchmark`` fixture gives a test.

    Call it with a function to trace ``warmup + steps`` calls, each inside a
    ``trainer.step`` span, or use :meth:`record` around code that traces its
    own spans. Each recording is saved and/or compared as the command line
    asked; after it, :attr:`frame` holds its spans and :attr:`comparison` the
    comparison with the baseline (``None`` when there was none).
    """

    def __init__(
        self,
        name: str,
        *,
        save_dir: Path | None = None,
        compare_dir: Path | None = None,
        threshold: float = 0.05,
        alpha: float = 0.01,
    ) -> None:
        self.name = name
        self.save_dir = save_dir
        self.compare_dir = compare_dir
        self.threshold = threshold
        self.alpha = alpha
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

        self.frame = exporters.spans_to_frame(batches)
        file_name = self.name if self._runs == 0 else f"{self.name}-{self._runs}"
        self._runs += 1
        file_name += ".json"
        if self.save_dir is not None:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            path = self.save_dir / file_name
            writer = exporters.ChromeTraceExporter(path)
            for batch in batches:
                writer.export_batch(batch)
            writer.shutdown()
            self.saved_path = path
        if self.compare_dir is None:
            return
        if len(self.frame) == 0:
            pytest.fail(
                "ppetrace: the benchmark recorded no spans, so there is nothing to compare. "
                "Is tracing disabled (ppetrace.configure(enabled=False)), or did the code "
                "call ppetrace.configure inside the benchmark?",
                pytrace=False,
            )
        baseline = self.compare_dir / file_name
        if not baseline.exists():
            warnings.warn(
                f"ppetrace: no baseline {baseline} for this benchmark; run once with "
                f"--ppetrace-save {self.compare_dir} to create it.",
                BaselineMissingWarning,
                stacklevel=3,
            )
            return
        base = exporters.read_chrome_trace(baseline)
        self.comparison = exporters.compare(
            base,
            self.frame,
            threshold=self.threshold,
            alpha=self.alpha,
            warmup_steps=warmup_steps,
        )
        if self.comparison.has_regression:
            pytest.fail(
                "ppetrace: significant regression against the baseline "
                f"{baseline}\n\n" + exporters.render_comparison_markdown(self.comparison),
                pytrace=False,
            )


@pytest.fixture
def ppetrace_benchmark(request: pytest.FixtureRequest) -> Benchmark:
    """A :class:`Benchmark` named after the test, set up from the ``--ppetrace-*`` options."""
    config = request.config
    save = config.getoption("--ppetrace-save")
    comp = config.getoption("--ppetrace-compare")
    return Benchmark(
        _safe_name(request.node.nodeid),
        save_dir=Path(save) if save else None,
        compare_dir=Path(comp) if comp else None,
        threshold=parse_threshold(config.getoption("--ppetrace-threshold")),
        alpha=float(config.getoption("--ppetrace-alpha")),
    )
