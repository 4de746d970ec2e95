"""Sharded checkpoints on 2 processes: epochal's sharded save against DCP alone and the rank-0 format.

Run: ``python bench/sharded_checkpoint.py [--mb 200] [--rounds 3] [--strategy ddp|fsdp|both]
[--dir DIR]`` (needs torch and epochal-checkpoint installed; CPU, gloo over loopback).

Two processes hold a ``TorchModel`` whose state is ``--mb`` MB: four bias-free square
``Linear`` layers (half the state) and SGD's momentum buffers (the other half), under DDP
(every rank holds the whole state) and under FSDP2 (``strategy="fsdp"``: each rank holds its
half of every parameter and momentum buffer). Per strategy three cases, each in its own pair of
fresh processes (so each one's peak memory is its own), one after the other in one run; per
case an untimed warm-up round, then ``--rounds`` timed ones (medians):

- **epochal sharded**: what the checkpoint plugin's ``format = "sharded"`` save does after the
  loop state is taken: ``write_tensors`` (rank 0 makes the temporary directory, every rank
  ``dcp.save``\\ s its part with a ``FileSystemWriter``, checksums and fsyncs its own files,
  all-gather), then rank 0's ``write_checkpoint`` of the plain rest with the manifest listing
  every file (commit record last, fsyncs, rename). The load is a resume's: rank 0 reads and
  verifies the checkpoint (every file's CRC-32), broadcasts the small plain state, every rank
  loads its tensors through ``TorchModel.load_state_dict`` (``dcp.load``).
- **epochal sharded async** (``async_save = true``): the time is the training thread's stall
  per save (from a barrier before to a barrier after): rank 0 makes the temporary directory,
  every rank copies its tensors into host memory (DCP's ``DefaultStager``, buffers reused
  from the previous save) and starts its writer thread; the threads then write as **epochal
  sharded** does, their collectives on their own gloo group, and rank 0's commits. The write's
  own time (to the commit, joined before the next save) is given as ``write s``.
- **DCP alone**: ``dcp.save(model.sharded_state_dict(), checkpoint_id=DIR)``; the load
  ``dcp.load`` + ``set_state_dict``. The floor: no checksums, no commit record.
- **epochal single** (today's format 4): rank 0 flattens ``TorchModel.state_dict()`` and writes
  one ``data.bin`` (``write_checkpoint``); the other rank waits (under FSDP it takes part in
  gathering the full state to rank 0's host). The load is a resume's: rank 0 reads it and
  broadcasts the whole state (``broadcast_object``), every rank loads it (under FSDP each rank
  slices its shards out of it).

Each time is rank 0's, from a barrier before to a barrier after. ``os.sync()`` runs (untimed)
before each save. Memory: rank 0's resident set is sampled every 2 ms during the saves (and
the loads); the table gives its peak above the resident set before them, and
``ru_maxrss`` at the end (the process's high-water mark, setup included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MB = 1 << 20
CASES = ("epochal sharded", "epochal sharded async", "DCP alone", "epochal single")


def rss() -> int:
    """This process's resident set now, in bytes."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """Sample the resident set every 2 ms while the block runs; ``peak`` is the highest seen."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __enter__(self) -> Peak:
        self.peak = rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def make_model(mb: int, world: Any, strategy: str) -> Any:
    from epochal.torch import TorchModel

    torch.manual_seed(0)
    side = int((mb * MB / 2 / 4 / 4) ** 0.5)  # four square float32 layers: half the state
    module = torch.nn.Sequential(*(torch.nn.Linear(side, side, bias=False) for _ in range(4)))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    model = TorchModel(module, optimizer, torch.nn.functional.mse_loss, device="cpu", strategy=strategy)
    model.distribute(world)  # FSDP2 shards (and refuses an optimizer that has stepped): first
    for p in model.raw_module.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()  # the momentum buffers: the other half
    optimizer.zero_grad(set_to_none=True)
    return model


def local_bytes(tensor: torch.Tensor) -> int:
    """The bytes this rank holds of *tensor* (its shard of a DTensor)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def timed(world: Any, action: Callable[[], None]) -> float:
    world.barrier()
    start = time.perf_counter()
    action()
    world.barrier()
    return time.perf_counter() - start


def worker(rank: int, strategy: str, case: str, mb: int, rounds: int, base: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from epochal_checkpoint.background import AsyncShards
    from epochal_checkpoint.sharded import temporary, write_tensors
    from epochal_checkpoint.storage import flatten, read_checkpoint, read_checkpoint_info, write_checkpoint

    from epochal.distributed.world import World
    from epochal.torch import sharded_state

    world = World(rank=rank, size=2, local_rank=rank, backend="gloo")
    model = make_model(mb, world, strategy)
    params = list(model.raw_module.parameters())
    state_bytes = sum(p.numel() * p.element_size() for p in params) * 2  # + momentum: the same
    held_bytes = sum(local_bytes(p) for p in params) * 2
    root = Path(base) / f"{strategy}-{case.replace(' ', '-')}"
    if world.is_zero:
        root.mkdir(parents=True)
    world.barrier()
    name = "ckpt-e0001-i000001"
    shards = AsyncShards()
    shards.open(world)  # a collective: every case opens it, so the processes stay in step
    writes: list[float] = []
    writer: list[threading.Thread] = []

    def write_later(target: Path, tmp: Path, staged: dict[str, Any], i: int, began: float) -> None:
        mine = target if world.is_zero else None
        files = shards.write(world, tmp, staged, mine, name)
        if world.is_zero:
            snapshot = flatten({"model": model.rest_state_dict()})
            write_checkpoint(target, name, snapshot, {"sequence": i}, prepared=(tmp, files))
        writes.append(time.perf_counter() - began)

    def save(i: int) -> None:
        target = root / f"r{i}"
        if case == "DCP alone":
            import torch.distributed.checkpoint as dcp

            dcp.save(model.sharded_state_dict(), checkpoint_id=str(target))
            return
        if world.is_zero:
            target.mkdir()
        if case == "epochal sharded async":
            began = time.perf_counter()
            tmp, _ = temporary(world, target if world.is_zero else None, name)
            staged = shards.stage(model.sharded_state_dict())
            writer.append(threading.Thread(target=write_later, args=(target, tmp, staged, i, began)))
            writer[-1].start()
        elif case == "epochal sharded":
            mine = target if world.is_zero else None
            prepared = write_tensors(world, model.sharded_state_dict(), mine, name)
            if world.is_zero:
                snapshot = flatten({"model": model.rest_state_dict()})
                write_checkpoint(target, name, snapshot, {"sequence": i}, prepared=prepared)
        else:
            full = model.state_dict()  # under FSDP a collective: the full state on rank 0's host
            if world.is_zero:
                write_checkpoint(target, name, flatten({"model": full}), {"sequence": i})

    def load(i: int) -> None:
        target = root / f"r{i}"
        if case == "DCP alone":
            sharded_state.load_from(model.raw_module, model.optimizer, target)
            return
        state = None
        if world.is_zero:
            path = target / name
            sharded = case.startswith("epochal sharded")
            state = read_checkpoint_info(path).state if sharded else read_checkpoint(path)[0]
        state = world.broadcast_object(state)
        model.load_state_dict(state["model"])

    saves, loads, save_peak, load_peak = [], [], 0, 0
    before = rss()
    for i in range(rounds + 1):  # round 0: warm-up
        if world.is_zero:
            os.sync()
        with Peak() as peak:
            seconds = timed(world, lambda i=i: save(i))  # type: ignore[misc]
            while writer:  # the write in flight finishes before the load (and the next save)
                writer.pop().join()
        save_peak = max(save_peak, peak.peak - before) if i else save_peak
        with Peak() as peak:
            loaded = timed(world, lambda i=i: load(i))  # type: ignore[misc]
        load_peak = max(load_peak, peak.peak - before) if i else load_peak
        if i:
            saves.append(seconds)
            loads.append(loaded)
        world.barrier()
        if world.is_zero:
            shutil.rmtree(root / f"r{i}")
    if world.is_zero:
        result = {
            "strategy": strategy,
            "case": case,
            "state_mb": state_bytes / MB,
            "held_mb": held_bytes / MB,
            "save_s": statistics.median(saves),
            "write_s": statistics.median(writes[1:]) if len(writes) > 1 else None,
            "load_s": statistics.median(loads),
            "save_peak_mb": save_peak / MB,
            "load_peak_mb": load_peak / MB,
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_before_mb": before / MB,
        }
        Path(out).write_text(json.dumps(result))
    world.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategy", choices=("ddp", "fsdp", "both"), default="both")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="epochal-sharded-bench-", dir=args.dir))
    strategies = ("ddp", "fsdp") if args.strategy == "both" else (args.strategy,)
    results = []
    try:
        for strategy in strategies:
            for case in CASES:
                out = base / f"{strategy}-{case.replace(' ', '-')}.json"
                spawn_args = (strategy, case, args.mb, args.rounds, str(base), free_port(), str(out))
                mp.spawn(worker, args=spawn_args, nprocs=2)
                results.append(json.loads(out.read_text()))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    state = results[0]["state_mb"]
    print(f"2 processes (gloo, CPU), state {state:.0f} MB, {args.rounds} rounds, medians")
    print("| strategy | case | save s | DCP/save | load s | DCP/load | rank 0 holds |", end="")
    print(" rank 0 peak RSS above start: save | load | peak/state: save | load | ru_maxrss |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        floor = next(f for f in results if f["strategy"] == r["strategy"] and f["case"] == "DCP alone")
        print(
            f"| {r['strategy']} | {r['case']} | {r['save_s']:.3f} | {floor['save_s'] / r['save_s']:.2f}"
            f" | {r['load_s']:.3f} | {floor['load_s'] / r['load_s']:.2f} | {r['held_mb']:.0f} MB"
            f" | {r['save_peak_mb']:.0f} MB | {r['load_peak_mb']:.0f} MB"
            f" | {r['save_peak_mb'] / state:.2f} | {r['load_peak_mb'] / state:.2f}"
            f" | {r['maxrss_mb']:.0f} MB |"
        )
    for strategy in strategies:
        before = next(r["rss_before_mb"] for r in results if r["strategy"] == strategy)
        print(
            f"({strategy}: rank 0's resident set before the saves: {before:.0f} MB, "
            "its part of the state included)"
        )
    for strategy in strategies:
        sync, background = (
            next(r for r in results if r["strategy"] == strategy and r["case"] == case)
            for case in ("epochal sharded", "epochal sharded async")
        )
        print(
            f"({strategy}: async_save stalls the training thread {background['save_s']:.3f} s per save, "
            f"{background['save_s'] / sync['save_s']:.2f}x the synchronous save's {sync['save_s']:.3f} s; "
            f"its write takes {background['write_s']:.3f} s in the background)"
        )


if __name__ == "__main__":
    main()
