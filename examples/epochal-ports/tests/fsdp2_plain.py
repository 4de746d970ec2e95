"""pytorch/examples' FSDP2 example (``originals/fsdp2_example.py``) on CPUs, started from given
weights: its ``main()`` with its meta path, its DTensor-API ``Checkpointer.load_model`` (reading
a safetensors file instead of a ``torch.save`` pickle), a fresh Adam, and its 10 steps; the full
weights at the end written by rank 0. The port is compared with this (``test_ports.py``).

``python -m torch.distributed.run --standalone --nproc-per-node 2 fsdp2_plain.py WEIGHTS OUT
[--explicit-prefetching]``
"""

from __future__ import annotations

import sys

import torch
from epochal_ports.fsdp2_model import ModelArgs, Transformer
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor


def set_modules_to_forward_prefetch(model: Transformer, num_to_forward_prefetch: int) -> None:
    for i, layer in enumerate(model.layers):
        if i >= len(model.layers) - num_to_forward_prefetch:
            break
        layers_to_prefetch = [model.layers[i + j] for j in range(1, num_to_forward_prefetch + 1)]
        layer.set_modules_to_forward_prefetch(layers_to_prefetch)  # type: ignore[operator]


def set_modules_to_backward_prefetch(model: Transformer, num_to_backward_prefetch: int) -> None:
    for i, layer in enumerate(model.layers):
        if i < num_to_backward_prefetch:
            continue
        layers_to_prefetch = [model.layers[i - j] for j in range(1, num_to_backward_prefetch + 1)]
        layer.set_modules_to_backward_prefetch(layers_to_prefetch)  # type: ignore[operator]


def main(weights: str, out: str, explicit_prefetching: bool) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    torch.distributed.init_process_group(backend="gloo")
    torch.manual_seed(0)
    vocab_size = 1024
    batch_size = 32
    seq_len = 64
    model_args = ModelArgs(n_layers=10, n_heads=4, vocab_size=vocab_size, max_seq_len=seq_len, dropout_p=0)
    with torch.device("meta"):
        model = Transformer(model_args)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    if explicit_prefetching:
        set_modules_to_forward_prefetch(model, num_to_forward_prefetch=2)
        set_modules_to_backward_prefetch(model, num_to_backward_prefetch=2)
    # Checkpointer.load_model, DTensor API
    full_sd = load_file(weights)
    meta_sharded_sd = model.state_dict()
    sharded_sd = {}
    for param_name, full_tensor in full_sd.items():
        sharded_meta_param = meta_sharded_sd.get(param_name)
        sharded_tensor = distribute_tensor(
            full_tensor, sharded_meta_param.device_mesh, sharded_meta_param.placements
        )
        sharded_sd[param_name] = nn.Parameter(sharded_tensor)
    model.load_state_dict(sharded_sd, strict=False, assign=True)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(10):
        if explicit_prefetching:
            model.unshard()  # type: ignore[operator]
        x = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)
        loss = model(x).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if torch.distributed.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--explicit-prefetching" in sys.argv[3:])
