"""Several nodes: two torchrun launchers on this machine train one job (issue 28, item 5).

Each launcher runs in a working directory of its own (``node0/``, ``node1/``: two machines with
their own local disks, each with its copy of the config and the model's module); the checkpoint
directory is one absolute path both name (``store/``: the shared filesystem or object store).
They meet through a c10d rendezvous on 127.0.0.1 (``--nnodes 2 --nproc-per-node 1``), which
assigns the ranks itself: which node runs global rank 0 is torch's choice, so the tests find it
from the workers' environment. Every subprocess runs under a timeout in a session of its own,
killed as a group when the test ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epochal.distributed.launch import free_port
from epochal.resumecheck import first_difference
from epochal.testing import unwrapped

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_tiny import write_config as tiny_ddp_config
from processes import wait_for, worker_pids

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
#: batches per epoch on each of 2 ranks (64 examples, 4 per batch, 2 shards)
PER_EPOCH = 8
EPOCHS = 4
PLUGINS = ["monitor", "checkpoint", "sqlite_log"]
#: how both ranks of a job that trained to its end say they ended (``where-RANK.txt``)
FINISHED = {rank: f"{EPOCHS} {EPOCHS * PER_EPOCH} max_epochs={EPOCHS} reached" for rank in (0, 1)}
#: a launcher's exit status, stdout and stderr
Ended = tuple[int, str, str]


def write_node(node: Path, store: Path, extra: str = "") -> Path:
    """A node's working directory: the config (checkpoints in *store*, by absolute path) and the
    model's module beside it."""
    node.mkdir(parents=True, exist_ok=True)
    table = f"\n[plugins.checkpoint]\ndir = {str(store / 'checkpoints')!r}\n"
    return tiny_ddp_config(node, PLUGINS, max_epochs=EPOCHS, tables=table, extra=extra)


def written(node: Path) -> list[str]:
    """What *node*'s working directory holds, but Python's bytecode cache of the model's module
    (written when bytecode writing is on, as in CI)."""
    return sorted(p.name for p in node.iterdir() if p.name != "__pycache__")


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return env


class Job:
    """Two nodes' working directories, one store, and the launchers started on them."""

    def __init__(self, root: Path, extra: str = "") -> None:
        self.root = root
        self.store = root / "store"
        self.nodes = [root / "node0", root / "node1"]
        for node in self.nodes:
            write_node(node, self.store, extra)
        self.launchers: list[subprocess.Popen[str]] = []

    def start(self, *args: str, launcher: str = "torchrun") -> list[subprocess.Popen[str]]:
        """``torchrun --nnodes 2 --node-rank N ... -m epochal run run.toml ARGS`` on each node
        (*launcher* ``"epochal"``: ``epochal run run.toml --nnodes 2 --rdzv-endpoint E ARGS``)."""
        endpoint = f"127.0.0.1:{free_port()}"
        rdzv_id = uuid.uuid4().hex
        started = []
        for rank, node in enumerate(self.nodes):
            command = [
                *TORCHRUN,
                "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
                "-m", "epochal", "run", "run.toml", *args,
            ] if launcher == "torchrun" else [
                sys.executable, "-m", "epochal", "run", "run.toml",
                "--nnodes", "2", "--rdzv-endpoint", endpoint, *args,
            ]  # fmt: skip
            process = subprocess.Popen(
                command,
                cwd=node,
                env=environment(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # its own process group: the teardown kills it whole
            )
            self.launchers.append(process)
            started.append(process)
        return started

    def finish(self, launchers: list[subprocess.Popen[str]], timeout: float = 180) -> list[Ended]:
        """Each launcher's (exit status, stdout, stderr), once every one ended."""
        ended = []
        for launcher in launchers:
            try:
                out, err = launcher.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                outputs = self.kill()
                pytest.fail(f"a launcher still ran after {timeout} s; their outputs: {outputs}")
            ended.append((launcher.returncode, out, err))
        return ended

    def run(self, *args: str, launcher: str = "torchrun") -> list[Ended]:
        return self.finish(self.start(*args, launcher=launcher))

    def kill(self) -> list[tuple[str, str]]:
        """Kill every launcher's process group; what each one printed that was not read yet."""
        outputs = []
        for launcher in self.launchers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(launcher.pid, signal.SIGKILL)
            outputs.append(launcher.communicate())
        return outputs

    def where(self) -> dict[int, str]:
        """rank → how that rank's run ended (``epoch iteration reason``), from either node."""
        found = {}
        for node in self.nodes:
            for path in node.glob("where-*.txt"):
                found[int(path.stem.split("-")[1])] = path.read_text().strip()
        return found

    def checkpoints(self) -> list[str]:
        directory = self.store / "checkpoints"
        return sorted(p.name for p in directory.glob("ckpt-*")) if directory.is_dir() else []


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    made = Job(tmp_path)
    try:
        yield made
    finally:
        made.kill()


def final_state(directory: Path) -> dict[str, Any]:
    from epochal_checkpoint.plugin import read_from

    state, _ = read_from(directory)
    return state


def compared(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "epoch": state["epoch"],
        "iteration": state["iteration"],
        "world_size": state["world_size"],
        "model": state["model"],
        "rng": state["rng"],
        "ranks": state["ranks"],
        "data": state["data"],
        "log rows": state["log"]["rows"],
        "plugins": {name: entry["state"] for name, entry in state["plugins"].items()},
    }


def logged(database: Path) -> list[tuple[int, str, Any]]:
    """The training records of the one run in *database* (not its timings)."""
    from epochal_sqlite.reader import Reader

    with Reader(database) as reader:
        runs = reader.runs()
        assert len(runs) == 1, runs
        return [r for r in reader.records(runs[0].run_id) if r[1].startswith(("train.", "valid."))]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[tuple[int, str, Any]]]:
    """The same config run straight by ``epochal run --nproc 2`` on one node: its final
    checkpoint's state and its log database's records."""
    root = tmp_path_factory.mktemp("one-node")
    config = write_node(root, root / "store")
    done = subprocess.run(
        [sys.executable, "-m", "epochal", "run", str(config), "--nproc", "2"],
        cwd=root,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    return final_state(root / "store" / "checkpoints"), logged(root / "epochal.sqlite")


@pytest.mark.distributed
def test_two_nodes_train_one_job_equal_to_two_processes_on_one_node(job, one_node):
    """(a) 2 nodes x 1 process == ``--nproc 2`` on one node: weights, log, state; global rank 0
    alone writes the checkpoints (into the shared store) and the log database (on its node)."""
    ended = job.run()
    for status, _, err in ended:
        assert status == 0, err
    assert job.where() == FINISHED
    summaries = [unwrapped(out) for _, out, _ in ended if "epochal: run " in out]
    assert len(summaries) == 1 and summaries[0].count("epochal: run ") == 1  # rank 0's node only
    # the node that ran rank 0 holds the log database; the other node wrote nothing but its
    # own where-file (and no checkpoint directory of its own)
    zero = next(node for node in job.nodes if (node / "where-0.txt").exists())
    other = next(node for node in job.nodes if node != zero)
    assert (zero / "epochal.sqlite").is_file()
    assert (
        f"log: {zero / 'epochal.sqlite'} (on {socket.gethostname()}, the machine of rank 0)" in summaries[0]
    )
    assert written(other) == ["ddp_tiny.py", "run.toml", "where-1.txt"]
    # rank 0's node has the run's own directory (run/version_0), and no checkpoint in it
    assert [p.relative_to(zero) for p in (zero / "run").rglob("*")] == [Path("run/version_0")]
    every_epoch = [f"ckpt-e{e:04d}-i{e * PER_EPOCH:06d}" for e in range(1, EPOCHS + 1)]
    assert job.checkpoints() == every_epoch[-3:]  # keep_last = 3
    state, records = one_node
    assert first_difference(compared(state), compared(final_state(job.store / "checkpoints"))) is None
    assert logged(zero / "epochal.sqlite") == records


@pytest.mark.distributed
@pytest.mark.parametrize("signalled", [0, 1])
def test_sigterm_to_one_nodes_launcher_stops_both_at_one_batch_and_both_resume(job, one_node, signalled):
    """(b) SIGTERM to the launcher of the node that runs rank *signalled*: torchrun forwards it
    to its worker, both nodes stop after the same batch, rank 0 writes one checkpoint into the
    shared store, both launchers exit 1 (torchrun's status for a stop on a signal; every worker
    143). (c) ``--resume auto`` on both nodes continues from it and ends bitwise equal to a
    straight run."""
    launchers = job.start("--set", "model.delay=0.08")
    wait_for(lambda: job.checkpoints(), timeout=120, process=launchers[0])
    ranks = {rank: launcher for launcher in launchers for rank in worker_pids(launcher.pid)}
    assert sorted(ranks) == [0, 1]
    ranks[signalled].send_signal(signal.SIGTERM)
    ended = job.finish(launchers)
    for status, _, err in ended:
        assert status == 1, err
    # the other node's torchrun reports its worker's 143 as a failure; no worker was killed
    stopped = {code for _, _, err in ended for code in re.findall(r"exitcode\s*:\s*(-?\d+)", err)}
    assert stopped == {"143"}, [err for _, _, err in ended]
    where = job.where()
    assert sorted(where) == [0, 1] and where[0] == where[1], where
    stopped_at = int(where[0].split()[1])
    assert PER_EPOCH <= stopped_at < EPOCHS * PER_EPOCH
    assert f"SIGTERM received (on rank {signalled})" in where[0]
    assert final_state(job.store / "checkpoints")["iteration"] == stopped_at  # complete, verified
    assert "interrupted after" in "".join(out for _, out, _ in ended)

    for node in job.nodes:
        for path in node.glob("where-*.txt"):
            path.unlink()
    resumed = job.run("--resume", "auto")
    for status, _, err in resumed:
        assert status == 0, err
    notices = "".join(err for _, _, err in resumed)
    assert f"at epoch {stopped_at // PER_EPOCH}, iteration {stopped_at}" in notices
    assert job.where() == FINISHED
    state, _ = one_node
    assert first_difference(compared(state), compared(final_state(job.store / "checkpoints"))) is None


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["torchrun", "epochal"])
def test_a_relative_checkpoint_directory_on_two_nodes_is_refused_before_anything_is_written(
    tmp_path, launcher
):
    """Each node would name its own directory: every rank says so in one line, nothing written.
    torchrun exits 1 after each rank's line; ``epochal run --nnodes`` prints the line once per
    node and exits 2, as for any configuration error."""
    made = Job(tmp_path, extra="")
    for node in made.nodes:
        config = node / "run.toml"
        config.write_text(re.sub(r"(?m)^dir = .*$", 'dir = "checkpoints"', config.read_text()))
    try:
        ended = made.run(launcher=launcher)
    finally:
        made.kill()
    lines = []
    for status, _, err in ended:
        node_lines = [line for line in err.splitlines() if line.startswith("Error:")]
        if launcher == "torchrun":
            assert status == 1  # torchrun's status for a failed worker (each worker exits 2)
            assert not re.search(r'File ".*epochal', err), err  # torchrun's traceback only, no worker's
        else:
            assert status == 2, err
            assert len(node_lines) == 1 and "Traceback" not in err, err
            assert node_lines[0].startswith("Error: [plugins.checkpoint] dir:")  # the message alone
        lines += node_lines
    assert lines, [err for _, _, err in ended]
    for line in lines:
        assert "[plugins.checkpoint] dir: the checkpoint directory 'checkpoints' is relative" in line
        assert "this run spans 2 machines" in line
    for node in made.nodes:
        assert written(node) == ["ddp_tiny.py", "run.toml"]
    assert not made.store.exists()


@pytest.mark.distributed
def test_epochal_run_nnodes_spans_two_nodes_stops_with_143_on_both_and_resumes(job, one_node):
    """``epochal run --nnodes 2 --rdzv-endpoint E`` on each node: the same job as torchrun's, but
    a stop on SIGTERM ends both launchers with 143 (a requeue script can test for it)."""
    launchers = job.start("--set", "model.delay=0.08", launcher="epochal")
    wait_for(lambda: job.checkpoints(), timeout=120, process=launchers[0])
    ranks = {rank: launcher for launcher in launchers for rank in worker_pids(launcher.pid)}
    assert sorted(ranks) == [0, 1]
    ranks[1].send_signal(signal.SIGTERM)
    ended = job.finish(launchers)
    assert [status for status, _, _ in ended] == [128 + signal.SIGTERM] * 2, [err for *_, err in ended]
    for _, _, err in ended:
        assert not [line for line in err.splitlines() if line.startswith("Error")], err
        assert "Traceback" not in err
    where = job.where()
    assert where[0] == where[1] and "SIGTERM received (on rank 1)" in where[0], where
    summary = "".join(out for _, out, _ in ended)
    assert "--nproc 1 --nnodes 2 --rdzv-endpoint 127.0.0.1:" in summary  # the resume command

    for node in job.nodes:
        for path in node.glob("where-*.txt"):
            path.unlink()
    resumed = job.run("--resume", "auto", launcher="epochal")
    assert [status for status, _, _ in resumed] == [0, 0], [err for *_, err in resumed]
    assert job.where() == FINISHED
    state, _ = one_node
    assert first_difference(compared(state), compared(final_state(job.store / "checkpoints"))) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "node1"], "--rdzv-endpoint 'node1': expected HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "node1:http"], "--rdzv-endpoint 'node1:http': expected"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:29500", "--port", "29500"], "--port and --rdzv-endpoint"),
        (["--nnodes", "0", "--rdzv-endpoint", "h:29500"], "'--nnodes'"),
    ],
)
def test_bad_nodes_options_are_one_line_before_anything_starts(tmp_path, args, message):
    config = write_node(tmp_path / "node0", tmp_path / "store")
    done = subprocess.run(
        [sys.executable, "-m", "epochal", "run", str(config), *args],
        cwd=tmp_path / "node0",
        env=environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and message in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "store").exists()


# -- without processes: how a process knows its machines, what the checkpoint plugin refuses ---


@pytest.mark.parametrize(
    ("environ", "nodes"),
    [
        ({"GROUP_WORLD_SIZE": "2", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, (2, 1)),  # torchrun
        ({"LOCAL_WORLD_SIZE": "4"}, (2, 0)),  # another launcher: 8 processes, 4 per machine
        ({"LOCAL_WORLD_SIZE": "8"}, (1, 0)),
        ({}, (1, 0)),  # nothing said: one machine
    ],
)
def test_the_world_counts_machines_from_the_launchers_environment(monkeypatch, environ, nodes):
    from epochal.distributed import world

    for name in ("GROUP_WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert world._nodes(8) == nodes
    assert world.World(size=8, nodes=nodes[0]).several_nodes == (nodes[0] > 1)


@pytest.mark.parametrize(
    ("options", "run_dir", "refused"),
    [
        ({"dir": "checkpoints"}, None, "[plugins.checkpoint] dir: the checkpoint directory 'checkpoints'"),
        ({}, "runs/run", "[loop] run_dir: the checkpoint directory 'runs/run/checkpoints'"),
        ({"dir": "/shared/run/checkpoints"}, "runs/run", None),  # every machine names the same
        ({"dir": "memory://bucket/run"}, "runs/run", None),  # a store's URL (no relative path)
    ],
)
def test_a_checkpoint_directory_relative_to_each_machine_is_refused_on_several(
    monkeypatch, tmp_path, options, run_dir, refused
):
    from epochal_checkpoint.plugin import Checkpoint

    from epochal.distributed import World, world
    from epochal.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    plugin = Checkpoint(**options)
    assert plugin.check_fresh_run(run_dir=run_dir, command=[]) is None  # one machine: as always
    monkeypatch.setattr(world, "_current", World(rank=1, size=4, nodes=2, node_rank=1))
    if refused is None:
        assert plugin.check_fresh_run(run_dir=run_dir, command=[]) is None
    else:
        with pytest.raises(ConfigError, match="relative to each machine") as raised:
            plugin.check_fresh_run(run_dir=run_dir, command=[])
        assert str(raised.value).startswith(refused)
        assert "this run spans 2 machines" in str(raised.value)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_workers_do_not_get_the_launchers_node_options():
    from epochal.distributed.launch import worker_arguments

    argv = ["run", "run.toml", "--nproc", "4", "--nnodes", "2", "--rdzv-endpoint", "node1:29500"]
    assert worker_arguments([*argv, "--resume", "auto"]) == ["run", "run.toml", "--resume", "auto"]
    assert worker_arguments(["run", "run.toml", "--nnodes=2", "--rdzv-endpoint=node1:29500"]) == [
        "run",
        "run.toml",
    ]


# -- sharded checkpoints to an object store from two nodes -------------------------------------

#: the checkpoint table of the sharded two-node runs (fsdp_mlp.write_config's model, data, record)
SHARDED_CHECKPOINT = """dir = "{url}"
format = "sharded"
every_n_batches = 3
keep_last = 10
async_save = {background}"""


@pytest.fixture(scope="module")
def s3_store() -> Iterator[dict[str, str]]:
    """moto's S3 server on 127.0.0.1 with a bucket: the environment that points s3fs at it."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'epochal-checkpoint[s3]')")
    server_module = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    import fsspec

    server = server_module.ThreadedMotoServer("127.0.0.1", 0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    keys = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    endpoint = f"http://{host}:{port}"
    # moto keeps its buckets process-wide: another test's server may have made this one already
    store = fsspec.filesystem("s3", endpoint_url=endpoint, key="testing", secret="testing")
    store.makedirs("bucket", exist_ok=True)
    yield {**keys, "AWS_ENDPOINT_URL": endpoint}
    server.stop()


def sharded_nodes(root: Path, url: str, epochs: int, background: bool, options: str = "") -> list[Path]:
    """Two nodes' working directories, each with its own temporary directory (its local disk:
    a store's staging directories go there) and the FSDP model's module; *options*, the
    checkpoint table's ``storage_options`` (TOML), if any."""
    import fsdp_mlp  # imports torch: only in the tests that run it

    nodes = [root / "node0", root / "node1"]
    for node in nodes:
        (node / "tmp").mkdir(parents=True, exist_ok=True)
        table = SHARDED_CHECKPOINT.format(url=url, background=str(background).lower())
        if options:
            table += f"\nstorage_options = {options}"
        fsdp_mlp.write_config(node, "fsdp", epochs=epochs, checkpoint=table)
    return nodes


def run_sharded_nodes(nodes: list[Path], env: dict[str, str], *args: str) -> dict[str, Any]:
    """Both launchers (torchrun, c10d on 127.0.0.1) to the end; rank 0's record. An empty value
    in *env* removes that variable."""
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex
    launchers = []
    for rank, node in enumerate(nodes):
        (node / "record.json").unlink(missing_ok=True)
        command = [
            *TORCHRUN,
            "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
            "-m", "epochal", "run", "run.toml", *args,
        ]  # fmt: skip
        node_env = {**environment(), **env, "TMPDIR": str(node / "tmp")}
        node_env = {k: v for k, v in node_env.items() if v}
        launchers.append(
            subprocess.Popen(
                command, cwd=node, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = []
    try:
        for launcher in launchers:
            _, err = launcher.communicate(timeout=300)
            outputs.append((launcher.returncode, err))
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
    assert all(code == 0 for code, _ in outputs), [err[-3000:] for _, err in outputs]
    (record,) = [node / "record.json" for node in nodes if (node / "record.json").is_file()]
    result: dict[str, Any] = json.loads(record.read_text())
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_two_nodes_write_sharded_checkpoints_to_s3_and_both_resume_from_it(
    tmp_path: Path, s3_store: dict[str, str], background: bool
) -> None:
    """Every rank uploads its own DCP files from its own machine's staging directory; rank 0
    commits; a resume on both nodes reads them back from the store: the straight run's end.

    The synchronous case knows the store from ``storage_options`` only, no ``AWS_*`` variable
    (issue 44, item 4: every rank reads its tensors with the checkpoint's options; DCP's reader
    is given no ``checkpoint_id``, with which torch 2.13 rebuilds the filesystem without them
    and reads the default AWS endpoint); the asynchronous one from the environment."""
    import fsspec

    options, env = "", s3_store
    if not background:
        endpoint = s3_store["AWS_ENDPOINT_URL"]
        options = f'{{endpoint_url = "{endpoint}", key = "testing", secret = "testing"}}'
        env = {key: "" for key in os.environ if key.startswith("AWS_")} | dict.fromkeys(s3_store, "")
    straight = run_sharded_nodes(
        sharded_nodes(tmp_path / "straight", f"s3://bucket/{uuid.uuid4().hex}", 2, background, options), env
    )
    url = f"s3://bucket/{uuid.uuid4().hex}"
    nodes = sharded_nodes(tmp_path / "resumed", url, 1, background, options)
    run_sharded_nodes(nodes, env)
    fs = fsspec.filesystem("s3", endpoint_url=s3_store["AWS_ENDPOINT_URL"], key="testing", secret="testing")
    newest = sorted(p.rsplit("/", 1)[1] for p in fs.ls(url.removeprefix("s3://")) if "/ckpt-" in p)[-1]
    stored = {p.rsplit("/", 1)[1] for p in fs.ls(f"{url.removeprefix('s3://')}/{newest}")}
    manifest = json.loads(fs.cat_file(f"{url.removeprefix('s3://')}/{newest}/manifest.json"))
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "manifest.json"} <= stored
    assert set(manifest["sharded"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    for node in nodes:  # every process's staging directory (on its own machine) is gone
        assert not list((node / "tmp").glob("epochal-checkpoint-*"))
    resumed = run_sharded_nodes(nodes, env, "--set", "loop.max_epochs=2", "--resume")
    assert resumed["module"] == straight["module"]
    assert resumed["optimizer"] == straight["optimizer"]
    assert resumed["losses"] == straight["losses"][len(straight["losses"]) - len(resumed["losses"]) :]
