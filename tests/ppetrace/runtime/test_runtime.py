"""BaseRuntime / PyTorchRuntime: seed API, hook spans, batch movement, autocast, scaler."""

from __future__ import annotations

import collections
import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any, ClassVar, NamedTuple

import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import ppetrace
from ppetrace.runtime import LIFECYCLE_HOOKS, BaseRuntime, PyTorchRuntime, call_hook

MODULE = torch.nn.Linear(2, 2)
BATCH = [torch.ones(2)]

# (hook, positional args after the runtime) for every hook the lifecycle calls
HOOK_CALLS: list[tuple[str, tuple[Any, ...]]] = [
    ("convert_batch", (BATCH,)),
    ("move_module", (MODULE,)),
    ("move_tensor", (BATCH[0],)),
    ("initialize_module", (MODULE, BATCH, None)),
    ("train_epoch_begin", (MODULE,)),
    ("train_epoch_end", (MODULE,)),
    ("train_pre_step", ("trainer", MODULE, 0, BATCH)),
    ("train_post_step", ("trainer", MODULE, 0, BATCH, {"loss": 1})),
    ("train_validation_begin", (MODULE,)),
    ("train_validation_end", (MODULE,)),
    ("eval_pre_step", ("evaluator", MODULE, 1, BATCH)),
    ("eval_post_step", ("evaluator", MODULE, 1, BATCH, {"loss": 1})),
    ("train_cleanup", (MODULE,)),
]


def span_names(exporter: InMemorySpanExporter) -> list[str]:
    ppetrace.flush()
    return [s.name for s in exporter.get_finished_spans()]


# -- the seed API ----------------------------------------------------------------


SEED_SIGNATURES = {
    "__init__": ["self", "device_spec", "options"],
    "convert_batch": ["self", "args"],
    "move_module": ["self", "module"],
    "move_tensor": ["self", "tensor"],
    "initialize_module": ["self", "module", "loader_or_batch", "optimizer"],
    "train_epoch_begin": ["self", "module"],
    "train_epoch_end": ["self", "module"],
    "train_pre_step": ["self", "trainer", "module", "batch_idx", "batch"],
    "train_post_step": ["self", "trainer", "module", "batch_idx", "batch", "outs"],
    "train_validation_begin": ["self", "module"],
    "train_validation_end": ["self", "module"],
    "eval_pre_step": ["self", "evaluator", "module", "batch_idx", "batch"],
    "eval_post_step": ["self", "evaluator", "module", "batch_idx", "batch", "outs"],
    "train_cleanup": ["self", "module"],
    "execute": ["self", "code_block", "batch"],
    "map": ["self", "func", "iterable", "out_keys", "device"],
    "trace": ["event_name", "arg"],  # a classmethod: cls is bound
}


@pytest.mark.parametrize("name", sorted(SEED_SIGNATURES))
def test_every_seed_method_keeps_its_signature_and_has_a_docstring(name: str) -> None:
    method = getattr(BaseRuntime, name)
    assert list(inspect.signature(method).parameters) == SEED_SIGNATURES[name]
    if name != "__init__":
        assert method.__doc__ and method.__doc__.strip()
    all_defaults: dict[str, dict[str, Any]] = {
        "initialize_module": {"optimizer": None},
        "map": {"out_keys": None, "device": "cpu"},
    }
    defaults = all_defaults.get(name, {})
    params = inspect.signature(method).parameters
    for param, default in defaults.items():
        assert params[param].default == default


def test_trace_is_a_classmethod_returning_the_recorder_span_directly() -> None:
    assert isinstance(inspect.getattr_static(BaseRuntime, "trace"), classmethod)
    cm = BaseRuntime.trace("runtime.x", None)
    # not a contextlib generator wrapper: the recorder's own context manager
    assert type(cm) is ppetrace.tracing._recorder.Span
    assert type(BaseRuntime.trace(None, None)) is contextlib.nullcontext


def test_lifecycle_hooks_list_is_the_seed_methods() -> None:
    expected = set(SEED_SIGNATURES) - {"__init__", "trace"}
    assert set(LIFECYCLE_HOOKS) == expected
    assert {name for name, _ in HOOK_CALLS} == expected - {"execute", "map"}


# -- hook spans ------------------------------------------------------------------


@pytest.mark.parametrize(("hook", "args"), HOOK_CALLS, ids=[h for h, _ in HOOK_CALLS])
def test_each_hook_gives_exactly_one_runtime_span(
    span_exporter: InMemorySpanExporter, hook: str, args: tuple[Any, ...]
) -> None:
    runtime = PyTorchRuntime("cpu", {})
    with ppetrace.trace("trainer.step"):
        call_hook(runtime, hook, {"ppetrace.batch_idx": 5}, *args)
    ppetrace.flush()
    spans = {s.name: s for s in span_exporter.get_finished_spans()}
    assert sorted(spans) == sorted(["trainer.step", f"runtime.{hook}"])
    span = spans[f"runtime.{hook}"]
    assert span.parent is not None
    assert span.parent.span_id == spans["trainer.step"].context.span_id
    assert span.attributes is not None and span.attributes["ppetrace.batch_idx"] == 5


def test_call_hook_returns_the_hook_result() -> None:
    runtime = PyTorchRuntime("cpu", {})
    batch = {"x": torch.zeros(1)}
    out = call_hook(runtime, "convert_batch", None, batch)
    assert out == batch and out is not batch
    assert call_hook(runtime, "move_module", None, MODULE) is MODULE


class SuperCallingRuntime(PyTorchRuntime):
    def __init__(self, device_spec: Any, options: Any) -> None:
        super().__init__(device_spec, options)
        self.calls: list[str] = []

    def train_pre_step(self, trainer: Any, module: Any, batch_idx: int, batch: Any) -> None:
        self.calls.append("sub")
        super().train_pre_step(trainer, module, batch_idx, batch)

    def convert_batch(self, args: Any) -> Any:
        self.calls.append("convert")
        return super().convert_batch(args)

    def move_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append("move_tensor")
        return super().move_tensor(tensor)


def test_subclass_calling_super_still_gives_one_span(span_exporter: InMemorySpanExporter) -> None:
    runtime = SuperCallingRuntime("cpu", {})
    call_hook(runtime, "train_pre_step", None, None, MODULE, 0, BATCH)
    call_hook(runtime, "convert_batch", None, [torch.zeros(1), torch.zeros(1)])
    # convert_batch calls move_tensor internally: that is not a lifecycle call
    assert runtime.calls == ["sub", "convert", "move_tensor", "move_tensor"]
    assert span_names(span_exporter) == ["runtime.train_pre_step", "runtime.convert_batch"]


class NvtxLikeRuntime(PyTorchRuntime):
    events: ClassVar[list[tuple[str, str | None, Any]]] = []

    @classmethod
    def trace(cls, event_name: str | None, arg: Any) -> contextlib.AbstractContextManager[Any]:
        @contextlib.contextmanager
        def ranged() -> Iterator[None]:
            cls.events.append(("push", event_name, arg))
            with super(NvtxLikeRuntime, cls).trace(event_name, arg):
                yield
            cls.events.append(("pop", event_name, arg))

        return ranged()


def test_subclass_overriding_trace_sees_every_hook(span_exporter: InMemorySpanExporter) -> None:
    NvtxLikeRuntime.events = []
    runtime = NvtxLikeRuntime("cpu", {})
    for hook, args in HOOK_CALLS:
        call_hook(runtime, hook, hook.upper(), *args)
    expected: list[tuple[str, str | None, Any]] = []
    for hook, _ in HOOK_CALLS:
        expected += [
            ("push", f"runtime.{hook}", hook.upper()),
            ("pop", f"runtime.{hook}", hook.upper()),
        ]
    assert NvtxLikeRuntime.events == expected
    # super().trace inside the override keeps the spans
    assert span_names(span_exporter) == [f"runtime.{hook}" for hook, _ in HOOK_CALLS]


def test_call_hook_opens_the_span_without_calling_the_default_trace(
    span_exporter: InMemorySpanExporter,
) -> None:
    default_trace = BaseRuntime.trace.__func__.__code__  # type: ignore[attr-defined]
    runtime = PyTorchRuntime("cpu", {})
    called: list[Any] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            called.append(frame.f_code)

    sys.setprofile(profile)
    try:
        call_hook(runtime, "train_epoch_begin", {"ppetrace.epoch": 3}, MODULE)
    finally:
        sys.setprofile(None)
    assert default_trace not in called
    ppetrace.flush()
    (span,) = span_exporter.get_finished_spans()
    assert span.name == "runtime.train_epoch_begin"
    assert span.attributes is not None and span.attributes["ppetrace.epoch"] == 3


def test_a_trace_assigned_to_a_class_later_sees_the_next_hooks(
    span_exporter: InMemorySpanExporter,
) -> None:
    class Late(PyTorchRuntime):
        pass

    runtime = Late("cpu", {})
    call_hook(runtime, "train_cleanup", None, MODULE)  # the default trace
    seen: list[str | None] = []

    def traced(cls: type, event_name: str | None, arg: Any) -> Any:
        seen.append(event_name)
        return BaseRuntime.trace.__func__(cls, event_name, arg)  # type: ignore[attr-defined]

    Late.trace = classmethod(traced)  # type: ignore[assignment, method-assign]
    call_hook(runtime, "train_cleanup", None, MODULE)
    del Late.trace
    call_hook(runtime, "train_cleanup", None, MODULE)
    assert seen == ["runtime.train_cleanup"]
    assert span_names(span_exporter) == ["runtime.train_cleanup"] * 3


def test_to_and_codeblocks_go_through_an_overridden_trace(
    span_exporter: InMemorySpanExporter,
) -> None:
    NvtxLikeRuntime.events = []
    module = ppetrace.to(torch.nn.Linear(2, 1), "cpu", runtime_class=NvtxLikeRuntime)
    block = ppetrace.forward(module)
    block(torch.ones(3, 2))
    list(ppetrace.map(module, [torch.ones(1, 2)]))
    pushed = [name for kind, name, _ in NvtxLikeRuntime.events if kind == "push"]
    assert pushed == [
        "runtime.move_module",
        "runtime.execute",
        "runtime.convert_batch",
        "runtime.execute",
    ]
    assert span_names(span_exporter) == pushed


def test_a_failing_hook_ends_its_span_with_error_and_propagates(
    span_exporter: InMemorySpanExporter,
) -> None:
    class Failing(PyTorchRuntime):
        def train_epoch_end(self, module: torch.nn.Module) -> None:
            raise RuntimeError("device lost")

    with pytest.raises(RuntimeError, match=r"^device lost$"):
        call_hook(Failing("cpu", {}), "train_epoch_end", None, MODULE)
    ppetrace.flush()
    (span,) = span_exporter.get_finished_spans()
    assert span.name == "runtime.train_epoch_end"
    assert span.status.status_code is StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]


def test_hooks_record_no_span_while_tracing_is_disabled(
    span_exporter: InMemorySpanExporter,
) -> None:
    ppetrace.configure(enabled=False)
    try:
        assert call_hook(PyTorchRuntime("cpu", {}), "convert_batch", None, 3) == 3
    finally:
        ppetrace.configure()
    assert span_names(span_exporter) == []


# -- construction and options ------------------------------------------------------


def test_device_spec_is_a_torch_device_where_torch_knows_it() -> None:
    assert BaseRuntime("cpu", None).device_spec == torch.device("cpu")
    cuda1 = BaseRuntime("cuda:1", {})
    assert cuda1.device_spec == torch.device("cuda", 1)
    assert cuda1.device_type == "cuda"
    custom = BaseRuntime("my_device:2", {"k": 1})
    assert custom.device_spec == "my_device:2"
    assert custom.device_type == "my_device"
    assert custom.options == {"k": 1}
    assert custom.span_attributes == {
        "ppetrace.device": "my_device:2",
        "ppetrace.runtime": "BaseRuntime",
    }


def test_pytorch_runtime_rejects_unknown_options() -> None:
    with pytest.raises(
        ValueError,
        match=r"^Unknown option 'autocats' for PyTorchRuntime; accepted: autocast, grad_scaler\.",
    ):
        PyTorchRuntime("cpu", {"autocats": True})


def test_bad_option_values_are_named() -> None:
    with pytest.raises(TypeError, match="Expected a dict of options for PyTorchRuntime, but"):
        PyTorchRuntime("cpu", [("autocast", True)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="for the 'autocast' option, but received str"):
        PyTorchRuntime("cpu", {"autocast": "bf16"})
    with pytest.raises(ValueError, match=r"Unknown torch\.autocast argument 'dtpye'"):
        PyTorchRuntime("cpu", {"autocast": {"dtpye": torch.bfloat16}})
    with pytest.raises(TypeError, match="'grad_scaler' option, but received int"):
        PyTorchRuntime("cpu", {"grad_scaler": 1})
    with pytest.raises(TypeError, match=r"Expected a device string .* but received 3"):
        PyTorchRuntime(3, {})  # type: ignore[arg-type]


def test_base_runtime_defaults_keep_objects_and_amp_off() -> None:
    runtime = BaseRuntime("my_device", {})
    tensor = torch.ones(2)
    assert runtime.move_tensor(tensor) is tensor
    assert runtime.move_module(MODULE) is MODULE
    assert runtime.grad_scaler is None
    assert runtime.autocast_enabled is False
    with runtime.autocast_context():
        assert not torch.is_autocast_enabled("cpu")


# -- convert_batch -----------------------------------------------------------------


class Pair(NamedTuple):
    x: torch.Tensor
    y: Any


def test_convert_batch_moves_nested_tensors_and_keeps_container_types() -> None:
    runtime = PyTorchRuntime("meta", {})  # a real move, without a GPU
    batch: dict[str, Any] = {
        "pair": Pair(torch.ones(2), [torch.zeros(1), "label", (torch.ones(1),)]),
        "ordered": collections.OrderedDict([("b", torch.ones(1)), ("a", 2)]),
        "n": 7,
    }
    out = runtime.convert_batch(batch)
    assert type(out) is dict and list(out) == ["pair", "ordered", "n"]
    pair = out["pair"]
    assert type(pair) is Pair
    assert pair.x.device.type == "meta"
    assert type(pair.y) is list and pair.y[1] == "label"
    assert pair.y[0].device.type == "meta" and pair.y[2][0].device.type == "meta"
    assert type(pair.y[2]) is tuple
    assert type(out["ordered"]) is collections.OrderedDict and list(out["ordered"]) == ["b", "a"]
    assert out["ordered"]["b"].device.type == "meta" and out["ordered"]["a"] == 2
    assert out["n"] == 7
    assert batch["pair"].x.device.type == "cpu"  # the input is left alone


def test_convert_batch_uses_move_tensor_of_the_subclass() -> None:
    class Doubling(BaseRuntime):
        def move_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
            return tensor.double()

    out = Doubling("my_device", {}).convert_batch((torch.ones(1), [torch.ones(1)]))
    assert out[0].dtype == torch.float64 and out[1][0].dtype == torch.float64


def test_move_tensor_is_non_blocking_only_towards_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Any, bool]] = []

    def fake_to(self: torch.Tensor, device: Any, non_blocking: bool = False) -> torch.Tensor:
        seen.append((device, non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    PyTorchRuntime("cuda:0", {}).move_tensor(torch.ones(1))
    PyTorchRuntime("cpu", {}).move_tensor(torch.ones(1))
    assert seen == [(torch.device("cuda", 0), True), (torch.device("cpu"), False)]


# -- autocast and the grad scaler ---------------------------------------------------


def test_cpu_autocast_means_bf16_matmuls() -> None:
    runtime = PyTorchRuntime("cpu", {"autocast": True})
    assert runtime.autocast_enabled
    assert runtime.autocast_kwargs == {
        "device_type": "cpu",
        "dtype": torch.bfloat16,
        "enabled": True,
    }
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    with runtime.autocast_context():
        assert (a @ b).dtype == torch.bfloat16
    assert (a @ b).dtype == torch.float32
    with PyTorchRuntime("cpu", {}).autocast_context():
        assert (a @ b).dtype == torch.float32


def test_autocast_dict_is_passed_to_torch_autocast() -> None:
    runtime = PyTorchRuntime("cpu", {"autocast": {"dtype": torch.float16, "cache_enabled": False}})
    a = torch.randn(2, 2)
    with runtime.autocast_context():
        assert (a @ a).dtype == torch.float16
    assert PyTorchRuntime("cpu", {"autocast": {"enabled": False}}).autocast_enabled is False


def test_cuda_autocast_defaults_to_fp16_without_needing_a_gpu() -> None:
    runtime = PyTorchRuntime("cuda", {"autocast": True})
    assert runtime.autocast_kwargs == {
        "device_type": "cuda",
        "dtype": torch.float16,
        "enabled": True,
    }


def test_grad_scaler_option() -> None:
    assert PyTorchRuntime("cpu", {"grad_scaler": True}).grad_scaler is None  # bf16: no scaling
    scaler = torch.amp.GradScaler("cpu")
    assert PyTorchRuntime("cpu", {"grad_scaler": scaler}).grad_scaler is scaler
    assert PyTorchRuntime("cpu", {"grad_scaler": None}).grad_scaler is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runtime_moves_batches_and_builds_a_scaler() -> None:
    runtime = PyTorchRuntime("cuda", {"autocast": True, "grad_scaler": True})
    assert isinstance(runtime.grad_scaler, torch.amp.GradScaler)
    out = runtime.convert_batch({"x": torch.ones(2, 2)})
    assert out["x"].is_cuda
    with runtime.autocast_context():
        assert (out["x"] @ out["x"]).dtype == torch.float16
