"""A custom device runtime: registered for its own device string, with its own ``trace``.

    python examples/custom_runtime.py [--epochs 3] [--samples 4096] [--trace runtime_trace.json]

``MyDeviceRuntime`` serves the made-up device type ``"my_device"``: a stand-in
for an accelerator plugin, backed here by the CPU so that the example runs
anywhere. It shows the three things a device runtime usually does:

- **moves data its own way**: batches arrive as float64 and the device computes
  in float32, so ``move_tensor`` converts floating-point tensors;
- **adds its own tracing** by overriding the classmethod ``trace``: every
  runtime hook (``runtime.convert_batch``, ``runtime.train_pre_step``, ...)
  is counted, is also a ``torch.profiler.record_function`` range (so it
  shows up in a torch profiler trace, as NVTX ranges would on a GPU), and
  its span gets the attribute ``my_device.call``, the hook's call number;
- is **registered** with ``ppetrace.runtime_registry.register("my_device", ...)``,
  after which ``ppetrace.Trainer(device="my_device")`` (and ``"my_device:0"``)
  trains through it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ppetrace
from exporters import read_chrome_trace

DEVICE_TYPE = "my_device"


class MyDeviceRuntime(ppetrace.BaseRuntime):
    """The runtime of ``"my_device"``: float32 compute on the CPU, hooks counted and ranged."""

    #: hook event name -> calls, over every instance (``trace`` is a classmethod)
    calls: ClassVar[collections.Counter[str]] = collections.Counter()

    def move_module(self, module: nn.Module) -> nn.Module:
        """Put the module on the device: float32 parameters on the CPU."""
        return module.to(device="cpu", dtype=torch.float32)

    def move_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Put a tensor on the device: floating point becomes float32, the rest stays."""
        if tensor.is_floating_point() and tensor.dtype != torch.float32:
            return tensor.to(torch.float32)
        return tensor

    @classmethod
    @contextlib.contextmanager
    def trace(cls, event_name: str | None, arg: Any) -> Iterator[None]:
        """Count the hook, open a ``record_function`` range, and record the ppetrace span.

        The span's attributes are the Trainer's (``arg``, a dict shared between
        hooks, so it is copied rather than changed) plus ``my_device.call``.
        """
        if event_name is None:
            yield
            return
        cls.calls[event_name] += 1
        attrs = dict(arg) if isinstance(arg, dict) else {"ppetrace.arg": arg}
        attrs["my_device.call"] = cls.calls[event_name]
        with torch.profiler.record_function(event_name), super().trace(event_name, attrs):
            yield


def register() -> None:
    """Serve ``"my_device"`` with :class:`MyDeviceRuntime` (replaces an earlier registration)."""
    ppetrace.runtime_registry.register(DEVICE_TYPE, MyDeviceRuntime)


def synthetic_regression(samples: int, features: int = 8, seed: int = 0) -> TensorDataset:
    """float64 inputs and targets of one fixed noisy linear function (the device converts them).

    The function is the same for every ``seed``; ``seed`` draws the inputs and the noise.
    """
    w = torch.randn(features, 1, generator=torch.Generator().manual_seed(1234), dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen, dtype=torch.float64)
    y = x @ w + 0.01 * torch.randn(samples, 1, generator=gen, dtype=torch.float64)
    return TensorDataset(x, y)


class ValidationMSE(ppetrace.CallbackInterface):
    """Keeps the mean validation loss of each validation run."""

    def __init__(self) -> None:
        self.history: list[float] = []

    def on_end_val_epoch(
        self, global_step: int, *val_step_collated_outputs: Any, key: str = "default"
    ) -> None:
        losses = val_step_collated_outputs[0]  # a plain module's outputs are (loss, preds)
        self.history.append(float(losses.float().mean()))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train on ``"my_device"``; print the hook counts and return them with the losses."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--trace", default="runtime_trace.json", help="Chrome trace to write")
    args = parser.parse_args(argv)

    register()
    MyDeviceRuntime.calls.clear()
    torch.manual_seed(0)
    train = synthetic_regression(args.samples)
    val = synthetic_regression(max(args.samples // 4, args.batch_size), seed=1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).double()
    val_mse = ValidationMSE()

    trainer = ppetrace.Trainer(
        device=DEVICE_TYPE,
        max_epochs=args.epochs,
        callbacks=[val_mse],
        progress=False,
        trace_path=args.trace,
    )
    trainer.fit(
        model,
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(val, batch_size=256),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss_fn=nn.functional.mse_loss,
    )

    print(f"runtime: {trainer.runtime!r}; parameters are {next(model.parameters()).dtype}")
    print("validation MSE per epoch: " + ", ".join(f"{v:.4f}" for v in val_mse.history))
    print("runtime hooks traced by MyDeviceRuntime.trace:")
    for name, count in sorted(MyDeviceRuntime.calls.items()):
        print(f"  {name:<32} {count:6d}")
    frame = read_chrome_trace(args.trace)
    tagged = frame[frame["name"].str.startswith("runtime.")]
    print(
        f"{len(tagged)} runtime spans in {args.trace}; open it in Perfetto UI "
        "(https://ui.perfetto.dev) or speedscope (https://www.speedscope.app)."
    )
    return {"calls": dict(MyDeviceRuntime.calls), "val_mse": val_mse.history}


if __name__ == "__main__":
    main()
    sys.exit(0)
