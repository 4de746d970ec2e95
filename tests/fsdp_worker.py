"""The two processes of ``test_torch_sharded_state.py``: FSDP2 shards saved with DCP (spawned)."""

from __future__ import annotations

import os

import torch


def make_module() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def fsdp_worker(rank: int, port: int, path: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from epochal.torch import sharded_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    module = make_module()
    mesh = init_device_mesh("cpu", (2,))
    for layer in (module[0], module[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    module(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    state = sharded_state.sharded_state(module, optimizer)
    kinds = {type(value).__name__ for value in state["model"].values()}
    dcp.save(state, checkpoint_id=path)
    full = {k: v.full_tensor() for k, v in module.state_dict().items()}  # for the check only
    if rank == 0:
        torch.save({"full": full, "kinds": sorted(kinds)}, os.path.join(path, "expected.pt"))
    dist.barrier()
    dist.destroy_process_group()
