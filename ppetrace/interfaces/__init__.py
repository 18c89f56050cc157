"""Interfaces: the module contracts kept from upstream, for users to subclass.

Takes in: nothing from the rest of ppetrace (these modules import only torch).
:mod:`.module_interface` is PyMarlin's ``core.module_interface``
(:class:`Stage`, :class:`CallbackInterface`, :class:`ModuleInterface`), and
:mod:`.network` is delira's ``AbstractPyTorchNetwork`` with
:class:`DataParallelPyTorchNetwork` and :func:`scale_loss`.

Hands on: user subclasses, which :mod:`ppetrace.training` drives through one
adapter per module kind. Names and signatures follow the seeds in
``shared/seeds``.
"""

from __future__ import annotations

from .module_interface import CallbackInterface, ModuleInterface, Stage
from .network import AbstractPyTorchNetwork, DataParallelPyTorchNetwork, scale_loss

__all__ = [
    "AbstractPyTorchNetwork",
    "CallbackInterface",
    "DataParallelPyTorchNetwork",
    "ModuleInterface",
    "Stage",
    "scale_loss",
]
