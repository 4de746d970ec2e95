"""pytorch/examples' FSDP2 example (``distributed/FSDP2/example.py``) as an epochal model: its
meta-device path as written.

The example builds its Transformer under ``torch.device("meta")``, shards each block then the
root with ``fully_shard``, then gives the shards memory (``model.to_empty(device=...)``) and
initialises them (``model.reset_parameters()``) or loads a checkpoint into them; its loop draws a
batch of random tokens, takes ``model(x).sum()`` as the loss, clips the gradients' norm at 1.0
and steps Adam, 10 times. The factory keeps the first lines word for word (the same model
file, :mod:`epochal_ports.fsdp2_model`); ``TorchModel(strategy="fsdp")`` does the rest:

- ``fsdp_options = {"wrap_policy": ["TransformerBlock"]}``: the example's units (each of
  ``model.layers``, then the root); ``--explicit-prefetching`` is ``forward_prefetch = 2``,
  ``backward_prefetch = 2`` (and the root gathered before each forward: its ``model.unshard()``);
  ``--mixed-precision`` is ``precision = "bf16-mixed"`` (its ``MixedPrecisionPolicy``);
- each rank materialises its shards and initialises them by every submodule's
  ``reset_parameters`` (the example's ``Transformer.reset_parameters`` leaves its blocks as
  ``to_empty`` left them: uninitialised memory), or reads ``pretrained`` weights into them (its
  ``Checkpointer.load_model``);
- the optimizer the factory makes on the meta parameters is re-pointed at the shards (the
  example makes it after sharding); checkpoints are the checkpoint plugin's (sharded, DCP).

``epochal run examples/epochal-ports/fsdp2.toml --nproc 2``. Started from the same weights, it
ends bitwise where the example's loop does (``tests/test_ports.py``, on 2 gloo processes: the
example itself asks for 2 GPUs).
"""

from __future__ import annotations

from typing import Any

import torch

from epochal.torch import TorchModel
from epochal_ports.fsdp2_model import ModelArgs, Transformer

__all__ = ["make_data", "make_model"]


def make_model(
    vocab_size: int = 1024,
    batch_size: int = 32,
    seq_len: int = 64,
    n_layers: int = 10,
    n_heads: int = 4,
    lr: float = 1e-2,
    explicit_prefetching: bool = False,
    mixed_precision: bool = False,
    pretrained: str | None = None,
    device: str = "auto",
) -> TorchModel:
    """The example's model, sharded as it shards it, with its optimizer and loop body."""
    torch.manual_seed(0)
    model_args = ModelArgs(
        n_layers=n_layers,
        n_heads=n_heads,
        vocab_size=vocab_size,
        max_seq_len=seq_len,
        dropout_p=0,
    )
    with torch.device("meta"):
        model = Transformer(model_args)
    fsdp_options: dict[str, Any] = {"wrap_policy": ["TransformerBlock"]}
    if explicit_prefetching:
        fsdp_options.update(forward_prefetch=2, backward_prefetch=2)

    def training_step(self: TorchModel, batch: Any) -> torch.Tensor:
        x = torch.randint(0, vocab_size, (batch_size, seq_len), device=self.device)
        loss: torch.Tensor = self.module(x).sum()
        return loss

    return TorchModel(
        model,
        torch.optim.Adam(model.parameters(), lr=lr),
        training_step=training_step,
        strategy="fsdp",
        fsdp_options=fsdp_options,
        precision="bf16-mixed" if mixed_precision else "32-true",
        gradient_clip_val=1.0,
        pretrained=pretrained,
        device=device,
    )


def make_data(steps: int = 10, processes: int = 2) -> dict[str, Any]:
    """*steps* batches on each of *processes* ranks: the example's ``for _ in range(10)`` (the
    step draws its tokens itself)."""
    return {"train": list(range(steps * processes))}
