"""A GAN under manual optimization through ``epochal run``: killed with SIGKILL inside an epoch and
resumed, on 1 and 2 processes, DDP and FSDP, single and sharded checkpoints; ``epochal
check-resume`` on 1 and 2 processes. Every resumed run must end bitwise where the straight run
ends (the model, both optimizers' moments and schedules, the gradients a step left, the noise
drawn, under FSDP each rank's own batch-norm statistics).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from epochal.testing import epochal_command  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import own_step_models as models  # noqa: E402

pytestmark = pytest.mark.slow


def epochal(directory: Path, *args: str, kill_at: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {"OMP_NUM_THREADS": "1", "OWN_STEP_KILL_AT": "" if kill_at is None else str(kill_at)}
    return epochal_command(*args, cwd=directory, env=env, timeout=600)


def record(directory: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((directory / "record.json").read_text())
    return result


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``straight(nproc, strategy)``: the record of the GAN's straight run, run once per pair (the
    checkpoint format changes nothing a straight run computes)."""
    done: dict[tuple[int, str], dict[str, Any]] = {}

    def get(nproc: int, strategy: str) -> dict[str, Any]:
        if (nproc, strategy) not in done:
            directory = tmp_path_factory.mktemp(f"straight-{nproc}-{strategy}")
            models.write_gan_config(directory, strategy=strategy)
            launch = ["--nproc", str(nproc)] if nproc > 1 else []
            result = epochal(directory, "run", "gan.toml", *launch)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
            done[nproc, strategy] = record(directory)
        return done[nproc, strategy]

    return get


@pytest.mark.parametrize(
    ("nproc", "strategy", "format"),
    [(1, "ddp", "single"), pytest.param(2, "ddp", "sharded", marks=pytest.mark.distributed),
     pytest.param(2, "fsdp", "sharded", marks=pytest.mark.distributed),
     pytest.param(2, "fsdp", "single", marks=pytest.mark.distributed)],
)  # fmt: skip
def test_a_gan_killed_inside_an_epoch_resumes_to_the_straight_runs_weights(
    tmp_path: Path, straight: Any, nproc: int, strategy: str, format: str
) -> None:
    launch = ["--nproc", str(nproc)] if nproc > 1 else []
    models.write_gan_config(tmp_path, strategy=strategy, format=format)
    # 6 batches an epoch on one process, 3 on each of two: batch 5 is inside an epoch either way
    # and the newest checkpoint then is batch 4's
    died = epochal(tmp_path, "run", "gan.toml", *launch, kill_at=5)
    assert died.returncode != 0 and not (tmp_path / "record.json").exists()
    resumed = epochal(tmp_path, "run", "gan.toml", *launch, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "i000004" in resumed.stdout + resumed.stderr  # it resumed from batch 4's checkpoint
    a, b = straight(nproc, strategy), record(tmp_path)
    assert a["sharded"] == b["sharded"] == (strategy == "fsdp")
    assert a["iteration"] == b["iteration"] == 12 // nproc
    assert a["optimizer_steps"] == b["optimizer_steps"] == 12 // nproc
    assert a["module"].keys() == b["module"].keys()
    assert {k.split(".")[0] for k in a["module"]} == {"generator", "discriminator"}
    assert a["module"] == b["module"]  # bitwise: JSON keeps every float32 exactly


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_check_resume_finds_a_gan_bitwise(tmp_path: Path, nproc: int) -> None:
    config = models.write_gan_config(tmp_path)
    launch = ["--nproc", str(nproc)] if nproc > 1 else []
    done = epochal(tmp_path, "check-resume", str(config), *launch)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("ok: ")]
    assert len(lines) == 2, done.stdout  # the SIGTERM-style stop inside an epoch, and the kill -9
    assert "matches the straight run bitwise" in lines[1]


@pytest.mark.distributed
def test_ddp_wraps_each_module_and_accumulates_without_all_reducing(tmp_path: Path) -> None:
    """Two modules under automatic optimization with accumulate_grad_batches = 2 on two
    processes: each has its own DDP wrapper, which all-reduces only on the batches that step."""
    models.copy_beside(tmp_path)
    (tmp_path / "two.toml").write_text(
        """[loop]
max_epochs = 2
seed = 0
run_dir = "run"

[model]
factory = "own_step_models:make_two_part"

[data]
factory = "own_step_models:make_gan_data"

[plugins]
autoload = false
order = ["count"]

[plugins.count]
factory = "own_step_models:CountAllReduces"
""",
        encoding="utf-8",
    )
    done = epochal(tmp_path, "run", "two.toml", "--nproc", "2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    record = json.loads((tmp_path / "allreduces.json").read_text())
    # 3 batches per rank and epoch, 6 in all: windows of 2 make 3 optimizer steps, each one
    # all-reduce (one bucket) of each module's gradients
    assert record["optimizer_steps"] == 3
    assert record["allreduces"] == {"encoder": 3, "decoder": 3}


@pytest.mark.parametrize(
    ("table", "key", "value", "words"),
    [
        ("model", "accumulate_grad_batches", "2", "accumulate_grad_batches=2 with automatic_optimization"),
        ("model", "automatic_optimization", '"no"', "automatic_optimization"),
        ("plugins.lr_scheduler", "optimizer", '"generatr"', "optimizer = 'generatr' is not an optimizer of"),
    ],
)  # fmt: skip
def test_bad_model_options_are_one_line_naming_them_from_toml_and_set(
    tmp_path: Path, table: str, key: str, value: str, words: str
) -> None:
    config = models.write_gan_config(tmp_path)
    text = config.read_text(encoding="utf-8").replace(f"[{table}]\n", f"[{table}]\n{key} = {value}\n", 1)
    config.with_name("bad.toml").write_text(text, encoding="utf-8")
    for args in (["bad.toml"], ["gan.toml", "--set", f"{table}.{key}={value}"]):
        done = epochal(tmp_path, "run", *args)
        assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
        errors = [line for line in done.stderr.splitlines() if line.startswith("Error")]
        assert len(errors) == 1 and words in errors[0] and "Traceback" not in done.stderr, done.stderr
    assert not list((tmp_path / "run").glob("version_*/checkpoints/ckpt-*"))  # nothing trained
