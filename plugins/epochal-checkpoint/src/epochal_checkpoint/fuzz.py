"""Fuzzing the checkpoint readers: mutated files read in child processes under a memory limit.

:func:`make_pristine` writes a directory with two checkpoints of a small synthetic run (the
older one is the good one to fall back to). :func:`fuzz` starts a few child processes; each
sets an address-space limit (``RLIMIT_AS``: what it had after its imports plus *memory_mb*),
then for each of its cases copies the pristine directory, damages one file of the newest
checkpoint (a bit flip, a truncation, garbage appended, a JSON value of a wrong type, a deep
nesting, an ``.npy`` header declaring a huge shape or a pickle dtype, a symbolic link to
``/dev/zero``, a FIFO, a directory, a missing file...; with the checksums re-signed or not, so
that the parsers are reached as well as the checks) and reads it with
:func:`epochal_checkpoint.storage.load.find_latest`. A case passes when the read ends in a clean
load (of the newest checkpoint when the damage is harmless or costs only log rows, else of the
older one: a fallback) within the limits, with one warning naming the damaged checkpoint.

``bench/fuzz_checkpoint.py`` runs it with more cases and prints the figures.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epochal_checkpoint.errors import CheckpointError
from epochal_checkpoint.storage.codec import DATA, MANIFEST, seal
from epochal_checkpoint.storage.layout import list_checkpoints
from epochal_checkpoint.storage.load import find_latest
from epochal_checkpoint.testing import resign

#: the kinds of damage, each a function of (rng, file path, checkpoint path) below.
KINDS = (
    "flip",
    "flip-resigned",
    "truncate",
    "truncate-resigned",
    "append",
    "append-resigned",
    "json-value",
    "json-deep",
    "npy-header",
    "symlink-dev-zero",
    "symlink-outside",
    "fifo",
    "directory",
    "missing",
)
_WRONG = ["3a", 5, -1, 10**20, None, [], {}, 1.5, True, "x" * 10_000, [[[[1]]]], {"a": {"b": 1}}]


@dataclass
class FuzzReport:
    """What a fuzz run found."""

    cases: int = 0
    #: cases that loaded the newest checkpoint (harmless damage, or only log rows lost).
    newest: int = 0
    #: cases that fell back to the older, good checkpoint.
    fallbacks: int = 0
    #: cases that ended in a clean CheckpointError (only when the damage hit both checkpoints).
    clean_errors: int = 0
    #: cases that did not end cleanly: (file, kind, what happened).
    failures: list[tuple[str, str, str]] = field(default_factory=list)
    #: cases per damaged file and per kind.
    per_file: Counter[str] = field(default_factory=Counter)
    per_kind: Counter[str] = field(default_factory=Counter)
    #: the slowest read (CPU seconds and wall seconds) and the largest memory growth of a child
    #: (peak resident set minus what it had before the first case, MB).
    worst_cpu_s: float = 0.0
    worst_wall_s: float = 0.0
    worst_memory_mb: float = 0.0


def make_pristine(directory: Path) -> Path:
    """Write two checkpoints (with log segments) of a small run into *directory*; return it."""
    from epochal import Loop
    from epochal_checkpoint.plugin import Checkpoint
    from epochal_checkpoint.testing import BatchRecorder, make_data, make_model

    plugin = Checkpoint(dir=str(directory), every_n_batches=8, every_n_epochs=0, keep_last=2)
    loop = Loop(
        make_model(size=4000, chunks=3),
        make_data(examples=128, batch_size=16),
        plugins={"recorder": BatchRecorder(), "checkpoint": plugin},
        max_iterations=16,
        handle_signals=False,
    )
    loop.run()
    return directory


def _resign_file(checkpoint: Path, name: str) -> None:
    """Make the manifest (and its commit record) agree with file *name* as it is now."""
    if name == MANIFEST:
        (checkpoint / name).write_bytes(seal((checkpoint / name).read_bytes()))
        return
    manifest = json.loads((checkpoint / MANIFEST).read_bytes())
    data = (checkpoint / name).read_bytes()
    if name != DATA:  # resign() finds data.bin's state and array records itself
        manifest["files"][name] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    resign(checkpoint, manifest)
    # resign() recomputed every listed file; the damaged one is what counts here


def _json_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(value, dict):
        for key, item in list(value.items())[:50]:
            out += _json_paths(item, (*path, key))
    elif isinstance(value, list):
        for k, item in enumerate(value[:50]):
            out += _json_paths(item, (*path, k))
    return out


def _damage(rng: random.Random, kind: str, file: Path) -> None:
    """Damage *file* in place as *kind* says."""
    checkpoint, name = file.parent, file.name
    resign = kind.endswith("-resigned") or kind in ("json-value", "json-deep", "npy-header")
    if kind.startswith("flip"):
        data = bytearray(file.read_bytes())
        if data:
            k = rng.randrange(len(data))
            data[k] ^= 1 << rng.randrange(8)
        file.write_bytes(bytes(data))
    elif kind.startswith("truncate"):
        whole = file.read_bytes()
        file.write_bytes(whole[: rng.randrange(max(len(whole), 1))])
    elif kind.startswith("append"):
        file.write_bytes(file.read_bytes() + rng.randbytes(rng.choice([1, 7, 4096])))
    elif kind == "json-value":
        try:
            document = json.loads(file.read_bytes())
        except ValueError:  # not a JSON file: garbage in the middle instead
            data = bytearray(file.read_bytes())
            k = rng.randrange(max(len(data), 1))
            data[k : k + 8] = rng.randbytes(8)
            file.write_bytes(bytes(data))
        else:
            path = rng.choice(_json_paths(document)[1:] or [()])
            value = rng.choice(_WRONG)
            if path:
                target = document
                for key in path[:-1]:
                    target = target[key]
                if rng.random() < 0.2 and isinstance(target, dict):
                    del target[path[-1]]
                else:
                    target[path[-1]] = value
            else:
                document = value
            file.write_bytes(json.dumps(document).encode())
    elif kind == "json-deep":
        depth = rng.choice([300, 5000, 200_000])
        if rng.random() < 0.5:
            file.write_bytes(b"[" * depth + b"]" * depth)
        else:
            file.write_bytes(b'{"a":' * depth + b"1" + b"}" * depth)
    elif kind == "npy-header":
        data = bytearray(file.read_bytes())
        start = data.find(b"{'descr'")
        end = data.find(b"}", start)
        if start < 0 or end < 0:
            data[:16] = rng.randbytes(16)
        else:
            header = rng.choice(
                [
                    "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000,), }",
                    "{'descr': '|O', 'fortran_order': False, 'shape': (1,), }",
                    "{'descr': '<f8', 'fortran_order': True, 'shape': (10, 10), }",
                    "{'descr': [('a', '<f4', (1000000, 1000000))], 'fortran_order': False, 'shape': (), }",
                    "{'descr': '<f4', 'fortran_order': False, 'shape': (-5,), }",
                    "__import__('os').system('touch PWNED')",
                ]
            )
            old = end + 1 - start
            data[start : end + 1] = header.encode().ljust(old)[: max(old, len(header))]
        file.write_bytes(bytes(data))
    elif kind == "symlink-dev-zero":
        file.unlink()
        file.symlink_to("/dev/zero")
    elif kind == "symlink-outside":
        outside = checkpoint.parent.parent / f"outside-{name}"
        if not outside.exists():
            shutil.copyfile(file, outside)
        file.unlink()
        file.symlink_to(outside)
    elif kind == "fifo":
        file.unlink()
        os.mkfifo(file)
    elif kind == "directory":
        file.unlink()
        file.mkdir()
    elif kind == "missing":
        file.unlink()
    if resign and file.is_file() and not file.is_symlink():
        _resign_file(checkpoint, name)


def _child(pristine: Path, work: Path, seed: int, count: int, memory_mb: int) -> dict[str, Any]:
    """Run *count* cases (in this process: a child started by :func:`fuzz`); return the results."""
    import numpy as np  # imported before the limit is set

    work = work / f"child-{seed}"
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # a crafted header that ran code would leave PWNED here

    infos, _ = list_checkpoints(pristine)
    older, newest = infos[-2], infos[-1]
    files = sorted(p.name for p in newest.path.iterdir())
    find_latest(pristine)  # warm up every code path before measuring
    np.zeros(1)
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/status") as status:
        vm = next(int(line.split()[1]) for line in status if line.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + memory_mb * 2**20, resource.RLIM_INFINITY))

    def alarm(signum: int, frame: Any) -> None:
        raise TimeoutError("the read hung")

    signal.signal(signal.SIGALRM, alarm)
    rng = random.Random(seed)
    results = []
    for k in range(count):
        name = files[k % len(files)]
        kind = KINDS[rng.randrange(len(KINDS))]
        case = work / f"case-{seed}-{k}"
        shutil.copytree(pristine, case, symlinks=True)
        _damage(rng, kind, case / newest.name / name)
        outcome, detail, warned = "", "", 0
        started, cpu = time.perf_counter(), time.process_time()
        signal.alarm(10)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                read, _ = find_latest(case)
            warned = sum(newest.name in str(w.message) for w in caught)
            outcome = {newest.name: "newest", older.name: "older"}.get(read.name, "other")
            detail = read.name
        except CheckpointError as error:
            outcome, detail = "clean-error", str(error)[:300]
        except BaseException as error:  # what the fuzzing is for: anything else is a failure
            outcome, detail = "crash", f"{type(error).__name__}: {str(error)[:300]}"
        finally:
            signal.alarm(0)
        results.append(
            {
                "file": name,
                "kind": kind,
                "outcome": outcome,
                "detail": detail,
                "warned": warned,
                "cpu": time.process_time() - cpu,
                "wall": time.perf_counter() - started,
            }
        )
        shutil.rmtree(case, ignore_errors=True)
        for stray in work.glob("outside-*"):
            stray.unlink(missing_ok=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"results": results, "memory_mb": peak - usage, "pwned": (work / "PWNED").exists()}


def child_main() -> None:
    """Entry of a fuzz child: ``python -m epochal_checkpoint.fuzz PRISTINE WORK SEED COUNT MB``."""
    pristine, work, seed, count, memory_mb = sys.argv[1:6]
    report = _child(Path(pristine), Path(work), int(seed), int(count), int(memory_mb))
    sys.stdout.write(json.dumps(report))


def fuzz(
    pristine: Path, work: Path, cases: int = 300, children: int = 2, memory_mb: int = 200, seed: int = 0
) -> FuzzReport:
    """Run *cases* damaged reads of *pristine*'s newest checkpoint in *children* processes."""
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    per_child = [cases // children + (k < cases % children) for k in range(children)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "epochal_checkpoint.fuzz",
                *map(str, (pristine, work, seed + k, n, memory_mb)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=work,
        )
        for k, n in enumerate(per_child)
    ]
    report = FuzzReport()
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            report.failures.append(("<child>", "", f"exit {proc.returncode}: {err.decode()[-2000:]}"))
            continue
        data = json.loads(out)
        if data["pwned"]:
            report.failures.append(("<child>", "npy-header", "a crafted header ran code"))
        report.worst_memory_mb = max(report.worst_memory_mb, data["memory_mb"])
        for result in data["results"]:
            report.cases += 1
            report.per_file[result["file"]] += 1
            report.per_kind[result["kind"]] += 1
            report.worst_cpu_s = max(report.worst_cpu_s, result["cpu"])
            report.worst_wall_s = max(report.worst_wall_s, result["wall"])
            outcome = result["outcome"]
            where = (result["file"], result["kind"], f"{outcome}: {result['detail']}")
            if outcome == "newest":
                report.newest += 1
                checked = result["file"] in (MANIFEST, DATA)
                if checked and result["kind"] in ("flip", "truncate", "append", "missing"):
                    report.failures.append((*where[:2], "damage not detected: the newest was loaded"))
            elif outcome == "older":
                report.fallbacks += 1
                if result["warned"] != 1:
                    report.failures.append((*where[:2], f"{result['warned']} warnings naming it, not 1"))
            elif outcome == "clean-error":
                report.clean_errors += 1
                report.failures.append(where)  # the older checkpoint is intact: must fall back
            else:
                report.failures.append(where)
            if result["cpu"] > 1.0:
                report.failures.append((*where[:2], f"took {result['cpu']:.2f} s of CPU"))
    return report


if __name__ == "__main__":
    child_main()
