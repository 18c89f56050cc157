"""delira networks ported to ppetrace: a classifier on float64 NumPy data, and a GAN closure.

Each network is written as a delira user writes it (only the import changes);
ppetrace's Trainer trains it, and :func:`delira_reference` trains a copy with a
plain loop written to delira's semantics. Parameters after N steps must match
exactly. The rules, in delira at 9c23906 (github.com/delira-dev/delira, the
version whose ``AbstractPyTorchNetwork`` is the seed ppetrace keeps):

- ``delira/models/backends/torch/abstract_network.py:90-97`` (``prepare_batch``):
  every array becomes a tensor on its device, then ``.to(torch.float)``;
- ``:139-140``: the closure asserts losses when optimizers are given;
- ``:156-163``: ``preds = model(data)``; each loss is ``crit(preds["pred"], data_dict["label"])``;
- ``:171-176``: ``zero_grad``, backward inside ``scale_loss``, ``step`` of ``"default"``;
- ``:178-189``: without optimizers, loss and metric keys get the ``"val_"`` prefix;
- ``:191-192``: the predictions come back as a dict of detached tensors;
- ``delira/training/base_trainer.py:379-390`` (``_train_single_epoch``): per batch,
  ``closure_fn(module, data_dict, optimizers=..., losses=..., metrics=..., fold=...,
  batch_nr=...)``: whatever the closure steps, it steps in place, in its own order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import ppetrace
from ppetrace import AbstractPyTorchNetwork, scale_loss  # was: from delira.models import ...

STEPS_PER_EPOCH, EPOCHS = 4, 2


class Blobs(Dataset[dict[str, np.ndarray]]):
    """delira-style samples: float64 NumPy features and one-hot float64 labels."""

    def __init__(self, n: int = 32, seed: int = 3) -> None:
        rng = np.random.default_rng(seed)
        self.label = rng.integers(0, 3, n)
        self.data = rng.normal(size=(n, 5)) + self.label[:, None]  # float64
        self.noise = rng.normal(size=(n, 4))  # float64, for the GAN

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {
            "data": self.data[i],
            "label": np.eye(3)[self.label[i]],
            "noise": self.noise[i],
        }


def loader() -> DataLoader[Any]:
    return DataLoader(Blobs(), batch_size=8, shuffle=False)


def delira_prepare_batch(batch: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """delira's default ``prepare_batch``, written out (the batch arrives as CPU tensors of
    the NumPy arrays from the default collate)."""
    return {key: torch.as_tensor(value).to(device).to(torch.float) for key, value in batch.items()}


# -- the classifier ------------------------------------------------------------------


class Classifier(AbstractPyTorchNetwork):
    """delira's convention: forward returns ``{"pred": ...}``; the default closure trains it."""

    def __init__(self, in_channels: int = 5, n_outputs: int = 3) -> None:
        super().__init__(in_channels=in_channels, n_outputs=n_outputs)
        self.module = torch.nn.Sequential(
            torch.nn.Linear(in_channels, 16), torch.nn.ReLU(), torch.nn.Linear(16, n_outputs)
        )

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.module(x)}


class Predictions(ppetrace.CallbackInterface):
    def __init__(self) -> None:
        self.train_steps: list[Any] = []

    def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
        self.train_steps.append(outputs)


def delira_reference(
    net: AbstractPyTorchNetwork, optimizers: dict[str, Any], losses: dict[str, Any]
) -> list[dict[str, Any]]:
    """delira's trainer loop; returns what each closure call returned."""
    device = torch.device("cpu")
    returned = []
    for _ in range(EPOCHS):
        net.train()
        for batch_nr, batch in enumerate(loader()):
            data_dict = delira_prepare_batch(batch, device)
            returned.append(
                type(net).closure(
                    net,
                    data_dict,
                    optimizers=optimizers,
                    losses=losses,
                    metrics={},
                    fold=0,
                    batch_nr=batch_nr,
                )
            )
    return returned


def test_the_ported_classifier_trains_exactly_as_on_delira() -> None:
    torch.manual_seed(0)
    ours, theirs = Classifier(), Classifier()
    theirs.load_state_dict(ours.state_dict())
    losses = {"CE": torch.nn.CrossEntropyLoss()}  # one-hot float targets: class probabilities
    opt = torch.optim.Adam(ours.parameters(), lr=0.01)
    callback = Predictions()
    ppetrace.Trainer(
        max_epochs=EPOCHS, val_every_n_epochs=None, callbacks=[callback], progress=False
    ).fit(
        ours,
        loader(),
        optimizer={"default": opt},
        loss_fn=losses,
        metrics={"acc": lambda pred, label: (pred.argmax(1) == label.argmax(1)).float().mean()},
    )
    delira_reference(theirs, {"default": torch.optim.Adam(theirs.parameters(), lr=0.01)}, losses)
    for got, want in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(got, want)
    assert ours.init_kwargs == {"in_channels": 5, "n_outputs": 3}
    # the dict predictions reach callbacks collated key by key
    (first,) = callback.train_steps[0]
    assert set(first) == {"pred"} and first["pred"].shape == (8, 3)
    assert len(callback.train_steps) == STEPS_PER_EPOCH * EPOCHS


def test_validation_closure_results_get_delira_prefixes() -> None:
    net = Classifier()
    outs = ppetrace.Trainer(progress=False).validate(
        net, loader(), loss_fn={"CE": torch.nn.CrossEntropyLoss()}
    )
    assert set(outs) == {"default"}
    (preds,) = outs["default"]
    assert preds["pred"].shape == (32, 3) and preds["pred"].dtype == torch.float32


# -- the GAN ---------------------------------------------------------------------------


class GAN(AbstractPyTorchNetwork):
    """A delira user's GAN: the closure steps the discriminator, then the generator against
    the updated discriminator."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5)
        )
        self.discr = torch.nn.Sequential(
            torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )

    def forward(self, noise: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.gen(noise)}

    @staticmethod
    def closure(
        model: Any,
        data_dict: dict[str, Any],
        optimizers: dict[str, Any],
        losses: dict[str, Any] = {},  # noqa: B006 - delira's signature
        metrics: dict[str, Any] = {},  # noqa: B006
        fold: int = 0,
        **kwargs: Any,
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        real = data_dict["data"]
        fake = model(data_dict["noise"])["pred"]
        crit = losses["adv"]
        ones = torch.ones(real.shape[0], 1)
        zeros = torch.zeros(real.shape[0], 1)
        loss_d = crit(model.discr(real), ones) + crit(model.discr(fake.detach()), zeros)
        optimizers["discr"].zero_grad()
        with scale_loss(loss_d, optimizers["discr"]) as scaled:
            scaled.backward()
        optimizers["discr"].step()
        loss_g = crit(model.discr(fake), ones)  # the discriminator after its step
        optimizers["gen"].zero_grad()
        with scale_loss(loss_g, optimizers["gen"]) as scaled:
            scaled.backward()
        optimizers["gen"].step()
        return {}, {"discr": loss_d.item(), "gen": loss_g.item()}, {"pred": fake.detach()}


def gan_optimizers(net: GAN) -> dict[str, Any]:
    return {
        "discr": torch.optim.Adam(net.discr.parameters(), lr=0.01),
        "gen": torch.optim.Adam(net.gen.parameters(), lr=0.01),
    }


def _params(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    return (p.detach() for p in module.parameters())


@pytest.mark.parametrize("scaler", [False, True])
def test_the_ported_gan_closure_trains_exactly_as_on_delira(scaler: bool) -> None:
    torch.manual_seed(0)
    ours, theirs = GAN(), GAN()
    theirs.load_state_dict(ours.state_dict())
    losses = {"adv": torch.nn.BCEWithLogitsLoss()}
    options = None
    grad_scaler = None
    if scaler:  # one GradScaler for both optimizers, updated once per step (torch AMP docs)
        grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        options = {"grad_scaler": grad_scaler}
    trainer = ppetrace.Trainer(
        max_epochs=EPOCHS, val_every_n_epochs=None, runtime_options=options, progress=False
    )
    trainer.fit(ours, loader(), optimizer=gan_optimizers(ours), loss_fn=losses)
    delira_reference(theirs, gan_optimizers(theirs), losses)
    for got, want in zip(_params(ours), _params(theirs), strict=True):
        assert torch.equal(got, want)  # a power-of-two scale, unscaled before each step
    assert trainer.global_step == STEPS_PER_EPOCH * EPOCHS
    assert set(trainer.optimizers) == {"discr", "gen"}
    if grad_scaler is not None:  # growth_interval=1: doubled once per training step
        assert grad_scaler.get_scale() == 2.0 ** (10 + STEPS_PER_EPOCH * EPOCHS)


def test_deferring_the_gan_steps_would_train_differently() -> None:
    """What the issue saw: stepping both optimizers after the closure gives the generator the
    discriminator's old weights, and other numbers."""
    torch.manual_seed(0)
    ours, deferred = GAN(), GAN()
    deferred.load_state_dict(ours.state_dict())
    losses = {"adv": torch.nn.BCEWithLogitsLoss()}
    ppetrace.Trainer(max_epochs=EPOCHS, val_every_n_epochs=None, progress=False).fit(
        ours, loader(), optimizer=gan_optimizers(ours), loss_fn=losses
    )

    class Deferred:
        def __init__(self, opt: torch.optim.Optimizer) -> None:
            self.opt = opt

        def zero_grad(self) -> None: ...

        def step(self) -> None: ...

    opts = gan_optimizers(deferred)
    for _ in range(EPOCHS):
        for batch in loader():
            data = delira_prepare_batch(batch, torch.device("cpu"))
            GAN.closure(deferred, data, {k: Deferred(v) for k, v in opts.items()}, losses)
            for opt in opts.values():
                opt.step()
                opt.zero_grad()
    gap = max(
        (a - b).abs().max().item() for a, b in zip(_params(ours), _params(deferred), strict=True)
    )
    assert gap > 1e-3
