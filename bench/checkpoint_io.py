"""Checkpoint I/O benchmark: save and load throughput against raw I/O, and loop stall.

Run: ``python bench/checkpoint_io.py [--dir DIR] [--quick] [--io-only | --log-only]`` (needs
epochal-checkpoint installed).

1. Save throughput for 1 MB to 1 GB of float32 state (4 arrays): the epochal-checkpoint save
   (flatten + ``data.bin`` (arrays written from their memory, then the JSON state) +
   ``manifest.json`` sealed by its commit record, the files and the temporary directory
   fsynced concurrently, rename, ``latest`` link, parent-directory fsync) against the floor:
   the same bytes written to one file with ``write`` + ``fsync``; beside it the *atomic
   publish floor* (that raw write into a new temporary directory, fsynced, renamed, parent
   fsynced, one fsync after the other: the textbook crash-safe directory save). ``np.savez``
   + fsync is shown for reference. Measured side by side in one run, interleaved (from
   256 MB on, ``os.sync()`` untimed before each case so none pays for the previous one's
   writeback); medians and ratios.
2. Load: a checkpoint of 100 MB to 1 GB (half model, half optimizer) read whole and with
   ``model_only``, against a raw read of the same bytes into a preallocated buffer; all from
   the page cache (the files were just written).
3. Loop stall per checkpoint: the time a training loop spends inside the checkpoint plugin's
   ``after_batch`` when it saves 64 MB, with ``async_save`` off and on, against an in-memory
   copy of the same arrays, with a save due every 30 and every 3 batches (faster than the disk:
   the asynchronous saves are then deferred, and the worst stall is what the loop waited).
4. Save cost against the length of the training log: a loop whose log holds 1k / 10k / 50k
   rows of 10 records, 1,000 of them added since the previous save (an epoch with a record
   every batch). Each repeat is a fresh run: a first save (untimed) writes every row, 1,000
   rows are added, then the saves are timed. "whole log" is the method before log segments
   (``flatten(loop.state_dict())`` with every row, written into ``state.json``); "segments" is
   the ``checkpoint`` plugin's save (the rows compared with the previous save's, the new rows
   into one new segment, the previous segments hard-linked); "no new row": the same save
   again with nothing added (the comparison, the links and the fixed cost). Interleaved,
   medians; a small model (4 KB) so the log dominates.

Targets (issues #3, #13): save >= 0.8x raw throughput from 1 MB to 1 GB; load >= 0.8x a raw
read from 100 MB; async stall <= one in-memory copy.
Files go to a temporary directory (default: under the current directory, so on the disk the
checkpoints would use) which is deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from epochal_checkpoint import Checkpoint
from epochal_checkpoint.storage import flatten, read_checkpoint, write_checkpoint
from epochal_checkpoint.testing import make_data, make_model

from epochal import Loop, hookimpl

MB = 1 << 20


def make_state(nbytes: int) -> dict[str, Any]:
    per = nbytes // 4 // 4
    rng = np.random.default_rng(0)
    return {
        "model": {f"layer{i}": rng.standard_normal(per, dtype=np.float32) for i in range(4)},
        "epoch": 3,
        "log": {"rows": {str(i): {"loss": 1.0 / (i + 1)} for i in range(100)}},
    }


def raw_save(directory: Path, state: dict[str, Any]) -> None:
    path = directory / f"raw-{uuid.uuid4().hex}.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for array in state["model"].values():
            view = memoryview(array).cast("B")
            while view.nbytes:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_floor(directory: Path, state: dict[str, Any]) -> None:
    """The crash-safe publish recipe alone: the raw write+fsync into a new temporary directory,
    that directory fsynced, renamed into place, its parent fsynced (what any atomic directory
    save needs at least)."""
    tmp = directory / f"pub-{uuid.uuid4().hex}.tmp"
    tmp.mkdir()
    raw_save(tmp, state)
    fd = os.open(tmp, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    os.rename(tmp, directory / tmp.stem)
    fd = os.open(directory, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def checkpoint_save(directory: Path, state: dict[str, Any]) -> None:
    write_checkpoint(directory, "ckpt-e0003-i000150", flatten(state), {"sequence": 1, "run_id": "bench"})


def savez_save(directory: Path, state: dict[str, Any]) -> None:
    path = directory / f"savez-{uuid.uuid4().hex}.npz"
    with open(path, "wb") as file:
        np.savez(file, **state["model"])
        file.flush()
        os.fsync(file.fileno())


def clear(directory: Path) -> None:
    for entry in directory.iterdir():
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def throughput(directory: Path, sizes: list[int], reps: dict[int, int]) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        state = make_state(size * MB)
        nbytes = sum(a.nbytes for a in state["model"].values())
        times: dict[str, list[float]] = {"raw": [], "publish": [], "checkpoint": [], "savez": [], "crc32": []}
        cases = (
            ("raw", raw_save),
            ("publish", publish_floor),
            ("checkpoint", checkpoint_save),
            ("savez", savez_save),
        )
        for _ in range(reps[size]):
            for name, save in cases:
                if size >= 256:  # start each case with no dirty pages of the one before (untimed)
                    os.sync()
                started = time.perf_counter()
                save(directory, state)
                times[name].append(time.perf_counter() - started)
                clear(directory)
            started = time.perf_counter()
            crc = 0
            for array in state["model"].values():
                crc = zlib.crc32(memoryview(array).cast("B"), crc)
            times["crc32"].append(time.perf_counter() - started)
        medians = {k: statistics.median(v) for k, v in times.items()}
        rows.append(
            {
                "MB": size,
                "reps": reps[size],
                **{f"{k}_GBps": nbytes / v / 1e9 for k, v in medians.items()},
                "ratio": medians["raw"] / medians["checkpoint"],
                "publish_ratio": medians["raw"] / medians["publish"],
                "savez_ratio": medians["raw"] / medians["savez"],
            }
        )
        del state
    return rows


class TimedCheckpoint(Checkpoint):
    """Records the time spent in after_batch on the batches where a save was due."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.stalls: list[float] = []
        self.worst = 0.0

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        started, sequence = time.perf_counter(), self._sequence
        super().after_batch(loop)
        spent = time.perf_counter() - started
        self.worst = max(self.worst, spent)
        if self._sequence != sequence:  # a save was taken (not deferred)
            self.stalls.append(spent)


def stall(directory: Path, size_mb: int, saves: int, every: int) -> dict[str, Any]:
    results: dict[str, Any] = {"MB": size_mb, "saves": saves}
    size = size_mb * MB // 4
    for mode in ("sync", "async"):
        plugin = TimedCheckpoint(every_n_batches=every, every_n_epochs=0, save_at_end=False, keep_last=1,
                                 async_save=mode == "async", dir=str(directory / mode))  # fmt: skip
        loop = Loop(
            make_model(size=size),
            make_data(examples=4096),
            plugins={"checkpoint": plugin},
            max_iterations=saves * every,
            seed=0,
            handle_signals=False,
        )
        started = time.perf_counter()
        loop.run()
        results[f"{mode}_wall_s"] = time.perf_counter() - started
        results[f"{mode}_stall_ms"] = statistics.median(plugin.stalls) * 1e3
        results[f"{mode}_worst_ms"] = plugin.worst * 1e3
        results[f"{mode}_saves"] = len(plugin.stalls)
        results[f"{mode}_deferred"] = plugin.deferred
        shutil.rmtree(directory / mode)
    model = make_model(size=size)
    copies, reused = [], []
    spare = {k: np.empty_like(v) for k, v in model.params.items()}
    for _ in range(saves):
        started = time.perf_counter()
        _copy = {k: v.copy() for k, v in model.params.items()}
        copies.append(time.perf_counter() - started)
        del _copy
        started = time.perf_counter()
        for k, v in model.params.items():
            np.copyto(spare[k], v)
        reused.append(time.perf_counter() - started)
    results["copy_ms"] = statistics.median(copies) * 1e3
    results["copy_reused_ms"] = statistics.median(reused) * 1e3
    results["async_over_copy"] = results["async_stall_ms"] / results["copy_ms"]
    results["sync_over_copy"] = results["sync_stall_ms"] / results["copy_ms"]
    return results


def _fill(loop: Loop, rows: int) -> None:
    """Append *rows* rows of 10 records to the loop's log and advance its counter past them."""
    start = loop.iteration
    for i in range(start + 1, start + rows + 1):
        loop.log[i].update({f"metric{k}": 1.0 / (i + k + 1) for k in range(10)})
    loop.iteration = start + rows


def log_length(directory: Path, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """Per size: *reps* times a fresh loop whose log reaches *size* rows with the last 1,000 rows
    added after a first (untimed) save; then timed: the whole-log save, the plugin's save, and a
    save with no new row."""
    rows_out = []
    for size in sizes:
        times: dict[str, list[float]] = {"whole": [], "segments": [], "unchanged": []}
        count = 0
        for rep in range(reps):
            plugin = Checkpoint(dir=str(directory / "segments"), keep_last=1, every_n_epochs=0)
            loop = Loop(make_model(size=1000), make_data(), plugins={"checkpoint": plugin}, seed=0,
                        handle_signals=False)  # fmt: skip
            plugin.before_training(loop)
            _fill(loop, size - 1000)
            plugin._save(loop, "batch")  # the first save of a run writes every row
            _fill(loop, 1000)
            whole_dir = directory / "whole"
            whole_dir.mkdir()
            started = time.perf_counter()
            write_checkpoint(whole_dir, f"ckpt-e0000-i{loop.iteration:06d}", flatten(loop.state_dict()),
                             {"sequence": rep + 1, "run_id": "bench"})  # fmt: skip
            times["whole"].append(time.perf_counter() - started)
            shutil.rmtree(whole_dir)
            started = time.perf_counter()
            plugin._save(loop, "batch")
            times["segments"].append(time.perf_counter() - started)
            loop.iteration += 1  # a save with no new row: the comparison and the links only
            started = time.perf_counter()
            plugin._save(loop, "batch")
            times["unchanged"].append(time.perf_counter() - started)
            count = len(plugin._known[-1].manifest.get("log_segments", []))
            shutil.rmtree(directory / "segments")
        medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows_out.append({"rows": size, "reps": reps, "files": count, **medians,
                         "ratio": medians["whole"] / medians["segments"]})  # fmt: skip
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under the cwd)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--log-only", action="store_true", help="only the save cost against the log length")
    parser.add_argument("--io-only", action="store_true", help="only save and load throughput")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix=".bench-checkpoint-", dir=args.dir or os.getcwd()))
    try:
        if args.log_only:
            print_log_length(directory, args.quick)
            return
        sizes = [1, 8, 64, 256, 1024]
        reps = dict(zip(sizes, [9, 5, 5, 3, 3] if args.quick else [31, 15, 9, 5, 3], strict=True))
        rows = throughput(directory, sizes, reps)
        print("## Checkpoint save throughput (float32 state in 4 arrays; medians)\n")
        print("| state | reps | raw write+fsync | atomic publish floor (ratio) | epochal-checkpoint save "
              "| ratio (target >= 0.8) | np.savez+fsync (ratio) | crc32 alone |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['MB']} MB | {r['reps']} | {r['raw_GBps']:.2f} GB/s "
                f"| {r['publish_GBps']:.2f} GB/s ({r['publish_ratio']:.2f}x) "
                f"| {r['checkpoint_GBps']:.2f} GB/s "
                f"| {r['ratio']:.2f}x | {r['savez_GBps']:.2f} GB/s ({r['savez_ratio']:.2f}x) "
                f"| {r['crc32_GBps']:.2f} GB/s |"
            )
        print_load(directory, args.quick)
        if args.io_only:
            return
        for every in (30, 3):
            result = stall(directory, 64, saves=3 if args.quick else 7, every=every)
            print(f"\n## Loop stall per checkpoint (64 MB model state, a save due every {every} batches)\n")
            print("| in-memory copy (fresh / into reused buffers) | async_save = true: median / worst "
                  "| saves taken / deferred | async_save = false | worst async / copy (target <= 1 + noise) "
                  "| sync / copy | loop wall time async vs sync |")  # fmt: skip
            print("|---|---|---|---|---|---|---|")
            print(
                f"| {result['copy_ms']:.1f} ms / {result['copy_reused_ms']:.1f} ms "
                f"| {result['async_stall_ms']:.1f} ms / {result['async_worst_ms']:.1f} ms "
                f"| {result['async_saves']} / {result['async_deferred']} "
                f"| {result['sync_stall_ms']:.1f} ms "
                f"| {result['async_worst_ms'] / result['copy_ms']:.2f}x | {result['sync_over_copy']:.2f}x "
                f"| {result['async_wall_s']:.2f} s vs {result['sync_wall_s']:.2f} s |"
            )
        print_log_length(directory, args.quick)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def raw_read(path: Path, nbytes: int) -> None:
    buffer = np.empty(nbytes, np.uint8)
    view = memoryview(buffer.data)
    with open(path, "rb", buffering=0) as file:
        got = 0
        while got < nbytes:
            got += file.readinto(view[got:])


def load_speed(directory: Path, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """Per size: a checkpoint of *size* MB (half model, half optimizer) read whole, read with
    model_only, and the same bytes read raw into a preallocated buffer (from the page cache:
    the files were just written), interleaved."""
    out = []
    for size in sizes:
        model = make_state(size * MB // 2)["model"]
        state = {"model": model, "optimizer": {k: v + 1 for k, v in model.items()}, "epoch": 3}
        path = write_checkpoint(directory, "ckpt-e0003-i000150", flatten(state), {"sequence": 1}).path
        del state, model
        data = path / "data.bin"
        nbytes = data.stat().st_size
        raw_file = directory / "raw.bin"
        shutil.copyfile(data, raw_file)
        times: dict[str, list[float]] = {"raw": [], "load": [], "model_only": []}
        for _ in range(reps):
            for name, call in (
                ("raw", lambda: raw_read(raw_file, nbytes)),  # noqa: B023 (called in this iteration)
                ("load", lambda: read_checkpoint(path)),  # noqa: B023
                ("model_only", lambda: read_checkpoint(path, model_only=True)),  # noqa: B023
            ):
                started = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - started)
        medians = {k: statistics.median(v) for k, v in times.items()}
        out.append({"MB": size, "reps": reps, **{f"{k}_GBps": nbytes / v / 1e9 for k, v in medians.items()},
                    "ratio": medians["raw"] / medians["load"],
                    "model_ratio": medians["load"] / medians["model_only"]})  # fmt: skip
        clear(directory)
    return out


def print_load(directory: Path, quick: bool) -> None:
    rows = load_speed(directory, [100, 256, 1024], 3 if quick else 7)
    print("\n## Checkpoint load (half model, half optimizer; from the page cache; medians)\n")
    print("| checkpoint | reps | raw read into a buffer | read_checkpoint | ratio (target >= 0.8) "
          "| model_only | whole / model_only |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['MB']} MB | {r['reps']} | {r['raw_GBps']:.2f} GB/s | {r['load_GBps']:.2f} GB/s "
            f"| {r['ratio']:.2f}x | {r['model_only_GBps']:.2f} GB/s (of the whole) "
            f"| {r['model_ratio']:.2f}x |"
        )


def print_log_length(directory: Path, quick: bool) -> None:
    rows = log_length(directory, [1_000, 10_000, 50_000], 5 if quick else 9)
    print(
        "\n## Save cost against the log length (10 records per row, 1,000 of them new since the previous "
        "save; medians)\n"
    )
    print("| rows in the log | reps | whole log (before) | segments (now) | whole / segments "
          "| no new row | segments in the checkpoint |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['rows']:,} | {r['reps']} | {r['whole']:.2f} ms | {r['segments']:.2f} ms "
            f"| {r['ratio']:.1f}x | {r['unchanged']:.2f} ms | {r['files']} |"
        )


if __name__ == "__main__":
    main()
