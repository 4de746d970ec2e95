"""``epochal.torch.sharded_state`` with FSDP2's DTensors: saved sharded by 2 processes, read by one.

The checkpoint plugin's sharded format gives DCP what :func:`sharded_state` returns; under FSDP2
(``fully_shard`` over a CPU ``DeviceMesh``, gloo) those are DTensor shards, never gathered. Two
processes save them with ``dcp.save``; one process without a process group reads them back
with :func:`load_from` into a plain module (DCP reshards): the weights equal the full tensors
the two processes held, and the optimizer's state is there.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the spawned processes import it too
from fsdp_worker import fsdp_worker, make_module  # noqa: E402


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_shards_saved_by_two_processes_load_whole_on_one(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from epochal.torch import sharded_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(fsdp_worker, args=(port, str(tmp_path)), nprocs=2)
    expected = torch.load(tmp_path / "expected.pt")
    assert expected["kinds"] == ["DTensor"]  # sharded, not gathered, when handed to DCP
    torch.manual_seed(1)  # other initial weights
    module = make_module()
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    sharded_state.load_from(module, optimizer, tmp_path)
    loaded = module.state_dict()
    assert loaded.keys() == expected["full"].keys()
    for name, value in expected["full"].items():
        assert torch.equal(loaded[name], value), name
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(optimizer.state_dict()["state"][0])
