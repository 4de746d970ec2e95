"""Elastic runs (issue 46, item 3): a checkpoint taken inside an epoch continues on another number
of processes with every example of that epoch trained exactly once, and a job under
``torchrun --nnodes 1:2 --max-restarts N`` whose second node is killed goes on by itself on the
survivor, from the last complete checkpoint.

The runs are real: ``epochal run`` (``--nproc 2`` through torch's elastic launcher) and two
torchrun launchers on this machine, gloo on CPUs. A probe plugin (``ddp_probe.Probe``) records
every training batch of each rank; a batch's rows name its examples.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from epochal.distributed.launch import free_port
from epochal.testing import epochal_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_tiny import write_config
from processes import wait_for, worker_pids

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PROBE = '[plugins.probe]\nfactory = "ddp_probe:Probe"\ndir = "probe"\n'


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return env


def epochal(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = epochal_command(*args, cwd=cwd, env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, timeout=180)
    assert done.returncode == 0, done.stderr
    return done


def trained(probe: Path) -> list[np.ndarray]:
    """The rows of every training batch each rank of one run recorded."""
    rows = []
    for path in sorted(probe.glob("rank*.pkl")):
        record = pickle.loads(path.read_bytes())
        rows += [x for x, _ in record["train"]]
    return rows


def indices(rows: list[np.ndarray], examples: np.ndarray) -> Counter[int]:
    """How many times each example (a row of *examples*) was trained."""
    where = {row.tobytes(): k for k, row in enumerate(examples)}
    return Counter(where[row.tobytes()] for batch in rows for row in batch)


def config(tmp_path: Path, torch_model: bool) -> Path:
    """One epoch of ddp_tiny's regression (numpy) or ddp_probe's MLP (a TorchModel over
    DataLoaders), stopped by finish_after, checkpointed, every batch recorded."""
    path = write_config(
        tmp_path,
        ["finish_after", "checkpoint", "probe"],
        max_epochs=1,
        tables="[plugins.finish_after]\nbatches = 1000\n",
        extra=PROBE,
        helpers=("ddp_probe.py",),
    )
    if torch_model:
        text = path.read_text().replace('"ddp_tiny:make_model"', '"ddp_probe:make_model"')
        path.write_text(text.replace('"ddp_tiny:make_data"', '"ddp_probe:make_data"'))
    return path


def resumed_on_1_then_2(tmp_path: Path, torch_model: bool, stops: tuple[int, int]) -> Counter[int]:
    """2 processes stop inside the epoch, 1 process resumes and stops inside it again, 2 processes
    finish it: how many times each example of the epoch was trained, over the three runs."""
    path = config(tmp_path, torch_model)
    first, second = stops
    epochal(tmp_path, "run", str(path), "--nproc", "2", "--set", f"plugins.finish_after.batches={first}",
            "--set", "plugins.probe.dir=probe-a")  # fmt: skip
    one = epochal(tmp_path, "run", str(path), "--resume", "--set", f"plugins.finish_after.batches={second}",
                  "--set", "plugins.probe.dir=probe-b")  # fmt: skip
    assert f"{second} batch(es)" in one.stdout
    epochal(tmp_path, "run", str(path), "--nproc", "2", "--resume", "--disable", "finish_after",
            "--set", "plugins.probe.dir=probe-c")  # fmt: skip
    rows = [row for run in "abc" for row in trained(tmp_path / f"probe-{run}")]
    if torch_model:
        from ddp_probe import arrays

        examples = arrays(64, 1)[0]
    else:
        from ddp_tiny import make_data

        examples = make_data()["train"].arrays[0]
    return indices(rows, examples)


def test_a_numpy_model_resumed_inside_an_epoch_on_1_then_2_processes_trains_each_example_once(tmp_path):
    # 64 examples, 4 per batch: 3 batches on 2 processes (24), 3 on 1 (12), the rest (28) on 2
    seen = resumed_on_1_then_2(tmp_path, torch_model=False, stops=(3, 6))
    assert seen == Counter(range(64))


def test_a_torch_model_resumed_inside_an_epoch_on_1_then_2_processes_trains_each_example_once(tmp_path):
    # 64 examples, 8 per batch: 2 batches on 2 processes (32), 2 on 1 (16), the rest (16) on 2
    seen = resumed_on_1_then_2(tmp_path, torch_model=True, stops=(2, 4))
    assert seen == Counter(range(64))


# -- an elastic job under torchrun ------------------------------------------------------------


def node(root: Path, name: str) -> Path:
    """A node's working directory: 3 epochs of ddp_tiny's regression (slowed down so that the
    kill lands inside the run), checkpoints every 2 batches into the store both nodes name."""
    directory = root / name
    directory.mkdir()
    table = f"[plugins.checkpoint]\ndir = {str(root / 'store')!r}\nevery_n_batches = 2\n"
    path = write_config(directory, ["checkpoint"], max_epochs=3, tables=table)
    path.write_text(path.read_text().replace('"ddp_tiny:make_model"', '"ddp_tiny:make_model"\ndelay = 0.05'))
    return directory


def torchrun(directory: Path, endpoint: str, rdzv_id: str, host: bool) -> subprocess.Popen[str]:
    """One node's launcher of the job: 1 or 2 nodes of 1 process, 3 restarts; the rendezvous is
    hosted by the first node (c10d on localhost), a round waits 5 s for more nodes once one
    is there, and a node that stops answering leaves it after 2 s."""
    conf = f"is_host={int(host)},last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2"
    return subprocess.Popen(
        [*TORCHRUN, "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id, "--rdzv-conf", conf,
         "--monitor-interval", "0.2", "-m", "epochal", "run", "run.toml"],
        cwd=directory, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def test_an_elastic_job_goes_on_on_the_survivor_when_a_node_is_killed(tmp_path):
    first, second = node(tmp_path, "node0"), node(tmp_path, "node1")
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex
    # both at once: the first round waits 5 s (last call) for the second node after the first
    launchers = [
        torchrun(first, endpoint, rdzv_id, host=True),
        torchrun(second, endpoint, rdzv_id, host=False),
    ]
    try:
        store = tmp_path / "store"
        # both nodes train, and saved inside epoch 2
        wait_for(
            lambda: any(p.name.startswith("ckpt-e0001") for p in store.glob("ckpt-*")), 120, launchers[0]
        )
        workers = worker_pids(launchers[1].pid)
        assert list(workers) in ([0], [1])
        for pid in [launchers[1].pid, *workers.values()]:  # the node dies: its launcher and its worker
            os.kill(pid, signal.SIGKILL)
        out, err = launchers[0].communicate(timeout=180)
    finally:
        for launcher in launchers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(launcher.pid, signal.SIGKILL)
    assert launchers[0].returncode == 0, err
    assert "restart 1 of this elastic job" in err and "now on 1 process(es)" in err
    resumed = re.search(r"resumed from checkpoint \S+ of run \w+ at epoch (\d+), iteration (\d+)", err)
    assert resumed is not None, err
    from epochal_checkpoint.plugin import read_from

    state, _ = read_from(store)
    assert (state["epoch"], state["in_epoch"], state.get("world_size", 1)) == (3, False, 1)
    assert (first / "where-0.txt").read_text().split()[0] == "3"
    assert "finished after 3 epoch(s)" in out


def test_an_elastic_range_whose_worlds_cannot_share_the_batch_size_is_one_line(tmp_path):
    path = write_config(tmp_path, ["checkpoint"], data="batch_size = 3\n")
    done = subprocess.run(
        [sys.executable, "-m", "epochal", "run", str(path), "--nnodes", "1:2",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "2"],
        cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --nnodes 1:2 --nproc 1: ")
    assert "[data] batch_size, a batch size of 3 per process" in lines[0]
    assert "(1, 2 processes)" in lines[0] and "a multiple of 2" in lines[0]
    assert not (tmp_path / "run").exists()
