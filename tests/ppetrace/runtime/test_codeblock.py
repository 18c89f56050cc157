"""The CodeBlock API: forward, update_parameters and map, executed by the runtime."""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import ppetrace
from ppetrace.runtime import BaseRuntime, CodeBlock, PyTorchRuntime, forward, map, update_parameters


class Regressor(torch.nn.Module):
    """Returns a dict of outputs, as CodeBlocks expect."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        pred = self.net(x)
        return {"pred": pred, "loss": F.mse_loss(pred, y), "l1": F.l1_loss(pred, y)}


def batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(5, 3, generator=gen), "y": torch.randn(5, 1, generator=gen)}
        for _ in range(n)
    ]


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def model_pair(seed: int = 0) -> tuple[Regressor, Regressor]:
    torch.manual_seed(seed)
    model = Regressor()
    return model, copy.deepcopy(model)


def test_update_parameters_step_equals_a_hand_written_step() -> None:
    model, reference = model_pair()
    model = ppetrace.to(model, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    before = params(model)
    step = update_parameters(model, opt)
    for batch in batches(3):
        out = step(batch)
        ref_opt.zero_grad()
        ref_out = reference(**batch)
        ref_out["loss"].backward(retain_graph=True)  # both scalar losses, as ppe
        ref_out["l1"].backward()
        ref_opt.step()
        assert torch.equal(out["loss"].detach(), ref_out["loss"].detach())
    after = params(model)
    assert all(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
    for got, want in zip(after, params(reference), strict=True):
        assert torch.equal(got, want)


def test_backprop_from_selects_the_loss() -> None:
    model, reference = model_pair(1)
    model = ppetrace.to(model, "cpu")
    (batch,) = batches(1)
    update_parameters(model, [], backprop_from="l1")(batch)
    reference(**batch)["l1"].backward()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert got.grad is not None and want.grad is not None
        assert torch.equal(got.grad, want.grad)


def test_default_back_propagates_every_scalar_loss_as_ppe() -> None:
    model, reference = model_pair(2)
    model = ppetrace.to(model, "cpu")
    (batch,) = batches(1)
    update_parameters(model, [])(batch)  # "pred" is not a scalar: "loss" and "l1" are
    ref_out = reference(**batch)
    ref_out["loss"].backward(retain_graph=True)  # ppe: one backward() per loss, in dict order
    ref_out["l1"].backward()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert got.grad is not None and want.grad is not None
        assert torch.equal(got.grad, want.grad)


def test_a_module_returning_a_scalar_tensor_back_propagates_from_it() -> None:
    torch.manual_seed(3)
    model = ppetrace.to(torch.nn.Linear(3, 1), "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = params(model)

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x).pow(2).mean()

    loss_module = ppetrace.to(Loss(), "cpu")
    update_parameters(loss_module, opt)(torch.ones(4, 3))
    assert all(not torch.equal(b, a) for b, a in zip(before, params(model), strict=True))


def test_missing_loss_and_wrong_backprop_from_are_explained() -> None:
    model = ppetrace.to(Regressor(), "cpu")
    (batch,) = batches(1)
    with pytest.raises(
        ValueError,
        match=r"^Expected the outputs of Regressor to contain backprop_from='los', but received "
        r"pred, loss, l1\.",
    ):
        update_parameters(model, [], backprop_from="los")(batch)
    with pytest.raises(ValueError, match=r"Expected output 'pred' of Regressor to be a scalar"):
        update_parameters(model, [], backprop_from="pred")(batch)
    linear = ppetrace.to(torch.nn.Linear(3, 2), "cpu")
    with pytest.raises(
        ValueError,
        match=r"^Expected the outputs of Linear to contain a scalar floating-point tensor with a "
        r"gradient to back-propagate from, but received a torch.float32 tensor of shape \(5, 2\)",
    ):
        update_parameters(linear, [])(batch["x"])


def test_backprop_to_stops_gradients_at_the_named_values() -> None:
    model = ppetrace.to(Regressor(), "cpu")
    (batch,) = batches(1)
    x = batch["x"].requires_grad_(True)
    update_parameters(model, [], backprop_to={"x"})({"x": x, "y": batch["y"]})
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="backprop_to key 'z' in the block's outputs or input"):
        update_parameters(model, [], backprop_to={"z"})(batch)
    with pytest.raises(ValueError, match="backprop_to value 'y' to be a tensor that requires grad"):
        update_parameters(model, [], backprop_to={"y"})(batches(1)[0])
    with pytest.raises(TypeError, match=r"Expected a set of names for backprop_to.*Pass \{'x'\}"):
        update_parameters(model, [], backprop_to="x")


def test_forward_block_runs_the_module_without_touching_parameters() -> None:
    model = ppetrace.to(Regressor(), "cpu")
    (batch,) = batches(1)
    out = forward(model)(batch)
    assert torch.equal(out["loss"], model(**batch)["loss"])
    assert all(p.grad is None for p in model.parameters())


def test_codeblock_batch_calling_convention() -> None:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    class Echo(torch.nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> int:
            calls.append((args, kwargs))
            return 0

    block = forward(ppetrace.to(Echo(), "cpu"))
    block({"a": 1})
    block((1, 2))
    block([3])
    block(4)
    assert calls == [((), {"a": 1}), ((1, 2), {}), ((3,), {}), ((4,), {})]


def test_codeblock_of_a_bound_method_uses_its_module_runtime() -> None:
    class Two(torch.nn.Module):
        def twice(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    module = ppetrace.to(Two(), "cpu")
    block = forward(module.twice)
    assert block.runtime is module._ppe_runtime
    assert torch.equal(block(torch.ones(2)), torch.full((2,), 2.0))


def test_codeblock_on_a_module_without_runtime_says_to_call_to_first() -> None:
    model = Regressor()
    message = (
        r"^Expected a module placed with ppetrace\.to, but Regressor has no ppetrace runtime\. "
        r"Call ppetrace\.to\(module, device\) on it first\.$"
    )
    with pytest.raises(ValueError, match=message):
        forward(model)
    with pytest.raises(ValueError, match=message):
        update_parameters(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=message):
        map(model, [])
    with pytest.raises(ValueError, match=r"Expected a CodeBlock with a runtime, but .* none"):
        CodeBlock(model, [], False, None, None)(None)


def test_bad_block_and_optimizer_arguments_are_named() -> None:
    model = ppetrace.to(Regressor(), "cpu")
    with pytest.raises(TypeError, match=r"a bound method of one or a CodeBlock, but received int"):
        forward(3)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"of optimizers to be a torch\.optim\.Optimizer, but .* str"
    ):
        update_parameters(model, ["sgd"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="or a list of them for optimizers, but received dict"):
        update_parameters(model, {})  # type: ignore[arg-type]
    step = update_parameters(model, [])
    with pytest.raises(ValueError, match="received a block that already updates parameters"):
        update_parameters(step, [])


def test_execute_is_one_span_per_call_and_dispatches_to_the_runtime(
    span_exporter: InMemorySpanExporter,
) -> None:
    class Counting(PyTorchRuntime):
        executed: ClassVar[list[CodeBlock]] = []

        def execute(self, code_block: CodeBlock, batch: Any) -> Any:
            Counting.executed.append(code_block)
            return super().execute(code_block, batch)

    model = ppetrace.to(Regressor(), "cpu", runtime_class=Counting)
    step = update_parameters(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in batches(2):
        step(batch)
    assert Counting.executed == [step, step]
    ppetrace.flush()
    spans = span_exporter.get_finished_spans()
    assert [s.name for s in spans] == ["runtime.move_module", "runtime.execute", "runtime.execute"]
    assert spans[1].attributes is not None
    assert spans[1].attributes["ppetrace.runtime"] == "Counting"


def test_cpu_autocast_applies_inside_execute_and_parameters_stay_fp32() -> None:
    model = ppetrace.to(Regressor(), "cpu", options={"autocast": True})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = params(model)
    out = update_parameters(model, opt)(batches(1)[0])
    assert out["pred"].dtype == torch.bfloat16
    after = params(model)
    assert all(p.dtype == torch.float32 for p in after)
    assert all(not torch.equal(b, a) for b, a in zip(before, after, strict=True))


class RecordingScaler(torch.amp.GradScaler):
    def __init__(self) -> None:
        super().__init__("cpu", init_scale=1024.0)
        self.calls: list[str] = []

    def scale(self, outputs: Any) -> Any:
        self.calls.append("scale")
        return super().scale(outputs)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("step")
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        self.calls.append("update")
        super().update(new_scale)


def test_grad_scaler_scales_the_loss_and_steps_every_optimizer_then_updates_once() -> None:
    model, reference = model_pair(4)
    scaler = RecordingScaler()
    model = ppetrace.to(model, "cpu", options={"grad_scaler": scaler})
    opt_a = torch.optim.SGD(model.net[0].parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model.net[2].parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    (batch,) = batches(1)
    update_parameters(model, [opt_a, opt_b], backprop_from="loss")(batch)
    reference(**batch)["loss"].backward()
    ref_opt.step()
    assert scaler.calls == ["scale", "step", "step", "update"]
    assert scaler.get_scale() == 1024.0  # finite gradients: the scale is kept
    for got, want in zip(params(model), params(reference), strict=True):
        torch.testing.assert_close(got, want)  # unscaled before the step


def test_grad_scaler_scales_each_of_several_losses() -> None:
    model, reference = model_pair(5)
    scaler = RecordingScaler()
    model = ppetrace.to(model, "cpu", options={"grad_scaler": scaler})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    (batch,) = batches(1)
    update_parameters(model, opt)(batch)
    out = reference(**batch)
    (out["loss"] + out["l1"]).backward()
    ref_opt.step()
    assert scaler.calls == ["scale", "scale", "step", "update"]  # ppe asserts one loss here
    for got, want in zip(params(model), params(reference), strict=True):
        torch.testing.assert_close(got, want)


def test_map_is_lazy_moves_items_and_selects_out_keys(
    span_exporter: InMemorySpanExporter,
) -> None:
    seen: list[str] = []

    class Recorder(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            seen.append(x.device.type)
            return {"a": x + 1, "b": x * 2}

    class MetaTarget(BaseRuntime):
        pass  # keeps batches where they are

    module = ppetrace.to(Recorder(), "cpu", runtime_class=MetaTarget)
    results = map(module, [torch.zeros(2), torch.ones(2)], out_keys={"b"}, device="meta")
    assert seen == []  # nothing ran yet
    outs = list(results)
    assert seen == ["cpu", "cpu"]
    assert [list(o) for o in outs] == [["b"], ["b"]]
    assert all(o["b"].device.type == "meta" for o in outs)
    ppetrace.flush()
    names = [s.name for s in span_exporter.get_finished_spans()]
    assert names == ["runtime.move_module"] + ["runtime.convert_batch", "runtime.execute"] * 2


def test_map_results_match_the_module_and_out_keys_need_a_dict() -> None:
    torch.manual_seed(5)
    linear = ppetrace.to(torch.nn.Linear(3, 2), "cpu")
    inputs = [torch.randn(4, 3) for _ in range(3)]
    outs = list(map(linear, inputs))
    for x, out in zip(inputs, outs, strict=True):
        assert torch.equal(out, linear(x))
    with pytest.raises(ValueError, match=r"Expected a dict output to select out_keys=\['a'\]"):
        list(map(linear, inputs, out_keys={"a"}))


def test_codeblock_state_round_trips() -> None:
    model = ppetrace.to(torch.nn.Linear(2, 2), "cpu")
    block = forward(model)
    block.state["counter"] = 3
    block.state["lin"] = torch.nn.Linear(1, 1)
    saved = block.state_dict()
    assert saved["counter"] == 3 and set(saved["lin"]) == {"weight", "bias"}
    other = forward(model)
    other.state["lin"] = torch.nn.Linear(1, 1)
    other.load_state_dict(saved)
    assert other.state["counter"] == 3
    assert torch.equal(other.state["lin"].weight, block.state["lin"].weight)
    # forward() of a block keeps its state and runtime
    again = forward(block)
    assert again.state is block.state and again.runtime is block.runtime
