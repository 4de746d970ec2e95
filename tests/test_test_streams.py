"""``[loop] test_streams``: held-out streams evaluated once after training, with the last or
the best saved weights, through the ``epochal`` CLI.

The data are :mod:`epochal.examples.tiny`'s with a ``test`` stream that is the ``valid`` one:
the same weights give the same loss on both, so a test value names the weights it was taken
with (the last epoch's valid loss, or the best one's).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from epochal.testing import epochal_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_log import rows

pytest.importorskip("epochal_checkpoint")
pytest.importorskip("epochal_sqlite")

MODULE = """\
from epochal.examples.tiny import tiny_data


def data(seed=0):
    streams = tiny_data(examples=40, batch_size=8, seed=seed)
    streams["test"] = tiny_data(examples=40, batch_size=8, seed=seed)["valid"]
    return streams
"""

CONFIG = """\
[loop]
max_epochs = 3
seed = 0
run_dir = "runs/tiny"
{loop}
[model]
factory = "epochal.examples.tiny:TinyModel"

[data]
factory = "held_data:data"

[plugins]
order = ["checkpoint", "sqlite_log"]
autoload = false

[plugins.checkpoint]
{checkpoint}
"""


def epochal(tmp: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    """``epochal ARGS`` in *tmp*, which is on the path (its ``held_data`` module)."""
    return epochal_command(
        *arguments,
        cwd=tmp,
        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp), os.environ.get("PYTHONPATH")]))},
    )


def write(tmp: Path, loop: str, checkpoint: str = "") -> Path:
    (tmp / "held_data.py").write_text(MODULE)
    config = tmp / "run.toml"
    config.write_text(CONFIG.format(loop=loop, checkpoint=checkpoint))
    return config


def test_last_weights_evaluate_the_test_stream_once_at_the_end(tmp_path):
    result = epochal(tmp_path, "run", str(write(tmp_path, 'test_streams = ["test"]')))
    assert result.returncode == 0, result.stderr
    logged = rows(tmp_path)
    tested = [row for row in logged if "test.loss" in row]
    assert [row["iteration"] for row in tested] == [15]  # once, in the last row; never during training
    assert len([row for row in logged if "valid.loss" in row]) == 3
    assert tested[0]["test.loss"] == tested[0]["valid.loss"]  # the last weights, on the same data


def test_best_weights_are_the_best_checkpoint_and_the_last_come_back(tmp_path):
    # mode = "max" on a falling loss: the best checkpoint is the first epoch's
    checkpoint = 'monitor = "valid.loss"\nmode = "max"\nexport = "last"'
    config = write(tmp_path, 'test_streams = ["test"]\ntest_weights = "best"', checkpoint)
    result = epochal(tmp_path, "run", str(config))
    assert result.returncode == 0, result.stderr
    logged = rows(tmp_path)
    valid = [row["valid.loss"] for row in logged if "valid.loss" in row]
    test = [row["test.loss"] for row in logged if "test.loss" in row]
    assert valid[0] != valid[-1] and test == [valid[0]]

    # after the test the model has its last weights again: what training ends with (export =
    # "last" writes them in after_training) is what a run without test streams ends with
    (tmp_path / "plain").mkdir()
    plain = epochal(tmp_path / "plain", "run", str(write(tmp_path / "plain", "", checkpoint)))
    assert plain.returncode == 0, plain.stderr
    from safetensors.numpy import load_file

    last = [load_file(str(next(where.rglob("last.safetensors")))) for where in (tmp_path, tmp_path / "plain")]
    assert last[0].keys() == last[1].keys()
    assert all(last[0][k].tobytes() == last[1][k].tobytes() for k in last[0])


def test_printing_says_which_weights_the_test_was_evaluated_with(tmp_path):
    pytest.importorskip("epochal_printing")
    config = write(tmp_path, 'test_streams = ["test"]', "")
    result = epochal(tmp_path, "run", str(config), "--plugins", "printing")
    assert result.returncode == 0, result.stderr
    tested = [
        line for line in result.stdout.splitlines() if "test" in line and not line.startswith("epochal:")
    ]
    assert len(tested) == 1 and tested[0].startswith("after training, last weights: test")


def test_test_streams_resume_bitwise(tmp_path):
    checkpoint = 'monitor = "valid.loss"\nmode = "max"'
    config = write(tmp_path, 'test_streams = ["test"]\ntest_weights = "best"', checkpoint)
    result = epochal(tmp_path, "check-resume", str(config), "--at", "7")
    assert result.returncode == 0, result.stderr
    assert "ok: interrupted after batch 7 of 15 and resumed" in result.stdout


@pytest.mark.parametrize(
    ("loop", "message"),
    [
        ('test_streams = ["tset"]', "test_streams names 'tset', which is not an evaluation stream"),
        ('test_streams = ["train"]', "test_streams names 'train'"),
        ('test_streams = ["test", "test"]', "test_streams names 'test' twice"),
        ('test_streams = ["test"]\ntest_weights = "best"', 'test_weights = "best" needs a plugin'),
        ('test_weights = "worst"', "test_weights"),
    ],
)
def test_bad_test_options_are_one_line_before_the_first_batch(tmp_path, loop, message):
    result = epochal(tmp_path, "run", str(write(tmp_path, loop)))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "run.toml" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not list((tmp_path / "runs").rglob("ckpt-*"))
