"""What a small checkpoint save costs, against the same file operations done raw and against the
least an atomic, durable save can do: where the fixed cost of a save goes.

A save of a tiny state (``bench/peers.py``'s: a 2-float model, a little JSON) and one log row of
28 numbers, as a checkpoint per epoch writes it, in these ways, interleaved:

* ``write_checkpoint``: epochal-checkpoint's (format 4): a temporary directory holding
  ``data.bin``, the new log segment and the manifest; the three files and the directory fsynced
  concurrently; the directory renamed into place, ``latest`` replaced, the parent fsynced.
* the same entries, raw: the same directory, files, concurrent fsyncs, renames and parent fsync
  with bytes already encoded (no encoding, checksums or checks): the floor of this layout; and
  three variants of it: the files fsynced one after another, no ``latest`` pointer, one file in
  the directory.
* one file: the same bytes in one file, written, fsynced, renamed into place, the parent
  fsynced: the least a durable atomic save does.

The difference between ``write_checkpoint`` and the same entries raw is the plugin's own work;
between the raw entries and one file, what a directory of three files costs over one file.
Run: ``python bench/checkpoint_entries.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from epochal_checkpoint import storage

sys.path.insert(0, str(Path(__file__).parent))

import peers  # beside this file

STATE = {"model": {"w": np.zeros(2, np.float32)}, "rng": {"state": list(range(20))}, "loop": {"epoch": 1}}
ROW = {f"timing.plugin.p{i}.after_epoch": 0.001 * i for i in range(28)}


def plugin_save(directory: Path, k: int) -> None:
    snapshot = storage.flatten(STATE)
    segment = storage.NewSegment(storage.segment_name(k, [k]), {str(k): ROW})
    storage.write_checkpoint(directory, f"ck-{k:06d}", snapshot, {"sequence": k}, segments=[segment])


def _encode() -> list[tuple[str, bytes]]:
    data = json.dumps(STATE, default=lambda array: array.tolist()).encode() + bytes(300)
    return [("data.bin", data), ("log.json", json.dumps(ROW).encode()), ("manifest.json", b'{"key": 1}' * 40)]


#: the raw cases' files, encoded once, outside the timed saves
BLOBS = _encode()
ONE_BLOB = b"".join(blob for _, blob in BLOBS)


def raw_entries(files: int = 3, together: bool = True, pointer: bool = True) -> Callable[[Path, int], None]:
    """The layout's file operations on bytes already encoded: *files* files (the three pieces, or
    them joined in one) in a temporary directory, fsynced concurrently (*together*) or one after
    another, the directory renamed into place, ``latest`` replaced (*pointer*), the parent fsynced."""

    def save(directory: Path, k: int) -> None:
        name = f"ck-{k:06d}"
        tmp = directory / f"{name}.tmp"
        tmp.mkdir()
        blobs = BLOBS if files == 3 else [("checkpoint", ONE_BLOB)]
        flushes = storage.Flushes()
        for filename, blob in blobs:
            fd = os.open(tmp / filename, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, blob)
                if not together:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if together:
                flushes.start(tmp / filename)
        if together:
            flushes.start(tmp)
            flushes.wait()
        else:
            storage.fsync_dir(tmp)
        os.rename(tmp, directory / name)
        if pointer:
            os.symlink(name, directory / "latest.tmp")
            os.replace(directory / "latest.tmp", directory / "latest")
        storage.fsync_dir(directory)

    return save


def one_file(directory: Path, k: int) -> None:
    name = f"ck-{k:06d}"
    tmp = directory / f"{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, ONE_BLOB)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, directory / name)
    storage.fsync_dir(directory)


CASES: dict[str, Callable[[Path, int], None]] = {
    "write_checkpoint (data.bin, a log segment, the manifest, `latest`)": plugin_save,
    "the same entries, raw": raw_entries(),
    "the same, fsynced one after another": raw_entries(together=False),
    "the same, without the `latest` pointer": raw_entries(pointer=False),
    "the same directory holding one file": raw_entries(files=1),
    "one file: write, fsync, rename, parent fsync": one_file,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=peers.rounds, default=100)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="epochal-entries-"))
    try:
        folders = {name: base / str(i) for i, name in enumerate(CASES)}
        samples: dict[str, list[float]] = {name: [] for name in CASES}
        warm_up = 10
        for k in range(1, warm_up + args.rounds + 1):
            for name, save in CASES.items():
                if (k - 1) % 20 == 0:  # a few checkpoints in a folder at a time, as pruning keeps it
                    shutil.rmtree(folders[name], ignore_errors=True)
                    folders[name].mkdir()
                start = time.perf_counter()
                save(folders[name], k)
                if k > warm_up:
                    samples[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(values) for name, values in samples.items()}
        floor = medians["one file: write, fsync, rename, parent fsync"]
        print(f"a small save, medians of {args.rounds} interleaved rounds")
        print()
        print("| save | ms | × one file |")
        print("|---|---:|---:|")
        for name, value in medians.items():
            print(f"| {name} | {value * 1e3:.3f} | {value / floor:.2f}× |")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
