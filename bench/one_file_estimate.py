"""What-if: ``bench/peers.py``'s epochal-against-Ignite figures if a checkpoint were one file.

Not a checkpoint format: a stand-in for ``storage.write_checkpoint``, used only here, that
writes what a one-file format would have to write and nothing it could skip, so that the
figures bound what such a format could gain before anyone builds it. Each save writes one file
holding ``data.bin``'s bytes (encoded as the real save encodes them), the new log rows' segment
bytes (for a merge, also as many bytes as the merged segments hold, written as if copied but
not read back: no merge happens in peers.py's five epochs), and the
manifest with a CRC-32 trailer; the file is fsynced, renamed into place and the directory
fsynced. Earlier segments are referenced rather than hard-linked (so, unlike format 4, such a
checkpoint would not be self-contained), and there is no ``latest`` pointer. Everything else
(the plugin's state, plan and encoding, every other plugin) is what ``peers.py`` runs.

Pruning old checkpoints is switched off in every epochal case, the real format's included, so
both formats do the same work apart from the write itself. Cases, interleaved rounds, medians:
epochal's six plugins with format 4 and with the stand-in, at both of ``peers.py``'s levels (a
record every step; epoch records only), Ignite's equivalents, and the bare Python loop whose
time is subtracted from each. Run: ``python bench/one_file_estimate.py [--rounds N]``
(``BENCH_STEPS`` etc. as for peers.py; needs ``pip install -r bench/requirements-peers.txt``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import epochal_checkpoint.plugin as checkpoint_plugin
import peers  # beside this file
from epochal_checkpoint import storage

FORMAT_4 = storage.write_checkpoint


def one_file(
    directory: Path,
    name: str,
    snapshot: storage.Snapshot,
    manifest: dict[str, Any],
    pointer: bool = True,
    segments: Sequence[Any] = (),
) -> storage.CheckpointInfo:
    """The stand-in save (see the module's docstring); returns what the plugin keeps of a save."""
    pieces, data = storage.encode(snapshot)
    written: list[storage.Segment] = []
    for source in segments:
        if isinstance(source, storage.LinkedSegment):  # referenced in its earlier file
            written.append(source.segment)
            continue
        body = storage.encode_segment(source.rows)
        rows = [int(i) for i in source.rows]
        if isinstance(source, storage.MergedSegment):  # the parts' bytes would be copied in
            copied = sum(part.segment.size for part in source.parts)
            pieces.append(bytes(copied))
            rows = [i for part in source.parts for i in part.segment.rows] + rows
        pieces.append(body)
        written.append(storage.Segment(source.name, len(body), f"{zlib.crc32(body):08x}", rows))
    document = {**manifest, "name": name, "files": {"data.bin": data}, "segments": [s.name for s in written]}
    text = json.dumps(document, separators=(",", ":"), default=str).encode()
    pieces += [text, b"%08x" % zlib.crc32(text)]
    temp = directory / f".{name}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if os.writev(fd, pieces) != sum(memoryview(p).nbytes for p in pieces):  # tiny: one call writes all
            raise OSError(f"short write to {temp}")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temp, directory / name)
    storage.fsync_dir(directory)
    # the plan of the next save takes the previous one's segments (to reference) from a base
    # whose path is a directory: the checkpoints' directory stands in for it
    return storage.CheckpointInfo(directory, document, written)


#: the wall time of every save, per case (the writer's call, inside the timed runs).
SAVES: dict[str, list[float]] = {}


def writing_with(setup: peers.Setup, writer: Callable[..., storage.CheckpointInfo], case: str) -> peers.Setup:
    """*setup*, its run saving its checkpoints with *writer*; each save's time goes to SAVES[case]."""
    saves = SAVES.setdefault(case, [])

    def save(*args: Any, **kwargs: Any) -> storage.CheckpointInfo:
        start = time.perf_counter()
        try:
            return writer(*args, **kwargs)
        finally:
            saves.append(time.perf_counter() - start)

    def with_writer(tmp: Path) -> Callable[[], Any]:
        run = setup(tmp)

        def timed() -> Any:
            storage.write_checkpoint = save
            try:
                return run()
            finally:
                storage.write_checkpoint = FORMAT_4

        return timed

    return with_writer


CASES: dict[str, peers.Setup] = {"bare python": peers.bare_python}
for _level, _records in (("", True), (" (epoch records)", False)):
    for _format, _writer in (("format 4", FORMAT_4), ("one file", one_file)):
        _case = f"epochal{_level}, {_format}"
        CASES[_case] = writing_with(peers.make_epochal_features(_records), _writer, _case)
    CASES[f"ignite{_level}"] = peers.make_ignite_features("0.1s", step_records=_records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=peers.rounds, default=15)
    args = parser.parse_args()
    peers.silence_peers()
    checkpoint_plugin.Checkpoint._prune = lambda self, directory: None
    for setup in CASES.values():  # warm-up
        peers.time_run(setup)
    for saves in SAVES.values():
        saves.clear()
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.rounds):
        for name, setup in CASES.items():
            samples[name].append(peers.time_run(setup)[0])
    median = {name: statistics.median(values) for name, values in samples.items()}
    steps = peers.EPOCHS * peers.STEPS
    over = {name: (median[name] - median["bare python"]) / steps * 1e6 for name in CASES}
    print(
        f"{peers.EPOCHS} epochs × {peers.STEPS} steps, wall time, medians of {args.rounds} interleaved rounds"
    )
    print()
    print("| level | format 4 µs | one file µs | Ignite µs | Ignite / format 4 | Ignite / one file |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for level, suffix in (("a record every step", ""), ("epoch records only", " (epoch records)")):
        four, one, ignite = (
            over[f"epochal{suffix}, format 4"],
            over[f"epochal{suffix}, one file"],
            over[f"ignite{suffix}"],
        )
        print(
            f"| {level} | {four:.2f} | {one:.2f} | {ignite:.2f} | "
            f"{ignite / four:.2f}× | {ignite / one:.2f}× |"
        )
        saves = [
            statistics.median(SAVES[f"epochal{suffix}, {form}"]) * 1e3 for form in ("format 4", "one file")
        ]
        rows.append(f"| {level} | {saves[0]:.2f} | {saves[1]:.2f} | {saves[0] / saves[1]:.2f}× |")
    print()
    print("A save inside these runs (median ms, every save of every round):")
    print()
    print("| level | format 4 | one file | format 4 / one file |")
    print("|---|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
