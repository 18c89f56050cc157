"""String columns for the exporters' DataFrames.

Frames keep their strings in :data:`STRING_DTYPE` (pandas 3's ``str`` in
Python storage), built from dictionary-encoded columns (:class:`Coded`), so
that each distinct string is handled once rather than once per row.

A Python ``str`` may also hold a lone surrogate (``"\\ud800"``): a span name
or attribute built from undecodable bytes, say. pandas 3 stores inferred
``str`` columns in pyarrow whenever pyarrow is installed, and pyarrow takes
only valid UTF-8, so ``pd.DataFrame`` raises ``UnicodeEncodeError`` on such a
string. :func:`dataframe`, :func:`series` and :func:`records_frame` keep such
columns, and a column index holding such a name, as Python objects instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ._accel import SPEEDUPS as _speedups


def _string_dtype() -> Any:
    """The frames' string dtype: pandas' default ``str`` (pandas 3) in Python
    storage, or None where pandas keeps strings as objects (pandas 2)."""
    default = pd.Series(["a"]).dtype
    if not isinstance(default, pd.StringDtype):
        return None
    return pd.StringDtype("python", na_value=default.na_value)


#: ``str`` kept in Python objects, as pandas 3 itself does where pyarrow is not
#: installed. With pyarrow, pandas would copy every row's bytes into an arrow
#: buffer: for the million spans of benchmarks/bench_export.py, 113 MB for the
#: six string columns against 48 MB of pointers here, and about 0.6 s against
#: 0.2 s to build them (profiles on the development machine). Python storage
#: shares each distinct string, and holds any str (pyarrow refuses lone
#: surrogates). It compares equal to ``"str"``.
STRING_DTYPE: Any = _string_dtype()

_MIN_ENCODED = 1024  # shorter columns are not worth encoding


@dataclass(frozen=True, slots=True)
class Coded:
    """A dictionary-encoded column: ``uniques[codes[i]]``, missing where the code is -1."""

    codes: np.ndarray
    uniques: list[Any]

    @classmethod
    def of(cls, encoded: tuple[Any, list[Any]]) -> Coded:
        """From the C helpers' ``(int32 code bytes, uniques)``."""
        return cls(np.frombuffer(encoded[0], dtype=np.int32), encoded[1])

    def __len__(self) -> int:
        return len(self.codes)


def dataframe(columns: Mapping[Any, Any], index: pd.Index | None = None) -> pd.DataFrame:
    """``pd.DataFrame(columns, index=index, copy=False)``, with object arrays of
    strings as :data:`STRING_DTYPE` (see :func:`strings`), keeping any string.

    Where pandas refuses a string anyway (a lone surrogate in a column name, or
    in a column pandas converts to pyarrow), that column or the column index
    stays Python objects. The fallback runs only after such a refusal.
    """
    columns = {
        key: strings(values)
        if isinstance(values, np.ndarray) and values.dtype == object
        else values
        for key, values in columns.items()
    }
    try:
        return pd.DataFrame(columns, index=index, copy=False)
    except UnicodeEncodeError:
        pass
    kept = {i: series(values, index) for i, values in enumerate(columns.values())}
    frame = pd.DataFrame(kept, index=index, copy=False)
    try:
        frame.columns = pd.Index(list(columns))
    except UnicodeEncodeError:
        frame.columns = pd.Index(list(columns), dtype=object)
    return frame


def strings(values: Sequence[Any] | np.ndarray | Coded) -> Any:
    """A column that may hold strings, typed for a frame.

    All strings (None and NaN for missing): a :data:`STRING_DTYPE` array.
    Anything else, and every column on pandas 2: an object array, for pandas
    to infer as usual. Long columns are dictionary-encoded first (in C where
    ``exporters._speedups`` is built), so each distinct string is handled
    once rather than once per row.
    """
    if isinstance(values, Coded):
        return strings_from_codes(values.codes, values.uniques)
    if type(values) is list and len(values) >= _MIN_ENCODED and _speedups is not None:
        encoded = _speedups.dict_encode(values)
        if encoded is not None:
            return strings(Coded.of(encoded))
    objs = objects(values)
    if len(objs) >= _MIN_ENCODED:
        try:
            codes, uniques = pd.factorize(objs)  # missing values (None, NaN) get -1
        except TypeError:  # unhashable values, such as lists
            return objs
        if len(uniques) * 4 <= len(objs):
            return strings_from_codes(codes, list(uniques))
    return _typed(objs, set(map(type, objs)))


def strings_from_codes(codes: np.ndarray, uniques: list[Any]) -> Any:
    """:func:`strings` of ``uniques[codes[i]]`` for each i (missing where the code is -1).

    The distinct values are typed once and then spread over the rows (pandas checks
    each value it is given: per row, that took 1.5 s of the 12 s read of a 4-million
    span trace)."""
    table = _typed(objects([*uniques, None]), set(map(type, uniques)) | {type(None)})
    if isinstance(table, np.ndarray):
        return table[codes]  # code -1 takes the trailing None
    return table.take(codes)  # a pandas array: code -1 wraps around to the trailing None


def _typed(values: np.ndarray, types: set[type]) -> Any:
    """The object array as :data:`STRING_DTYPE` when its values (of ``types``) are
    strings and missing values (None, NaN) with at least one string, else as it is.

    pandas would turn any other value into its text (1.5 -> "1.5"); a column that
    mixes strings with other values stays objects, as pandas itself infers it.
    """
    if STRING_DTYPE is None or str not in types or not types <= {str, type(None), float}:
        return values
    if float in types and any(v == v for v in values if type(v) is float):
        return values  # a float that is not NaN: a value, not a missing one
    return pd.array(values, dtype=STRING_DTYPE)


def objects(values: Sequence[Any] | np.ndarray) -> np.ndarray:
    """A 1-d object array of the values (tuples stay elements, not rows)."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    return np.fromiter(values, dtype=object, count=len(values))


def series(values: Any, index: pd.Index | None = None) -> pd.Series:
    """``pd.Series(values, index=index, copy=False)``, as objects if pandas refuses a string."""
    try:
        return pd.Series(values, index=index, copy=False)
    except UnicodeEncodeError:
        return pd.Series(values, index=index, dtype=object, copy=False)


def records_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """``pd.DataFrame(rows)`` for records that share their keys, keeping any string."""
    if not rows:
        return pd.DataFrame()
    return dataframe({key: [row[key] for row in rows] for key in rows[0]})
