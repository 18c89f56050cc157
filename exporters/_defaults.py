"""The defaults of :func:`exporters.compare`, in a module that imports nothing, so the
CLI and the pytest plugin can show them without loading pandas or SciPy.

The figures behind them are in the README ("How `compare` decides") and come
from ``benchmarks/bench_compare.py``.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_GATE",
    "DEFAULT_MIN_EFFECT",
    "DEFAULT_MIN_EFFECT_NS",
    "DEFAULT_NOISE_FLOOR",
    "DEFAULT_THRESHOLD",
]

#: The run-to-run coefficient of variation of a run's median step time assumed at least:
#: what one run per side is judged against. 5%: the smallest floor at which identical
#: runs gave no false alarm on this project's shared 2-core machine (45 A/A pairs,
#: measured CV 6.1%, ``benchmarks/bench_compare.py``; README "How compare decides").
DEFAULT_NOISE_FLOOR = 0.05
#: The smallest relative change that counts.
DEFAULT_THRESHOLD = 0.03
#: The significance level, after Holm's correction over the gated events.
DEFAULT_ALPHA = 0.01
#: The events that can fail a comparison by default: the step's own span, and the wall
#: time per step (``step.wall``: the data wait and the time between steps too).
DEFAULT_GATE = ("trainer.step", "step.wall")
#: The minimum absolute effect, as a fraction of the base's median step time ...
DEFAULT_MIN_EFFECT = 0.01
#: ... and never less than this many nanoseconds.
DEFAULT_MIN_EFFECT_NS = 1_000
