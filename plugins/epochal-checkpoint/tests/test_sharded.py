"""Sharded checkpoints (``format = "sharded"``): every rank writes through torch.distributed.checkpoint.

Through the CLI: ``epochal run --nproc 2`` (gloo, CPU) saves; resuming, ``check-resume``,
damaged and partial checkpoints, resharding 2 -> 1 and ``epochal export`` are checked against
what the processes recorded (a probe plugin) and against DCP's own reader.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal.testing import epochal_command, unwrapped

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

pytestmark = pytest.mark.slow

#: the model, data and probe the runs import (written beside the config: ``python -m`` puts the
#: working directory on the path).
MODULE = '''
from pathlib import Path

import numpy as np
import torch

from epochal import hookimpl
from epochal.data import BatchStream
from epochal.torch import TorchModel


def make_model():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    return TorchModel(module, optimizer, torch.nn.functional.mse_loss, device="cpu")


def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], dtype=np.float32)).astype(np.float32)
    return {"train": BatchStream(x, y, batch_size=4, seed=0)}


def tensors(loop):
    """The model's and optimizer's tensors by flat name (full tensors: DDP or one process)."""
    state = loop.model.sharded_state_dict()
    flat = {f"model/{k}": v for k, v in state["model"].items()}
    for fqn, values in state["optim"]["state"].items():
        flat.update({f"optim/{fqn}/{k}": v for k, v in values.items()})
    return {k: v.detach().numpy().copy() for k, v in flat.items()}


class Probe:
    """Rank 0 writes the tensors it resumed with and the ones it ended with."""

    def __init__(self, dir):
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    @hookimpl
    def on_resumption(self, loop):
        if loop.world.is_zero:
            np.savez(self.dir / "resumed.npz", **tensors(loop))

    @hookimpl
    def after_training(self, loop):
        if loop.world.is_zero:
            np.savez(self.dir / "final.npz", **tensors(loop))
'''

CONFIG = """
[loop]
max_epochs = 2
seed = 0
run_dir = "run"

[model]
factory = "shardmodel:make_model"

[data]
factory = "shardmodel:make_data"

[plugins]
autoload = false
order = ["probe", "checkpoint"]

[plugins.probe]
factory = "shardmodel:Probe"
dir = "."

[plugins.checkpoint]
format = "sharded"
every_n_batches = 5
keep_last = {keep_last}
"""

#: 2 processes x 8 batches per epoch: saves after batches 5, 8 (epoch end), 10, 15 and 16 (end);
#: a name holds the epochs completed.
MID, FIRST = "ckpt-e0000-i000005", "ckpt-e0001-i000008"
BEFORE, NEWEST = "ckpt-e0001-i000015", "ckpt-e0002-i000016"


def project(where: Path, keep_last: str = "10") -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "shardmodel.py").write_text(MODULE)
    (where / "run.toml").write_text(CONFIG.format(keep_last=keep_last))
    return where


def run(where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return epochal_command(*args, cwd=where, env={"OMP_NUM_THREADS": "1"}, timeout=600)


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def saved(checkpoint: Path) -> dict[str, np.ndarray]:
    """The tensors of a sharded checkpoint as DCP's own reader consolidates them (one process)."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = _load_state_dict_from_keys(checkpoint_id=str(checkpoint))
    flat = {f"model/{k}": v for k, v in state["model"].items()}
    for fqn, values in state["optim"]["state"].items():
        flat.update({f"optim/{fqn}/{k}": v for k, v in values.items()})
    return {k: v.numpy() for k, v in flat.items()}


def assert_same(found: Any, expected: dict[str, np.ndarray]) -> None:
    assert sorted(found.keys()) == sorted(expected), (sorted(found.keys()), sorted(expected))
    for name, value in expected.items():
        assert np.array_equal(found[name], value), f"{name} differs"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A straight 2-epoch run on 2 processes; every checkpoint kept."""
    where = project(tmp_path_factory.mktemp("sharded"))
    ok(run(where, "run", "run.toml", "--nproc", "2"))
    return where


@pytest.fixture
def copy(trained: Path, tmp_path: Path) -> Path:
    """The trained project, copied (a test may damage it)."""
    return Path(shutil.copytree(trained, tmp_path / "copy", symlinks=True))


def test_every_rank_writes_its_files_listed_with_sizes_and_checksums(trained: Path) -> None:
    from epochal_checkpoint import list_checkpoints
    from epochal_checkpoint.storage import read_manifest

    checkpoints = trained / "run" / "version_0" / "checkpoints"
    names = [info.name for info in list_checkpoints(checkpoints)[0]]
    assert names == [MID, FIRST, "ckpt-e0001-i000010", BEFORE, NEWEST]
    manifest = read_manifest(checkpoints / NEWEST)
    shards = manifest["sharded"]
    assert ".metadata" in shards
    assert {name.split("_")[2] for name in shards if name.endswith(".distcp")} == {"0", "1"}  # both ranks
    for name in shards:
        assert manifest["files"][name]["size"] == (checkpoints / NEWEST / name).stat().st_size
    # the final tensors the run ended with are the newest checkpoint's
    assert_same(np.load(trained / "final.npz"), saved(checkpoints / NEWEST))


def test_resuming_on_one_process_at_an_epoch_end_reshards(copy: Path) -> None:
    checkpoints = copy / "run" / "version_0" / "checkpoints"
    ok(run(copy, "run", "run.toml", "--set", "loop.max_epochs=3", "--resume"))
    assert_same(np.load(copy / "resumed.npz"), saved(checkpoints / NEWEST))


def test_a_damaged_shard_is_skipped_with_a_warning_and_never_pruned(copy: Path) -> None:
    checkpoints = copy / "run" / "version_0" / "checkpoints"
    shard = sorted((checkpoints / NEWEST).glob("__1_*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    shard.write_bytes(bytes(data))
    (copy / "run.toml").write_text(CONFIG.format(keep_last="1"))
    before = saved(checkpoints / BEFORE)  # keep_last = 1: pruned by the resumed run
    done = ok(run(copy, "run", "run.toml", "--nproc", "2", "--set", "loop.max_epochs=3", "--resume"))
    assert f"{shard.name} fails its checksum" in done.stderr
    # it resumed from the one before (mid-epoch: on 2 processes again)
    assert_same(np.load(copy / "resumed.npz"), before)
    assert (checkpoints / NEWEST).is_dir()  # damaged: not counted, not pruned


def test_a_checkpoint_without_its_commit_record_is_skipped(copy: Path) -> None:
    checkpoints = copy / "run" / "version_0" / "checkpoints"
    (checkpoints / NEWEST / "manifest.json").unlink()
    done = ok(run(copy, "run", "run.toml", "--nproc", "2", "--set", "loop.max_epochs=3", "--resume"))
    assert f"ignoring {NEWEST}" in done.stderr
    assert_same(np.load(copy / "resumed.npz"), saved(checkpoints / BEFORE))


def test_a_mid_epoch_checkpoint_of_two_processes_continues_on_one(copy: Path) -> None:
    """The shards are read resharded and the epoch's rest shared out afresh (elastic runs:
    tests/test_elastic.py checks that every example is trained once)."""
    done = run(copy, "run", "run.toml", "--resume", f"run/version_0/checkpoints/{MID}")
    assert done.returncode == 0, done.stderr
    assert "batch 5 of epoch 1" in done.stderr and "finished after 2 epoch(s)" in unwrapped(done.stdout)


def test_export_writes_the_consolidated_weights(trained: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    out = tmp_path / "weights.safetensors"
    ok(run(trained, "export", "run/version_0/checkpoints", "-o", str(out)))
    final = np.load(trained / "final.npz")
    weights = load_file(str(out))
    assert sorted(weights) == sorted(k.removeprefix("model/") for k in final if k.startswith("model/"))
    for name, value in weights.items():
        assert np.array_equal(value, final[f"model/{name}"]), name


def test_sharded_format_for_a_model_without_tensors_is_one_line(tmp_path: Path) -> None:
    where = project(tmp_path)
    text = (where / "run.toml").read_text().replace('"shardmodel:make_', '"epochal.examples.digits:make_')
    (where / "run.toml").write_text(text)
    done = run(where, "run", "run.toml")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert 'format = "sharded" needs a model with sharded_state_dict()' in done.stderr
    assert not list((where / "run").glob("checkpoints/ckpt-*"))


def test_load_weights_only_takes_the_modules_tensors_on_one_process(trained: Path, tmp_path: Path) -> None:
    where = project(tmp_path / "tuned")
    source = trained / "run" / "version_0" / "checkpoints" / NEWEST
    done = run(
        where,
        *("run", "run.toml", "--plugins", "load,probe", "--set", "loop.max_epochs=0"),
        *("--set", f'plugins.load.path="{source}"', "--set", "plugins.load.weights_only=true"),
    )
    ok(done)
    final = np.load(where / "final.npz")
    expected = {k: v for k, v in saved(source).items() if k.startswith("model/")}
    assert_same({k: final[k] for k in final.files if k.startswith("model/")}, expected)


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_sharded_checkpoint_on_a_memory_store_resumes_bitwise(tmp_path: Path, background: bool) -> None:
    """One process, in this one: the DCP files go to the store with the rest, and come back
    (written in the loop's thread, or in the background with ``async_save``)."""
    import uuid

    from epochal_checkpoint import Checkpoint
    from epochal_checkpoint.storage.store import RemoteStore

    from epochal import Loop

    namespace: dict[str, Any] = {}
    exec(compile(MODULE, "shardmodel", "exec"), namespace)  # the model and data of the CLI runs

    def train(url: str, where: Path, epochs: int, resume: bool = False) -> Loop:
        plugin = Checkpoint(dir=url, format="sharded", keep_last=None, async_save=background)
        loop = Loop(
            namespace["make_model"](),
            namespace["make_data"](),
            plugins={"checkpoint": plugin},
            seed=0,
            run_dir=where,
            handle_signals=False,
            max_epochs=epochs,
            resume=resume,
        )
        loop.run()
        return loop

    straight = train(f"memory://epochal-tests/{uuid.uuid4().hex}", tmp_path / "a", 3)
    url = f"memory://epochal-tests/{uuid.uuid4().hex}"
    train(url, tmp_path / "b", 2)
    remote = RemoteStore(url)
    newest = remote.checkpoints()[0][-1]
    stored = {key.rsplit("/", 1)[1] for key in remote.fs.find(remote._key(newest.name))}
    assert set(newest.manifest["sharded"]) <= stored and "__0_0.distcp" in stored
    resumed = train(url, tmp_path / "b", 3, resume=True)
    assert resumed.resumed_source == f"checkpoint {url}/{newest.name}"
    assert_same(namespace["tensors"](resumed), namespace["tensors"](straight))


# -- asynchronous sharded saves (async_save = true) -------------------------------------------

ASYNC = ("--set", "plugins.checkpoint.async_save=true")

#: a run that SIGKILLs rank 1 in its writer thread, after DCP wrote its files for the second
#: save and before the ranks agree on them (no commit record can exist yet).
KILLER = '''

class KillWhileWriting:
    """Rank 1 kills itself with SIGKILL in the background write of the checkpoint plugin's
    second save, between DCP's files and the gather that precedes the commit."""

    @hookimpl
    def before_training(self, loop):
        import os
        import signal
        import threading

        from epochal_checkpoint.storage import sharded as files

        describe, calls = files.describe, []

        def dying(directory, rank, coordinator):
            described = describe(directory, rank, coordinator)
            calls.append(directory)
            if rank == 1 and len(calls) == 2:
                assert threading.current_thread() is not threading.main_thread()
                os.kill(os.getpid(), signal.SIGKILL)
            return described

        files.describe = dying
'''


@pytest.fixture(scope="module")
def written_async(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The straight 2-epoch run of :func:`trained`, its sharded saves written in the background."""
    where = project(tmp_path_factory.mktemp("async"))
    ok(run(where, "run", "run.toml", "--nproc", "2", *ASYNC))
    return where


def test_async_sharded_saves_hold_the_sync_saves_tensors_and_resume_bitwise(
    trained: Path, written_async: Path, tmp_path: Path
) -> None:
    from epochal_checkpoint import list_checkpoints
    from epochal_checkpoint.storage import read_manifest

    background = written_async / "run" / "version_0" / "checkpoints"
    synchronous = trained / "run" / "version_0" / "checkpoints"
    names = [info.name for info in list_checkpoints(background)[0]]
    # a save due while the previous write runs is deferred to a later batch: other names then
    assert names[0] == MID and names[-1] == NEWEST, names
    for name in names:
        if (synchronous / name).is_dir():
            assert_same(saved(background / name), saved(synchronous / name))
        assert {n.split("_")[2] for n in read_manifest(background / name)["sharded"] if "_" in n} == {
            "0",
            "1",
        }
    assert not list(background.glob("*.epochal-tmp-*"))  # no temporary directory left
    assert_same(np.load(written_async / "final.npz"), np.load(trained / "final.npz"))
    # resumed mid-epoch from a checkpoint written in the background: the straight run's end
    where = Path(shutil.copytree(written_async, tmp_path / "resumed", symlinks=True))
    ok(run(where, "run", "run.toml", "--nproc", "2", *ASYNC, "--resume", f"run/version_0/checkpoints/{MID}"))
    assert_same(np.load(where / "resumed.npz"), saved(synchronous / MID))
    assert_same(np.load(where / "final.npz"), np.load(trained / "final.npz"))


def test_check_resume_with_async_sharded_saves_is_bitwise_equal(tmp_path: Path) -> None:
    """check-resume's five runs of two processes, with sharded saves written in the background
    (the synchronous sharded saves resume bitwise in the kill and resharding tests above, and
    under DDP and FSDP in tests/test_torch_own_step_cli.py: this path is the one with more)."""
    where = project(tmp_path)
    done = ok(run(where, "check-resume", "run.toml", "--nproc", "2", "--at", "11", *ASYNC))
    assert "match the straight run bitwise" in done.stdout + done.stderr


def with_plugin(where: Path, source: str, name: str, factory: str) -> str:
    """*where*'s model module extended by *source*, and its run.toml with the plugin *name*
    (``shardmodel:<factory>``) ordered before the checkpoint; returns the config as it was."""
    (where / "shardmodel.py").write_text(MODULE + source)
    config = (where / "run.toml").read_text()
    changed = config.replace('order = ["probe", "checkpoint"]', f'order = ["probe", "{name}", "checkpoint"]')
    (where / "run.toml").write_text(changed + f'\n[plugins.{name}]\nfactory = "shardmodel:{factory}"\n')
    return config


def test_a_kill_during_an_async_sharded_write_leaves_nothing_that_looks_complete(
    trained: Path, tmp_path: Path
) -> None:
    from epochal_checkpoint import list_checkpoints

    where = project(tmp_path)
    config = with_plugin(where, KILLER, "killer", "KillWhileWriting")
    done = run(where, "run", "run.toml", "--nproc", "2", *ASYNC)
    assert done.returncode != 0, done.stderr[-3000:]
    checkpoints = where / "run" / "version_0" / "checkpoints"
    assert [info.name for info in list_checkpoints(checkpoints)[0]] == [MID]  # the second never committed
    assert not (checkpoints / FIRST).exists()
    # resumed (without the killer) from the one complete checkpoint: the straight run's end
    (where / "run.toml").write_text(config)
    ok(run(where, "run", "run.toml", "--nproc", "2", *ASYNC, "--resume"))
    assert_same(np.load(where / "resumed.npz"), saved(trained / "run" / "version_0" / "checkpoints" / MID))
    assert_same(np.load(where / "final.npz"), np.load(trained / "final.npz"))
    assert not list(checkpoints.glob("*.epochal-tmp-*"))  # the killed write's leftovers were cleaned


FAILER = """

class FailWhileWriting:
    \"\"\"Rank 1's writer thread fails (an OSError, as a full disk gives) in the second save.\"\"\"

    @hookimpl
    def before_training(self, loop):
        from epochal_checkpoint.storage import sharded as files

        describe, calls = files.describe, []

        def failing(directory, rank, coordinator):
            calls.append(directory)
            if rank == 1 and len(calls) == 2:
                raise OSError(28, "No space left on device")
            return describe(directory, rank, coordinator)

        files.describe = failing
"""


def test_a_failed_async_sharded_write_is_said_once_on_every_rank(tmp_path: Path) -> None:
    from epochal_checkpoint import list_checkpoints

    where = project(tmp_path)
    with_plugin(where, FAILER, "failer", "FailWhileWriting")
    done = run(where, "run", "run.toml", "--nproc", "2", *ASYNC)
    assert done.returncode != 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    said = [line for line in done.stderr.splitlines() if "No space left on device" in line]
    assert len(said) == 1 and "rank 1: OSError" in said[0] and "earlier checkpoints are kept" in said[0], said
    checkpoints = where / "run" / "version_0" / "checkpoints"
    assert [info.name for info in list_checkpoints(checkpoints)[0]] == [MID]  # kept; nothing else
    assert not list(checkpoints.glob("*.epochal-tmp-*"))
