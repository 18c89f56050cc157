"""DataFrames whose strings need not be valid UTF-8.

A Python ``str`` may hold a lone surrogate (``"\\ud800"``): a span name or
attribute built from undecodable bytes, say. pandas 3 stores ``str`` columns in
pyarrow whenever pyarrow is installed, and pyarrow takes only valid UTF-8, so
``pd.DataFrame`` raises ``UnicodeEncodeError`` on such a string. Here those
columns, and a column index holding such a name, stay Python objects instead;
every other column keeps the dtype pandas would give it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd


def dataframe(columns: Mapping[Any, Any], index: pd.Index | None = None) -> pd.DataFrame:
    """``pd.DataFrame(columns, index=index, copy=False)``, keeping any string.

    The fallback runs only after pandas refused a string, so it costs nothing
    on the usual path.
    """
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
