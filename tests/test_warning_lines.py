"""How `epochal run` prints warnings: epochal's own as one `epochal:` line, others as Python does.

Issue 31: a warning raised by the user's own code was printed with the `epochal:` prefix, as if
epochal had warned.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

USER_CODE = """
import warnings

import numpy as np


class Model:
    def train_step(self, batch):
        warnings.warn("the user's own warning", UserWarning)
        return {"loss": float(np.mean(batch))}

    def eval_step(self, batch):
        return {"loss": 0.0}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def make_model():
    return Model()


def make_data():
    return {"train": [np.ones(2), np.ones(0), np.ones(2)]}
"""

CONFIG = """[loop]
max_epochs = 1
on_empty_batch = "warn"

[model]
factory = "usercode:make_model"

[data]
factory = "usercode:make_data"

[plugins]
autoload = false
"""


@pytest.mark.slow
def test_only_epochals_own_warnings_carry_its_name(tmp_path: Path) -> None:
    (tmp_path / "usercode.py").write_text(USER_CODE, encoding="utf-8")
    (tmp_path / "run.toml").write_text(CONFIG, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    done = subprocess.run(
        [sys.executable, "-m", "epochal", "run", "run.toml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    user = [line for line in lines if "the user's own warning" in line]
    assert user and all(not line.startswith("epochal:") for line in user), done.stderr
    assert any(line.endswith("UserWarning: the user's own warning") for line in user)
    assert "usercode.py" in user[0]  # Python's format: where the user's code warned
    ours = [line for line in lines if "yielded an empty batch" in line]
    assert len(ours) == 1 and ours[0].startswith("epochal: RuntimeWarning: stream 'train'"), done.stderr


def test_a_plugins_warning_is_one_line_and_a_libraries_is_pythons() -> None:
    from epochal.cli import _format_warning

    plugin = _format_warning(
        "mlflow: the tracker is down", RuntimeWarning, "/x/site-packages/epochal_mlflow/tracker.py", 9
    )
    assert plugin == "epochal: RuntimeWarning: mlflow: the tracker is down\n"
    library = _format_warning(
        "deprecated", DeprecationWarning, "/x/site-packages/somelib/core.py", 3, "call()"
    )
    assert library.startswith("/x/site-packages/somelib/core.py:3: DeprecationWarning: deprecated")


def test_a_warning_that_names_pluggys_frame_is_a_plugins() -> None:
    # a hook that warns with a stacklevel past itself lands in pluggy's caller (or in epochal's
    # generated hook caller): still a plugin's warning, one line, no pluggy path and source line
    import pluggy._callers

    from epochal.cli import _format_warning

    for filename in (pluggy._callers.__file__, "<epochal hook caller>"):
        line = _format_warning("ignoring ck-1: damaged", RuntimeWarning, filename, 147, "res = f(*args)")
        assert line == "epochal: RuntimeWarning: ignoring ck-1: damaged\n", filename
