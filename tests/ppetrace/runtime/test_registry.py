"""runtime_registry, ppetrace.to and runtime_of."""

from __future__ import annotations

import copy
import io
import pickle
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import ppetrace
from ppetrace.runtime import (
    BaseRuntime,
    PyTorchRuntime,
    RuntimeRegistry,
    runtime_of,
    runtime_registry,
    to,
)


class CudaRuntime(PyTorchRuntime):
    """Stands in for a vendor CUDA runtime; only its class is resolved."""


class MyDeviceRuntime(BaseRuntime):
    """A runtime for a device torch does not know: 'moves' by converting to float64."""

    moved: ClassVar[list[str]] = []

    def move_module(self, module: torch.nn.Module) -> torch.nn.Module:
        MyDeviceRuntime.moved.append(type(module).__name__)
        return module.double()

    def move_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.double()


@pytest.fixture
def my_device() -> Iterator[type[MyDeviceRuntime]]:
    MyDeviceRuntime.moved = []
    runtime_registry.register("my_device", MyDeviceRuntime)
    yield MyDeviceRuntime
    runtime_registry.unregister("my_device")


def net() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


# -- resolution ------------------------------------------------------------------


def test_default_registry_serves_cpu_and_cuda_with_pytorch_runtime() -> None:
    assert runtime_registry.registered_types()[:2] == ["cpu", "cuda"]
    for spec in ("cpu", "cuda", "cuda:1", torch.device("cuda", 3), torch.device("cpu")):
        assert runtime_registry.get_runtime_class_for_device_spec(spec) is PyTorchRuntime


def test_unregistering_an_unknown_type_lists_the_registered_ones() -> None:
    registry = RuntimeRegistry()
    registry.register("cpu", PyTorchRuntime)
    registry.register("my_device", MyDeviceRuntime)
    with pytest.raises(
        KeyError,
        match=(
            r"Expected a registered device type to unregister, but received 'tpu'; registered: "
            r"cpu, my_device\. Pass one of the registered types\."
        ),
    ):
        registry.unregister("tpu")
    registry.unregister("my_device")
    assert registry.registered_types() == ["cpu"]
    with pytest.raises(KeyError, match=r"received 'my_device'; registered: cpu\."):
        registry.unregister("my_device")


def test_indexed_spec_resolves_through_its_type() -> None:
    registry = RuntimeRegistry(fallback_class=None)
    registry.register("cuda", CudaRuntime)
    assert registry.get_runtime_class_for_device_spec("cuda:1") is CudaRuntime
    assert registry.get_runtime_class_for_device_spec(torch.device("cuda:1")) is CudaRuntime
    assert registry.get_runtime_class_for_device_spec(" cuda ") is CudaRuntime


def test_an_unregistered_type_falls_back_to_pytorch_runtime_as_ppe() -> None:
    registry = RuntimeRegistry()
    assert registry.get_runtime_class_for_device_spec("meta") is PyTorchRuntime
    assert registry.get_runtime_class_for_device_spec(torch.device("meta")) is PyTorchRuntime
    # pytorch_pfn_extras/runtime/_registry.py: get(device_type, self._fallback_class)
    assert registry.get_runtime_class_for_device_spec("tpu:0") is PyTorchRuntime
    with pytest.raises(ValueError, match=r"^Unknown device type 'meta'; registered: none\."):
        RuntimeRegistry(fallback_class=None).get_runtime_class_for_device_spec("meta")


def test_registering_again_replaces_the_class() -> None:
    registry = RuntimeRegistry()
    registry.register("cpu", PyTorchRuntime)
    registry.register("cpu", CudaRuntime)
    assert registry.get_runtime_class_for_device_spec("cpu") is CudaRuntime
    assert "cpu" in registry and "cuda" not in registry


# -- errors -------------------------------------------------------------------------


def test_unknown_device_lists_the_registered_types_without_a_fallback() -> None:
    registry = RuntimeRegistry(fallback_class=None)
    registry.register("cpu", PyTorchRuntime)
    registry.register("cuda", PyTorchRuntime)
    with pytest.raises(
        ValueError,
        match=(
            r"^Unknown device type 'tpu'; registered: cpu, cuda\. Register one with "
            r"runtime_registry\.register\('tpu', YourRuntime\)\.$"
        ),
    ):
        registry.get_runtime_class_for_device_spec("tpu:0")


def test_to_an_unknown_device_names_it_and_the_registered_types(
    my_device: type[BaseRuntime],
) -> None:
    with pytest.raises(
        ValueError,
        match=r"^Unknown device type 'tpu'; registered: cpu, cuda, my_device\. torch does not "
        r"know it either, so the fallback PyTorchRuntime cannot move anything there\. Register "
        r"one with runtime_registry\.register\('tpu', YourRuntime\)\.$",
    ):
        to(net(), "tpu")
    assert isinstance(PyTorchRuntime("tpu", None), PyTorchRuntime)  # building one works, as ppe


def test_registering_a_non_runtime_raises_type_error() -> None:
    registry = RuntimeRegistry()
    with pytest.raises(
        TypeError,
        match=(
            r"^Expected a subclass of ppetrace\.BaseRuntime for device type 'npu', but "
            r"received class Linear\. "
        ),
    ):
        registry.register("npu", torch.nn.Linear)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"but received MyDeviceRuntime MyDeviceRuntime\('npu'\)"):
        registry.register("npu", MyDeviceRuntime("npu", {}))  # type: ignore[arg-type]
    assert "npu" not in registry


def test_registering_an_indexed_type_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"without index .* but received 'npu:0'"):
        RuntimeRegistry().register("npu:0", PyTorchRuntime)


def test_registry_rejects_a_device_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="but received int 0"):
        runtime_registry.get_runtime_class_for_device_spec(0)  # type: ignore[arg-type]


def test_to_something_else_than_a_module_or_tensor_raises_type_error() -> None:
    with pytest.raises(
        TypeError,
        match=(
            r"^Expected a torch\.nn\.Module or a torch\.Tensor for module_or_tensor, but "
            r"received list\. Move batches"
        ),
    ):
        to([torch.ones(1)], "cpu")  # type: ignore[type-var]


def test_module_without_runtime_is_explained() -> None:
    with pytest.raises(
        ValueError,
        match=r"Sequential has no ppetrace runtime\. Call ppetrace\.to\(module, device\)",
    ):
        runtime_of(net())


# -- to() -------------------------------------------------------------------------------


def test_custom_device_string_works_end_to_end(
    span_exporter: InMemorySpanExporter, my_device: type[MyDeviceRuntime]
) -> None:
    model = net()
    moved = ppetrace.to(model, "my_device:1")
    runtime = runtime_of(moved)
    assert type(runtime) is MyDeviceRuntime
    assert runtime.device_spec == "my_device:1"
    assert MyDeviceRuntime.moved == ["Sequential"]
    assert all(p.dtype == torch.float64 for p in moved.parameters())
    # every submodule carries the same runtime
    assert {id(runtime_of(m)) for m in moved.modules()} == {id(runtime)}
    # the whole path runs on the custom runtime: batch movement and a CodeBlock
    batch = runtime.convert_batch({"input": torch.ones(2, 3)})
    assert batch["input"].dtype == torch.float64
    out = ppetrace.forward(moved)(batch["input"])
    assert out.dtype == torch.float64 and out.shape == (2, 1)
    ppetrace.flush()
    spans = [(s.name, dict(s.attributes or {})) for s in span_exporter.get_finished_spans()]
    device_attrs = {"ppetrace.device": "my_device:1", "ppetrace.runtime": "MyDeviceRuntime"}
    assert [name for name, _ in spans] == ["runtime.move_module", "runtime.execute"]
    for _, attrs in spans:
        assert {k: attrs[k] for k in device_attrs} == device_attrs


def test_to_moves_a_tensor_through_the_runtime(span_exporter: InMemorySpanExporter) -> None:
    tensor = torch.ones(3)
    moved = to(tensor, "meta")
    assert moved.device.type == "meta" and tensor.device.type == "cpu"
    ppetrace.flush()
    assert [s.name for s in span_exporter.get_finished_spans()] == ["runtime.move_tensor"]


def test_to_accepts_a_runtime_instance_and_options() -> None:
    runtime = PyTorchRuntime("cpu", {"autocast": True})
    model = to(net(), runtime)
    assert runtime_of(model) is runtime
    model2 = to(net(), torch.device("cpu"), options={"autocast": True})
    assert runtime_of(model2).autocast_enabled
    with pytest.raises(ValueError, match="but received both a PyTorchRuntime and options"):
        to(net(), runtime, options={"autocast": False})


def test_to_with_runtime_class_bypasses_the_registry() -> None:
    model = to(net(), "cuda:1", runtime_class=BaseRuntime)  # BaseRuntime keeps it on the CPU
    runtime = runtime_of(model)
    assert type(runtime) is BaseRuntime
    assert runtime.device_spec == torch.device("cuda", 1)
    assert next(model.parameters()).device.type == "cpu"
    with pytest.raises(TypeError, match="for runtime_class, but received"):
        to(net(), "cpu", runtime_class=dict)  # type: ignore[arg-type]


def test_a_module_replaced_by_move_module_is_tagged_too() -> None:
    class Wrapping(BaseRuntime):
        def move_module(self, module: torch.nn.Module) -> torch.nn.Module:
            return torch.nn.Sequential(module)

    inner = net()
    wrapped: Any = to(inner, "my_wrapper", runtime_class=Wrapping)
    assert wrapped is not inner and wrapped[0] is inner
    assert runtime_of(wrapped) is runtime_of(inner)


def test_tag_does_not_leak_into_state_dict() -> None:
    model = to(net(), "cpu")
    plain = net()
    assert list(model.state_dict()) == list(plain.state_dict())


def test_a_failed_move_leaves_the_module_untagged() -> None:
    class Broken(BaseRuntime):
        def move_module(self, module: torch.nn.Module) -> torch.nn.Module:
            raise RuntimeError("out of device memory")

    model = net()
    first = runtime_of(to(model, "cpu"))
    with pytest.raises(RuntimeError, match=r"^out of device memory$"):
        to(model, "cpu", runtime_class=Broken)
    assert {id(runtime_of(m)) for m in model.modules()} == {id(first)}
    fresh = net()
    with pytest.raises(RuntimeError, match=r"^out of device memory$"):
        to(fresh, "cpu", runtime_class=Broken)
    with pytest.raises(ValueError, match="has no ppetrace runtime"):
        runtime_of(fresh[0])


class LockedRuntime(PyTorchRuntime):
    """A runtime holding what cannot be pickled (a prefetch thread's lock, say)."""

    def __init__(self, device_spec: Any, options: Any) -> None:
        super().__init__(device_spec, options)
        self.lock = threading.Lock()


def test_a_tagged_module_pickles_and_copies_without_its_runtime_as_ppe() -> None:
    model = to(net(), "cpu", runtime_class=LockedRuntime)
    with pytest.raises(TypeError, match=r"cannot pickle '_thread\.lock'"):
        pickle.dumps(runtime_of(model))
    # pytorch_pfn_extras/runtime/_runtime.py: _set_module_runtime_tag strips the tag
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert "_ppe_runtime" not in copied.__dict__ and "__getstate__" not in copied.__dict__
        assert "_ppe_runtime" not in copied[0].__dict__
        assert torch.equal(copied.state_dict()["0.weight"], model.state_dict()["0.weight"])
        with pytest.raises(ValueError, match=r"Call ppetrace\.to"):
            runtime_of(copied)
    assert type(runtime_of(model)) is LockedRuntime  # the original keeps its tag
    assert torch.load(io_bytes(model), weights_only=False)[0].weight.shape == (4, 3)


def io_bytes(model: torch.nn.Module) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return buffer
