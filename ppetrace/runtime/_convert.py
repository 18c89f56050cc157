"""Moving batches: every tensor nested in a batch, each container keeping its type.

:func:`apply_to_tensors` is what ``BaseRuntime.convert_batch`` and ``map``
use. Tensors go through the given function (the runtime's ``move_tensor``);
an object with its own ``.to()`` method (a Hugging Face ``BatchEncoding``, a
PyG ``Data``, any ``Mapping`` subclass that moves itself) is moved by that
method, given the runtime's device; tuples, lists, dicts and namedtuples are
rebuilt as their own type; anything else passes through unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

__all__ = ["apply_to_tensors", "batch_size"]

_Tensor = torch.Tensor


def apply_to_tensors(obj: Any, fn: Callable[[torch.Tensor], Any], device: Any) -> Any:
    """Apply ``fn`` to every tensor nested in ``obj``; see the module docstring.

    ``device`` is what an object with its own ``.to()`` method is moved to.
    """
    if isinstance(obj, _Tensor):
        return fn(obj)
    kind = type(obj)
    if kind is dict:
        return {k: apply_to_tensors(v, fn, device) for k, v in obj.items()}
    if kind is list:
        return [apply_to_tensors(v, fn, device) for v in obj]
    if kind is tuple:
        return tuple(apply_to_tensors(v, fn, device) for v in obj)
    if kind in _LEAVES:
        return obj
    mover = getattr(obj, "to", None)
    if callable(mover):
        return mover(device)
    if isinstance(obj, (list, tuple)):
        items = [apply_to_tensors(v, fn, device) for v in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
            return kind(*items)
        return kind(items)
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, {k: apply_to_tensors(v, fn, device) for k, v in obj.items()})
    return obj


#: Types that hold no tensor: returned at once.
_LEAVES = frozenset({int, float, bool, str, bytes, type(None), complex})


def _rebuild_mapping(obj: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """``items`` as a mapping of ``obj``'s own type.

    A mutable mapping is copied and its values replaced (so a subclass whose
    constructor takes other arguments keeps its type and attributes); another
    mapping is rebuilt from the pairs, and becomes a plain ``dict`` only when
    its constructor does not take them.
    """
    if isinstance(obj, MutableMapping):
        new = copy.copy(obj)
        for key, value in items.items():
            new[key] = value
        return new
    kind: Any = type(obj)
    try:
        return kind(items)
    except TypeError:  # a constructor that takes something else
        return items


def batch_size(batch: Any) -> int | None:
    """The leading dimension of the batch's first tensor (a tensor, or a tuple, list or
    dict batch), else None."""
    first = batch
    kind = type(batch)
    if kind is tuple or kind is list:
        first = batch[0] if batch else None
    elif kind is dict:
        first = next(iter(batch.values()), None)
    if isinstance(first, _Tensor) and first.ndim:
        return int(first.shape[0])
    return None
