"""Per-run fixed costs of the six standard plugins against Ignite's equivalent handlers (issue 32).

Run: ``python bench/fixed_costs.py [--rounds N] [--no-strace]`` (needs pytorch-ignite, as
``bench/peers.py``; strace for the counts).

The cases are ``bench/peers.py``'s "epochal + features" (monitor, early_stopping, checkpoint,
sqlite_log, timing, progress; a validation stream) and "ignite + features, durable checkpoint"
(Ignite's equivalent handlers, its checkpoint fsynced as epochal's is), each a short run of
``BENCH_EPOCHS`` (5) epochs of ``BENCH_STEPS`` batches (here 10 by default: the per-step costs
are then small and what is left is mostly per run and per epoch).

Two figures, each case in a child process of its own that runs the case once untimed first
(imports and caches warm, as in a process that has run before; start-up is bench/startup.py's),
then builds it afresh and looks at the second run call only:

- **System calls of one run** (``strace -f -y``, every thread), counted between two marker calls
  made just before and just after the run call: fsyncs (``fsync``/``fdatasync``), file-system
  metadata operations (open, stat, rename, unlink, mkdir, rmdir, link, directory listings, ...),
  and reads/writes; then split by the path each call names (``-y`` prints a descriptor's path):
  the checkpoint directory (``checkpoints``), the SQLite log (``sqlite``) and the rest, with the
  files each creates (``O_CREAT``, ``mkdir``, ``symlink``: a new inode each, the costliest
  metadata operation). These are exact counts, not timings: the same on any machine.
- **CPU time of one run** (``time.process_time`` in the child, no strace), median over
  ``--rounds`` interleaved rounds, and its ratio epochal / Ignite.
- With ``--ops``: the CPU time of each kind of file-system operation alone (200 of each in a
  new directory beside the runs', median), which says what a count above costs on this disk.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("BENCH_STEPS", "10")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import peers  # noqa: E402  (beside this file; reads BENCH_STEPS when imported)
from _common import fsync_path  # noqa: E402

CASES = {
    "epochal": lambda: peers.make_epochal_features(step_records=True),
    "ignite": lambda: peers.make_ignite_features("0.1s", durable=True),
}
MARK = "/epochal-fixed-costs-marker"
FSYNC = {"fsync", "fdatasync", "sync_file_range"}
METADATA = {
    "open", "openat", "openat2", "creat", "stat", "lstat", "fstat", "newfstatat", "statx", "access",
    "faccessat", "faccessat2", "mkdir", "mkdirat", "rmdir", "rename", "renameat", "renameat2",
    "unlink", "unlinkat", "link", "linkat", "symlink", "symlinkat", "readlink", "readlinkat",
    "getdents64", "chmod", "fchmod", "fchmodat", "utimensat", "flock", "ftruncate", "truncate",
}  # fmt: skip
DATA = {"read", "pread64", "readv", "preadv", "write", "pwrite64", "writev", "pwritev"}
CALL = re.compile(r"^(?:\d+\s+)?(?:<\.\.\. )?([a-z_0-9]+)[( ]")
#: whose a call is, by the path it names: the checkpoint directory, the SQLite log, the rest.
OWNERS = (("checkpoint", "/checkpoints"), ("sqlite", "sqlite"))


def child(case: str, mark: bool) -> None:
    """Run *case* once untimed (its modules imported, its caches warm, as in a process that has
    run before), then build it again in a new temporary folder, run it, print its CPU seconds."""
    warm = Path(tempfile.mkdtemp(prefix="epochal-fixed-"))
    try:
        with peers.quiet():
            CASES[case]()(warm)()
    finally:
        shutil.rmtree(warm, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix="epochal-fixed-"))
    try:
        with peers.quiet():
            run = CASES[case]()(tmp)
            if mark:
                os.path.exists(MARK + "-start")
            started = time.process_time()
            run()
            cpu = time.process_time() - started
            if mark:
                os.path.exists(MARK + "-end")
        print(cpu)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def owner(line: str) -> str:
    """Whose system call *line* is (see :data:`OWNERS`); "rest" when it names neither."""
    return next((name for name, mark in OWNERS if mark in line), "rest")


def creates(name: str, line: str) -> bool:
    """Whether the call *line* (of system call *name*) made a new inode (a failed one did not)."""
    if "= -1" in line:
        return False
    return name in ("mkdir", "mkdirat", "symlink", "symlinkat") or (
        name in ("open", "openat", "creat") and ("O_CREAT" in line or "O_TMPFILE" in line)
    )


def counts(trace: Path) -> collections.Counter[tuple[str, str]]:
    """System calls between the markers of an ``strace -f -y`` output, by (owner, call); the
    calls that make a new inode are counted again as (owner, "+creates")."""
    inside, found = False, collections.Counter[tuple[str, str]]()
    for line in trace.read_text().splitlines():
        if MARK + "-start" in line:
            inside = True
            continue
        if MARK + "-end" in line:
            break
        if inside and "resumed>" not in line and (match := CALL.match(line)):
            who = owner(line)
            found[who, match[1]] += 1
            if creates(match[1], line):
                found[who, "+creates"] += 1
    return found


def run_child(case: str, mark: bool = False, trace: Path | None = None) -> float:
    command = [sys.executable, __file__, "--child", case] + (["--mark"] if mark else [])
    if trace is not None:
        command = ["strace", "-f", "-y", "-qq", "-o", str(trace), *command]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ)
    return float(out.stdout.strip().splitlines()[-1])


def file_ops(count: int = 200) -> dict[str, float]:
    """CPU microseconds of one file-system operation of each kind (median of *count*), in a new
    directory under the temporary directory the runs use."""

    def timed(operation: Callable[[int], object], times: int = count) -> float:
        spent = []
        for i in range(times):
            started = time.process_time()
            operation(i)
            spent.append(time.process_time() - started)
        return statistics.median(spent) * 1e6

    def create(i: int, prefix: str = "f") -> None:
        os.close(os.open(f"{d}/{prefix}{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))

    def written(i: int) -> None:
        fd = os.open(f"{d}/w{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"x" * 2000)
        os.fsync(fd)
        os.close(fd)

    d = tempfile.mkdtemp(prefix="epochal-fixed-ops-")
    try:
        return {
            "create a file (open O_CREAT)": timed(create),
            "mkdir": timed(lambda i: os.mkdir(f"{d}/d{i}")),
            "symlink": timed(lambda i: os.symlink("x", f"{d}/s{i}")),
            "link": timed(lambda i: os.link(f"{d}/f{i}", f"{d}/l{i}")),
            "rename": timed(lambda i: os.rename(f"{d}/l{i}", f"{d}/r{i}")),
            "unlink": timed(lambda i: os.unlink(f"{d}/r{i}")),
            "stat": timed(lambda i: os.stat(f"{d}/f{i}")),
            "rmdir": timed(lambda i: os.rmdir(f"{d}/d{i}")),
            "fsync a directory": timed(lambda i: fsync_path(d), count // 4),
            "create, write 2 kB, fsync": timed(written, count // 4),
        }
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=peers.rounds, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--no-strace", action="store_true", help="leave out the system-call counts")
    parser.add_argument("--ops", action="store_true", help="also the CPU of each file-system operation")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--mark", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.mark)
        return
    import epochal

    print(f"epochal from {Path(epochal.__file__).parent}; {peers.EPOCHS} epochs of {peers.STEPS} batches")
    if args.ops:
        print(f"\n| file-system operation in {tempfile.gettempdir()} | CPU µs (median) |\n|---|---:|")
        for name, micros in file_ops().items():
            print(f"| {name} | {micros:.0f} |")
    if not args.no_strace and shutil.which("strace"):
        print("\n| case | part | fsyncs | metadata ops | new inodes | reads + writes | all system calls |")
        print("|---|---|---:|---:|---:|---:|---:|")
        with tempfile.TemporaryDirectory() as folder:
            for case in CASES:
                trace = Path(folder) / f"{case}.trace"
                run_child(case, mark=True, trace=trace)
                found = counts(trace)
                for part in ("all", *(name for name, _ in OWNERS), "rest"):
                    calls = collections.Counter[str]()
                    for (who, call), n in found.items():
                        if part in ("all", who):
                            calls[call] += n
                    fsyncs = sum(calls[c] for c in FSYNC)
                    meta = sum(calls[c] for c in METADATA)
                    data = sum(calls[c] for c in DATA)
                    every = sum(n for c, n in calls.items() if c != "+creates")
                    print(f"| {case} | {part} | {fsyncs} | {meta} | {calls['+creates']} | {data} | {every} |")
                    if part != "all":
                        top = ", ".join(f"{c} {n}" for c, n in calls.most_common() if c in METADATA | FSYNC)
                        print(f"|  | ({part}: {top}) | | | | | |")
    cpu: dict[str, list[float]] = {case: [] for case in CASES}
    for number in range(args.rounds):
        order = list(CASES)[number % 2 :] + list(CASES)[: number % 2]
        for case in order:
            cpu[case].append(run_child(case))
    median = {case: statistics.median(v) * 1e3 for case, v in cpu.items()}
    spread = {case: (min(v) * 1e3, max(v) * 1e3) for case, v in cpu.items()}
    print("\n| case | CPU ms per run (median) | spread |")
    print("|---|---:|---:|")
    for case in CASES:
        print(f"| {case} | {median[case]:.1f} | {spread[case][0]:.1f}–{spread[case][1]:.1f} |")
    ratios = [e / i for e, i in zip(cpu["epochal"], cpu["ignite"], strict=True)]
    print(
        f"\nepochal / Ignite, CPU per run: {median['epochal'] / median['ignite']:.2f}× (medians); "
        f"per-round ratios {min(ratios):.2f}–{max(ratios):.2f}×, median {statistics.median(ratios):.2f}×"
    )


if __name__ == "__main__":
    main()
