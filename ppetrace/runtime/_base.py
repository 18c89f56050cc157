"""Device runtimes: where modules and batches live and how a CodeBlock runs.

The API is pytorch-pfn-extras' ``ppe.runtime.BaseRuntime``: every method keeps
the seed's name, signature and meaning. :class:`PyTorchRuntime` serves the
devices that PyTorch knows (``cpu``, ``cuda``) and adds autocast and a
``GradScaler``.

Tracing of hooks: the lifecycle (the Trainer, :func:`ppetrace.to`, CodeBlocks,
:func:`ppetrace.map`) never calls a runtime hook directly; it calls
:func:`call_hook`, which runs the hook inside
``type(runtime).trace("runtime.<method>", arg)``. The methods themselves are
plain, so a subclass hook that calls ``super()`` still gives exactly one span,
and a subclass that overrides :meth:`BaseRuntime.trace` (to add NVTX ranges,
say) sees every hook. :class:`PyTorchRuntime`'s ``trace`` also opens a
``torch.profiler.record_function`` range while a torch profiler records, as
ppe's does (``_ranges``).
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..tracing import _recorder
from . import _ranges
from ._backprop import backprop_inputs, call_block_func, describe_value, select_losses
from ._convert import apply_to_tensors

__all__ = ["LIFECYCLE_HOOKS", "BaseRuntime", "CodeBlock", "call_hook"]

#: The runtime methods that the training lifecycle calls, each traced as
#: ``runtime.<method>`` through :func:`call_hook`.
LIFECYCLE_HOOKS: tuple[str, ...] = (
    "convert_batch",
    "move_module",
    "move_tensor",
    "initialize_module",
    "train_epoch_begin",
    "train_epoch_end",
    "train_pre_step",
    "train_post_step",
    "train_validation_begin",
    "train_validation_end",
    "eval_pre_step",
    "eval_post_step",
    "train_cleanup",
    "execute",
    "map",
)
_EVENTS: dict[str, str] = {name: "runtime." + name for name in LIFECYCLE_HOOKS}
_NULL_CONTEXT: contextlib.nullcontext[None] = contextlib.nullcontext()


def call_hook(runtime: BaseRuntime, name: str, arg: Any, *args: Any) -> Any:
    """Call ``runtime.<name>(*args)`` inside ``type(runtime).trace("runtime.<name>", arg)``.

    When the class keeps the default :meth:`BaseRuntime.trace` (or
    ``PyTorchRuntime.trace`` while no torch profiler records), the span is
    opened directly (the same span, one call less per hook). Returns what the
    hook returns; an exception from the hook ends the span with ERROR status
    and propagates unchanged. ``arg`` becomes the span's attributes (a dict
    gives one attribute per key). Any method name works; the names in
    :data:`LIFECYCLE_HOOKS` skip building the event name.
    """
    try:
        event = _EVENTS[name]
    except KeyError:
        event = "runtime." + name
    tracer = type(runtime).trace
    func = getattr(tracer, "__func__", None)
    # PyTorchRuntime's trace first: the runtime of cpu and cuda, the common case
    if (func is _RANGE_TRACE and not _profiler_module._is_profiler_enabled) or func is _BASE_TRACE:
        # the default trace (or PyTorchRuntime's, no profiler on): open the span directly
        with _recorder.trace(event, arg):
            return getattr(runtime, name)(*args)
    with tracer(event, arg):
        return getattr(runtime, name)(*args)


def _device_type(device_spec: torch.device | str) -> str:
    if isinstance(device_spec, torch.device):
        return device_spec.type
    return device_spec.partition(":")[0]


def _normalize_device(device_spec: Any) -> torch.device | str:
    """``torch.device`` where torch knows the spec, else the string itself."""
    if isinstance(device_spec, torch.device):
        return device_spec
    if not isinstance(device_spec, str) or not device_spec.strip():
        raise TypeError(
            "Expected a device string (such as 'cpu', 'cuda:1' or a registered type) or "
            f"a torch.device for device_spec, but received {device_spec!r}."
        )
    spec = device_spec.strip()
    try:
        return torch.device(spec)
    except (RuntimeError, ValueError):
        return spec


class BaseRuntime:
    """A collection of device-specific callbacks, dispatched by device string.

    :func:`ppetrace.to` builds one through ``ppetrace.runtime_registry``, tags
    the module with it (attribute ``_ppe_runtime``) and moves the module with
    :meth:`move_module`; the Trainer calls the lifecycle hooks below through
    :func:`call_hook`. Every hook is a documented no-op here, ``move_*`` keep
    objects where they are, and :meth:`execute` / :meth:`map` run CodeBlocks
    generically, so a custom device runtime overrides only what it needs.

    Args:
        device_spec: the device modules and tensors go to. A string torch knows
            becomes a ``torch.device``; any other string (a custom device type
            such as ``"my_device"``) is kept as is.
        options: a configuration dict for the runtime's methods (``None``: ``{}``).
    """

    #: The option keys this class adds. The keys a runtime accepts are those of every
    #: class in its MRO that sets ``option_names``; ``None`` everywhere accepts any key. A
    #: class that sets it is checked strictly (an unknown key is an error); a subclass that
    #: does not may use keys of its own, and only a key close to an accepted one (a typo
    #: such as ``"autocats"``) is an error.
    option_names: ClassVar[frozenset[str] | None] = None

    def __init__(self, device_spec: torch.device | str, options: Mapping[str, Any] | None) -> None:
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise TypeError(
                f"Expected a dict of options for {type(self).__name__}, but received "
                f"{type(options).__name__}. Pass options={{...}} or None."
            )
        _check_options(type(self), options)
        self.device_spec: torch.device | str = _normalize_device(device_spec)
        self.options: dict[str, Any] = dict(options)
        #: Span attributes describing this runtime; shared, do not mutate.
        self.span_attributes: dict[str, Any] = {
            "ppetrace.device": str(self.device_spec),
            "ppetrace.runtime": type(self).__name__,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.device_spec)!r})"

    @property
    def device_type(self) -> str:
        """The device type without index: ``"cuda"`` for ``"cuda:1"``."""
        return _device_type(self.device_spec)

    # -- AMP accessors (no-ops here; PyTorchRuntime implements them) ----------

    @property
    def autocast_enabled(self) -> bool:
        """Whether :meth:`autocast_context` enables autocast (``False`` here)."""
        return False

    def autocast_context(self) -> contextlib.AbstractContextManager[Any]:
        """A context manager for the forward pass: autocast, or a no-op here."""
        return _NULL_CONTEXT

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The ``GradScaler`` that scales losses and steps optimizers, or ``None``."""
        return None

    # -- movement ---------------------------------------------------------------

    def convert_batch(self, args: Any) -> Any:
        """Transfer a batch of any type to the device, keeping its type.

        Tensors nested in tuples, lists, dicts and namedtuples are moved with
        :meth:`move_tensor`; containers keep their type (a ``Mapping`` subclass
        too); an object with its own ``.to()`` method is moved by it
        (``obj.to(device_spec)``); other values pass through unchanged.
        """
        return apply_to_tensors(args, self.move_tensor, self.device_spec)

    def move_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Transfer ``module`` to the device and return it.

        :func:`ppetrace.to` tags the module (``_ppe_runtime``) before calling
        this. The default returns the module unchanged.
        """
        return module

    def move_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Transfer ``tensor`` to the device and return it. The default returns it unchanged."""
        return tensor

    # -- lifecycle hooks (documented no-ops) -----------------------------------

    def initialize_module(
        self,
        module: torch.nn.Module,
        loader_or_batch: Iterable[Any] | torch.Tensor | None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """Initialize ``module`` at the start of training or inference.

        ``loader_or_batch`` is the training DataLoader or a batch;
        ``optimizer`` may be used, for example, to copy the learning rate to a
        device-side copy of the model. The default does nothing.
        """

    def train_epoch_begin(self, module: torch.nn.Module) -> None:
        """Called before the first step of each training epoch. The default does nothing."""

    def train_epoch_end(self, module: torch.nn.Module) -> None:
        """Called after the last step of each training epoch. The default does nothing."""

    def train_pre_step(
        self, trainer: Any, module: torch.nn.Module, batch_idx: int, batch: Any
    ) -> None:
        """Called at the beginning of every training step (iterations plus an update).

        ``batch`` is the batch as the loader produced it. The default does nothing.
        """

    def train_post_step(
        self, trainer: Any, module: torch.nn.Module, batch_idx: int, batch: Any, outs: Any
    ) -> None:
        """Called at the end of every training step with the step's outputs ``outs``.

        The default does nothing.
        """

    def train_validation_begin(self, module: torch.nn.Module) -> None:
        """Called before each validation run during training. The default does nothing."""

    def train_validation_end(self, module: torch.nn.Module) -> None:
        """Called after each validation run during training. The default does nothing."""

    def eval_pre_step(
        self, evaluator: Any, module: torch.nn.Module, batch_idx: int, batch: Any
    ) -> None:
        """Called at the beginning of each evaluation step. The default does nothing."""

    def eval_post_step(
        self, evaluator: Any, module: torch.nn.Module, batch_idx: int, batch: Any, outs: Any
    ) -> None:
        """Called at the end of each evaluation step with its outputs. The default does nothing."""

    def train_cleanup(self, module: torch.nn.Module) -> None:
        """Called once when a training run completes. The default does nothing."""

    # -- CodeBlocks --------------------------------------------------------------

    def execute(self, code_block: CodeBlock, batch: Any) -> Any:
        """Run ``code_block`` on ``batch`` (already on the device) and return its outputs.

        In order: ``zero_grad`` on the block's optimizers; the forward pass
        ``code_block.func(batch)`` (a dict batch is passed as keywords, a tuple
        or list as positionals) inside :meth:`autocast_context`; when
        ``code_block.backprop``, backward from ``backprop_from``, or, as in
        ppe, from *every* output that is a scalar floating-point tensor with a
        gradient, one ``backward()`` per loss in output order (their gradients
        add up; the graph is kept until the last one, so losses may share it),
        each scaled by :attr:`grad_scaler` when there is one and accumulating
        only into the ``backprop_to`` values when given; then ``step`` of
        every optimizer (through the scaler, followed by one
        ``scaler.update()``).
        """
        optimizers = code_block.optimizers
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        with self.autocast_context():
            out = call_block_func(code_block.func, batch)
        if not code_block.backprop:
            return out
        losses = select_losses(out, code_block.backprop_from, _name(code_block.func))
        scaler = self.grad_scaler
        if scaler is not None:
            losses = [scaler.scale(loss) for loss in losses]
        inputs = backprop_inputs(code_block.backprop_to, batch, out)
        last = len(losses) - 1
        for i, loss in enumerate(losses):  # one backward per loss, in order, as ppe
            loss.backward(inputs=inputs, retain_graph=i < last)
        if optimizers:
            if scaler is not None:
                for optimizer in optimizers:
                    scaler.step(optimizer)
                scaler.update()
            else:
                for optimizer in optimizers:
                    optimizer.step()
        return out

    def map(
        self,
        func: CodeBlock,
        iterable: Iterable[Any],
        out_keys: set[str] | None = None,
        device: Any = "cpu",
    ) -> Iterable[Any]:
        """Apply the CodeBlock ``func`` to each item of ``iterable``, lazily.

        Each item is moved with :meth:`convert_batch` and run with
        :meth:`execute` (one ``runtime.convert_batch`` and one
        ``runtime.execute`` span per item). A dict output is cut down to
        ``out_keys`` when given; the result's tensors are moved to ``device``.
        Returns a generator: nothing runs until it is iterated.
        """
        return _map_items(self, func, iterable, out_keys, device)

    @classmethod
    def trace(cls, event_name: str | None, arg: Any) -> contextlib.AbstractContextManager[Any]:
        """Context manager that traces one runtime event, such as a hook call.

        The default records a ppetrace span (:func:`ppetrace.trace`) named
        ``event_name`` with ``arg`` as attributes; ``event_name=None`` records
        nothing. Override it to add device tooling (NVTX ranges, say); call
        ``super().trace(...)`` inside to keep the span.
        """
        if event_name is None:
            return _NULL_CONTEXT
        return _recorder.trace(event_name, arg)


#: The function behind the default :meth:`BaseRuntime.trace`: :func:`call_hook` skips the
#: classmethod call when a runtime's class still has it (compared on every call, so a
#: ``trace`` assigned to a class later is honoured).
_BASE_TRACE: Any = BaseRuntime.__dict__["trace"].__func__
#: ``PyTorchRuntime.trace``: :func:`call_hook` opens the span directly while no torch
#: profiler records (never matches where torch lacks the profiler flag).
_RANGE_TRACE: Any = _ranges.range_trace if _ranges.HAS_PROFILER_FLAG else object()
_profiler_module: Any = _ranges._autograd_profiler


def _check_options(cls: type[BaseRuntime], options: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for an option key that ``cls`` does not accept (see
    :attr:`BaseRuntime.option_names`)."""
    accepted: set[str] = set()
    declared = False
    for klass in cls.__mro__:
        own = vars(klass).get("option_names")
        if own is not None:
            accepted |= own
            declared = True
    if not declared:
        return
    strict = vars(cls).get("option_names") is not None
    for key in sorted(set(options) - accepted, key=str):
        close = difflib.get_close_matches(str(key), sorted(accepted), n=1, cutoff=0.8)
        if not strict and not close:
            continue  # a subclass's own option
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"Unknown option {key!r} for {cls.__name__}; accepted: "
            f"{', '.join(sorted(accepted)) or 'none'}.{hint} Check the spelling of the options "
            "passed to ppetrace.to(...), or declare a subclass's own options in its "
            "option_names class attribute."
        )


def _map_items(
    runtime: BaseRuntime,
    block: CodeBlock,
    iterable: Iterable[Any],
    out_keys: set[str] | None,
    device: Any,
) -> Iterator[Any]:
    attrs = runtime.span_attributes
    for item in iterable:
        batch = call_hook(runtime, "convert_batch", attrs, item)
        out = call_hook(runtime, "execute", attrs, block, batch)
        if out_keys is not None:
            if not isinstance(out, Mapping):
                raise ValueError(
                    f"Expected a dict output to select out_keys={sorted(out_keys)} from, but "
                    f"received {describe_value(out)}. Pass out_keys=None."
                )
            out = {key: out[key] for key in out_keys}
        yield apply_to_tensors(out, lambda t: t.to(device), device)


@dataclass
class CodeBlock:
    """A callable plus what the runtime should do around it.

    Attributes:
        func: the module (or bound method of a module) to run on a batch.
        optimizers: optimizers to ``zero_grad`` before and ``step`` after.
        backprop: whether to back-propagate from the outputs.
        backprop_from: the output key of the loss; ``None`` back-propagates from
            every scalar floating-point output that has a gradient (the output
            itself when it is one), as ppe does.
        backprop_to: names of values (keys of the output or the input batch)
            where back-propagation stops: gradients accumulate only into them.
        state: data kept with the block (saved by :meth:`state_dict`).
        runtime: the runtime that executes the block.

    ``block(batch)`` runs :meth:`BaseRuntime.execute` and returns its outputs;
    ``batch`` must already be on the device (``runtime.convert_batch``).
    """

    func: Callable[..., Any]
    optimizers: list[torch.optim.Optimizer]
    backprop: bool
    backprop_from: str | None
    backprop_to: set[str] | None
    state: dict[str, Any] = field(default_factory=dict)
    runtime: BaseRuntime | None = None

    def __call__(self, batch: Any) -> Any:
        runtime = self.runtime
        if runtime is None:
            raise ValueError(
                f"Expected a CodeBlock with a runtime, but {_name(self.func)} has none. "
                "Call ppetrace.to(module, device) first, then build the block with "
                "ppetrace.forward(module)."
            )
        return call_hook(runtime, "execute", runtime.span_attributes, self, batch)

    def state_dict(self) -> dict[str, Any]:
        """The block's state; values with ``state_dict()`` are saved through it."""
        return {
            key: value.state_dict() if hasattr(value, "state_dict") else value
            for key, value in self.state.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (through ``load_state_dict`` where present)."""
        for key, value in state.items():
            current = self.state.get(key)
            if current is not None and hasattr(current, "load_state_dict"):
                current.load_state_dict(value)
            else:
                self.state[key] = value


def _name(func: Any) -> str:
    if isinstance(func, torch.nn.Module):
        return type(func).__name__
    return str(getattr(func, "__qualname__", type(func).__name__))
