"""The PyMarlin module interface: Stage, CallbackInterface and ModuleInterface."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ppetrace
from ppetrace import CallbackInterface, ModuleInterface, Stage
from ppetrace.training._callbacks import HOOKS, CallbackList, overrides


class Complete(ModuleInterface):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int) -> Any:
        return [torch.optim.SGD(self.parameters(), lr=0.1)], []

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> Any:
        return []

    def get_val_dataloaders(self, sampler: Any, batch_size: int) -> Any:
        return None

    def train_step(self, global_step: int, batch: Any, device: Any) -> Any:
        return ("train", global_step, batch, device)

    def val_step(self, global_step: int, batch: Any, device: Any) -> Any:
        return ("val", global_step, batch, device)


def test_stage_values_are_pymarlins_and_labels_are_the_span_attribute() -> None:
    assert [s.value for s in Stage] == [1, 2, 3]  # pymarlin/core/module_interface.py: Stage
    assert Stage(1) is Stage.TRAIN and Stage(3) is Stage.TEST
    assert [s.label for s in Stage] == ["train", "val", "test"]
    assert Stage("val") is Stage.VAL and Stage("Test") is Stage.TEST
    with pytest.raises(ValueError, match="4 is not a valid Stage"):
        Stage(4)


@pytest.mark.parametrize(
    "missing",
    [
        "get_optimizers_schedulers",
        "get_train_dataloader",
        "get_val_dataloaders",
        "train_step",
        "val_step",
    ],
)
def test_a_subclass_missing_an_abstract_method_fails_at_construction(missing: str) -> None:
    namespace = {k: v for k, v in vars(Complete).items() if k != missing}
    incomplete = type("Incomplete", (ModuleInterface,), namespace)
    with pytest.raises(TypeError, match=rf"Can't instantiate abstract class Incomplete.*{missing}"):
        incomplete()


def test_forward_dispatches_on_the_stage() -> None:
    m = Complete()
    assert m(Stage.TRAIN, 3, "b", "cpu") == ("train", 3, "b", "cpu")
    assert m(Stage.VAL, 4, "b", "cpu") == ("val", 4, "b", "cpu")
    # test_step defaults to val_step
    assert m(Stage.TEST, 5, "b", "cpu") == ("val", 5, "b", "cpu")
    with pytest.raises(AttributeError, match=r"Expected a ppetrace\.Stage .* but received 'train'"):
        m("train", 0, None, "cpu")


def test_get_state_and_update_state_round_trip() -> None:
    a, b = Complete(), Complete()
    assert not torch.equal(a.lin.weight, b.lin.weight)
    b.update_state(a.get_state())
    assert torch.equal(a.lin.weight, b.lin.weight)
    assert set(a.get_state()) == {"lin.weight", "lin.bias"}


def test_an_empty_state_is_skipped_as_pymarlin() -> None:
    module = Complete()
    before = module.lin.weight.detach().clone()
    module.update_state({})  # pymarlin/core/module_interface.py:254: `if state:`
    assert torch.equal(module.lin.weight, before)
    with pytest.raises(RuntimeError, match="Missing key"):
        module.update_state({"lin.weight": before})


def test_module_interface_is_a_callback_with_no_op_hooks() -> None:
    m = Complete()
    assert isinstance(m, CallbackInterface) and isinstance(m, torch.nn.Module)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    m.on_begin_train_epoch(0, 0)
    m.on_end_train_step(1, torch.ones(1))
    m.on_end_val_epoch(1, torch.ones(1), key="x")
    m.on_end_backward(1, torch.ones(()))
    m.on_end_train_epoch(1)
    m.on_end_train(1)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert m.get_test_dataloaders(torch.utils.data.SequentialSampler, 2) is None


def test_the_hook_list_is_derived_from_the_interface() -> None:
    assert HOOKS == (
        "on_begin_train_epoch",
        "on_end_train_step",
        "on_end_train_epoch",
        "on_end_backward",
        "on_end_val_epoch",
        "on_end_train",
    )


def test_only_overridden_hooks_are_dispatched() -> None:
    calls: list[Any] = []

    class One(CallbackInterface):
        def on_end_train(self, global_step: int) -> None:
            calls.append(("one", global_step))

    class Duck:  # not a CallbackInterface, but it has a hook
        def on_end_train(self, global_step: int) -> None:
            calls.append(("duck", global_step))

    assert overrides(One(), "on_end_train") and not overrides(One(), "on_end_backward")
    cbs = CallbackList([One(), CallbackInterface(), Duck()])
    assert cbs.wants("on_end_train") and not cbs.wants("on_end_backward")
    assert len(cbs.impl("on_end_train")) == 2
    cbs.call("on_end_train", {}, 7)
    cbs.call("on_end_backward", {}, 7, None)
    assert calls == [("one", 7), ("duck", 7)]


def test_public_names() -> None:
    assert ppetrace.ModuleInterface is ModuleInterface
    assert ppetrace.Stage is Stage
    assert ppetrace.CallbackInterface is CallbackInterface
