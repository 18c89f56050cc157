"""The runtime registry and :func:`to`: which runtime serves a device, and tagging.

``runtime_registry`` maps a device *type* (``"cpu"``, ``"cuda"``,
``"my_device"``) to a :class:`~ppetrace.BaseRuntime` subclass. A spec with an
index (``"cuda:1"``) resolves through its type; a type that nobody registered
falls back to :class:`~ppetrace.PyTorchRuntime`, as in pytorch-pfn-extras
(:func:`to` then explains a device that torch does not know either).

A tagged module pickles (and deep-copies) without its tag, as in ppe: the
copy is untagged, and a runtime holding locks, threads or device handles
never has to be pickled.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import torch

from ._base import BaseRuntime, call_hook
from ._pytorch import PyTorchRuntime

__all__ = ["RuntimeRegistry", "named_runtime_modules", "runtime_of", "runtime_registry", "to"]

#: The attribute that tags a module with its runtime (as in pytorch-pfn-extras).
RUNTIME_TAG = "_ppe_runtime"

T = TypeVar("T", bound="torch.nn.Module | torch.Tensor")


class RuntimeRegistry:
    """Maps device types to runtime classes.

    Args:
        fallback_class: the class for device types that were not registered
            (``None``: such types are errors).
    """

    def __init__(self, fallback_class: type[BaseRuntime] | None = PyTorchRuntime) -> None:
        self._classes: dict[str, type[BaseRuntime]] = {}
        self._fallback = fallback_class

    def register(self, device_type: str, runtime_class: type[BaseRuntime]) -> None:
        """Serve devices of ``device_type`` with ``runtime_class``; replaces an earlier one.

        ``device_type`` is a type without index (``"my_device"``, not
        ``"my_device:0"``); ``runtime_class`` must subclass ``BaseRuntime``.
        """
        if not isinstance(device_type, str) or not device_type or ":" in device_type:
            raise ValueError(
                "Expected a device type without index such as 'cuda' or 'my_device' for "
                f"device_type, but received {device_type!r}."
            )
        if not (isinstance(runtime_class, type) and issubclass(runtime_class, BaseRuntime)):
            got = (
                f"class {runtime_class.__qualname__}"
                if isinstance(runtime_class, type)
                else f"{type(runtime_class).__name__} {runtime_class!r}"
            )
            raise TypeError(
                f"Expected a subclass of ppetrace.BaseRuntime for device type {device_type!r}, "
                f"but received {got}. Subclass ppetrace.BaseRuntime (or PyTorchRuntime) and "
                "register the class, not an instance."
            )
        self._classes[device_type] = runtime_class

    def unregister(self, device_type: str) -> None:
        """Forget the runtime registered for ``device_type`` (``KeyError`` if none)."""
        try:
            del self._classes[device_type]
        except (KeyError, TypeError):
            raise KeyError(
                f"Expected a registered device type to unregister, but received "
                f"{device_type!r}; registered: {', '.join(self.registered_types()) or 'none'}. "
                "Pass one of the registered types."
            ) from None

    def registered_types(self) -> list[str]:
        """The registered device types, sorted."""
        return sorted(self._classes)

    def __contains__(self, device_type: object) -> bool:
        return device_type in self._classes

    def get_runtime_class_for_device_spec(self, device: torch.device | str) -> type[BaseRuntime]:
        """The runtime class for ``device`` (``"cuda:1"``, ``torch.device("cpu")``, ...).

        Resolution: the registered class for the spec's type, else the
        fallback class (as ppe does), else (no fallback) ``ValueError``
        listing the registered types.
        """
        if isinstance(device, torch.device):
            device_type = device.type
        elif isinstance(device, str):
            device_type = device.strip().partition(":")[0]
        else:
            raise TypeError(
                "Expected a device string such as 'cuda:1' or a torch.device, but received "
                f"{type(device).__name__} {device!r}."
            )
        cls = self._classes.get(device_type)
        if cls is not None:
            return cls
        if self._fallback is not None:
            return self._fallback
        raise ValueError(
            f"Unknown device type {device_type!r}; registered: "
            f"{', '.join(self.registered_types()) or 'none'}. Register one with "
            f"runtime_registry.register({device_type!r}, YourRuntime)."
        )


def _moves_with_torch(runtime: BaseRuntime) -> bool:
    """Whether ``runtime`` moves modules with PyTorchRuntime's ``module.to(device)``."""
    return type(runtime).move_module is PyTorchRuntime.move_module


def _torch_knows(device: torch.device | str) -> bool:
    if isinstance(device, torch.device):
        return True
    try:
        torch.device(device.strip())
    except (RuntimeError, ValueError):
        return False
    return True


#: The process-wide registry used by :func:`to` and the Trainer.
runtime_registry = RuntimeRegistry()
runtime_registry.register("cpu", PyTorchRuntime)
runtime_registry.register("cuda", PyTorchRuntime)


def make_runtime(
    device: torch.device | str | BaseRuntime,
    *,
    options: Mapping[str, Any] | None = None,
    runtime_class: type[BaseRuntime] | None = None,
) -> BaseRuntime:
    """The runtime for ``device``: the instance itself, or a new one from the registry.

    ``runtime_class`` overrides the registry; ``options`` go to the runtime's
    constructor. Passing options or a class together with a runtime instance
    is an error.
    """
    if isinstance(device, BaseRuntime):
        if options is not None or runtime_class is not None:
            raise ValueError(
                f"Expected either a runtime instance or options/runtime_class, but received "
                f"both a {type(device).__name__} and "
                f"{'options' if options is not None else 'runtime_class'}. Configure the "
                "instance when you build it."
            )
        return device
    if runtime_class is None:
        runtime_class = runtime_registry.get_runtime_class_for_device_spec(device)
    elif not (isinstance(runtime_class, type) and issubclass(runtime_class, BaseRuntime)):
        raise TypeError(
            "Expected a subclass of ppetrace.BaseRuntime for runtime_class, but received "
            f"{runtime_class!r}."
        )
    return runtime_class(device, options)


def to(
    module_or_tensor: T,
    device: torch.device | str | BaseRuntime,
    *,
    options: Mapping[str, Any] | None = None,
    runtime_class: type[BaseRuntime] | None = None,
    config: Mapping[str, Any] | None = None,
) -> T:
    """Move a module or tensor to ``device`` through its runtime and return it.

    ``device`` is a device string (``"cpu"``, ``"cuda:1"``, a registered custom
    type), a ``torch.device`` or a runtime instance. A module and every
    submodule are tagged with the runtime (attribute ``_ppe_runtime``) before
    :meth:`~ppetrace.BaseRuntime.move_module` runs; the move is traced as
    ``runtime.move_module`` (``runtime.move_tensor`` for a tensor).
    ``config`` is ppe's deprecated name for ``options`` (passing both is an
    error). A device type that nobody registered and torch does not know
    raises ``ValueError`` naming the registered types.
    """
    if config is not None:
        if options is not None:
            raise ValueError(
                "Expected options or config (its deprecated name), but received both. Pass "
                "options={...} only."
            )
        options = config
    if not isinstance(module_or_tensor, (torch.nn.Module, torch.Tensor)):
        raise TypeError(
            "Expected a torch.nn.Module or a torch.Tensor for module_or_tensor, but received "
            f"{type(module_or_tensor).__name__}. Move batches and other containers with "
            "runtime.convert_batch(...)."
        )
    runtime = make_runtime(device, options=options, runtime_class=runtime_class)
    if _moves_with_torch(runtime) and not _torch_knows(runtime.device_spec):
        device_type = str(runtime.device_spec).partition(":")[0]
        raise ValueError(
            f"Unknown device type {device_type!r}; registered: "
            f"{', '.join(runtime_registry.registered_types())}. torch does not know it either, "
            "so the fallback PyTorchRuntime cannot move anything there. Register one with "
            f"runtime_registry.register({device_type!r}, YourRuntime)."
        )
    attrs = runtime.span_attributes
    if isinstance(module_or_tensor, torch.Tensor):
        return call_hook(runtime, "move_tensor", attrs, module_or_tensor)
    previous = [(sub, sub.__dict__.get(RUNTIME_TAG)) for sub in module_or_tensor.modules()]
    _tag(module_or_tensor, runtime)
    try:
        moved = call_hook(runtime, "move_module", attrs, module_or_tensor)
    except BaseException:
        for sub, tag in previous:  # a failed move leaves the module as it was
            if tag is None:
                _untag(sub)
            else:
                object.__setattr__(sub, RUNTIME_TAG, tag)
        raise
    if moved is not module_or_tensor and isinstance(moved, torch.nn.Module):
        _tag(moved, runtime)
    return moved


class _StateWithoutRuntime:
    """A tagged module's ``__getstate__``: its state without the runtime tag (as ppe's
    ``_set_module_runtime_tag`` does), so pickling and deep copies never touch the runtime."""

    __slots__ = ("module",)

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = weakref.ref(module)  # no reference cycle through the module's dict

    def __call__(self) -> Any:
        module = self.module()
        assert module is not None  # called through the module, so it is alive
        state = type(module).__getstate__(module)
        if isinstance(state, dict):
            state = {k: v for k, v in state.items() if k != RUNTIME_TAG and k != "__getstate__"}
        return state


def _tag(module: torch.nn.Module, runtime: BaseRuntime) -> None:
    for sub in module.modules():
        d = sub.__dict__
        d[RUNTIME_TAG] = runtime
        if not isinstance(d.get("__getstate__"), _StateWithoutRuntime):
            d["__getstate__"] = _StateWithoutRuntime(sub)


def _untag(module: torch.nn.Module) -> None:
    module.__dict__.pop(RUNTIME_TAG, None)
    if isinstance(module.__dict__.get("__getstate__"), _StateWithoutRuntime):
        del module.__dict__["__getstate__"]


def named_runtime_modules(
    module: torch.nn.Module, name: str = "main"
) -> Iterator[tuple[str, torch.nn.Module, BaseRuntime]]:
    """The outermost tagged modules of ``module``'s tree: ``(name, module, runtime)``.

    As ppe's ``named_runtime_modules``: a tagged module is yielded and its
    children are not searched (a nested tag is ignored); an untagged one is
    searched through, each child named by its attribute name.
    """
    runtime = module.__dict__.get(RUNTIME_TAG)
    if isinstance(runtime, BaseRuntime):
        yield name, module, runtime
        return
    for child_name, child in module.named_children():
        yield from named_runtime_modules(child, child_name)


def runtime_of(module: torch.nn.Module) -> BaseRuntime:
    """The runtime that :func:`to` tagged ``module`` with.

    Raises ``ValueError`` telling to call ``ppetrace.to`` when it has none.
    """
    runtime = getattr(module, RUNTIME_TAG, None)
    if not isinstance(runtime, BaseRuntime):
        raise ValueError(
            f"Expected a module placed with ppetrace.to, but {type(module).__name__} has no "
            "ppetrace runtime. Call ppetrace.to(module, device) on it first."
        )
    return runtime
