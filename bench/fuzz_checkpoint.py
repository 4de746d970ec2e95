"""Fuzzing the checkpoint readers: mutated files of a checkpoint read under a memory limit.

Run: ``python bench/fuzz_checkpoint.py [--per-file 1000] [--children 2] [--memory-mb 200] [--key KEY]
[--sharded]``.

Writes two checkpoints of a small synthetic run, then reads ``--per-file`` damaged copies of
every file of the newest one (bit flips, truncations, garbage, wrong JSON types, deep nesting,
crafted ``.npy`` headers, symbolic links to ``/dev/zero`` or out of the directory, FIFOs,
directories, missing files; checksums re-signed or not) with ``load_latest``'s reader, each in
a child process under an address-space limit (``RLIMIT_AS``: the child's size after its imports
plus ``--memory-mb``). Every case must end in a clean load of the newest checkpoint (harmless
damage, or log rows lost) or a fallback to the older one, with one warning naming the damaged
checkpoint, in under 1 s of CPU and 5 s of wall time, no single read asking for more than
512 MB. The ``latest`` link is damaged as often as each file (a link to a missing, foreign or
outside name, ``/dev/zero``, itself, a name too long; a regular file, FIFO or directory) and read
as ``load``'s ``path`` is: a load or one ``CheckpointError``. With ``--key`` the checkpoints are
signed (``EPOCHAL_CHECKPOINT_KEY``) and read with the key: no damage to ``data.bin`` or the
manifest may load. ``pickle-payload`` replaces a file with a pickle that runs code when
unpickled (``os.system``, ``eval``, a ``getattr`` chain, a torch global): none may run. With
``--sharded`` the checkpoints are a ``TorchModel``'s sharded ones (DCP's ``.metadata`` and
``.distcp`` beside ``data.bin``) and each case that reads also loads the model as a resume does
(every DCP read): a load error is one line (``DamagedShardsError``), counted apart. The test
suite runs 200 per file kind, unsigned and signed, and 40 sharded
(tests/test_checkpoint_trust.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from epochal_checkpoint.fuzz import HANG_S, MAX_READ_BYTES, fuzz, make_pristine
from epochal_checkpoint.storage import list_checkpoints


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-file", type=int, default=1000, help="mutations per file")
    parser.add_argument("--children", type=int, default=2)
    parser.add_argument("--memory-mb", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--key", default=None, help="sign the checkpoints and read with this key")
    parser.add_argument("--sharded", action="store_true", help="a TorchModel's sharded checkpoints")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix=".fuzz-checkpoint-", dir=os.getcwd()))
    try:
        pristine = make_pristine(workdir / "pristine", key=args.key, sharded=args.sharded)
        files = [*sorted(p.name for p in list_checkpoints(pristine)[0][-1].path.iterdir()), "latest"]
        started = time.perf_counter()
        report = fuzz(
            pristine,
            workdir / "work",
            args.per_file * len(files),
            args.children,
            args.memory_mb,
            args.seed,
            key=args.key,
        )
        elapsed = time.perf_counter() - started
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    signed = ("signed, read with the key" if args.key else "unsigned") + (", sharded" if args.sharded else "")
    where = f"{len(files)} files x {args.per_file}; {signed}; {args.children} children, {elapsed:.0f} s"
    print(f"mutations tried: {report.cases} ({where})")
    print(f"files: {', '.join(f'{name} {n}' for name, n in sorted(report.per_file.items()))}")
    print(f"kinds: {', '.join(f'{kind} {n}' for kind, n in sorted(report.per_kind.items()))}")
    print(f"clean loads of the newest (harmless damage or log rows lost): {report.newest}")
    print(
        f"  of which re-signing had undone the damage (files byte for byte the pristine): {report.unchanged}"
    )
    print(f"fallbacks to the previous good checkpoint (one warning each): {report.fallbacks}")
    print(f"clean errors (CheckpointError; only for a damaged latest link): {report.clean_errors}")
    print(f"one-line load errors (sharded: damage only reading the tensors shows): {report.load_errors}")
    print(f"children in which a crafted file ran code: {report.executed}")
    print(
        f"worst read: {report.worst_cpu_s * 1000:.1f} ms CPU, {report.worst_wall_s * 1000:.1f} ms wall; "
        f"worst memory growth of a child: {report.worst_memory_mb:.1f} MB (limit {args.memory_mb} MB)"
    )
    print(f"largest single read: {report.largest_read} bytes (bound {MAX_READ_BYTES})")
    bounds = f"raw exception, hang over {HANG_S} s, over limits, undetected damage"
    print(f"failures ({bounds}): {len(report.failures)}")
    for failure in report.failures[:20]:
        print("  " + " | ".join(failure))
    sys.exit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
