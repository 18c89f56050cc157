"""The hook-level aggregates of summarised steps, read back from a frame.

A long run keeps full detail for some steps only; for the others (*summarised*
steps) the Chrome trace writer folds the spans inside the step into per-event
aggregates written on the step's ``trainer.step`` row (issue 19's contract):

- ``ppetrace.hooks``: one entry per name of the names list in force, in its
  order, separated by ``;``: empty when the event did not occur in the step,
  else ``total_ns``, ``total_ns/self_ns`` or ``total_ns/self_ns/count``
  (``self_ns`` defaults to ``total_ns``, ``count`` to 1); trailing empty
  entries may be left out. A ``trainer.step`` row that has it (even ``""``) is
  a summarised step; one without it had full detail.
- ``ppetrace.hook_names``: the names list, ``;``-separated, in force for its
  row and the later step rows of the same ``(pid, tid)`` in time order, until
  the next one.

:func:`parse_aggregates` reads them for a whole frame at once (a run's parts
read as one frame are one run): the entries of every row are parsed together
in one pass in C (``_speedups.parse_hooks``), or, without it, as one byte array
with numpy (:func:`_parse_entries`, the reference), so a million summarised steps
take well under a second. A summarised step whose names list is not in the frame (a later part
read alone) or whose entries cannot be read is not guessed: it is listed in
:attr:`Aggregates.unknown` and contributes no aggregate.

The aggregates carry no ancestry: which span was inside which is lost. Per
event they give exactly the count, the total (inclusive) time and the self
time (the total less the direct children's durations) of its spans in the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ._accel import SPEEDUPS as _speedups
from ._pandas import series

__all__ = ["HOOKS", "HOOK_NAMES", "Aggregates", "parse_aggregates"]

#: The ``trainer.step`` attribute with a summarised step's aggregates.
HOOKS = "ppetrace.hooks"
#: The ``trainer.step`` attribute with the names list of the aggregates.
HOOK_NAMES = "ppetrace.hook_names"
_STEP = "trainer.step"
_MAX_DIGITS = 18  # any 18-digit number fits in int64
# the byte classes of ppetrace.hooks: digit, minus, then the delimiters and the rest
_C_DIGIT, _C_MINUS, _C_SEMI, _C_SLASH, _C_NL, _C_ODD = range(6)
_CLASS = np.full(256, _C_ODD, dtype=np.uint8)
_CLASS[ord("0") : ord("9") + 1] = _C_DIGIT
_CLASS[ord("-")], _CLASS[ord(";")], _CLASS[ord("/")], _CLASS[ord("\n")] = (
    _C_MINUS,
    _C_SEMI,
    _C_SLASH,
    _C_NL,
)
_ZERO, _MINUS = ord("0"), ord("-")


@dataclass(frozen=True)
class Aggregates:
    """The aggregates of a frame's summarised steps, one entry per (step, event).

    ``step_row`` (the frame row of the step's ``trainer.step``), ``event`` (an
    index into ``names``), ``count``, ``total_ns`` and ``self_ns`` are aligned
    int64 arrays. ``summarised`` lists the frame rows of every summarised
    ``trainer.step`` (sorted), ``unknown`` those among them whose aggregates
    cannot be read (no names list in force, or entries that do not parse).
    """

    step_row: np.ndarray
    event: np.ndarray
    count: np.ndarray
    total_ns: np.ndarray
    self_ns: np.ndarray
    names: np.ndarray
    summarised: np.ndarray
    unknown: np.ndarray

    def __len__(self) -> int:
        return len(self.step_row)

    def frame(self) -> pd.DataFrame:
        """The tidy table: ``step_row, event, count, total_ns, self_ns``, one row per
        (summarised step, event that occurred in it)."""
        return pd.DataFrame(
            {
                "step_row": self.step_row,
                "event": series(self.names[self.event]) if len(self.names) else series([]),
                "count": self.count,
                "total_ns": self.total_ns,
                "self_ns": self.self_ns,
            }
        )

    def only(self, keep: np.ndarray) -> Aggregates:
        """The entries whose ``step_row`` is marked in ``keep`` (a bool array over the frame's
        rows); ``summarised`` and ``unknown`` keep their marked rows too."""
        sel = keep[self.step_row]
        return Aggregates(
            self.step_row[sel],
            self.event[sel],
            self.count[sel],
            self.total_ns[sel],
            self.self_ns[sel],
            self.names,
            self.summarised[keep[self.summarised]],
            self.unknown[keep[self.unknown]],
        )

    def per_step(self, n: int) -> np.ndarray:
        """Per frame row (``n`` rows), the summed self time of the aggregates of its step
        (0 for rows that are not summarised steps)."""
        # float sums are exact here: one step's time is far below 2**53 ns
        sums = np.bincount(self.step_row, weights=self.self_ns, minlength=n)
        return np.rint(sums).astype(np.int64)


_EMPTY = np.zeros(0, dtype=np.int64)


def no_aggregates() -> Aggregates:
    """The aggregates of a frame without summarised steps."""
    return Aggregates(
        _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, np.zeros(0, dtype=object), _EMPTY, _EMPTY
    )


def parse_aggregates(
    frame: pd.DataFrame, coded: tuple[np.ndarray, np.ndarray] | None = None
) -> Aggregates:
    """The aggregates of every summarised step of ``frame`` (see the module doc);
    ``coded``: the frame's names as ``pd.factorize`` gives them, when the caller has them."""
    if HOOKS not in frame.columns or not len(frame):
        return no_aggregates()
    hooks_col = frame[HOOKS]
    if coded is None:
        is_step = frame["name"].to_numpy(dtype=object) == _STEP
    else:
        codes, uniques = coded
        at = [i for i, name in enumerate(uniques.tolist()) if name == _STEP]
        is_step = codes == at[0] if at else np.zeros(len(frame), dtype=bool)
    steps = np.flatnonzero(is_step)
    of_steps = hooks_col.iloc[steps]
    has = of_steps.notna().to_numpy(dtype=bool)
    rows = steps[has]
    if not len(rows):
        return no_aggregates()
    hooks = of_steps.to_numpy(dtype=object)[has]
    lists, list_code = _names_in_force(frame, rows, is_step)
    if isinstance(hooks_col.dtype, pd.StringDtype):  # only strings (and missing)
        bad = np.zeros(len(hooks), dtype=bool)
    else:
        bad = np.fromiter((type(h) is not str for h in hooks), dtype=bool, count=len(hooks))
    if bad.any():
        hooks = np.where(bad, "", hooks)
    parsed = _speedups.parse_hooks(hooks.tolist()) if _speedups is not None else None
    if parsed is not None:  # the C twin of _parse_entries (a malformed row's entries left out)
        entry_row, entry_pos, total, own, count = (np.frombuffer(c, np.int64) for c in parsed[:5])
        malformed = np.frombuffer(parsed[5], dtype=np.bool_)
    else:
        entry_row, entry_pos, total, own, count, malformed = _parse_entries(hooks.tolist())
    bad |= malformed
    # each entry's event: its position in the names list of its row
    lengths = np.array([len(x) for x in lists], dtype=np.int64)
    code = list_code[entry_row]
    known = code >= 0
    length = np.append(lengths, 0)[code]  # code -1 (no list): length 0
    too_far = entry_pos >= length
    bad[entry_row[too_far]] = True
    vocab, flat = _vocabulary(lists)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    keep = ~bad[entry_row] & ~too_far
    keep &= known
    unknown = bad | (list_code < 0)
    sel = np.flatnonzero(keep)
    event = flat[offsets[code[sel]] + entry_pos[sel]] if len(sel) else _EMPTY
    return Aggregates(
        rows[entry_row[sel]],
        event.astype(np.int64, copy=False),
        count[sel],
        total[sel],
        own[sel],
        vocab,
        rows,
        rows[unknown],
    )


def _names_in_force(
    frame: pd.DataFrame, rows: np.ndarray, is_step: np.ndarray
) -> tuple[list[list[str]], np.ndarray]:
    """The distinct names lists, and for each summarised row the index of the list in
    force for it (-1: none), following each ``(pid, tid)``'s step rows in time order."""
    if HOOK_NAMES not in frame.columns:
        return [], np.full(len(rows), -1, dtype=np.int64)
    names_col = frame[HOOK_NAMES]
    steps = np.flatnonzero(is_step)
    carriers = steps[names_col.iloc[steps].notna().to_numpy(dtype=bool)]
    # the rows that matter: the summarised steps and the rows that set a list
    mark = np.zeros(len(frame), dtype=bool)
    mark[rows] = True
    mark[carriers] = True
    both = np.flatnonzero(mark)
    pid = frame["pid"].to_numpy(np.int64)[both]
    tid = frame["tid"].to_numpy(np.int64)[both]
    start = frame["start_ns"].to_numpy(np.int64)[both]
    order = np.lexsort((both, start, tid, pid))
    # the lists' codes (-1 where a row sets none; a value that is no str sets none)
    values = names_col.to_numpy(dtype=object)[carriers]
    ok = np.fromiter((type(v) is str for v in values), dtype=bool, count=len(values))
    list_codes, uniques = pd.factorize(values[ok])
    code_of = np.full(len(both), -1, dtype=np.int64)
    code_of[np.searchsorted(both, carriers[ok])] = list_codes
    codes = code_of[order]
    # forward fill within each (pid, tid)
    p, t = pid[order], tid[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (p[1:] != p[:-1]) | (t[1:] != t[:-1])
    idx = np.where(codes >= 0, np.arange(len(codes)), -1)
    group_start = np.maximum.accumulate(np.where(new, np.arange(len(codes)), 0))
    last = np.maximum.accumulate(idx)
    filled = np.where(last >= group_start, codes[np.maximum(last, 0)], -1)
    in_force = np.empty(len(both), dtype=np.int64)
    in_force[order] = filled
    at = np.searchsorted(both, rows)
    lists = [[_unescape(x) for x in str(u).split(";")] for u in uniques]
    return lists, in_force[at]


def _unescape(name: str) -> str:
    """A name of ``ppetrace.hook_names`` as it was: ``%3B`` is ``;``, ``%25`` is ``%``."""
    if "%" not in name:
        return name
    return name.replace("%3B", ";").replace("%3b", ";").replace("%25", "%")


def _vocabulary(lists: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """The distinct event names of all lists, and each list entry's index among them
    (the lists concatenated)."""
    flat = [name for names in lists for name in names]
    if not flat:
        return np.zeros(0, dtype=object), _EMPTY
    codes, uniques = pd.factorize(np.array(flat, dtype=object))
    return np.asarray(uniques, dtype=object), np.asarray(codes, dtype=np.int64)


def _parse_entries(
    hooks: list[str],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Parse every row's ``ppetrace.hooks`` at once.

    Returns, per non-empty entry: its row, its position in the row, total, self and
    count; and per row whether it is malformed (its entries are then not used).
    """
    m = len(hooks)
    if any("\n" in h for h in hooks):  # a row apart: an odd character marks it malformed
        hooks = ["?" if "\n" in h else h for h in hooks]
    text = "\n".join(hooks) + "\n"
    try:
        raw = text.encode("ascii")
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "replace")  # any non-ASCII byte marks its row malformed
    b = np.frombuffer(raw, dtype=np.uint8)
    # each token ends at a byte that is neither a digit nor a minus sign
    minus = np.flatnonzero(b == _MINUS)
    delim = np.flatnonzero((b < _ZERO) | (b > _ZERO + 9))
    if len(minus):
        delim = delim[b[delim] != _MINUS]
    term = _CLASS[b[delim]]
    starts = np.empty(len(delim), dtype=np.int64)
    starts[0] = 0
    starts[1:] = delim[:-1] + 1
    length = delim - starts
    row_end = term == _C_NL
    entry_end = row_end | (term == _C_SEMI)
    odd = term == _C_ODD  # a character that has no place here
    # each token's row, entry (over all rows), and slot inside its entry
    row = np.cumsum(row_end) - row_end
    entry = np.cumsum(entry_end) - entry_end
    tok = np.arange(len(delim))
    first_of_entry = np.flatnonzero(np.concatenate([[True], entry_end[:-1]]))
    slot = tok - first_of_entry[entry]
    n_entries = len(first_of_entry)
    row_of_entry = row[first_of_entry]
    row_first_entry = np.flatnonzero(np.concatenate([[True], row_end[:-1]]))
    pos = np.arange(n_entries) - entry[row_first_entry][row_of_entry]
    # a minus sign (a self time can be negative: children that overlap their parent)
    # only first in a token, before a digit
    neg = np.zeros(len(delim), dtype=bool)
    bad_sign = neg
    first, digits = starts, length
    if len(minus):
        some = length > 0
        neg[some] = b[starts[some]] == _MINUS
        holder = np.searchsorted(delim, minus)
        bad_sign = neg & (length < 2)
        bad_sign[holder[minus != starts[holder]]] = True  # a minus inside a number
        first, digits = starts + neg, length - neg
    value = _numbers(b, first, np.minimum(digits, _MAX_DIGITS))
    value = np.where(neg, -value, value)
    width = np.bincount(entry, minlength=n_entries)  # tokens per entry
    bad_tok = (
        odd
        | bad_sign
        | (digits > _MAX_DIGITS)
        | (slot > 2)
        | ((length == 0) & (width[entry] > 1))  # an empty number inside an entry
    )
    present = length[first_of_entry] > 0
    total = value[first_of_entry]
    own = total.copy()
    count = np.ones(n_entries, dtype=np.int64)
    s1 = slot == 1
    own[entry[s1]] = value[s1]
    s2 = slot == 2
    count[entry[s2]] = value[s2]
    bad_entry = np.zeros(n_entries, dtype=bool)
    bad_entry[entry[bad_tok]] = True
    bad_entry |= present & ((count < 1) | (total < 0) | (slot[first_of_entry] != 0))
    malformed = np.zeros(m, dtype=bool)
    malformed[row_of_entry[bad_entry]] = True
    keep = np.flatnonzero(present)
    return row_of_entry[keep], pos[keep], total[keep], own[keep], count[keep], malformed


def _numbers(b: np.ndarray, first: np.ndarray, digits: np.ndarray) -> np.ndarray:
    """The decimal numbers of ``digits`` digits at ``first`` in the bytes ``b`` (0 for no
    digit), one batch per length: a (tokens, length) block of bytes, a column at a time."""
    value = np.zeros(len(first), dtype=np.int64)
    for width in np.flatnonzero(np.bincount(digits)):
        if width == 0:
            continue
        at = np.flatnonzero(digits == width)
        block = b[first[at][:, None] + np.arange(width)]
        v = block[:, 0].astype(np.int64)
        for j in range(1, width):
            v *= 10
            v += block[:, j]
        value[at] = v - _ZERO * ((10**width - 1) // 9)  # the ASCII zeros of every digit
    return value
