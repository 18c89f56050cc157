"""A pytorch-pfn-extras program ported to ppetrace: a custom runtime and a two-loss CodeBlock.

The program below is written once, as a ppe user writes it, and run twice: on
the real ``pytorch_pfn_extras`` and on ppetrace through the same names
(``to``, ``runtime.PyTorchRuntime``, ``runtime.runtime_registry``, the
CodeBlock ``forward``/``update_parameters``). The parameters after N steps
must be equal bit for bit. The rules it relies on, in ppe 0.9
(github.com/pfnet/pytorch-pfn-extras at 8999d94):

- ``pytorch_pfn_extras/runtime/_runtime.py:459-479`` (``PyTorchRuntime.execute``):
  without ``backprop_from``, every scalar floating-point output with a
  gradient is back-propagated, one ``backward()`` each;
- ``:451-452`` and ``:490-491``: ``zero_grad`` before, ``step`` after, per optimizer;
- ``:345-366``: ``PyTorchRuntime`` reads the options it knows and ignores the
  rest, so a subclass adds its own (``prefetch``);
- ``pytorch_pfn_extras/runtime/_registry.py:27``: an unregistered device type
  falls back to ``PyTorchRuntime``;
- ``pytorch_pfn_extras/runtime/_to.py:48-53``: ``config`` is the deprecated
  name of ``options``;
- ``pytorch_pfn_extras/runtime/_runtime.py:514-527``: ``PyTorchRuntime.trace``
  opens a ``record_function`` range.

ppe is optional here (the ``test`` extra installs it): without it the ppe
side is skipped and ppetrace is checked against the same numbers written out.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ppetrace

try:
    import pytorch_pfn_extras as ppe
except ImportError:  # pragma: no cover - the test extra installs it
    ppe = None

needs_ppe = pytest.mark.skipif(ppe is None, reason="pytorch-pfn-extras is not installed")
STEPS = 5


def libraries() -> dict[str, types.SimpleNamespace]:
    """The names the program uses, from each library (ppe keeps the CodeBlock API in
    ``ppe.handler``; ppetrace exports it at the top)."""
    libs = {
        "ppetrace": types.SimpleNamespace(
            to=ppetrace.to,
            runtime=ppetrace.runtime,
            forward=ppetrace.forward,
            update_parameters=ppetrace.update_parameters,
        )
    }
    if ppe is not None:
        libs["ppe"] = types.SimpleNamespace(
            to=ppe.to,
            runtime=ppe.runtime,
            forward=ppe.handler.forward,
            update_parameters=ppe.handler.update_parameters,
        )
    return libs


# -- the user's program ------------------------------------------------------------


class TwoHeads(torch.nn.Module):
    """A regressor and a classifier trained together; the forward returns both losses, as a
    ppe user writes. (Their graphs are separate: ppe's one ``backward()`` per loss frees the
    graph after the first, so losses sharing a body fail on ppe; ppetrace keeps the graph
    until the last loss, see the last test.)"""

    def __init__(self) -> None:
        super().__init__()
        self.reg = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )
        self.cls = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor, c: torch.Tensor) -> dict[str, Any]:
        pred = self.reg(x)
        return {
            "pred": pred,
            "mse": torch.nn.functional.mse_loss(pred, y),
            "ce": torch.nn.functional.cross_entropy(self.cls(x), c),
        }


def make_runtime_class(lib: types.SimpleNamespace) -> type:
    """A ppe user's runtime for a simulated device: moves to the CPU, counts the moves, and
    takes an option of its own."""

    class SimDeviceRuntime(lib.runtime.PyTorchRuntime):  # type: ignore[misc,name-defined]
        def __init__(self, device_spec: Any, options: dict[str, Any]) -> None:
            super().__init__(device_spec, options)
            self.prefetch = options.get("prefetch", 1)
            self.moves = 0

        def move_module(self, module: torch.nn.Module) -> torch.nn.Module:
            return module.to("cpu")

        def move_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
            self.moves += 1
            return tensor.to("cpu")

    return SimDeviceRuntime


def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        {
            "x": torch.randn(8, 6, generator=g),
            "y": torch.randn(8, 1, generator=g),
            "c": torch.randint(0, 3, (8,), generator=g),
        }
        for _ in range(STEPS)
    ]


def run_program(lib: types.SimpleNamespace) -> tuple[list[torch.Tensor], Any]:
    """Train ``TwoHeads`` for STEPS steps on the "simdev" device; returns the parameters and
    the runtime."""
    torch.manual_seed(0)
    model = lib.to(TwoHeads(), "simdev", config={"prefetch": 2})
    runtime = model._ppe_runtime
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = lib.update_parameters(lib.forward(model), [optimizer])
    for batch in batches():
        step(runtime.convert_batch(batch))
    return [p.detach().clone() for p in model.parameters()], runtime


@pytest.fixture
def simdev() -> Iterator[None]:
    for lib in libraries().values():
        lib.runtime.runtime_registry.register("simdev", make_runtime_class(lib))
    yield
    ppetrace.runtime_registry.unregister("simdev")
    if ppe is not None:
        del ppe.runtime.runtime_registry._runtimes["simdev"]


# -- the comparison ----------------------------------------------------------------


@needs_ppe
def test_the_ported_program_trains_exactly_as_on_ppe(simdev: None) -> None:
    ours, our_runtime = run_program(libraries()["ppetrace"])
    theirs, their_runtime = run_program(libraries()["ppe"])
    for got, want in zip(ours, theirs, strict=True):
        assert torch.equal(got, want)
    assert our_runtime.prefetch == their_runtime.prefetch == 2  # the subclass's own option
    assert our_runtime.moves == their_runtime.moves == 3 * STEPS


def test_both_losses_back_propagate_as_on_ppe() -> None:
    """The issue's two-loss block: ppe gives (a, b) = (-2, -2) after one step (checked
    against ppe below when it is installed)."""

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor(1.0))
            self.b = torch.nn.Parameter(torch.tensor(1.0))

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"la": 2 * self.a * x.sum(), "lb": 2 * self.b * x.sum()}

    results = {}
    for name, lib in libraries().items():
        model = lib.to(Two(), "cpu")
        optimizer = torch.optim.SGD(model.parameters(), lr=1.5)
        lib.update_parameters(lib.forward(model), [optimizer])({"x": torch.ones(1)})
        results[name] = (model.a.item(), model.b.item())
    assert results["ppetrace"] == (-2.0, -2.0)
    if ppe is not None:
        assert results["ppe"] == results["ppetrace"]


def test_an_unregistered_device_type_resolves_to_pytorch_runtime_on_both() -> None:
    for lib in libraries().values():
        registry = lib.runtime.runtime_registry
        assert registry.get_runtime_class_for_device_spec("xyz:1") is lib.runtime.PyTorchRuntime


@needs_ppe
def test_runtime_events_are_record_function_ranges_on_both(simdev: None) -> None:
    names = {}
    for name, lib in libraries().items():
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with (
            torch.profiler.profile(activities=cpu) as prof,
            lib.runtime.PyTorchRuntime.trace("user.event", None),
        ):
            torch.ones(2).sum()
        names[name] = {e.name for e in prof.events()}
    assert "user.event" in names["ppe"] and "user.event" in names["ppetrace"]


class SharedBody(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(6, 8)
        self.reg = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, c: torch.Tensor) -> dict[str, Any]:
        pred = self.reg(torch.tanh(self.body(x)))
        return {"mse": torch.nn.functional.mse_loss(pred, y), "l1": (pred - y).abs().mean()}


def test_losses_sharing_a_graph_work_on_ppetrace_where_ppe_fails() -> None:
    """A deliberate difference (README, "Porting"): ppetrace retains the graph between the
    losses, so their gradients add up where ppe raises."""
    (batch, *_) = batches()
    grads = {}
    for name, lib in libraries().items():
        torch.manual_seed(0)
        model = lib.to(SharedBody(), "cpu")
        block = lib.update_parameters(lib.forward(model), [])
        if name == "ppe":
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                block(batch)
            continue
        block(batch)
        grads[name] = [p.grad.clone() for p in model.parameters()]
    torch.manual_seed(0)
    reference = SharedBody()
    out = reference(**batch)
    (out["mse"] + out["l1"]).backward()
    for got, want in zip(grads["ppetrace"], [p.grad for p in reference.parameters()], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
