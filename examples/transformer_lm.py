"""A small transformer language model on generated token data, with validation, traced.

    python examples/transformer_lm.py [--epochs 3] [--samples 2048] [--trace lm_trace.json]

The data is generated here, so nothing is downloaded. Each sequence is a
sentence of a tiny "reversal" language::

    <bos> a b c d e <sep> e d c b a

The symbols before ``<sep>`` are random; the ones after it are determined by
them (the prefix reversed). A decoder-only transformer (causal self-attention,
learned positions) learns next-token prediction on the determined part; the
loss ignores the random prefix, which no model can predict. Validation on
held-out sentences reports the loss and the token accuracy after ``<sep>``
(chance is ``1 / symbols``).

The model is a ``ppetrace.ModuleInterface``: it owns its loaders, its AdamW
optimizer with a warmup-cosine schedule, its training and validation steps,
and it is its own callback (``on_end_val_epoch`` turns the collected
validation outputs into metrics). ``ppetrace.Trainer`` clips gradients,
validates every epoch and traces every hook into a Chrome trace; the step
report is printed at the end.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import ppetrace
from exporters import read_chrome_trace, render, step_report

PAD, BOS, SEP = 0, 1, 2
SPECIAL = 3  # symbols are the tokens SPECIAL .. SPECIAL + symbols - 1
IGNORE = -100  # target value that the loss skips


def reversal_sentences(
    samples: int, length: int, symbols: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` for next-token prediction on reversal sentences.

    Each sentence is ``<bos> x1..xL <sep> xL..x1``; ``inputs`` is the sentence
    without its last token and ``targets`` without its first, with the
    targets inside the random prefix set to ``IGNORE``.
    """
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(SPECIAL, SPECIAL + symbols, (samples, length), generator=gen)
    bos = torch.full((samples, 1), BOS)
    sep = torch.full((samples, 1), SEP)
    sentence = torch.cat([bos, prefix, sep, prefix.flip(1)], dim=1)  # (N, 2L + 2)
    inputs = sentence[:, :-1].clone()
    targets = sentence[:, 1:].clone()
    targets[:, :length] = IGNORE  # x1..xL are random: nothing to learn there
    return inputs, targets


class TinyDecoder(nn.Module):
    """A decoder-only transformer: token + position embeddings, causal encoder layers."""

    causal_mask: torch.Tensor  # a buffer: -inf above the diagonal

    def __init__(
        self, vocab: int, context: int, d_model: int = 64, heads: int = 4, layers: int = 2
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(context, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model,
            heads,
            dim_feedforward=4 * d_model,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        mask = nn.Transformer.generate_square_subsequent_mask(context)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, time, vocab)`` for each next token."""
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        h = self.tokens(tokens) + self.positions(pos)
        h = self.blocks(h, mask=self.causal_mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


class ReversalLM(ppetrace.ModuleInterface):
    """The language model with its data, optimizer, schedule, steps and metrics."""

    def __init__(
        self,
        *,
        samples: int,
        length: int = 6,
        symbols: int = 10,
        lr: float = 3e-3,
        epochs: int = 1,
        d_model: int = 64,
        layers: int = 2,
    ) -> None:
        super().__init__()
        self.symbols = symbols
        self.vocab = SPECIAL + symbols
        self.lr = lr
        self.net = TinyDecoder(self.vocab, context=2 * length + 1, d_model=d_model, layers=layers)
        self.train_set = TensorDataset(*reversal_sentences(samples, length, symbols, seed=0))
        self.val_set = TensorDataset(
            *reversal_sentences(max(samples // 8, 64), length, symbols, seed=1)
        )
        self.history: dict[str, list[float]] = {"val_loss": [], "val_accuracy": []}
        #: prints above the progress bar once main() sets it to trainer.print
        self.log: Callable[..., None] = print

    # -- data and optimization -----------------------------------------------------

    def get_train_dataloader(self, sampler: type[Sampler[Any]], batch_size: int) -> DataLoader[Any]:
        return DataLoader(
            self.train_set,
            batch_size=batch_size,
            sampler=sampler(self.train_set),  # type: ignore[call-arg]
        )

    def get_val_dataloaders(self, sampler: type[Sampler[Any]], batch_size: int) -> DataLoader[Any]:
        return DataLoader(
            self.val_set,
            batch_size=batch_size,
            sampler=sampler(self.val_set),  # type: ignore[call-arg]
        )

    def get_optimizers_schedulers(
        self, estimated_global_steps_per_epoch: int, epochs: int
    ) -> tuple[list[torch.optim.Optimizer], list[Any]]:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        total = max(1, estimated_global_steps_per_epoch * epochs)
        warmup = max(1, total // 10)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        return [opt], [torch.optim.lr_scheduler.LambdaLR(opt, schedule)]

    # -- steps ---------------------------------------------------------------------

    def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs, targets = batch
        logits = self.net(inputs)
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, self.vocab), targets.reshape(-1), ignore_index=IGNORE
        )
        return loss, logits, targets

    def train_step(self, global_step: int, batch: Any, device: Any) -> torch.Tensor:
        loss, _, _ = self._loss(batch)
        return loss

    def val_step(self, global_step: int, batch: Any, device: Any) -> Any:
        loss, logits, targets = self._loss(batch)
        scored = targets != IGNORE
        correct = (logits.argmax(-1) == targets) & scored
        n = scored.sum()
        # per batch: summed loss, correct tokens, scored tokens (collated on dim 0)
        return (loss * n).reshape(1), correct.sum().reshape(1), n.reshape(1)

    # -- metrics (this module is its own callback) ---------------------------------

    def on_end_val_epoch(
        self, global_step: int, *val_step_collated_outputs: Any, key: str = "default"
    ) -> None:
        loss_sum, correct, scored = (t.sum().item() for t in val_step_collated_outputs)
        loss, accuracy = loss_sum / scored, correct / scored
        self.history["val_loss"].append(loss)
        self.history["val_accuracy"].append(accuracy)
        self.log(
            f"step {global_step:5d}  val loss {loss:.3f}  token accuracy {accuracy:.1%} "
            f"(chance {1 / self.symbols:.0%})"
        )


def main(argv: Sequence[str] | None = None) -> dict[str, list[float]]:
    """Train, print validation metrics and the step report; return the validation history."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048, help="training sentences")
    parser.add_argument("--length", type=int, default=8, help="symbols before <sep>")
    parser.add_argument("--symbols", type=int, default=16, help="size of the alphabet")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--trace", default="lm_trace.json", help="where to write the Chrome trace")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = ReversalLM(
        samples=args.samples,
        length=args.length,
        symbols=args.symbols,
        epochs=args.epochs,
        d_model=args.d_model,
        layers=args.layers,
    )
    trainer = ppetrace.Trainer(
        device="cpu",
        max_epochs=args.epochs,
        clip_grad_norm=1.0,
        val_every_n_epochs=1,
        progress=not args.no_progress,
        trace_path=args.trace,
    )
    model.log = trainer.print  # callbacks print above the progress bar
    trainer.fit(model, batch_size=args.batch_size, val_batch_size=256)

    print()
    print(render(step_report(read_chrome_trace(args.trace), warmup_steps=1), top=12))
    print(
        f"\nWrote {args.trace}: open it in Perfetto UI (https://ui.perfetto.dev) or speedscope (https://www.speedscope.app)."
    )
    return model.history


if __name__ == "__main__":
    main()
    sys.exit(0)
