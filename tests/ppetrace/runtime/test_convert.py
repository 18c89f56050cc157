"""convert_batch keeps a batch's type: Mapping subclasses, and objects that move themselves."""

from __future__ import annotations

from collections import OrderedDict, UserDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ppetrace.runtime import BaseRuntime


class DoubleRuntime(BaseRuntime):
    """'Moves' a tensor by making it float64, so a moved tensor is visible."""

    def move_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.double()


class BatchEncoding(UserDict):  # type: ignore[type-arg]
    """Like Hugging Face's: a mapping with its own ``.to()`` that keeps its type."""

    def __init__(self, data: dict[str, Any], *, note: str) -> None:
        super().__init__(data)
        self.note = note
        self.moved_to: Any = None

    def to(self, device: Any) -> BatchEncoding:
        self.data = {k: v.to(torch.float16) for k, v in self.data.items()}
        self.moved_to = device
        return self


class Tagged(UserDict):  # type: ignore[type-arg]
    """A mutable mapping whose constructor takes more than the pairs."""

    def __init__(self, data: dict[str, Any], tag: str) -> None:
        super().__init__(data)
        self.tag = tag


class Frozen(Mapping[str, Any]):
    """A read-only mapping built from a dict."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def test_an_object_with_its_own_to_is_moved_by_it_and_keeps_its_type() -> None:
    runtime = DoubleRuntime("cpu", {})
    batch = BatchEncoding({"ids": torch.ones(2)}, note="kept")
    out = runtime.convert_batch(batch)
    assert type(out) is BatchEncoding and out.note == "kept"
    assert out.moved_to == torch.device("cpu") and out["ids"].dtype == torch.float16
    nested = runtime.convert_batch({"enc": BatchEncoding({"ids": torch.ones(1)}, note="n")})
    assert type(nested["enc"]) is BatchEncoding and nested["enc"]["ids"].dtype == torch.float16


def test_mapping_subclasses_keep_their_type_and_attributes() -> None:
    runtime = DoubleRuntime("cpu", {})
    tagged = runtime.convert_batch(Tagged({"x": torch.ones(1)}, tag="t"))
    assert type(tagged) is Tagged and tagged.tag == "t" and tagged["x"].dtype == torch.float64
    frozen = runtime.convert_batch(Frozen({"x": torch.ones(1)}))
    assert type(frozen) is Frozen and frozen["x"].dtype == torch.float64
    ordered = runtime.convert_batch(OrderedDict(b=torch.ones(1), a=torch.ones(1)))
    assert type(ordered) is OrderedDict and list(ordered) == ["b", "a"]
    assert ordered["a"].dtype == torch.float64
