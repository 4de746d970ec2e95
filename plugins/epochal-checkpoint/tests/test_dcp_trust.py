"""Issue 44: nothing in a checkpoint runs code without a key, on every reader, and DCP's errors
are one line.

A one-process run saves sharded (DCP) checkpoints, another single-format ones; a forgery is
planted as the newest (its CRC-32s made to agree, as anyone who can write the directory can):
a pickle payload as DCP's ``.metadata`` (``os.system``, ``builtins.eval``, a ``getattr`` chain,
a torch global, a payload inside DCP's own ``Metadata``), a value in a ``.distcp`` file that
only ``torch.load(weights_only=False)`` reads, or a single-format state whose model names a
DCP directory elsewhere. Every reader (``--resume``, ``--resume auto``, ``epochal export``,
``[plugins.load] path``) either falls back to the previous checkpoint with a warning naming the
forged one, or ends in one error line (exit 2): no payload ever runs.
"""

from __future__ import annotations

import shutil
import subprocess
import zlib
from pathlib import Path

import pytest

from epochal.testing import epochal_command

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from epochal_checkpoint.forgery import (  # noqa: E402
    executed,
    pickle_payload,
    plant_dcp_location,
    plant_metadata,
    plant_value,
)
from epochal_checkpoint.storage import KEY_ENV  # noqa: E402
from epochal_checkpoint.testing import force_crc32  # noqa: E402

pytestmark = pytest.mark.slow

MODULE = """
import numpy as np
import torch

from epochal.data import BatchStream
from epochal.torch import TorchModel


def make_model(width=4):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    return TorchModel(module, optimizer, torch.nn.functional.mse_loss, device="cpu")


def make_data(width=4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, width)).astype(np.float32)
    return {"train": BatchStream(x, x[:, :1].copy(), batch_size=8, seed=0)}
"""

CONFIG = """
[loop]
max_epochs = 2
seed = 0
run_dir = "{run_dir}"

[model]
factory = "dcpmodel:make_model"

[data]
factory = "dcpmodel:make_data"

[plugins]
autoload = false
order = ["checkpoint"]

[plugins.checkpoint]
format = "{format}"
keep_last = 10
every_n_epochs = 1
"""

#: 4 batches an epoch, a checkpoint at each epoch end; the sharded run has four, the single two.
EPOCHS = [f"ckpt-e{e:04d}-i{4 * e:06d}" for e in range(1, 5)]
#: where the metadata payloads go for each resume reader (newest first; a value payload below).
RESUMED_KINDS = {
    "resume": ("os-system", "builtins-eval"),
    "resume-auto": ("getattr-chain", "torch-global"),
}
VALUE = "__0_0.distcp value 'optim.param_groups.0.lr' does not read without code"
METADATA = ".metadata is not DCP metadata"
LOCATION = "data.bin key model.dcp is set"


def run(where: Path, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"OMP_NUM_THREADS": "1", **({KEY_ENV: key} if key is not None else {})}
    return epochal_command(*args, cwd=where, env=env, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project with a sharded run (``run``, four epochs) and a single-format run (``srun``, two)."""
    where = tmp_path_factory.mktemp("dcp-trust")
    (where / "dcpmodel.py").write_text(MODULE)
    (where / "run.toml").write_text(CONFIG.format(run_dir="run", format="sharded"))
    (where / "single.toml").write_text(CONFIG.format(run_dir="srun", format="single"))
    for config, epochs in (("run.toml", 4), ("single.toml", 2)):
        done = run(where, "run", config, "--set", f"loop.max_epochs={epochs}")
        assert done.returncode == 0, done.stderr[-3000:]
    return where


@pytest.fixture
def project(trained: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(trained, tmp_path / "project", symlinks=True))


def checkpoint(project: Path, epoch: int, run_dir: str = "run") -> Path:
    return project / run_dir / "version_0" / "checkpoints" / EPOCHS[epoch - 1]


def resume(project: Path, reader: str, config: str = "run.toml") -> subprocess.CompletedProcess[str]:
    mode = ["auto"] if reader == "resume-auto" else []
    return run(project, "run", config, "--set", "loop.max_epochs=5", "--resume", *mode)


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def fell_back(done: subprocess.CompletedProcess[str], forged: dict[str, str], to: str) -> None:
    """The run resumed from checkpoint *to* after one warning for each *forged* checkpoint
    (name: what the warning says)."""
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    for name, culprit in forged.items():
        warned = [line for line in lines if name in line and "Warning" in line]
        assert len(warned) == 1 and culprit in warned[0], done.stderr
    assert to in next(line for line in lines if "resumed from" in line), done.stderr


@pytest.mark.parametrize("reader", sorted(RESUMED_KINDS))
def test_payloads_in_dcp_files_run_on_no_resume(project: Path, reader: str) -> None:
    newest, second = RESUMED_KINDS[reader]
    plant_metadata(checkpoint(project, 4), pickle_payload(newest, project))
    plant_metadata(checkpoint(project, 3), pickle_payload(second, project))
    plant_value(checkpoint(project, 2), project)
    done = resume(project, reader)
    assert executed(project) == []
    fell_back(done, {EPOCHS[3]: METADATA, EPOCHS[2]: METADATA, EPOCHS[1]: VALUE}, to=EPOCHS[0])


def plant_location(project: Path) -> Path:
    """A single-format checkpoint whose model state names DCP files elsewhere (with a payload)."""
    elsewhere = project / "elsewhere"
    shutil.copytree(checkpoint(project, 4), elsewhere)  # the DCP files of a sharded checkpoint
    (elsewhere / ".metadata").write_bytes(pickle_payload("os-system", project))
    forged = checkpoint(project, 2, "srun")
    plant_dcp_location(forged, str(elsewhere))
    return forged


@pytest.mark.parametrize("reader", sorted(RESUMED_KINDS))
def test_a_dcp_location_in_a_single_format_state_is_never_followed_on_resume(
    project: Path, reader: str
) -> None:
    plant_location(project)
    done = resume(project, reader, "single.toml")
    assert executed(project) == []
    fell_back(done, {EPOCHS[1]: LOCATION}, to=EPOCHS[0])


@pytest.mark.parametrize("forgery", ["inside-metadata", "value", "location"])
def test_export_of_a_forged_checkpoint_is_one_line_and_runs_nothing(project: Path, forgery: str) -> None:
    if forgery == "location":
        forged, culprit = plant_location(project), LOCATION
    elif forgery == "value":
        forged, culprit = checkpoint(project, 4), VALUE
        plant_value(forged, project)
    else:
        forged, culprit = checkpoint(project, 4), METADATA
        plant_metadata(forged, pickle_payload(forgery, project))
    line = one_error_line(run(project, "export", str(forged), "-o", str(project / "weights.safetensors")))
    assert executed(project) == []
    assert forged.name in line and culprit in line, line
    assert not (project / "weights.safetensors").exists()


@pytest.mark.parametrize("forgery", ["os-system", "location"])
def test_a_load_plugins_path_to_a_forged_checkpoint_is_one_line_and_runs_nothing(
    project: Path, forgery: str
) -> None:
    if forgery == "location":
        forged, culprit, config = plant_location(project), LOCATION, "single.toml"
    else:
        forged, culprit, config = checkpoint(project, 4), METADATA, "run.toml"
        plant_metadata(forged, pickle_payload(forgery, project))
    done = run(
        project,
        *("run", config, "--plugins", "load", "--set", "loop.max_epochs=5"),
        *("--set", f'plugins.load.path="{forged}"'),
    )
    line = one_error_line(done)
    assert executed(project) == []
    assert forged.name in line and culprit in line, line


def test_a_sharded_checkpoint_of_another_model_is_one_line(project: Path) -> None:
    """DCP raises a CheckpointException (a BaseException): one error line, exit 2."""
    done = run(
        project,
        *("run", "run.toml", "--set", "model.width=6", "--set", "data.width=6"),
        *("--resume", str(checkpoint(project, 4))),
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "CheckpointException" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "does not fit the model" in errors[0] and "0.weight" in errors[0], done.stderr
    assert "Global metadata" not in done.stderr


def in_place(file: Path, data: bytes | bytearray) -> None:
    """Write *data* (as long as *file*) into *file*, its last 4 bytes chosen so that the file's
    CRC-32 stays: the manifest is left byte for byte, and only a signature tells."""
    before = file.read_bytes()
    assert len(data) == len(before)
    forged = bytearray(data)
    force_crc32(forged, len(forged) - 4, zlib.crc32(before))
    file.write_bytes(bytes(forged))


def test_signed_sharded_checkpoints_refuse_forged_dcp_files(project: Path) -> None:
    """Issue 44, item 2: with EPOCHAL_CHECKPOINT_KEY every rank signs its DCP files; a file
    changed in place with its CRC-32 kept (what only a key tells) is refused, ``.metadata``
    before a byte of it is unpickled, and the run resumes from the one before."""
    key = "the owner's key"
    shutil.rmtree(project / "run")
    done = run(project, "run", "run.toml", "--set", "loop.max_epochs=3", key=key)
    assert done.returncode == 0, done.stderr[-3000:]
    signature = (checkpoint(project, 3) / "signature.json").read_text()
    assert ".metadata" in signature and "__0_0.distcp" in signature
    shard = checkpoint(project, 3) / "__0_0.distcp"
    tensors = bytearray(shard.read_bytes())
    tensors[len(tensors) // 2] ^= 0x01
    in_place(shard, tensors)
    metadata = checkpoint(project, 2) / ".metadata"
    payload = pickle_payload("os-system", project)  # unpickling stops at its STOP opcode
    in_place(metadata, payload + bytes(metadata.stat().st_size - len(payload)))
    done = run(project, "run", "run.toml", "--set", "loop.max_epochs=4", "--resume", key=key)
    assert executed(project) == []
    mismatch = "does not match its signature"
    fell_back(done, {EPOCHS[2]: f"__0_0.distcp {mismatch}", EPOCHS[1]: f".metadata {mismatch}"}, to=EPOCHS[0])
    # without the key the changed tensor file passes (its CRC-32 agrees): the signature found it
    forged = str(checkpoint(project, 3))
    done = run(project, "run", "run.toml", "--set", "loop.max_epochs=4", "--resume", forged)
    assert done.returncode == 0, done.stderr[-3000:]
    assert executed(project) == []
