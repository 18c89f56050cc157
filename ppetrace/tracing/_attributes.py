"""Span attributes: the snapshot a span takes of its ``arg``, and OpenTelemetry's form.

:func:`_snapshot` is what ``trace(event_name, arg)`` records as attributes for
any ``arg`` its hot path (C or Python) does not copy itself;
:func:`_otel_attributes` turns a row's attributes into OpenTelemetry span
attributes for ``ReadableSpan``\\ s. Neither raises for a bad value: a value
that cannot be converted becomes ``"<unencodable: TypeName>"`` and costs
nothing else.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from exporters._spans import FrozenAttributes

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_PRIMITIVES = (str, bool, int, float)
_INT64 = (-(2**63), 2**63 - 1)


def _unencodable(v: Any) -> str:
    """The string that stands for a value that cannot be turned into an attribute."""
    return f"<unencodable: {type(v).__name__}>"


def _attr_value(v: Any) -> Any:
    """One attribute value as OpenTelemetry takes it: ``str``, ``bool``, an int within
    int64, ``float``, or a tuple of those; anything else becomes its ``str()``, and
    what cannot even be that becomes ``"<unencodable: TypeName>"``. Never raises."""
    try:
        if isinstance(v, (str, bool, float)):
            return v
        if isinstance(v, int):
            return v if _INT64[0] <= v <= _INT64[1] else str(v)
        if isinstance(v, (list, tuple)) and all(isinstance(x, _PRIMITIVES) for x in v):
            return tuple(_attr_value(x) for x in v)
        return str(v)
    except Exception:  # a str() that raises, an int too long for str(): this value only
        return _unencodable(v)


_AS_IS = frozenset({str, float, bool})


def _otel_attributes(attrs: Mapping[Any, Any]) -> dict[str, Any]:
    """A row's attributes as OpenTelemetry span attributes (None values dropped); a key or
    value that cannot be converted costs only itself (:func:`_attr_value`)."""
    if type(attrs) is dict or type(attrs) is FrozenAttributes:
        # the common case, checked first: str keys, values OpenTelemetry takes as they are
        low, high = _INT64
        for k, v in attrs.items():
            t = type(v)
            if (t in _AS_IS or (t is int and low <= v <= high)) and type(k) is str:
                continue
            break
        else:
            return dict(attrs)
    try:
        items = list(attrs.items())
    except Exception:
        return {"ppetrace.arg": _unencodable(attrs)}
    out: dict[str, Any] = {}
    for k, v in items:
        if v is None:
            continue
        try:
            key = k if type(k) is str else str(k)
        except Exception:
            key = _unencodable(k)
        out[key] = _attr_value(v)
    return out


def _reduce(v: Any) -> Any:
    if v is None or isinstance(v, _PRIMITIVES):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, _PRIMITIVES) for x in v):
        return tuple(v)
    return type(v).__qualname__


def _snapshot(arg: Any) -> Mapping[Any, Any]:
    """The attributes of a span whose ``arg`` is ``arg``, as they are now.

    The hot paths (C and Python) copy a dict of numbers and strings themselves
    and hand everything else here. A mapping becomes a new dict, a
    :class:`FrozenAttributes` is kept as it is, any other value becomes the
    attribute ``ppetrace.arg``. Values that are not numbers, strings or tuples
    of them (a tensor, a module) become their type name, so no reference to
    them is kept and nothing is formatted (formatting a CUDA tensor would
    synchronize the device). Never raises for a bad ``arg``: a mapping that
    cannot be read becomes ``{"ppetrace.arg": "<unencodable: TypeName>"}``.
    """
    if arg is None:
        return _EMPTY
    if type(arg) is FrozenAttributes:
        return arg
    try:
        if isinstance(arg, Mapping):
            return {k: _reduce(v) for k, v in arg.items()}
        return {"ppetrace.arg": _reduce(arg)}
    except Exception:
        return {"ppetrace.arg": _unencodable(arg)}


def _error_text(exc: BaseException) -> str:
    """``"Type: message"`` and the traceback; never raises."""
    name = type(exc).__qualname__
    try:
        head = f"{name}: {exc}"
    except Exception:
        head = f"{name}: <unprintable>"
    try:
        stack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception:
        stack = ""
    return head + "\n" + stack
