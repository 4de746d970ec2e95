"""How much a batch weighs in an evaluation mean: its examples, by the documented rule.

The rule (docs/concepts.md): the model's ``batch_size(batch)`` if it has one, else the leading
dimension of the first array found depth-first. Batches here are dicts whose first entry is a
tuple, ``{"inputs": (x, flag), "targets": y}``: the rule counts ``len(x)``, not the tuple's 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from epochal.data import batch_size

pytest.importorskip("epochal_monitor")

MODULE = """\
import numpy as np

from epochal.testing import StubModel

TARGETS = np.arange(10, dtype=float) ** 2   # 10 examples: batches of 4, 4 and 2


def batches():
    out = []
    for start in range(0, 10, 4):
        y = TARGETS[start:start + 4]
        x = np.ones((len(y), 3))
        out.append({"inputs": (x, np.zeros(len(y), dtype=bool)), "targets": y})
    return out


def make_data():
    return {"train": batches(), "valid": batches()}


class Model(StubModel):
    def __init__(self):
        super().__init__(evaluation=lambda batch: {"target": float(batch["targets"].mean())})


class Declared(Model):
    def batch_size(self, batch):
        return 1   # every batch weighs the same: the mean of the batch means
"""

CONFIG = """\
[loop]
max_epochs = 1
[model]
factory = "weights_model:{model}"
[data]
factory = "weights_model:make_data"
[plugins]
order = ["printing"]
autoload = false
"""


def run(tmp: Path, model: str) -> float:
    (tmp / "weights_model.py").write_text(MODULE)
    config = tmp / "run.toml"
    config.write_text(CONFIG.format(model=model))
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "epochal", "run", str(config)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    line = next(x for x in (result.stdout + result.stderr).splitlines() if "last valid:" in x)
    return float(line.split("target=")[1].split()[0])


def test_a_batch_weighs_the_examples_of_the_first_array_depth_first(tmp_path):
    targets = np.arange(10, dtype=float) ** 2
    assert run(tmp_path, "Model") == pytest.approx(targets.mean(), rel=1e-3)


def test_a_model_declared_batch_size_gives_the_weight(tmp_path):
    targets = np.arange(10, dtype=float) ** 2
    batch_means = [targets[s : s + 4].mean() for s in range(0, 10, 4)]
    assert run(tmp_path, "Declared") == pytest.approx(np.mean(batch_means), rel=1e-3)


@pytest.mark.parametrize(
    ("batch", "examples"),
    [
        ({"inputs": (np.ones((5, 3)), np.zeros(5)), "targets": np.ones(5)}, 5),
        ({"inputs": {"ids": np.ones((6, 2))}, "targets": np.ones(6)}, 6),
        (((np.ones((7, 3)), np.ones(7)), np.ones(7)), 7),
        (([1, 2, 3], [0, 1, 0]), 3),
        ({"inputs": (np.ones((0, 3)), np.zeros(0)), "targets": np.ones(0)}, 0),
        ((np.float64(2.0), 1), 1),
    ],
)
def test_the_rule_on_nested_batches(batch, examples):
    assert batch_size(batch) == examples


def test_the_rule_is_said_in_the_concepts_page():
    page = (Path(__file__).resolve().parents[1] / "docs" / "concepts.md").read_text()
    assert textwrap.dedent("batch_size(batch)") in page and "depth-first" in page
