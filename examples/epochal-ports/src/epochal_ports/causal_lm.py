"""A Hugging Face ``transformers`` causal language model trained by epochal: the model computes
its own loss from the ``labels`` of a dict batch.

The model is built from a small ``GPT2Config`` (nothing downloaded); the data are random
token sequences in a shuffling DataLoader of dict batches (``input_ids``, ``attention_mask``,
``labels``). :func:`lm_step` is all the port needs: ``model.module(**batch).loss``.
:func:`plain_loop` is the same training in plain PyTorch, the reference the port equals
bitwise (tests/test_ports.py), through ``kill -9`` and ``--resume`` too::

    epochal run examples/epochal-ports/causal_lm.toml
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from epochal.torch import TorchModel

__all__ = ["lm_step", "make_data", "make_model", "plain_loop", "tiny_gpt2"]


def tiny_gpt2(seed: int, vocab: int = 64, layers: int = 2, width: int = 32) -> Any:
    """A GPT-2 of *layers* blocks of *width*, initialised after ``torch.manual_seed(seed)``
    (dropout left at GPT-2's 0.1: it draws from torch's global generator while training)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=width, n_layer=layers, n_head=2)
    return GPT2LMHeadModel(config)


def lm_step(model: TorchModel, batch: Mapping[str, torch.Tensor]) -> Any:
    """The model's own loss (labels shifted inside the model, as every causal LM does)."""
    return model.module(**batch).loss


def _optimizer(net: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)


def make_model(seed: int = 0, lr: float = 1e-3, **options: Any) -> TorchModel:
    """The tiny GPT-2 and its AdamW; *options* go to TorchModel (precision, accumulation...)."""
    net = tiny_gpt2(seed)
    return TorchModel(net, _optimizer(net, lr), training_step=lm_step, **options)


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, count: int, length: int, vocab: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def make_data(count: int = 96, valid: int = 32, length: int = 16, batch_size: int = 8) -> dict[str, Any]:
    """Random token sequences: a shuffling train loader and an unshuffled valid one."""
    return {
        "train": torch.utils.data.DataLoader(
            _Tokens(count, length, 64, 1), batch_size=batch_size, shuffle=True
        ),
        "valid": torch.utils.data.DataLoader(_Tokens(valid, length, 64, 2), batch_size=batch_size),
    }


def plain_loop(
    epochs: int, seed: int = 0, lr: float = 1e-3, accumulate: int = 1, clip: float | None = None, **data: Any
) -> torch.nn.Module:
    """The same training as a plain PyTorch loop (what the port replaces): gradient
    accumulation over *accumulate* batches, norm clipping, an evaluation pass after each epoch."""
    net = tiny_gpt2(seed)
    optimizer = _optimizer(net, lr)
    loaders = make_data(**data)
    for _ in range(epochs):
        net.train()
        for i, batch in enumerate(loaders["train"]):
            loss = net(**batch).loss
            (loss / accumulate if accumulate > 1 else loss).backward()
            if (i + 1) % accumulate == 0:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(list(net.parameters()), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        net.eval()
        with torch.no_grad():
            for batch in loaders["valid"]:
                net(**batch)
    return net
