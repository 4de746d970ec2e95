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

The directory's ``latest`` link is fuzzed too (a link to a missing, foreign or outside name, to
``/dev/zero`` or itself, a regular file, a FIFO, a directory...), read as ``load``'s ``path``
does (:func:`epochal_checkpoint.plugin.read_from`): a load or one clean
:class:`~epochal_checkpoint.errors.CheckpointError`. Every case must end within
:data:`HANG_S` seconds and no single read may ask for more than :data:`MAX_READ_BYTES`.
With *key*, the pristine checkpoints are signed (``EPOCHAL_CHECKPOINT_KEY``) and read with the
key: then no damage to ``data.bin`` or the manifest, re-signed with CRC-32s or not, may load.

``bench/fuzz_checkpoint.py`` runs it with more cases and prints the figures.
"""

from __future__ import annotations

import contextlib
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

from epochal.errors import EpochalError
from epochal_checkpoint.errors import CheckpointError
from epochal_checkpoint.storage.codec import DATA, MANIFEST, seal
from epochal_checkpoint.storage.layout import POINTER, list_checkpoints
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
    "pickle-payload",
)
#: the kinds of damage to the ``latest`` link.
POINTER_KINDS = (
    "pointer-missing-name",
    "pointer-older",
    "pointer-path",
    "pointer-outside",
    "pointer-dev-zero",
    "pointer-self",
    "pointer-long",
    "pointer-garbage",
    "pointer-regular-file",
    "pointer-fifo",
    "pointer-directory",
    "pointer-missing",
)
#: a case that takes longer than this (wall seconds) is a hang.
HANG_S = 5
#: the largest read a case may ask for (bytes).
MAX_READ_BYTES = 512 << 20
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
    #: cases whose damage re-signing undid (the files are the pristine ones byte for byte).
    unchanged: int = 0
    #: sharded cases that read, then ended in one error of the model's load (DCP files whose
    #: damage only reading their tensors shows: their checksums made to agree).
    load_errors: int = 0
    #: children in which a crafted file ran code.
    executed: int = 0
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
    #: the largest single read (``os.read``/``pread``/``preadv``) a case asked for, in bytes.
    largest_read: int = 0


def make_pristine(directory: Path, key: str | None = None, sharded: bool = False) -> Path:
    """Write two checkpoints (with log segments) of a small run into *directory*; return it.
    With *key*, they are signed with it; with *sharded*, they are a ``TorchModel``'s sharded
    checkpoints (DCP files: :mod:`epochal_checkpoint.fuzz_shards`)."""
    if sharded:
        from epochal_checkpoint.fuzz_shards import make_sharded_pristine

        return make_sharded_pristine(directory, key)
    from epochal_checkpoint.testing import make_data, make_model

    run_pristine(directory, make_model(size=4000, chunks=3), make_data(examples=128, batch_size=16), key)
    return directory


def run_pristine(directory: Path, model: Any, data: Any, key: str | None, **checkpoint: Any) -> None:
    """Train *model* on *data* for 16 batches with a checkpoint every 8 into *directory* (the
    two newest kept; *checkpoint*: more of the plugin's options), every save writing a log
    segment, signed with *key* if given (``EPOCHAL_CHECKPOINT_KEY`` as it was afterwards)."""
    from epochal import Loop
    from epochal_checkpoint import incremental
    from epochal_checkpoint.plugin import Checkpoint
    from epochal_checkpoint.storage.sign import KEY_ENV
    from epochal_checkpoint.testing import BatchRecorder

    plugin = Checkpoint(dir=str(directory), every_n_batches=8, every_n_epochs=0, keep_last=2, **checkpoint)
    loop = Loop(
        model,
        data,
        plugins={"recorder": BatchRecorder(), "checkpoint": plugin},
        max_iterations=16,
        handle_signals=False,
    )
    saved = os.environ.pop(KEY_ENV, None)
    if key is not None:
        os.environ[KEY_ENV] = key
    inline, incremental.INLINE_VALUES = incremental.INLINE_VALUES, 0  # every save: a segment to damage
    try:
        loop.run()
    finally:
        incremental.INLINE_VALUES = inline
        os.environ.pop(KEY_ENV, None)
        if saved is not None:
            os.environ[KEY_ENV] = saved


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
    resign = kind.endswith("-resigned") or kind in ("json-value", "json-deep", "npy-header", "pickle-payload")
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
    elif kind == "pickle-payload":  # what stock DCP unpickles from .metadata: code
        from epochal_checkpoint.forgery import METADATA_KINDS, pickle_payload

        file.write_bytes(pickle_payload(rng.choice(METADATA_KINDS[:4]), Path.cwd()))
    if resign and file.is_file() and not file.is_symlink():
        _resign_file(checkpoint, name)


def _damage_pointer(rng: random.Random, kind: str, pointer: Path, older: str) -> None:
    """Damage the ``latest`` link *pointer* as *kind* says."""
    pointer.unlink(missing_ok=True)
    targets = {
        "pointer-missing-name": "ckpt-e9999-i999999",
        "pointer-older": older,
        "pointer-path": f"./{older}",
        "pointer-outside": "../" + rng.choice(["pristine", "etc", "outside"]),
        "pointer-dev-zero": "/dev/zero",
        "pointer-self": "latest",
        "pointer-long": "ckpt-e" + "9" * rng.choice([20, 300, 4000]),
    }
    if kind in targets:
        with contextlib.suppress(OSError):  # a name longer than the system takes: no link at all
            pointer.symlink_to(targets[kind])
    elif kind == "pointer-garbage":
        pointer.symlink_to(
            rng.randbytes(rng.randrange(1, 64)).replace(b"\0", b"x").replace(b"/", b"x").decode("latin-1")
        )
    elif kind == "pointer-regular-file":
        pointer.write_bytes(
            older.encode() if rng.random() < 0.5 else rng.randbytes(rng.choice([1, 100, 100_000]))
        )
    elif kind == "pointer-fifo":
        os.mkfifo(pointer)
    elif kind == "pointer-directory":
        pointer.mkdir()


def _same(pristine: Path, case: Path, name: str) -> bool:
    """Whether file *name* and the manifest of *case* are byte for byte *pristine*'s: re-signing
    can undo a damage (JSON re-encoded: ``1E-05`` becomes ``1e-05`` again, appended whitespace
    goes), and such a case holds nothing to detect."""
    for file in {name, MANIFEST}:
        target = case / file
        if (
            target.is_symlink()
            or not target.is_file()
            or target.read_bytes() != (pristine / file).read_bytes()
        ):
            return False
    return True


class _LoadError(Exception):
    """The model's load of a checkpoint that read ended in one error (a sharded one's DCP files)."""


def _child(pristine: Path, work: Path, seed: int, count: int, memory_mb: int) -> dict[str, Any]:
    """Run *count* cases (in this process: a child started by :func:`fuzz`); return the results."""
    import numpy as np  # imported before the limit is set

    work = work / f"child-{seed}"
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # a crafted header that ran code would leave PWNED here

    from epochal_checkpoint.plugin import read_from

    infos, _ = list_checkpoints(pristine)
    older, newest = infos[-2], infos[-1]
    files = [*sorted(p.name for p in newest.path.iterdir()), POINTER]
    model = None
    if ".metadata" in files:  # sharded: a resume then loads the model's tensors (DCP reads)
        from epochal_checkpoint.fuzz_shards import load_model, make_model

        model = make_model()
        load_model(model, find_latest(pristine)[0].state)
    find_latest(pristine)  # warm up every code path before measuring
    read_from(pristine / POINTER)
    np.zeros(1)
    largest = [0]

    def counted(read: Any, size: Any) -> Any:
        def wrapper(fd: int, what: Any, *args: Any) -> Any:
            largest[0] = max(largest[0], size(what))
            return read(fd, what, *args)

        return wrapper

    os.read = counted(os.read, int)
    os.pread = counted(os.pread, int)
    os.preadv = counted(os.preadv, lambda buffers: sum(memoryview(b).nbytes for b in buffers))
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
        case = work / f"case-{seed}-{k}"
        shutil.copytree(pristine, case, symlinks=True)
        if name == POINTER:
            kind = POINTER_KINDS[rng.randrange(len(POINTER_KINDS))]
            _damage_pointer(rng, kind, case / POINTER, older.name)
        else:
            kind = KINDS[rng.randrange(len(KINDS))]
            _damage(rng, kind, case / newest.name / name)
        changed = name == POINTER or not _same(newest.path, case / newest.name, name)
        outcome, detail, warned = "", "", 0
        largest[0] = 0
        started, cpu = time.perf_counter(), time.process_time()
        signal.alarm(HANG_S)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if name == POINTER:
                    _, where = read_from(case / POINTER)
                else:
                    read, _ = find_latest(case)
                    where = read.path
                    if model is not None:
                        try:
                            load_model(model, read.state)
                        except EpochalError as error:  # found only by reading the tensors
                            raise _LoadError(str(error)) from None
            warned = sum(newest.name in str(w.message) for w in caught)
            outcome = {newest.name: "newest", older.name: "older"}.get(where.name, "other")
            detail = where.name
        except _LoadError as error:
            outcome, detail = "load-error", str(error)[:300]
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
                "read": largest[0],
                "changed": changed,
            }
        )
        shutil.rmtree(case, ignore_errors=True)
        for stray in work.glob("outside-*"):
            stray.unlink(missing_ok=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    from epochal_checkpoint.forgery import executed

    pwned = (work / "PWNED").exists() or bool(executed(work))
    return {"results": results, "memory_mb": peak - usage, "pwned": pwned}


def child_main() -> None:
    """Entry of a fuzz child: ``python -m epochal_checkpoint.fuzz PRISTINE WORK SEED COUNT MB``."""
    pristine, work, seed, count, memory_mb = sys.argv[1:6]
    report = _child(Path(pristine), Path(work), int(seed), int(count), int(memory_mb))
    sys.stdout.write(json.dumps(report))


def fuzz(
    pristine: Path,
    work: Path,
    cases: int = 300,
    children: int = 2,
    memory_mb: int = 200,
    seed: int = 0,
    key: str | None = None,
) -> FuzzReport:
    """Run *cases* damaged reads of *pristine*'s newest checkpoint (and its ``latest`` link) in
    *children* processes; with *key*, read with that signing key (*pristine* signed with it)."""
    from epochal_checkpoint.storage.sign import KEY_ENV

    pristine, work = Path(pristine).resolve(), Path(work).resolve()  # the children run in *work*
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if key is not None:
        env[KEY_ENV] = key
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
            report.failures.append(("<child>", "npy-header/pickle-payload", "a crafted file ran code"))
            report.executed += 1
        report.worst_memory_mb = max(report.worst_memory_mb, data["memory_mb"])
        for result in data["results"]:
            report.cases += 1
            report.unchanged += not result["changed"]
            report.per_file[result["file"]] += 1
            report.per_kind[result["kind"]] += 1
            report.worst_cpu_s = max(report.worst_cpu_s, result["cpu"])
            report.worst_wall_s = max(report.worst_wall_s, result["wall"])
            report.largest_read = max(report.largest_read, result["read"])
            outcome, pointer = result["outcome"], result["file"] == POINTER
            where = (result["file"], result["kind"], f"{outcome}: {result['detail']}")
            if outcome == "newest":
                report.newest += 1
                checked = result["file"] in (MANIFEST, DATA) and result["changed"]
                if checked and (
                    key is not None or result["kind"] in ("flip", "truncate", "append", "missing")
                ):
                    report.failures.append((*where[:2], "damage not detected: the newest was loaded"))
            elif outcome == "older":
                report.fallbacks += 1
                if result["warned"] != 1 and not pointer:
                    report.failures.append((*where[:2], f"{result['warned']} warnings naming it, not 1"))
            elif outcome == "load-error":  # one line from the model's load: damage DCP found
                report.load_errors += 1
                if result["file"] in (MANIFEST, DATA) and result["changed"]:
                    report.failures.append(where)  # the reader checks these wholly
            elif outcome == "clean-error":
                report.clean_errors += 1
                if not pointer:  # the older checkpoint is intact: must fall back
                    report.failures.append(where)
            else:
                report.failures.append(where)
            if result["cpu"] > 1.0:
                report.failures.append((*where[:2], f"took {result['cpu']:.2f} s of CPU"))
            if result["wall"] > HANG_S:
                report.failures.append((*where[:2], f"took {result['wall']:.2f} s (a hang)"))
            if result["read"] > MAX_READ_BYTES:
                report.failures.append((*where[:2], f"read {result['read']} bytes at once"))
    return report


if __name__ == "__main__":
    child_main()
