"""Where a training step's time goes: data wait, forward, backward, optimizer, other.

Each span inside a step belongs to one part: the part of the nearest span,
itself or an ancestor, whose name is in :data:`STEP_PARTS`. A part's time in a
step is the sum of the *self* times of its spans on the step's thread, so the
parts never count a nested span twice and add up to the step:

============================  ==========
event                         part
============================  ==========
``trainer.fetch_batch``       data wait
``module.train_step``         forward
``module.forward``            forward
``network.closure``           forward
``runtime.execute``           forward (a CodeBlock: its backward and optimizer step
                              run inside the one span, so they count as forward)
``trainer.backward``          backward
``trainer.optimizer_step``    optimizer
``trainer.step``              other
============================  ==========

``other`` is the rest of the step's wall time: the self time of
``trainer.step`` and of spans under no event above (callbacks, runtime hooks,
``runtime.convert_batch``), and the loop time between the previous step and
this step's fetch. Spans on other threads (DataLoader workers, autograd
threads) run alongside the step and are in no part.

A *summarised* step (a long run's step kept as per-event aggregates, see
:mod:`exporters._aggregates`) has the same parts, from its aggregates' self
times: an event named in :data:`STEP_PARTS` gives its self time to its part,
exactly as in a detailed step. The aggregates keep no ancestry, so an event
*not* named there counts as ``other`` even where, in the step, it ran inside
``module.forward`` (say): such a span's self time moves from that part to
``other`` in summarised steps. Events named in the table, and the step's wall
time and data wait, are exact.
"""

from __future__ import annotations

import numpy as np

from ._aggregates import Aggregates
from .frame import _inherit

__all__ = [
    "PART_COLUMNS",
    "PART_NAMES",
    "STEP_PARTS",
    "on_step_thread",
    "part_sums",
    "summarised_part_sums",
]

DATA_WAIT = "data wait"
FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"
OTHER = "other"

#: The parts of a step, in the order they are shown.
PART_NAMES: tuple[str, ...] = (DATA_WAIT, FORWARD, BACKWARD, OPTIMIZER, OTHER)
#: The per-step column of each part in :attr:`exporters.StepReport.steps`.
PART_COLUMNS: tuple[str, ...] = (
    "data_wait_ns",
    "forward_ns",
    "backward_ns",
    "optimizer_ns",
    "other_ns",
)

#: Event names that start a part; every span below one belongs to it too, up to
#: the next event named here (the module doc has the table).
STEP_PARTS: dict[str, str] = {
    "trainer.fetch_batch": DATA_WAIT,
    "module.train_step": FORWARD,
    "module.forward": FORWARD,
    "network.closure": FORWARD,
    "runtime.execute": FORWARD,
    "trainer.backward": BACKWARD,
    "trainer.optimizer_step": OPTIMIZER,
    "trainer.step": OTHER,
}


def on_step_thread(step_row: np.ndarray, pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """Whether each row is inside a step (``step_row >= 0``) on that step's thread."""
    inside = step_row >= 0
    at = np.where(inside, step_row, 0)
    return inside & (pid[at] == pid) & (tid[at] == tid)


def part_codes(coded: tuple[np.ndarray, np.ndarray], ppos: np.ndarray) -> np.ndarray:
    """Each row's part as an index into :data:`PART_NAMES` (``other`` when no span
    on its path up is named in :data:`STEP_PARTS`); ``coded``: the rows' names as
    ``pd.factorize`` gives them (``_steps.name_codes``)."""
    codes, uniques = coded
    index = {name: float(i) for i, name in enumerate(PART_NAMES)}
    own = np.array([index[STEP_PARTS[u]] if u in STEP_PARTS else np.nan for u in uniques])
    values = own[codes] if len(codes) else np.zeros(0)
    filled = _inherit(values, ppos)
    return np.where(np.isnan(filled), PART_NAMES.index(OTHER), filled).astype(np.int64)


def part_sums(
    coded: tuple[np.ndarray, np.ndarray],
    ppos: np.ndarray,
    step_row: np.ndarray,
    on_thread: np.ndarray,
    self_ns: np.ndarray,
    step_rows: np.ndarray,
) -> np.ndarray:
    """An (steps, parts) int64 array: per step (in ``step_rows`` order) the self time
    of its spans on its thread, summed per part of :data:`PART_NAMES` (``coded``: see
    :func:`part_codes`)."""
    out = np.zeros((len(step_rows), len(PART_NAMES)), dtype=np.int64)
    n = len(coded[0])
    if not len(step_rows) or not n:
        return out
    rows = np.flatnonzero(on_thread)
    index_of = np.full(n, -1, dtype=np.int64)
    index_of[step_rows] = np.arange(len(step_rows))
    codes = part_codes(coded, ppos)[rows]
    np.add.at(out, (index_of[step_row[rows]], codes), self_ns[rows])
    return out


def summarised_part_sums(aggregates: Aggregates, step_rows: np.ndarray, n: int) -> np.ndarray:
    """An (steps, parts) int64 array like :func:`part_sums`, from the aggregates of the
    summarised steps among ``step_rows`` (frame rows; ``n`` rows in the frame): each
    event's self time in its part, ``other`` for an event not in :data:`STEP_PARTS`."""
    out = np.zeros((len(step_rows), len(PART_NAMES)), dtype=np.int64)
    if not len(aggregates) or not len(step_rows):
        return out
    index_of = np.full(n, -1, dtype=np.int64)
    index_of[step_rows] = np.arange(len(step_rows))
    other = PART_NAMES.index(OTHER)
    part_of = np.array(
        [PART_NAMES.index(STEP_PARTS[e]) if e in STEP_PARTS else other for e in aggregates.names],
        dtype=np.int64,
    )
    at = index_of[aggregates.step_row]
    mine = at >= 0
    flat = at[mine] * len(PART_NAMES) + part_of[aggregates.event[mine]]
    sums = np.bincount(flat, weights=aggregates.self_ns[mine], minlength=out.size)
    return np.rint(sums).astype(np.int64).reshape(out.shape)
