"""PyTorch checkpoints through ``TorchModel`` against raw I/O, torch.save and safetensors (issue 32).

Run: ``python bench/torch_checkpoint.py [--rounds N] [--big] [--sizes MB,...] [--params N] [--dir DIR]
[--device D] [--profile-load]``
(needs torch, safetensors and epochal-checkpoint installed).

A CPU module of float32 parameters (8 by default; ``--params N``: e.g. 240, about as many
tensors as ResNet-50's state holds, where each record's own cost shows) and its SGD optimizer with
momentum (the state is half module, half optimizer: 64 MB and 256 MB in all, 1 GB too with
``--big``) is saved and loaded,
side by side in one run, in interleaved rounds (each case once per round, the order rotating;
an untimed warm-up round first; medians):

- **raw**: the same bytes (every parameter and momentum buffer) written to one new file with
  ``write`` + ``fsync``; read back with one ``readinto`` into a fresh buffer. The floor.
- **raw, warm buffer**: the same read into a buffer allocated and touched once, before the
  rounds: the floor without first touches of fresh memory (which, on a shared virtual machine,
  swing by 10x between rounds), i.e. what a load into live tensors can reach; each table ends
  with the loads' ratios to it.
- **torch.save** of ``{"module": module.state_dict(), "optimizer": optimizer.state_dict()}`` +
  ``fsync``; **torch.load** (``weights_only=True``) + ``module.load_state_dict`` +
  ``optimizer.load_state_dict`` into a second model.
- **safetensors** ``save_file`` of the parameters and momentum buffers + ``fsync``;
  ``load_file`` + ``module.load_state_dict`` + a copy into the second optimizer's buffers.
- **epochal**: what the checkpoint plugin's synchronous save does, ``loop.state_dict()`` (the
  model's state through ``TorchModel.state_dict``, RNG, log, counters), ``storage.flatten``,
  ``storage.write_checkpoint`` (crash-safe: files and directories fsynced, rename); the load is
  what the plugin's ``resume_state`` does with ``--resume PATH``: ``read_from`` with the
  model's load destinations (the arrays read straight into the live tensors once the checkpoint
  verified), ``check_fits`` (which checks the state against the model: ``TorchModel`` has
  ``check_state``, so nothing is loaded on trial) and ``loop.load_state_dict`` into the
  second model (whose optimizer has stepped: its momentum buffers exist).
- **epochal, fresh optimizer**: the same load into the second model's module with a new
  optimizer that has no state yet, as in a resumed run: the momentum buffers (half the state)
  have no live memory to be read into and take fresh memory, as torch.load's do.

The adapter's own share is printed beneath each table: the time of ``loop.state_dict()`` in
the save and of ``loop.load_state_dict()`` in the load (the rest is the storage layer).
Save and load ratios are the raw time over the case's time (1.0: as fast as the floor; the
targets of issue 32: epochal >= 0.8 from 64 MB to 1 GB), in wall time and in process CPU time
(user + system: on a shared virtual machine the wall time of a first touch of fresh memory
swings by up to 10x between rounds; a save's CPU time leaves out the wait for the disk). Each
case also gives the median of its minor page faults (``ru_minflt``: fresh memory touched, e.g.
a buffer allocated per save).
From 256 MB on, ``os.sync()`` runs (untimed) before each save, so no case pays for the
previous one's writeback. Loads read from the page cache (the files were just written).

With ``--device cuda`` the module and its optimizer live on the GPU (the loads go back into a
GPU model): torch.save, safetensors and epochal then each copy the state to the host in their
save, and two more save cases split that copy from the write (both floors of a save from a GPU):

- **raw + copy**: each tensor copied to fresh host memory (``tensor.cpu()``, what a
  hand-written save does), then written as **raw** writes;
- **raw + pinned copy**: each tensor copied into page-locked host buffers allocated once before
  the rounds (``copy_(non_blocking=True)``, one synchronisation), then written the same way.

and the two floors of a load into a GPU model (the **raw** read stops on the host):

- **raw + copy**: the raw read into a fresh buffer, then each tensor's bytes copied into the
  second model's live tensors with ``copy_`` (from pageable memory: each copy waits);
- **raw + pinned copy**: the raw read into a page-locked buffer allocated once before the
  rounds, then the same copies queued (``non_blocking=True``) and one synchronisation. A resume
  loads once per process, so a real one would also pay for locking that memory
  (``cudaHostAlloc`` of the state's size), which this floor leaves out.

``--profile-load`` prints, after each size's table, where one more epochal load (into the
second model, its optimizer with state) spends its time: cProfile's functions by their own time.

To compare with another epochal (e.g. before a change), run the script twice with that
epochal's ``src`` first on ``PYTHONPATH``: only the ``epochal`` columns depend on it.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import peers  # beside this file
import torch
from _common import fsync_path  # beside this file
from epochal_checkpoint import plugin as checkpoint_plugin
from epochal_checkpoint.storage import codec, flatten, read_checkpoint, write_checkpoint
from safetensors.torch import load_file, save_file

from epochal import Loop
from epochal.torch import TorchModel

MB = 1 << 20
CHECKPOINT = "ckpt-e0001-i000001"
PIECES = 8  # parameters of the module by default (each has its momentum buffer)


class Flat(torch.nn.Module):
    """A module of *pieces* float32 parameters holding *nbytes* in all."""

    def __init__(self, nbytes: int, seed: int, pieces: int = PIECES) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        per = nbytes // 4 // pieces
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(per // 1024, 1024, generator=generator)) for _ in range(pieces)
        )


def make_model(
    nbytes: int, seed: int, run_dir: Path, device: str = "cpu", pieces: int = PIECES
) -> tuple[Loop, Flat, torch.optim.Optimizer]:
    """A loop around a TorchModel on *device* whose state (module + momentum, *pieces*
    parameters) is *nbytes*."""
    module = Flat(nbytes // 2, seed, pieces).to(device)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    for param in module.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()  # the momentum buffers exist
    optimizer.zero_grad(set_to_none=True)
    model = TorchModel(module, optimizer, torch.nn.functional.mse_loss, device=device)
    loop = Loop(model, {"train": []}, plugins={}, run_dir=run_dir, handle_signals=False)
    return loop, module, optimizer


def tensors(module: Flat, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the state, by a flat name (safetensors' layout)."""
    out = {f"module.{k}": v for k, v in module.state_dict().items()}
    for i, param in enumerate(module.parameters()):
        out[f"momentum.{i}"] = optimizer.state[param]["momentum_buffer"]
    return out


def raw_save(path: Path, arrays: list[np.ndarray]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for array in arrays:
            view = memoryview(array.reshape(-1).view(np.uint8).data)
            while view.nbytes:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_load(path: Path, buffer: np.ndarray | None = None) -> np.ndarray:
    """The file read with ``readinto`` into *buffer* (memory already touched), else into a
    fresh one (the first touches of fresh memory count)."""
    nbytes = path.stat().st_size
    if buffer is None:
        buffer = np.empty(nbytes, np.uint8)
    view = memoryview(buffer.data)
    with open(path, "rb", buffering=0) as file:
        got = 0
        while got < nbytes:
            got += file.readinto(view[got:])
    return buffer


def copies(
    module: Flat, optimizer: torch.optim.Optimizer, pinned: list[torch.Tensor] | None
) -> list[np.ndarray]:
    """The state's tensors on the host: fresh copies, or copied into the *pinned* buffers."""
    if pinned is None:
        return [t.detach().cpu().numpy() for t in tensors(module, optimizer).values()]
    for buffer, tensor in zip(pinned, tensors(module, optimizer).values(), strict=True):
        buffer.copy_(tensor.detach(), non_blocking=True)
    torch.cuda.synchronize()
    return [buffer.numpy() for buffer in pinned]


def raw_load_to(path: Path, targets: list[torch.Tensor], pinned: torch.Tensor | None) -> None:
    """The raw read, then each tensor's bytes (in *targets*' order) copied into *targets*, the
    live tensors of a GPU model: from a fresh buffer, or from the page-locked *pinned* one
    (the copies queued, one wait)."""
    host = raw_load(path, None if pinned is None else pinned.numpy())
    offset = 0
    with torch.no_grad():
        for target in targets:
            size = target.numel() * target.element_size()
            source = torch.from_numpy(host[offset : offset + size]).view(target.dtype).view(target.shape)
            target.copy_(source, non_blocking=pinned is not None)
            offset += size
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def torch_save(path: Path, module: Flat, optimizer: torch.optim.Optimizer) -> None:
    with open(path, "wb") as file:
        torch.save({"module": module.state_dict(), "optimizer": optimizer.state_dict()}, file)
        file.flush()
        os.fsync(file.fileno())


def torch_load(path: Path, module: Flat, optimizer: torch.optim.Optimizer) -> None:
    state = torch.load(path, weights_only=True)
    module.load_state_dict(state["module"])
    optimizer.load_state_dict(state["optimizer"])


def safetensors_save(path: Path, module: Flat, optimizer: torch.optim.Optimizer) -> None:
    save_file(tensors(module, optimizer), str(path))
    fsync_path(path)


def safetensors_load(path: Path, module: Flat, optimizer: torch.optim.Optimizer) -> None:
    loaded = load_file(str(path))
    module.load_state_dict(
        {k.removeprefix("module."): v for k, v in loaded.items() if k.startswith("module.")}
    )
    with torch.no_grad():
        for i, param in enumerate(module.parameters()):
            optimizer.state[param]["momentum_buffer"].copy_(loaded[f"momentum.{i}"])


def epochal_save(directory: Path, name: str, loop: Loop, parts: dict[str, float]) -> Path:
    """The checkpoint plugin's synchronous save; ``parts["adapter"]``: ``loop.state_dict()``'s share."""
    started = time.perf_counter()
    state = loop.state_dict(log_rows=False)
    parts["adapter"] = time.perf_counter() - started
    return write_checkpoint(directory, name, flatten(state), {"sequence": 1, "run_id": loop.run_id}).path


def epochal_load(path: Path, loop: Loop, parts: dict[str, float]) -> None:
    """A resume's load (the checkpoint plugin's ``resume_state`` for ``--resume PATH``, less its
    run-directory bookkeeping); ``parts["adapter"]``: ``loop.load_state_dict()``'s share."""
    offer = getattr(checkpoint_plugin, "load_destinations", None)  # None: an epochal before issue 32's
    if offer is None:
        state, _ = read_checkpoint(path)
    else:
        state, _ = checkpoint_plugin.read_from(path, into=offer(loop))
    checkpoint_plugin.check_fits(loop, state, path)
    started = time.perf_counter()
    loop.load_state_dict(state)
    parts["adapter"] = time.perf_counter() - started


def timed(call: Callable[[], Any]) -> tuple[float, float, int]:
    """Wall seconds, process CPU seconds and minor page faults of one call."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started, cpu = time.perf_counter(), time.process_time()
    call()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    return elapsed, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


SAVES = ("raw", "torch.save", "safetensors", "epochal")
GPU_SAVES = ("raw + copy", "raw + pinned copy")
LOADS = ("raw", "torch.load", "safetensors", "epochal", "epochal, fresh optimizer", "raw, warm buffer")
GPU_LOADS = GPU_SAVES  # the same names: the floors of a GPU model's save and load


def profile_load(path: Path, loop: Loop, rows: int = 15) -> str:
    """One epochal load into *loop*'s model under cProfile: the functions by their own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    epochal_load(path, loop, {})
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    top = sorted(stats.items(), key=lambda item: -item[1][2])[:rows]
    total = sum(entry[2] for entry in stats.values())
    lines = [f"| own ms | with callees ms | calls | function (all: {total * 1e3:.1f} ms) |"]
    lines.append("|---:|---:|---:|---|")
    for (file, line, name), (_, calls, own, cumulative, _) in top:
        where = name if file == "~" else f"{Path(file).parent.name}/{Path(file).name}:{line} {name}"
        lines.append(f"| {own * 1e3:.2f} | {cumulative * 1e3:.2f} | {calls} | `{where}` |")
    return "\nwhere one more epochal load spends its time (cProfile, by own time):\n\n" + "\n".join(lines)


def measure(
    directory: Path,
    size_mb: int,
    rounds: int,
    device: str = "cpu",
    profile: bool = False,
    pieces: int = PIECES,
) -> dict[str, Any]:
    nbytes = size_mb * MB
    loop, module, optimizer = make_model(nbytes, 0, directory / "run-a", device, pieces)
    target_loop, target, target_optimizer = make_model(nbytes, 1, directory / "run-b", device, pieces)
    arrays = [t.detach().cpu().numpy() for t in tensors(module, optimizer).values()]
    state_bytes = sum(a.nbytes for a in arrays)
    warm = np.ones(state_bytes, np.uint8)  # touched: the raw read's floor without fresh memory
    on_gpu = torch.device(device).type == "cuda"
    save_cases = SAVES + GPU_SAVES if on_gpu else SAVES
    load_cases = LOADS + GPU_LOADS if on_gpu else LOADS
    pinned = (
        [torch.empty_like(a, device="cpu").pin_memory() for a in tensors(module, optimizer).values()]
        if on_gpu
        else []
    )
    pinned_read = torch.empty(state_bytes, dtype=torch.uint8, pin_memory=True) if on_gpu else None
    targets = list(tensors(target, target_optimizer).values())
    names = [f"save {k}" for k in save_cases] + [f"load {k}" for k in load_cases]
    times: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    faults: dict[str, list[int]] = {k: [] for k in times}
    adapter: dict[str, list[float]] = {"save": [], "load": [], "load, fresh optimizer": []}
    parts: dict[str, float] = {}
    profiled = ""
    for number in range(-1, rounds):  # round -1 warms up (first touches of memory, files), untimed
        here = directory / f"round{number}"
        here.mkdir()
        paths = {k: here / f"{k}.bin" for k in save_cases}
        saves: dict[str, Callable[[], Any]] = {
            "raw": lambda: raw_save(paths["raw"], arrays),  # noqa: B023 (called in this round)
            "torch.save": lambda: torch_save(paths["torch.save"], module, optimizer),  # noqa: B023
            "safetensors": lambda: safetensors_save(paths["safetensors"], module, optimizer),  # noqa: B023
            "epochal": lambda: paths.update(epochal=epochal_save(here, CHECKPOINT, loop, parts)),  # noqa: B023
            "raw + copy": lambda: raw_save(paths["raw + copy"], copies(module, optimizer, None)),  # noqa: B023
            "raw + pinned copy": lambda: raw_save(
                paths["raw + pinned copy"],  # noqa: B023
                copies(module, optimizer, pinned),
            ),
        }
        order = save_cases[number % len(save_cases) :] + save_cases[: number % len(save_cases)]
        for name in order:
            if size_mb >= 256:
                os.sync()
            seconds, cpu_seconds, count = timed(saves[name])
            if number >= 0:
                times[f"save {name}"].append(seconds)
                cpu[f"save {name}"].append(cpu_seconds)
                faults[f"save {name}"].append(count)
                if name == "epochal":
                    adapter["save"].append(parts["adapter"])
        fresh = Loop(  # untimed: a resumed run's model, whose optimizer has no state yet
            TorchModel(
                target,
                torch.optim.SGD(target.parameters(), lr=0.01, momentum=0.9),
                torch.nn.functional.mse_loss,
                device=device,
            ),
            {"train": []},
            plugins={},
            run_dir=directory / "run-c",
            handle_signals=False,
        )
        loads: dict[str, Callable[[], Any]] = {
            "raw": lambda: raw_load(paths["raw"]),  # noqa: B023
            "torch.load": lambda: torch_load(paths["torch.save"], target, target_optimizer),  # noqa: B023
            "safetensors": lambda: safetensors_load(paths["safetensors"], target, target_optimizer),  # noqa: B023
            "epochal": lambda: epochal_load(paths["epochal"], target_loop, parts),  # noqa: B023
            "epochal, fresh optimizer": lambda: epochal_load(paths["epochal"], fresh, parts),  # noqa: B023
            "raw, warm buffer": lambda: raw_load(paths["raw"], warm),  # noqa: B023
            "raw + copy": lambda: raw_load_to(paths["raw"], targets, None),  # noqa: B023
            "raw + pinned copy": lambda: raw_load_to(paths["raw"], targets, pinned_read),  # noqa: B023
        }
        for name in load_cases[number % len(load_cases) :] + load_cases[: number % len(load_cases)]:
            seconds, cpu_seconds, count = timed(loads[name])
            if number >= 0:
                times[f"load {name}"].append(seconds)
                cpu[f"load {name}"].append(cpu_seconds)
                faults[f"load {name}"].append(count)
                if name.startswith("epochal"):
                    adapter["load" if name == "epochal" else "load, fresh optimizer"].append(parts["adapter"])
        # a resume is bitwise: the second model now holds the first one's state
        assert all(torch.equal(a, b) for a, b in zip(module.parameters(), target.parameters(), strict=True))
        if profile and number == rounds - 1:
            profiled = profile_load(paths["epochal"], target_loop)
        shutil.rmtree(here)
    medians = {k: statistics.median(v) for k, v in times.items()}
    cpu_medians = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "MB": size_mb,
        "device": device,
        "bytes": state_bytes,
        "rounds": rounds,
        "ms": {k: v * 1e3 for k, v in medians.items()},
        "ratio": {
            k: medians[f"{k.split()[0]} raw"] / v for k, v in medians.items() if not k.endswith(" raw")
        },
        "cpu_ratio": {
            k: cpu_medians[f"{k.split()[0]} raw"] / v
            for k, v in cpu_medians.items()
            if not k.endswith(" raw")
        },
        "faults": {k: int(statistics.median(v)) for k, v in faults.items()},
        "adapter_ms": {k: statistics.median(v) * 1e3 for k, v in adapter.items()},
        "profile": profiled,
        "params": pieces,
    }


def report(result: dict[str, Any]) -> None:
    ms, ratio, faults, cpu = result["ms"], result["ratio"], result["faults"], result["cpu_ratio"]
    size, count = result["MB"], result["rounds"]
    tensors = f"{result['bytes'] / MB:.0f} MiB in {result['params']} parameters and their momentum"
    print(f"\n### {size} MB state ({tensors}), {count} rounds\n")
    print(
        "| case | save ms | save: raw / case | save, CPU: raw / case | save faults "
        "| load ms | load: raw / case | load, CPU: raw / case | load faults |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case in GPU_SAVES if f"save {GPU_SAVES[0]}" in ms else ():
        save, load = f"save {case}", f"load {case}"
        print(
            f"| {case} | {ms[save]:.1f} | **{ratio[save]:.2f}x** | {cpu[save]:.2f}x | {faults[save]} "
            f"| {ms[load]:.1f} | **{ratio[load]:.2f}x** | {cpu[load]:.2f}x | {faults[load]} |"
        )
    for save, load in zip(SAVES, LOADS[: len(SAVES)], strict=True):
        label = save if save == load else f"{save} / {load}"
        save_ratio = "1" if save == "raw" else f"**{ratio[f'save {save}']:.2f}x**"
        load_ratio = "1" if load == "raw" else f"**{ratio[f'load {load}']:.2f}x**"
        save_cpu = "1" if save == "raw" else f"{cpu[f'save {save}']:.2f}x"
        load_cpu = "1" if load == "raw" else f"{cpu[f'load {load}']:.2f}x"
        print(
            f"| {label} | {ms[f'save {save}']:.1f} | {save_ratio} | {save_cpu} | {faults[f'save {save}']} "
            f"| {ms[f'load {load}']:.1f} | {load_ratio} | {load_cpu} | {faults[f'load {load}']} |"
        )
    for load in LOADS[len(SAVES) :]:
        print(
            f"| {load} | | | | | {ms[f'load {load}']:.1f} | **{ratio[f'load {load}']:.2f}x** "
            f"| {cpu[f'load {load}']:.2f}x | {faults[f'load {load}']} |"
        )
    warm = ms["load raw, warm buffer"]
    print(
        f"\nagainst the raw read into memory already touched ({warm:.1f} ms: what a load into live "
        f"tensors can reach): epochal {warm / ms['load epochal']:.2f}x, torch.load "
        f"{warm / ms['load torch.load']:.2f}x, safetensors {warm / ms['load safetensors']:.2f}x"
    )
    if f"load {GPU_LOADS[0]}" in ms:
        floors = ", ".join(f"{ms[f'load {k}'] / ms['load epochal']:.2f}x {k}" for k in GPU_LOADS)
        print(f"\nagainst the loads into the GPU model's tensors (a GPU load's floors): epochal {floors}")
    parts = result["adapter_ms"]
    print(
        f"\nepochal's adapter (TorchModel inside loop.state_dict / loop.load_state_dict): "
        f"save {parts['save']:.1f} ms, load {parts['load']:.1f} ms, load with a fresh optimizer "
        f"{parts['load, fresh optimizer']:.1f} ms (medians; in the epochal rows)"
    )
    if result["profile"]:
        print(result["profile"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=peers.rounds, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--big", action="store_true", help="also 1 GB")
    parser.add_argument(
        "--sizes", help="comma-separated state sizes in MB instead (e.g. 8,96: a small MLP's and ResNet-18's)"
    )
    parser.add_argument("--dir", default=".", help="where the files go (a temporary directory inside)")
    parser.add_argument("--device", default="cpu", help="where the model lives (cpu, cuda)")
    parser.add_argument(
        "--params", type=int, default=PIECES, help=f"parameters of the module (default {PIECES})"
    )
    parser.add_argument(
        "--profile-load", action="store_true", help="also print where one epochal load spends its time"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    directory = Path(tempfile.mkdtemp(prefix="bench-torch-checkpoint-", dir=args.dir))
    import epochal

    crc = "zlib-ng" if "zlib_ng" in (codec.crc32.__module__ or "") else "zlib (no zlib-ng: ~5x slower)"
    print(f"epochal from {Path(epochal.__file__).parent}, torch {torch.__version__}, {os.cpu_count()} cores")
    print(f"CRC-32 of the checkpoint: {crc}; the model on {args.device}")
    try:
        sizes = [int(mb) for mb in args.sizes.split(",")] if args.sizes else [64, 256] + [1024] * args.big
        for size in sizes:
            report(measure(directory, size, args.rounds, args.device, args.profile_load, args.params))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
