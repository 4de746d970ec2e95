"""Crash torture for epochal-checkpoint: many SIGKILLs at random moments of checkpointing runs.

Run: ``python bench/torture_checkpoint.py [--chains 4] [--kills 50] [--size 4000000] [--dir DIR]``.

Each chain is an ``epochal run`` of a synthetic numpy model (``--size`` float32 parameters)
with a plugin writing a log record every batch and now and then into an older row
(``epochal_checkpoint.testing.BatchRecorder``: every save links the previous checkpoint's log
segments and adds one), saving a checkpoint after every batch (odd chains with
``async_save``), killed with SIGKILL at
a random moment, then restarted with ``--resume``, ``--kills`` times. After every kill every
checkpoint under a final name must verify and ``latest`` must name one; at the end every chain
resumes to a fixed iteration and must equal a straight run bitwise. The test suite runs 50
kills (tests/test_checkpoint_torture.py); this runs 200 by default.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from epochal_checkpoint.testing import torture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--kills", type=int, default=50, help="kills per chain")
    parser.add_argument("--size", type=int, default=4_000_000, help="float32 parameters (16 MB)")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir under the cwd)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix=".torture-checkpoint-", dir=args.dir or os.getcwd()))
    started = time.perf_counter()
    try:
        report = torture(workdir, args.chains, args.kills, args.size, args.parallel, args.seed)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.perf_counter() - started
    print(
        f"kills: {report.kills} ({args.chains} chains, state {args.size * 4 / 2**20:.0f} MB, {elapsed:.0f} s)"
    )
    print(f"kills that left a partial write behind (temporary dir present): {report.partial_writes_seen}")
    print(
        f"restarts with --resume: {report.resumes}; "
        f"checkpoints verified after kills: {report.checkpoints_verified}"
    )
    print(f"final resumes: {report.final_runs}, bitwise equal to a straight run: {report.exact_matches}")
    print(f"failures: {len(report.failures)}")
    for failure in report.failures:
        print("  " + failure)
    sys.exit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
