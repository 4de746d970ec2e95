"""A synthetic numpy model and data for crash tests and benchmarks (no scikit-learn needed);
crafting damaged checkpoints (:func:`resign`, :func:`replace_state`, :func:`force_crc32`) for
tests and fuzzing.

``make_model(size=...)`` holds ``size`` float32 parameters updated deterministically by every
batch; ``make_data(...)`` returns a seeded :class:`epochal.data.BatchStream`. Used by this
distribution's torture test and ``bench/checkpoint_io.py``/``bench/torture_checkpoint.py``::

    [model]
    factory = "epochal_checkpoint.testing:make_model"
    size = 1000000
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from epochal import hookimpl
from epochal.data import BatchStream


class SyntheticModel:
    """``size`` float32 parameters in ``chunks`` arrays; each step adds a batch-derived value."""

    def __init__(self, size: int = 1_000_000, chunks: int = 4, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        per = max(1, size // chunks)
        self.params = {f"p{i}": rng.standard_normal(per, dtype=np.float32) for i in range(chunks)}
        self.steps = 0

    def train_step(self, batch: Any) -> dict[str, float]:
        """Move every parameter array by a batch-dependent amount; return a loss."""
        value = np.float32(np.asarray(batch, dtype=np.float32).mean())
        for array in self.params.values():
            array *= np.float32(0.999)
            array += value
        self.steps += 1
        return {"loss": float(value)}

    def eval_step(self, batch: Any) -> dict[str, float]:
        """A loss derived from the first parameters."""
        return {"loss": float(next(iter(self.params.values()))[:16].mean())}

    def state_dict(self) -> dict[str, Any]:
        """The parameter arrays themselves (not copies, as frameworks do) and the step count."""
        return {**self.params, "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy a state from :meth:`state_dict` back in."""
        for key, array in self.params.items():
            np.copyto(array, state[key])
        self.steps = int(state["steps"])


def make_model(size: int = 1_000_000, chunks: int = 4, seed: int = 0) -> SyntheticModel:
    """A :class:`SyntheticModel`."""
    return SyntheticModel(size, chunks, seed)


def make_data(examples: int = 256, batch_size: int = 16, seed: int = 0) -> dict[str, BatchStream]:
    """A shuffled train stream and a small valid stream of random float32 rows."""
    x = np.random.default_rng(seed).standard_normal((examples, 8), dtype=np.float32)
    return {
        "train": BatchStream(x, batch_size=batch_size, seed=seed),
        "valid": BatchStream(x[:32], batch_size=batch_size, shuffle=False, seed=seed),
    }


class BatchRecorder:
    """A plugin writing a record into every batch's log row, and now and then into an old row.

    Every batch: ``loss`` (the step's output) and ``step``; every 5th batch also ``late`` into
    the row 3 batches back (a row an earlier checkpoint may hold already). Deterministic from
    the iteration, so a resumed run writes what a straight run writes.
    """

    @hookimpl
    def after_batch(self, loop: Any, outputs: Any) -> None:
        """Write this batch's records (and the late one)."""
        row = loop.log.current_row
        row["loss"], row["step"] = outputs["loss"], loop.iteration
        if loop.iteration % 5 == 0 and loop.iteration > 3:
            loop.log[loop.iteration - 3]["late"] = loop.iteration


def run_with_recorder(argv: list[str] | None = None) -> None:
    """``epochal run CONFIG [--resume] [--max-iterations N]`` with a :class:`BatchRecorder` first.

    Run as ``python -c "from epochal_checkpoint.testing import run_with_recorder; run_with_recorder()"``
    (the torture's runs): the config's plugins (without autoload) after the recorder.
    """
    import argparse

    from epochal import Loop, load_plugins
    from epochal.config import call_factory, load_config, loop_options, plugin_options

    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--max-iterations", type=int, default=None)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    if args.max_iterations is not None:
        config["loop"]["max_iterations"] = args.max_iterations
    plugins = load_plugins(
        order=["recorder", *config.get("plugins", {}).get("order", [])],
        autoload=False,
        options=plugin_options(config),
        extra={"recorder": BatchRecorder()},
    )
    loop = Loop(
        call_factory(config, "model"),
        call_factory(config, "data"),
        plugins=plugins,
        resume=args.resume,
        config=config,
        **loop_options(config),
    )
    loop.run()
    print(f"{loop.iteration} batch(es)")


# -- crash torture ------------------------------------------------------------------------------

TORTURE_CONFIG = """\
[loop]
max_epochs = 1000000
seed = 0
run_dir = "run"

[model]
factory = "epochal_checkpoint.testing:make_model"
size = {size}

[data]
factory = "epochal_checkpoint.testing:make_data"

[plugins]
order = ["checkpoint"]
autoload = false

[plugins.checkpoint]
every_n_batches = {every}
keep_last = 2
async_save = {async_save}
"""


@dataclass
class TortureReport:
    """What :func:`torture` observed."""

    kills: int = 0
    partial_writes_seen: int = 0
    checkpoints_verified: int = 0
    resumes: int = 0
    final_runs: int = 0
    exact_matches: int = 0
    failures: list[str] = field(default_factory=list)


def _cli(
    cwd: Path, resume: bool, record: bool, max_iterations: int | None = None, **kwargs: Any
) -> subprocess.Popen[bytes]:
    """``epochal run run.toml`` (with *record*: the same run with a :class:`BatchRecorder`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    if record:
        code = "from epochal_checkpoint.testing import run_with_recorder; run_with_recorder()"
        args = ["run.toml", *([f"--max-iterations={max_iterations}"] if max_iterations else [])]
    else:
        code = "from epochal.cli import main; main()"
        limit = ["--set", f"loop.max_iterations={max_iterations}"] if max_iterations else []
        args = ["run", "run.toml", *limit]
    args += ["--resume"] if resume else []
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=cwd, env=env, **kwargs)


def verify_directory(directory: Path) -> tuple[int, list[str]]:
    """Check every checkpoint under a final name reads and verifies, and ``latest`` names one.

    Returns ``(checkpoints verified, problems)``.
    """
    from epochal_checkpoint import storage

    problems = []
    infos, ignored = storage.list_checkpoints(directory)
    problems += [f"{directory}/{name}: {why}" for name, why in ignored]
    for info in infos:
        try:
            storage.read_checkpoint(info.path)
        except Exception as error:
            problems.append(f"{info.path}: {type(error).__name__}: {error}")
    pointer = storage.read_pointer(directory)
    if pointer is not None and pointer not in {info.name for info in infos}:
        problems.append(f"{directory}/latest names {pointer!r}, which is not a complete checkpoint")
    return len(infos), problems


def _chain(
    workdir: Path,
    kills: int,
    size: int,
    async_save: bool,
    rng: random.Random,
    report: TortureReport,
    record: bool,
) -> None:
    from epochal_checkpoint import storage

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "run.toml").write_text(
        TORTURE_CONFIG.format(size=size, every=1, async_save=str(async_save).lower())
    )
    directory = workdir / "run" / "checkpoints"

    def newest() -> int | None:
        infos = storage.list_checkpoints(directory)[0]
        return infos[-1].manifest["iteration"] if infos else None

    for _ in range(kills):
        resume = bool(storage.list_checkpoints(directory)[0])
        with open(workdir / "stderr.txt", "wb") as err:
            proc = _cli(workdir, resume, record, stdout=subprocess.DEVNULL, stderr=err)
            # the random moment counts from the run's first save (it saves every batch), not from
            # its start: on a loaded machine the start-up alone outlasted the delay, and no kill
            # met a checkpoint being written
            before, deadline = newest(), time.monotonic() + 120
            while newest() == before and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 1.1))
            if proc.poll() is not None:
                report.failures.append(
                    f"{workdir}: the run ended (status {proc.returncode}) before it was killed: "
                    + (workdir / "stderr.txt").read_text(errors="replace")[-2000:]
                )
                continue
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        report.kills += 1
        report.resumes += resume
        if directory.is_dir() and any(storage.TMP_RE.search(p.name) for p in directory.iterdir()):
            report.partial_writes_seen += 1
        count, problems = verify_directory(directory) if directory.is_dir() else (0, [])
        report.checkpoints_verified += count
        report.failures += problems


def _final(workdir: Path, size: int, report: TortureReport, record: bool) -> None:
    """Resume once more to a fixed iteration; compare with a straight in-process run."""
    from epochal import Loop
    from epochal_checkpoint import storage

    directory = workdir / "run" / "checkpoints"
    infos, _ = storage.list_checkpoints(directory)
    target = (infos[-1].manifest["iteration"] if infos else 0) + 3
    proc = _cli(workdir, bool(infos), record, target, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _out, err = proc.communicate(timeout=300)
    if proc.returncode != 0:
        report.failures.append(
            f"{workdir}: final --resume failed ({proc.returncode}): {err.decode()[-2000:]}"
        )
        return
    report.final_runs += 1
    state, info = storage.load_latest(directory)
    if state["iteration"] != target:
        report.failures.append(f"{workdir}: final checkpoint {info.name} is not at iteration {target}")
        return
    model = make_model(size)
    plugins = {"recorder": BatchRecorder()} if record else {}
    straight = Loop(model, make_data(), plugins=plugins, max_iterations=target, seed=0, handle_signals=False)
    straight.run()
    same = all(state["model"][k].tobytes() == v.tobytes() for k, v in model.params.items())
    same = same and state["model"]["steps"] == model.steps
    same = same and repr(state["log"]["rows"]) == repr(straight.log.state_dict()["rows"])
    if same:
        report.exact_matches += 1
    else:
        report.failures.append(
            f"{workdir}: the resumed run differs from a straight run to iteration {target}"
        )


def torture(
    workdir: Path,
    chains: int = 5,
    kills: int = 10,
    size: int = 1_000_000,
    parallel: int = 2,
    seed: int = 0,
    record: bool = True,
) -> TortureReport:
    """Kill ``epochal run`` with SIGKILL at random moments, *kills* times in each of *chains* runs.

    Each chain restarts its run with ``--resume`` after every kill (once a checkpoint exists),
    checkpointing after every batch (chains alternate sync and async saves). After every kill
    every checkpoint under a final name must verify; at the end each chain resumes to a fixed
    iteration and must match a straight run bitwise. With *record* the runs have a
    :class:`BatchRecorder` (a log record every batch, and records into older rows), so every
    checkpoint links the previous one's log segments and adds one; without it they are plain
    ``epochal run`` (the CLI).
    """
    from concurrent.futures import ThreadPoolExecutor

    report = TortureReport()
    rngs = [random.Random(seed * 1000 + c) for c in range(chains)]
    with ThreadPoolExecutor(parallel) as pool:
        futures = [
            pool.submit(_chain, Path(workdir) / f"chain{c}", kills, size, c % 2 == 1, rngs[c], report, record)
            for c in range(chains)
        ]
        for future in futures:
            future.result()
        futures = [
            pool.submit(_final, Path(workdir) / f"chain{c}", size, report, record) for c in range(chains)
        ]
        for future in futures:
            future.result()
    return report


# -- crafting damaged checkpoints (tests and fuzzing) ---------------------------------------------


def resign(path: Path, manifest: Mapping[str, Any] | None = None) -> None:
    """Recompute the sizes and CRC-32s of checkpoint *path*'s files and rewrite its manifest
    (*manifest*, or the one there) with its commit record: for tests that craft damaged
    checkpoints whose damage must reach the parsers rather than stop at a checksum. In
    ``data.bin`` the state is found again (after a change of length) and every array's CRC-32
    recomputed."""
    import json

    from epochal_checkpoint.storage.codec import DATA, MANIFEST, crc32, manifest_text, seal

    document = dict(manifest if manifest is not None else json.loads((path / MANIFEST).read_bytes()))
    document.pop("commit", None)
    files = document.get("files")
    if isinstance(files, dict):
        fresh: dict[str, Any] = {}
        for name, entry in files.items():
            file = path / name
            if not file.is_file() or file.is_symlink():
                fresh[name] = entry
            elif name == DATA and isinstance(entry, dict):
                fresh[name] = _resign_data(file, entry)
            else:
                data = file.read_bytes()
                fresh[name] = {"size": len(data), "crc32": f"{crc32(data):08x}"}
        document["files"] = fresh
    (path / MANIFEST).write_bytes(seal(manifest_text(document)))


def replace_state(path: Path, document: Any) -> None:
    """Put the JSON *document* in place of the state in checkpoint *path*'s ``data.bin`` and
    :func:`resign` it: for tests that craft damaged states."""
    import json

    from epochal_checkpoint.storage.codec import DATA, MANIFEST

    manifest = json.loads((path / MANIFEST).read_bytes())
    manifest.pop("commit", None)
    at = manifest["files"][DATA]["state"]
    blob = (path / DATA).read_bytes()[:at]
    (path / DATA).write_bytes(blob + json.dumps(document).encode("ascii"))
    resign(path, manifest)


def _resign_data(file: Path, entry: Mapping[str, Any]) -> dict[str, Any]:
    import json
    import re

    from epochal_checkpoint.storage.codec import FORMAT, crc32

    blob = bytearray(file.read_bytes())
    prefix = re.compile(rb'\{\s*"format":\s*"' + f"{FORMAT}-state".encode("ascii") + rb'"')
    at = entry.get("state")
    if type(at) is not int or not prefix.match(blob, max(at, 0)):
        found = [m.start() for m in prefix.finditer(blob)]
        at = found[-1] if found else min(max(at if type(at) is int else 0, 0), len(blob))
    try:
        document = json.loads(blob[at:])
    except (ValueError, RecursionError):
        document = None
    if isinstance(document, dict) and isinstance(document.get("arrays"), list):
        entries = [e for e in document["arrays"] if isinstance(e, dict) and type(e.get("offset")) is int]
        ends = sorted({e["offset"] for e in entries} | {at})
        for item in entries:
            end = next((x for x in ends if x > item["offset"]), at)
            item["crc32"] = f"{crc32(blob[item['offset'] : end]):08x}"
        blob[at:] = json.dumps(document, separators=(",", ":"), allow_nan=True).encode("ascii")
        file.write_bytes(blob)
    return {**entry, "size": len(blob), "crc32": f"{crc32(blob[at:]):08x}", "state": at}


def force_crc32(data: bytearray, at: int, crc: int) -> None:
    """Change the 4 bytes ``data[at:at + 4]`` so that ``zlib.crc32(data) == crc``: a forgery that
    CRC-32 cannot see (the manifest and the index stay as they were), for tests of the keyed
    signature. CRC-32 is affine over GF(2): the effect of each of the 32 bits is computed, and
    the bits to flip are found by Gaussian elimination."""
    from zlib import crc32

    if not 0 <= at <= len(data) - 4:
        raise ValueError(f"no 4 bytes at {at} in {len(data)} bytes")
    zero = crc32(bytes(len(data)))
    rows = []  # (effect on the CRC, bits flipped), one per bit of the 4 bytes
    for bit in range(32):
        probe = bytearray(len(data))
        probe[at + bit // 8] = 1 << (bit % 8)
        rows.append((crc32(probe) ^ zero, 1 << bit))
    want, flips = crc32(data) ^ crc, 0
    for target in range(32):  # eliminate: find a row with bit *target*, clear it in the others
        pivot = next((k for k in range(target, 32) if rows[k][0] >> target & 1), None)
        if pivot is None:
            raise ValueError("these 4 bytes cannot set the CRC-32")  # never for 4 adjacent bytes
        rows[target], rows[pivot] = rows[pivot], rows[target]
        for k in range(32):
            if k != target and rows[k][0] >> target & 1:
                rows[k] = (rows[k][0] ^ rows[target][0], rows[k][1] ^ rows[target][1])
    for target in range(32):
        if want >> target & 1:
            flips ^= rows[target][1]
    data[at : at + 4] = (int.from_bytes(data[at : at + 4], "little") ^ flips).to_bytes(4, "little")
