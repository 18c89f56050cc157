"""The runtime for the devices PyTorch supports natively: autocast and a GradScaler.

It is also ``runtime_registry``'s fallback for device types that nobody
registered, as in pytorch-pfn-extras.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ._base import _NULL_CONTEXT, BaseRuntime
from ._convert import apply_to_tensors
from ._ranges import range_trace

__all__ = ["PyTorchRuntime"]


class PyTorchRuntime(BaseRuntime):
    """The runtime for devices that PyTorch supports natively (``cpu``, ``cuda``, ...).

    Options:
        ``autocast``: ``False`` (default), ``True``, or a dict of keyword
            arguments for ``torch.autocast``. ``device_type`` defaults to the
            runtime's device type, ``dtype`` to ``torch.bfloat16`` on CPU and
            ``torch.float16`` on CUDA.
        ``grad_scaler``: ``None``/``False`` (default), a ``torch.amp.GradScaler``
            (used as given), or ``True`` to build one on CUDA. On other
            devices ``True`` means no scaler: bf16 autocast needs no loss scaling.

    A subclass may take options of its own (see ``BaseRuntime.option_names``).
    :meth:`trace` records the ppetrace span and, while a torch profiler
    records, a ``torch.profiler.record_function`` range of the same name (as
    ppe's ``PyTorchRuntime.trace`` does).
    """

    option_names: ClassVar[frozenset[str] | None] = frozenset({"autocast", "grad_scaler"})
    _AUTOCAST_KEYS = frozenset({"device_type", "dtype", "enabled", "cache_enabled"})

    def __init__(self, device_spec: torch.device | str, options: Mapping[str, Any] | None) -> None:
        super().__init__(device_spec, options)
        device_type = self.device_type
        self._non_blocking = device_type == "cuda"
        self._on_cpu = device_type == "cpu"
        self._autocast_kwargs = self._build_autocast(self.options.get("autocast", False))
        self._grad_scaler = self._build_grad_scaler(self.options.get("grad_scaler"))

    def _build_autocast(self, option: Any) -> dict[str, Any] | None:
        if option is None or option is False:
            return None
        if option is True:
            option = {}
        if not isinstance(option, Mapping):
            raise TypeError(
                "Expected a bool or a dict of torch.autocast keyword arguments for the "
                f"'autocast' option, but received {type(option).__name__}."
            )
        unknown = sorted(set(option) - self._AUTOCAST_KEYS)
        if unknown:
            raise ValueError(
                f"Unknown torch.autocast argument {unknown[0]!r} in the 'autocast' option; "
                f"accepted: {', '.join(sorted(self._AUTOCAST_KEYS))}."
            )
        kwargs = dict(option)
        device_type = kwargs.setdefault("device_type", self.device_type)
        if "dtype" not in kwargs:
            kwargs["dtype"] = torch.bfloat16 if device_type == "cpu" else torch.float16
        kwargs.setdefault("enabled", True)
        if not kwargs["enabled"]:
            return None
        return kwargs

    def _build_grad_scaler(self, option: Any) -> torch.amp.GradScaler | None:
        if option is None or option is False:
            return None
        if option is True:
            if self.device_type != "cuda":
                return None
            return torch.amp.GradScaler("cuda")
        if not isinstance(option, torch.amp.GradScaler):
            raise TypeError(
                "Expected a torch.amp.GradScaler, True or None for the 'grad_scaler' option, "
                f"but received {type(option).__name__}."
            )
        return option

    @property
    def autocast_enabled(self) -> bool:
        """Whether the forward pass runs under ``torch.autocast``."""
        return self._autocast_kwargs is not None

    @property
    def autocast_kwargs(self) -> dict[str, Any] | None:
        """The ``torch.autocast`` keyword arguments in use, or ``None`` when off."""
        return None if self._autocast_kwargs is None else dict(self._autocast_kwargs)

    def autocast_context(self) -> contextlib.AbstractContextManager[Any]:
        """A fresh ``torch.autocast`` context when autocast is on, else a no-op."""
        kwargs = self._autocast_kwargs
        if kwargs is None:
            return _NULL_CONTEXT
        return torch.autocast(**kwargs)

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The ``GradScaler`` in use, or ``None``."""
        return self._grad_scaler

    trace = classmethod(range_trace)  # type: ignore[var-annotated]

    def convert_batch(self, args: Any) -> Any:
        """Transfer a batch of any type to the device, keeping its type (see
        :meth:`BaseRuntime.convert_batch`).

        On the CPU, a batch whose tensors are all on the CPU already costs no move: a
        tensor comes back as it is, a tuple too, a list or dict of them as a new list or
        dict holding the same tensors (unless a subclass overrides :meth:`move_tensor`,
        which then sees every tensor).
        """
        if self._on_cpu and type(self).move_tensor is _MOVE_TENSOR:
            kind = type(args)
            if kind is _Tensor:
                if args.is_cpu:
                    return args
            elif kind is list or kind is tuple:
                for value in args:
                    if type(value) is not _Tensor or not value.is_cpu:
                        break
                else:
                    return args if kind is tuple else list(args)
            elif kind is dict:
                for value in args.values():
                    if type(value) is not _Tensor or not value.is_cpu:
                        break
                else:
                    return dict(args)
        return apply_to_tensors(args, self.move_tensor, self.device_spec)

    def move_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move ``module`` to the device with ``module.to(device)``."""
        return module.to(self.device_spec)

    def move_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Move ``tensor`` to the device; non-blocking when the target is CUDA."""
        return tensor.to(self.device_spec, non_blocking=self._non_blocking)


_MOVE_TENSOR = PyTorchRuntime.move_tensor
_Tensor = torch.Tensor
