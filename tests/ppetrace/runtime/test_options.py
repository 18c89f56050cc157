"""Runtime options: a subclass's own options, typos still caught, and ppe's ``config`` name."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

import ppetrace
from ppetrace.runtime import BaseRuntime, PyTorchRuntime, runtime_of


class PrefetchRuntime(PyTorchRuntime):
    """A ppe user's subclass reading an option of its own, without declaring it."""

    def __init__(self, device_spec: Any, options: Any) -> None:
        super().__init__(device_spec, options)
        self.prefetch = self.options.get("prefetch", 1)


class DeclaredRuntime(PyTorchRuntime):
    """A subclass that declares its options: checked strictly."""

    option_names: ClassVar[frozenset[str] | None] = frozenset({"prefetch"})


def test_a_subclass_may_take_options_of_its_own() -> None:
    runtime = PrefetchRuntime("cpu", {"prefetch": 4, "autocast": True})
    assert runtime.prefetch == 4 and runtime.autocast_enabled
    assert DeclaredRuntime("cpu", {"prefetch": 2, "grad_scaler": None}).options["prefetch"] == 2


def test_typos_of_the_base_options_are_still_caught() -> None:
    with pytest.raises(
        ValueError,
        match=r"^Unknown option 'autocats' for PrefetchRuntime; accepted: autocast, grad_scaler\. "
        r"Did you mean 'autocast'\? Check the spelling",
    ):
        PrefetchRuntime("cpu", {"autocats": True})
    with pytest.raises(
        ValueError, match=r"Unknown option 'grad_scalar' .* Did you mean 'grad_scaler'"
    ):
        PrefetchRuntime("cpu", {"grad_scalar": None})
    with pytest.raises(ValueError, match=r"^Unknown option 'autocats' for PyTorchRuntime"):
        PyTorchRuntime("cpu", {"autocats": True})


def test_a_declaring_subclass_rejects_unknown_keys_and_accepts_the_bases() -> None:
    with pytest.raises(
        ValueError,
        match=r"^Unknown option 'workers' for DeclaredRuntime; accepted: autocast, grad_scaler, "
        r"prefetch\. Check the spelling .* declare a subclass's own options in its "
        r"option_names class attribute\.$",
    ):
        DeclaredRuntime("cpu", {"workers": 2})


def test_a_base_runtime_subclass_accepts_any_option() -> None:
    class Custom(BaseRuntime):
        pass

    assert Custom("cpu", {"anything": 1}).options == {"anything": 1}


def test_to_takes_ppes_deprecated_config_name_for_options() -> None:
    model = ppetrace.to(
        torch.nn.Linear(2, 2), "cpu", runtime_class=PrefetchRuntime, config={"prefetch": 3}
    )
    runtime = runtime_of(model)
    assert isinstance(runtime, PrefetchRuntime) and runtime.prefetch == 3
    with pytest.raises(
        ValueError,
        match=r"^Expected options or config \(its deprecated name\), but received both\.",
    ):
        ppetrace.to(torch.nn.Linear(2, 2), "cpu", options={}, config={})
