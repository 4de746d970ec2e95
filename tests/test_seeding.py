"""``[loop] seed`` makes a run reproducible: every generator is seeded before the model and data
factories are called, so factories that draw from the global generators (random init, a random
data split) give the same run every time (issue 29). Runs through the CLI."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal import _rng
from epochal.testing import EpochalCli

pytest_plugins = ["epochal.testing"]
pytestmark = pytest.mark.usefixtures("no_epochal_env")

# Factories with no seed argument: they draw from the global generators, as a user's often do.
FACTORIES = """
import json
import random

import numpy as np

from epochal import hookimpl


class NumpyModel:
    def __init__(self):
        self.w = np.random.randn(4)
        self.b = random.random()

    def train_step(self, batch):
        x, y = batch
        error = x @ self.w + self.b - y
        self.w = self.w - 0.1 * x.T @ error / len(y)
        return {"loss": float((error**2).mean())}

    def eval_step(self, batch):
        x, y = batch
        return {"loss": float(((x @ self.w + self.b - y) ** 2).mean())}

    def state_dict(self):
        return {"w": self.w.copy(), "b": self.b}

    def load_state_dict(self, state):
        self.w, self.b = np.array(state["w"]), state["b"]


def numpy_model():
    return NumpyModel()


def torch_model():
    import torch  # first imported here, inside the factory, after the run has started

    from epochal.torch import TorchModel

    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    loss = lambda out, y: torch.nn.functional.mse_loss(out.squeeze(-1), y)
    return TorchModel(net, optimizer, loss, device="cpu")


def data(fixed=False):
    rng = np.random.default_rng(0) if fixed else np.random  # the global one unless fixed
    x = rng.random((32, 4)).astype(np.float32) if fixed else rng.rand(32, 4).astype(np.float32)
    y = rng.random(32).astype(np.float32) if fixed else rng.rand(32).astype(np.float32)
    return {"train": [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)], "valid": [(x, y)]}


class Record:
    def __init__(self, path):
        self.path = path

    @hookimpl
    def after_batch(self, loop, outputs):
        self._write({"epoch": loop.epoch + 1, "batch": {k: float(v) for k, v in outputs.items()}})

    @hookimpl
    def after_evaluation(self, loop, stream, metrics):
        self._write({"epoch": loop.epoch, stream: {k: float(v) for k, v in metrics.items()}})

    def _write(self, row):
        with open(self.path, "a") as out:
            out.write(json.dumps(row) + "\\n")
"""

CONFIG = """
[loop]
max_epochs = 2
seed = {seed}

[model]
factory = "factories:{model}"

[data]
factory = "factories:data"
fixed = {fixed}

[plugins.record]
factory = "factories:Record"
path = "{out}"
"""


def run(epochal_cli: EpochalCli, tmp_path: Path, model: str, seed: int, name: str) -> list[dict[str, Any]]:
    """One CLI run of a fresh config; the rows the Record plugin wrote for epoch 1."""
    (tmp_path / "factories.py").write_text(FACTORIES)
    # torch's model: the data do not depend on the seed, so the weights alone show that it counts
    fixed = "true" if model == "torch_model" else "false"
    (tmp_path / f"{name}.toml").write_text(
        CONFIG.format(seed=seed, model=model, out=f"{name}.jsonl", fixed=fixed)
    )
    result = epochal_cli("run", f"{name}.toml", "--only", "record", "--set", f"loop.run_dir=runs/{name}")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    first = [row for row in rows if row["epoch"] == 1]
    assert any("valid" in row for row in first) and any("batch" in row for row in first)
    return first


@pytest.mark.slow
@pytest.mark.parametrize("model", ["numpy_model", "torch_model"])
def test_a_seeded_config_gives_the_same_first_epoch_every_run(
    model: str, tmp_path: Path, epochal_cli: EpochalCli
) -> None:
    if model == "torch_model":
        pytest.importorskip("torch")
    first = run(epochal_cli, tmp_path, model, 0, "first")
    second = run(epochal_cli, tmp_path, model, 0, "second")
    assert first == second
    # the seed is what decides the init (torch's too, imported only by its factory)
    other = run(epochal_cli, tmp_path, model, 1, "other")
    assert other != first


@pytest.mark.slow
def test_check_resume_of_a_factory_that_draws_is_not_a_mismatch(
    tmp_path: Path, epochal_cli: EpochalCli
) -> None:
    """check-resume's straight and interrupted runs build their models from the same seed, so
    a random init is not reported as a resume that went wrong."""
    (tmp_path / "factories.py").write_text(FACTORIES)
    config = CONFIG.format(seed=0, model="numpy_model", out="rows.jsonl", fixed="false")
    (tmp_path / "run.toml").write_text(config + '\n[plugins]\norder = ["checkpoint"]\nautoload = false\n')
    result = epochal_cli("check-resume", "run.toml", "--at", "5", "--disable", "record")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok: interrupted after batch 5 of 8 and resumed" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("seed", "problem"),
    [("-1", "greater than or equal to 0"), (str(2**32), f"less than {2**32}")],
)
def test_a_seed_no_generator_takes_is_one_line_naming_the_key(
    seed: str, problem: str, tmp_path: Path, epochal_cli: EpochalCli
) -> None:
    (tmp_path / "factories.py").write_text(FACTORIES)
    (tmp_path / "run.toml").write_text(
        CONFIG.format(seed=0, model="numpy_model", out="rows.jsonl", fixed="false")
    )
    result = epochal_cli("run", "run.toml", "--set", f"loop.seed={seed}")
    assert result.returncode == 2
    # the file is fine: the --set that broke it is named
    assert (
        result.stderr.strip()
        == f"Error: --set 'loop.seed={seed}': [loop]: seed must be {problem}, not {seed}"
    )
    assert not (tmp_path / "rows.jsonl").exists()  # refused before the run started


RANKS = """
import json
import os
import random

import numpy as np

from epochal.data import BatchStream


class Model:
    def __init__(self):
        self.w = np.random.randn(3)
        with open(f"init-{os.environ['RANK']}.json", "w") as out:
            json.dump({"numpy": self.w.tolist(), "python": random.random()}, out)

    def distribute(self, world):
        pass  # it learns nothing: no gradients to average

    def train_step(self, batch):
        return {"loss": 0.0}

    def eval_step(self, batch):
        return {"loss": 0.0}

    def state_dict(self):
        return {"w": self.w.copy()}

    def load_state_dict(self, state):
        self.w = np.array(state["w"])


def model():
    return Model()


def data():
    x = np.arange(32.0).reshape(16, 2)
    return {"train": BatchStream(x, x[:, 0], batch_size=4, shuffle=False, seed=0)}
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_every_rank_builds_the_same_initial_model(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    """On several processes the model factory draws from the same seed on every rank, so the
    replicas start equal (what DDP and fully_shard expect)."""
    pytest.importorskip("torch.distributed")
    (tmp_path / "ranks.py").write_text(RANKS)
    (tmp_path / "run.toml").write_text(
        '[loop]\nmax_epochs = 1\nseed = 7\n\n[distributed]\nbackend = "gloo"\ntimeout = 60\n\n'
        '[model]\nfactory = "ranks:model"\n\n[data]\nfactory = "ranks:data"\n\n'
        "[plugins]\nautoload = false\n"
    )
    result = epochal_cli("run", "run.toml", "--nproc", "2")
    assert result.returncode == 0, result.stderr
    first, second = (json.loads((tmp_path / f"init-{rank}.json").read_text()) for rank in (0, 1))
    assert first == second


def test_seeded_seeds_every_generator_for_its_block_and_leaves_no_hook_behind() -> None:
    hooks = list(sys.meta_path)
    draws = []
    for _ in range(2):
        with _rng.seeded(11):
            draws.append((random.random(), float(np.random.rand())))
        assert sys.meta_path == hooks
    assert draws[0] == draws[1]
    state = _rng.capture()
    with _rng.seeded(None):  # no seed: the generators are left as they are
        pass
    assert random.getstate()[1] == tuple(state["python"]["state"].tolist())
