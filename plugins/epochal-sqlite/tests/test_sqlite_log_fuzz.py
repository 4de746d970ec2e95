"""A damaged SQLite log header: 200 mutations, each read in a child under an address-space limit.

Each case damages the 100-byte database header of a copy of a real log (a bit flip, random
bytes, a field set to an extreme value, a truncation) and opens it with the ``epochal log``
reader (``Reader(path).runs()``). It must end in a clean load or one ``EpochalError`` (the CLI's
one-line error), within 1 s of CPU and the memory limit, never a raw ``sqlite3`` error,
a crash or a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from epochal_sqlite import SQLiteLog

from epochal import Loop
from epochal.examples.tiny import TinyModel, tiny_data

CHILD = r"""
import json, os, random, resource, shutil, signal, sqlite3, struct, sys, time
from pathlib import Path
from epochal.errors import EpochalError
from epochal_sqlite import Reader

db, work, count = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
with Reader(db) as reader:  # warm up every code path before the limit
    reader.runs()
with open("/proc/self/status") as status:
    vm = next(int(line.split()[1]) for line in status if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 200 * 2**20, resource.RLIM_INFINITY))


def alarm(signum, frame):
    raise TimeoutError("the read hung")


signal.signal(signal.SIGALRM, alarm)
rng = random.Random(0)
# header fields worth setting to extremes: page size, reserved bytes, payload fractions,
# page count, freelist, schema cookie/format, text encoding, user version, application id
FIELDS = [(16, 2), (20, 1), (21, 1), (22, 1), (23, 1), (28, 4), (32, 4), (36, 4), (40, 4),
          (44, 4), (48, 4), (52, 4), (56, 4), (60, 4), (64, 4), (68, 4), (92, 4), (96, 4)]
results = []
for k in range(count):
    case = work / f"case-{k}.sqlite"
    shutil.copyfile(db, case)
    data = bytearray(case.read_bytes())
    kind = rng.choice(["flip", "random", "field", "truncate"])
    if kind == "flip":
        i = rng.randrange(100)
        data[i] ^= 1 << rng.randrange(8)
    elif kind == "random":
        i = rng.randrange(100)
        data[i : i + 4] = rng.randbytes(4)
    elif kind == "field":
        offset, size = rng.choice(FIELDS)
        value = rng.choice([0, 1, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 3, 65536])
        data[offset : offset + size] = (value & ((1 << (8 * size)) - 1)).to_bytes(size, "big")
    else:
        data = data[: rng.randrange(100)]
    case.write_bytes(bytes(data))
    outcome = ""
    started = time.process_time()
    signal.alarm(10)
    try:
        with Reader(case) as reader:
            runs = reader.runs()
        outcome = f"load {len(runs)}"
    except EpochalError as error:
        outcome = "clean " + type(error).__name__
    except BaseException as error:
        outcome = f"crash {type(error).__name__}: {error}"
    finally:
        signal.alarm(0)
    results.append({"kind": kind, "outcome": outcome, "cpu": time.process_time() - started})
    for leftover in work.glob(f"case-{k}.sqlite*"):
        leftover.unlink()
print(json.dumps(results))
"""


def test_a_damaged_database_header_is_a_clean_error_or_a_clean_load(tmp_path: Path) -> None:
    db = tmp_path / "log.sqlite"
    loop = Loop(TinyModel(), tiny_data(), plugins={"sqlite_log": SQLiteLog(path=str(db))}, max_epochs=2)
    loop.run()
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(db), str(work), "200"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    results = json.loads(child.stdout)
    assert len(results) == 200
    crashes = [r for r in results if r["outcome"].startswith("crash")]
    assert crashes == [], crashes[:5]
    assert max(r["cpu"] for r in results) < 1.0
    assert any(r["outcome"].startswith("clean") for r in results)
