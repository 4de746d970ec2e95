"""`epochal run --nproc 2`: real processes started by torch's elastic launcher, gloo over loopback.

Each test trains the tiny data-parallel regression of ``ddp_tiny.py`` (copied beside the config)
through the CLI in a subprocess: one writer of checkpoints and log rows, agreed stops, reduced
evaluation metrics, signals to the launcher and to one rank, a rank killed with SIGKILL, resumes
that match a straight run bitwise, and the bad inputs refused before anything starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from epochal.resumecheck import first_difference
from epochal.testing import unwrapped

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_tiny import write_config as tiny_ddp_config
from processes import wait_for, worker_pids

pytestmark = pytest.mark.distributed

HERE = Path(__file__).parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
#: batches per epoch on each of 2 ranks (64 examples, 4 per batch, 2 shards)
PER_EPOCH = 8


def write_run(tmp_path: Path, plugins: list[str], *, max_epochs: int = 3, extra: str = "") -> Path:
    shutil.copy(HERE / "linger.py", tmp_path / "linger.py")
    return tiny_ddp_config(tmp_path, plugins, max_epochs=max_epochs, extra=extra)


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def epochal(tmp_path: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "epochal", *args],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "epochal", *args],
        cwd=tmp_path,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def where(tmp_path: Path) -> list[str]:
    """How each rank's run ended: ``epoch iteration reason``, rank 0 first."""
    return [p.read_text().strip() for p in sorted(tmp_path.glob("where-*.txt"))]


def newest_run(tmp_path: Path) -> Path:
    """The directory of the newest run of ``run.toml`` (``run/version_N``)."""
    from epochal.run_dirs import versions

    found = versions(tmp_path / "run")
    return found[-1] if found else tmp_path / "run" / "version_0"


def checkpoints(tmp_path: Path) -> list[str]:
    directory = newest_run(tmp_path) / "checkpoints"
    return sorted(p.name for p in directory.glob("ckpt-*")) if directory.is_dir() else []


def final_state(tmp_path: Path) -> dict[str, Any]:
    from epochal_checkpoint.plugin import read_from

    state, _ = read_from(newest_run(tmp_path) / "checkpoints")
    return state


def compared(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "epoch": state["epoch"],
        "iteration": state["iteration"],
        "model": state["model"],
        "rng": state["rng"],
        "ranks": state["ranks"],
        "data": state["data"],
        "log rows": state["log"]["rows"],
        "plugins": {name: entry["state"] for name, entry in state["plugins"].items()},
    }


# -- training ---------------------------------------------------------------------------------


def test_two_processes_train_with_one_writer_of_checkpoints_and_log_rows(tmp_path):
    config = write_run(tmp_path, ["monitor", "checkpoint", "sqlite_log", "progress"], max_epochs=3)
    done = epochal(tmp_path, "run", str(config), "--nproc", "2")
    assert done.returncode == 0, done.stderr
    # one summary (rank 0), which names the resume command with --nproc
    assert done.stdout.count("epochal: run ") == 1
    assert "finished after 3 epoch(s), 24 batch(es)" in done.stdout
    assert "--nproc 2 --set loop.max_epochs=6 --resume" in unwrapped(done.stdout)  # as many epochs again
    # both ranks trained the same batches
    assert where(tmp_path) == ["3 24 max_epochs=3 reached"] * 2
    # one checkpoint per epoch, written once, holding both ranks' parts
    assert checkpoints(tmp_path) == ["ckpt-e0001-i000008", "ckpt-e0002-i000016", "ckpt-e0003-i000024"]
    state = final_state(tmp_path)
    assert state["world_size"] == 2 and len(state["ranks"]) == 2
    generators = [rank["rng"]["numpy"] for rank in state["ranks"]]
    assert generators[0]["pos"] != generators[1]["pos"]  # each rank's own, saved
    # one run in the log database, each (step, key) once
    with sqlite3.connect(tmp_path / "run" / ".." / "epochal.sqlite") as db:
        tables = {row[0] for row in db.execute("select name from sqlite_master where type = 'table'")}
        assert "runs" in tables
        assert db.execute("select count(*) from runs").fetchone()[0] == 1


def test_evaluation_metrics_are_reduced_to_the_value_over_the_whole_stream(tmp_path):
    """Rank 0 logs the metric of all 30 examples: the same as one process evaluating them all."""
    extra = "[plugins.checkpoint]\nevery_n_epochs = 0\n"
    config = write_run(tmp_path, ["checkpoint"], max_epochs=0, extra=extra)
    text = config.read_text().replace("max_epochs = 0", "max_epochs = 0\neval_at_start = true")
    config.write_text(text)
    done = epochal(tmp_path, "run", str(config), "--nproc", "2")
    assert done.returncode == 0, done.stderr
    two = final_state(tmp_path)["log"]["rows"]
    shutil.rmtree(tmp_path / "run")
    done = epochal(tmp_path, "run", str(config))
    assert done.returncode == 0, done.stderr
    one = final_state(tmp_path)["log"]["rows"]
    row2, row1 = two["0"], one["0"]  # the evaluation before the first epoch
    assert row2["valid.loss"] == pytest.approx(row1["valid.loss"], rel=1e-12)
    assert row2["valid.mae"] == pytest.approx(row1["valid.mae"], rel=1e-12)


# -- agreed stops -----------------------------------------------------------------------------


def test_a_stop_asked_on_one_rank_stops_every_rank_at_the_same_batch(tmp_path):
    extra = '[plugins.stop]\nfactory = "ddp_tiny:StopOnRank"\nrank = 1\nbatch = 5\n'
    config = write_run(tmp_path, ["monitor", "checkpoint"], max_epochs=3, extra=extra)
    done = epochal(tmp_path, "run", str(config), "--nproc", "2")
    assert done.returncode == 0, done.stderr
    # asked after batch 5 on rank 1: every rank stops after batch 6 (one batch later), agreed
    ended = where(tmp_path)
    assert ended == ["0 6 stop-on-rank after batch 5 (on rank 1)"] * 2
    assert "stop-on-rank after batch 5 (on rank 1)" in done.stdout
    assert final_state(tmp_path)["iteration"] == 6


def test_a_stop_asked_at_an_epoch_end_on_one_rank_stops_every_rank_at_that_epoch_end(tmp_path):
    extra = '[plugins.stop]\nfactory = "ddp_tiny:StopOnRank"\nrank = 1\nepoch = 1\n'
    config = write_run(tmp_path, ["monitor"], max_epochs=3, extra=extra)
    done = epochal(tmp_path, "run", str(config), "--nproc", "2")
    assert done.returncode == 0, done.stderr
    assert where(tmp_path) == [f"1 {PER_EPOCH} stop-on-rank after epoch 1 (on rank 1)"] * 2


def test_finish_after_batches_stops_at_that_batch_on_every_rank(tmp_path):
    extra = "[plugins.finish_after]\nbatches = 5\n"
    config = write_run(tmp_path, ["finish_after"], max_epochs=3, extra=extra)
    done = epochal(tmp_path, "run", str(config), "--nproc", "2")
    assert done.returncode == 0, done.stderr
    assert where(tmp_path) == ["0 5 finish_after: batches=5 reached"] * 2


# -- signals, faults and resume ---------------------------------------------------------------


@pytest.fixture
def straight(tmp_path_factory):
    """A straight 2-process run of 4 epochs: its final checkpoint's state."""
    directory = tmp_path_factory.mktemp("straight")
    config = write_run(directory, ["monitor", "checkpoint"], max_epochs=4)
    done = epochal(directory, "run", str(config), "--nproc", "2")
    assert done.returncode == 0, done.stderr
    return final_state(directory)


#: rank 1 lingers 3 s in its exit: still there when rank 0 exits (the agent then stops it)
LINGER_ON_RANK_1 = '[plugins.linger]\nfactory = "linger:Linger"\nrank = 1\n'


def errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("Error")]


def interrupted(tmp_path: Path, send: Any, extra: str = "") -> subprocess.Popen[str]:
    """A slow 2-process run, given to *send(launcher, workers)* once its first checkpoint exists."""
    config = write_run(tmp_path, ["monitor", "checkpoint"], max_epochs=4, extra=extra)
    run = start(tmp_path, "run", str(config), "--nproc", "2", "--set", "model.delay=0.08")
    wait_for(lambda: checkpoints(tmp_path), process=run)
    workers = worker_pids(run.pid)
    assert sorted(workers) == [0, 1]
    send(run.pid, workers)
    return run


@pytest.mark.parametrize("target", ["launcher", "rank 1"])
def test_sigterm_stops_every_rank_at_one_boundary_saves_once_and_resume_matches_a_straight_run(
    tmp_path, straight, target
):
    def send(launcher: int, workers: dict[int, int]) -> None:
        os.kill(launcher if target == "launcher" else workers[1], signal.SIGTERM)

    run = interrupted(tmp_path, send, extra=LINGER_ON_RANK_1)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 128 + signal.SIGTERM, err
    assert errors(err) == []  # an agreed stop is no failure (issue 31)
    ended = where(tmp_path)
    assert len(ended) == 2 and ended[0] == ended[1], ended  # the same batch on both ranks
    stopped_at = int(ended[0].split()[1])
    assert PER_EPOCH <= stopped_at < 4 * PER_EPOCH
    assert "interrupted after" in out and out.count("epochal: run ") == 1
    if target == "rank 1":
        assert "SIGTERM received (on rank 1)" in out
    saved = final_state(tmp_path)
    assert saved["iteration"] == stopped_at  # the interrupt's checkpoint, complete
    resumed = epochal(tmp_path, "run", str(tmp_path / "run.toml"), "--nproc", "2", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"at epoch {stopped_at // PER_EPOCH}, iteration {stopped_at}" in resumed.stderr
    assert first_difference(compared(straight), compared(final_state(tmp_path))) is None


def test_a_rank_killed_ends_the_run_with_one_clear_error_and_resume_continues(tmp_path, straight):
    def send(launcher: int, workers: dict[int, int]) -> None:
        os.kill(workers[1], signal.SIGKILL)

    started = time.monotonic()
    run = interrupted(tmp_path, send)
    _, err = run.communicate(timeout=120)
    assert time.monotonic() - started < 90  # the survivor does not wait for its timeout
    assert run.returncode == 1
    last = [line for line in err.splitlines() if line.startswith("Error: rank 1")]
    assert len(last) == 1, err
    assert "was killed by SIGKILL" in last[0] and "--nproc 2" in last[0] and "--resume" in last[0]
    assert "Traceback" not in err
    assert errors(err) == last, err  # the survivor says nothing: the launcher's line only
    assert "by peer" not in err
    kept = checkpoints(tmp_path)
    assert kept and f"the last complete checkpoint is run/version_0/checkpoints/{kept[-1]}" in last[0]
    final_state(tmp_path)  # complete and verified
    resumed = epochal(tmp_path, "run", str(tmp_path / "run.toml"), "--nproc", "2", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert first_difference(compared(straight), compared(final_state(tmp_path))) is None


@pytest.mark.parametrize(
    ("codes", "status"),
    [
        ({143}, 143),
        ({130}, 130),
        ({143, -signal.SIGTERM}, 143),  # a rank still winding down, stopped by the agent
        ({-signal.SIGTERM}, None),  # killed by SIGTERM from outside, nothing agreed
        ({143, -signal.SIGKILL}, None),
        ({143, 1}, None),
        ({2}, None),
    ],
)
def test_which_ends_of_the_workers_are_an_agreed_stop(codes, status):
    from epochal.distributed.launch import agreed_stop

    assert agreed_stop(codes) == status


@pytest.mark.parametrize(
    ("reports", "everywhere"),
    [
        ({1: {"message": "bad", "config": True}}, False),  # rank 0 stopped first: rank 1 named
        ({1: {"message": "bad", "config": True}, 0: {"message": "bad", "config": True}}, True),
        ({1: {"message": "bad", "config": True}, 0: {"message": "other", "config": True}}, False),
        ({1: {"message": "broke", "config": False}}, False),  # rank 1's own failure: name it
        ({1: {"message": "broke", "config": False}, 0: {"message": "broke", "config": False}}, True),
    ],
)
def test_an_error_is_said_without_its_rank_only_when_every_rank_reported_it(reports, everywhere):
    """An error one rank found names the rank (the agent may have stopped the others before
    they found it too: a loaded machine); one every rank reported is said once, without it."""
    from epochal.distributed.launch import LaunchFailure, _with_report

    failure = _with_report(LaunchFailure(rank=1, pid=7, exitcode=2), reports, ranks=2)
    assert failure.message == reports[1]["message"]
    assert failure.everywhere is everywhere


def test_a_signal_to_a_rank_after_a_finished_run_changes_nothing(tmp_path):
    """Issue 31: rank 1 winding down was killed by a SIGTERM and the run reported as failed."""
    config = write_run(tmp_path, ["checkpoint"], max_epochs=1, extra=LINGER_ON_RANK_1)
    run = start(tmp_path, "run", str(config), "--nproc", "2")
    wait_for(lambda: (tmp_path / "lingering-1").exists(), process=run)
    os.kill(worker_pids(run.pid)[1], signal.SIGTERM)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert errors(err) == [] and "finished after 1 epoch(s)" in out


def test_resume_on_another_number_of_processes(tmp_path):
    """At an epoch end it continues (re-sharded); in the middle of an epoch counted in batches
    (epoch_size) it is refused (test_elastic.py: an epoch of the stream's continues)."""
    config = write_run(tmp_path, ["checkpoint"], max_epochs=1)
    assert epochal(tmp_path, "run", str(config), "--nproc", "2").returncode == 0
    done = epochal(tmp_path, "run", str(config), "--resume", "--set", "loop.max_epochs=2")
    assert done.returncode == 0, done.stderr
    assert "finished after 2 epoch(s), 24 batch(es)" in done.stdout  # 8 on 2 ranks, then 16 alone

    shutil.rmtree(tmp_path / "run")
    stop = "[plugins.finish_after]\nbatches = 3\n"
    config = write_run(tmp_path, ["finish_after", "checkpoint"], extra=stop)
    assert epochal(tmp_path, "run", str(config), "--nproc", "2", "--set", "loop.epoch_size=8").returncode == 0
    before = checkpoints(tmp_path)
    done = epochal(
        tmp_path, "run", str(config), "--resume", "--disable", "finish_after", "--set", "loop.epoch_size=8"
    )
    assert done.returncode == 2
    assert "cannot resume on 1 process(es) a state saved by 2 in the middle of epoch 1" in done.stderr
    assert "[loop] epoch_size" in done.stderr
    assert "--nproc 2" in done.stderr
    assert checkpoints(tmp_path) == before


def test_torchrun_starts_the_same_run(tmp_path):
    config = write_run(tmp_path, ["checkpoint"], max_epochs=1)
    done = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "epochal", "run", str(config)],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("epochal: run ") == 1
    assert where(tmp_path) == [f"1 {PER_EPOCH} max_epochs=1 reached"] * 2
    assert final_state(tmp_path)["world_size"] == 2


def test_under_torchrun_ranks_agree_on_a_new_directory_an_odd_train_set_is_padded_hint_is_torchruns(
    tmp_path,
):
    """Issue 29: rank 0 makes the run's directory and every rank writes into it; 61 examples on 2
    processes train (one repeated, said once); the resume command is torchrun's and trains on."""
    extra = '[plugins.rundir]\nfactory = "ddp_tiny:RunDir"\n'
    config = write_run(tmp_path, ["checkpoint"], max_epochs=1, extra=extra)
    (tmp_path / "run" / "version_0").mkdir(parents=True)  # an earlier run's
    command = ["--standalone", "--nproc-per-node", "2", "-m", "epochal", "run", str(config)]
    done = subprocess.run(
        [*TORCHRUN, *command, "--set", "data.examples=61"],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    agreed = {(tmp_path / f"run-dir-{rank}.txt").read_text().strip() for rank in range(2)}
    assert agreed == {"run/version_1"}
    padded = [line for line in done.stderr.splitlines() if "repeated per epoch" in line]
    assert len(padded) == 1, done.stderr
    assert "[data] stream 'train': 61 examples on 2 processes: 1 of them repeated per epoch" in padded[0]
    assert where(tmp_path) == [f"1 {PER_EPOCH} max_epochs=1 reached"] * 2  # 31 examples each
    assert checkpoints(tmp_path) == ["ckpt-e0001-i000008"]
    assert done.stdout.count("epochal: directory: run/version_1") == 1
    hint = [line for line in unwrapped(done.stdout).splitlines() if line.startswith("epochal: resume: ")]
    again = "--set data.examples=61 --set loop.max_epochs=2 --resume"  # max_epochs = 1 was reached
    assert hint == [f"epochal: resume: torchrun {' '.join(command)} {again}"], done.stdout


def test_under_torchrun_a_sigterm_to_one_rank_stops_every_rank_and_torchrun_exits_1(tmp_path):
    """What docs/scaling-out.md says of torchrun (torch's launcher, not epochal's): every rank
    stops at the same batch and saves, each exits with 143, and torchrun reports that as its
    ChildFailedError with exit status 1 (a requeue script cannot test for 143)."""
    config = write_run(tmp_path, ["monitor", "checkpoint"], max_epochs=4, extra=LINGER_ON_RANK_1)
    command = ["-m", "epochal", "run", str(config), "--set", "model.delay=0.08"]
    run = subprocess.Popen(
        [*TORCHRUN, "--standalone", "--nproc-per-node", "2", *command],
        cwd=tmp_path,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: checkpoints(tmp_path), process=run)
    os.kill(worker_pids(run.pid)[1], signal.SIGTERM)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 1
    assert "ChildFailedError" in err
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", err)) == {"143"}, err  # no rank killed
    ended = where(tmp_path)
    assert len(ended) == 2 and ended[0] == ended[1], ended
    assert final_state(tmp_path)["iteration"] == int(ended[0].split()[1])
    assert "interrupted after" in out


def test_check_resume_on_two_processes(tmp_path):
    config = write_run(tmp_path, ["monitor", "checkpoint"], max_epochs=2)
    done = epochal(tmp_path, "check-resume", str(config), "--nproc", "2", "--at", "11")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok: interrupted after batch 11 of 16 and resumed" in done.stdout


def test_check_resume_on_two_processes_names_a_state_changed_after_the_checkpoint(tmp_path):
    shutil.copy(HERE / "epoch_counter.py", tmp_path)
    extra = '[plugins.counter]\nfactory = "epoch_counter:EpochCounter"\n'
    config = write_run(tmp_path, ["checkpoint", "counter"], max_epochs=2, extra=extra)
    done = epochal(tmp_path, "check-resume", str(config), "--nproc", "2", "--at", "3")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ok: interrupted after batch 3 of 16 and resumed" in done.stdout
    assert "MISMATCH: ended after epoch 1 as kill -9 ends it and resumed from its latest" in done.stderr
    assert "plugins.counter.epochs: straight run has 2, resumed run has 1" in done.stderr


# -- bad input --------------------------------------------------------------------------------


def test_plugins_check_on_two_processes_says_where_each_plugin_runs(tmp_path):
    config = write_run(tmp_path, ["monitor", "checkpoint", "sqlite_log"])
    done = epochal(tmp_path, "plugins", "--check", str(config), "--nproc", "2")
    assert done.returncode == 0, done.stderr
    assert "every rank runs monitor, checkpoint, where; rank 0 only: sqlite_log" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "0"], "'--nproc'"),
        (["--nproc", "2", "--backend", "mpi"], "'--backend'"),
        (["--nproc", "2", "--port", "70000"], "--port 70000: not a TCP port number"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(tmp_path, args, message):
    config = write_run(tmp_path, ["checkpoint"])
    done = epochal(tmp_path, "run", str(config), *args)
    assert done.returncode == 2
    assert message in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_uneven_shards_are_one_error_line_without_resume_advice(tmp_path):
    """61 examples on 2 ranks under "error": every rank finds it; the launcher says it once (issue 31)."""
    config = write_run(tmp_path, ["checkpoint"])
    done = epochal(
        tmp_path,
        "run",
        str(config),
        "--nproc",
        "2",
        "--set",
        "data.examples=61",
        "--set",
        "loop.uneven_shards=error",
    )
    assert done.returncode == 2
    assert len(errors(done.stderr)) == 1, done.stderr
    assert "[loop] uneven_shards" in errors(done.stderr)[0]
    assert "[data] stream 'train'" in errors(done.stderr)[0]
    # no resume advice; "rank N (pid ...) stopped:" when the agent stopped the other rank
    # before it reported the same error (a loaded machine)
    assert "resume" not in errors(done.stderr)[0] and "checkpoint" not in errors(done.stderr)[0]
    assert "--resume" not in done.stderr and "Traceback" not in done.stderr
    assert checkpoints(tmp_path) == []


def test_a_port_in_use_is_refused(tmp_path):
    config = write_run(tmp_path, ["checkpoint"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = epochal(tmp_path, "run", str(config), "--nproc", "2", "--port", str(port))
    assert done.returncode == 2
    assert f"Error: --port {port}: the port is in use" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="this machine has GPUs: nccl is available"
)
def test_nccl_without_gpus_is_refused(tmp_path):
    config = write_run(tmp_path, ["checkpoint"])
    done = epochal(tmp_path, "run", str(config), "--nproc", "2", "--backend", "nccl")
    assert done.returncode == 2
    assert "Error: --backend = 'nccl' needs CUDA GPUs and this machine has none" in done.stderr
    text = config.read_text().replace('backend = "gloo"', 'backend = "nccl"')
    config.write_text(text)
    done = epochal(tmp_path, "run", str(config), "--nproc", "2")
    assert done.returncode == 2
    assert "[distributed] backend = 'nccl' needs CUDA GPUs" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('backend = "mpi"', "[distributed]: backend must be 'auto', 'gloo', 'nccl' or None, not 'mpi'"),
        ("timeout = 0", "[distributed]: timeout must be greater than 0, not 0"),
        ("retries = 3", "[distributed]: unknown key 'retries'"),
        (
            "agree_every_n_batches = 0",
            "[distributed]: agree_every_n_batches must be greater than or equal to 1",
        ),
    ],
)
def test_a_bad_distributed_section_names_its_key(tmp_path, table, message):
    config = write_run(tmp_path, ["checkpoint"])
    text = config.read_text().replace('backend = "gloo"\ntimeout = 60', table)
    config.write_text(text)
    done = epochal(tmp_path, "run", str(config), "--nproc", "2")
    assert done.returncode == 2
    assert message in done.stderr, done.stderr


def test_sigint_to_the_launcher_finishes_the_epoch_on_every_rank(tmp_path):
    def send(launcher: int, workers: dict[int, int]) -> None:
        os.kill(launcher, signal.SIGINT)

    run = interrupted(tmp_path, send)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 128 + signal.SIGINT, err
    assert "interrupted after" in out
    ended = where(tmp_path)
    assert len(ended) == 2 and ended[0] == ended[1], ended
    epoch, iteration = (int(n) for n in ended[0].split()[:2])
    assert iteration == epoch * PER_EPOCH and epoch < 4  # at an epoch end, before the last
    assert "finishing the current epoch" in err and err.count("SIGINT received") == 1
    assert final_state(tmp_path)["iteration"] == iteration


def test_asynchronous_saves_deferred_on_rank_0_are_deferred_on_every_rank(tmp_path, straight):
    """Back-pressure is agreed: a save rank 0 defers (its previous write still runs) is deferred
    on the other rank too, so their parts of every snapshot meet (no hang) and the run ends as a
    straight run does."""
    extra = "[plugins.checkpoint]\nasync_save = true\nevery_n_batches = 1\nkeep_last = 2\n"
    config = write_run(tmp_path, ["monitor", "checkpoint"], max_epochs=4, extra=extra)
    done = epochal(tmp_path, "run", str(config), "--nproc", "2", timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("is deferred") <= 1  # said by the writer (rank 0) only
    assert where(tmp_path) == [f"4 {4 * PER_EPOCH} max_epochs=4 reached"] * 2
    ours, theirs = compared(final_state(tmp_path)), compared(straight)
    ours["plugins"].pop("checkpoint", None)
    theirs["plugins"].pop("checkpoint", None)
    assert first_difference(theirs, ours) is None


RANK_ONE_FAILS = """
import os

from epochal import hookimpl
from epochal.errors import ConfigError

import ddp_tiny


class RaiseOnRankOne:
    @hookimpl
    def after_batch(self, loop):
        if os.environ.get("RANK") == "1" and loop.iteration == 3:
            raise RuntimeError("rank one's own failure")


def data_failing_on_rank_one(**options):
    if os.environ.get("RANK") == "1":
        raise ConfigError("[data] the shard of rank 1 is missing")
    return ddp_tiny.make_data(**options)
"""


def test_the_rank_that_failed_first_is_named_not_the_survivor_that_lost_it(tmp_path):
    """Rank 1 raises; rank 0 then reports a lost peer: the line names rank 1 (issue 32's outside pass)."""
    (tmp_path / "rank_one.py").write_text(RANK_ONE_FAILS)
    config = write_run(
        tmp_path, ["raiser", "sqlite_log"], extra='\n[plugins.raiser]\nfactory = "rank_one:RaiseOnRankOne"\n'
    )
    done = epochal(tmp_path, "run", str(config), "--nproc", "2")
    assert done.returncode == 1, done.stderr[-3000:]
    (line,) = errors(done.stderr)
    assert line.startswith("Error: rank 1 (pid "), line
    assert "stopped: RuntimeError: rank one's own failure" in line  # what rank 1 reported of itself
    # rank 0's log says what it saw in epochal's words, not gloo's text
    (database,) = tmp_path.glob("**/epochal.sqlite")
    runs = epochal(tmp_path, "log", "runs", "--json", "--db", str(database))
    (run,) = json.loads(runs.stdout)
    assert run["status"] == "failed" and run["error"].startswith("PeerLostError: "), run["error"]


def test_an_error_of_one_rank_only_names_that_rank(tmp_path):
    (tmp_path / "rank_one.py").write_text(RANK_ONE_FAILS)
    config = write_run(tmp_path, ["checkpoint"])
    config.write_text(
        config.read_text().replace('"ddp_tiny:make_data"', '"rank_one:data_failing_on_rank_one"')
    )
    done = epochal(tmp_path, "run", str(config), "--nproc", "2")
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = errors(done.stderr)
    assert line.startswith("Error: rank 1 (pid ") and "the shard of rank 1 is missing" in line, line
    assert "--resume" not in done.stderr
