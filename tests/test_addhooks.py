"""A plugin adds a hook specification that a plugin of another distribution implements."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from epochal.testing import epochal_command

HERE = Path(__file__).parent
CONFIG = """
[loop]
max_epochs = 2
seed = 0

[model]
factory = "epochal.examples.tiny:TinyModel"

[data]
factory = "epochal.examples.tiny:tiny_data"

[plugins]
order = {order}
autoload = false
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, pip_install_target: Callable[[Path, Path], None]) -> Path:
    """Both distributions pip-installed into one directory (as third-party packages are)."""
    root = tmp_path_factory.mktemp("addhooks")
    target = root / "site"
    for name in ("host", "user"):
        shutil.copytree(HERE / "addhooks" / name, root / name)
        pip_install_target(root / name, target)
    return target


def run(site: Path, tmp_path: Path, order: list[str]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "run.toml").write_text(CONFIG.format(order=json.dumps(order)))
    env = {"PYTHONPATH": str(site), "EPOCHAL_HH_OUT": str(tmp_path / "out.jsonl")}
    return epochal_command("run", "run.toml", cwd=tmp_path, env=env)


@pytest.mark.parametrize("order", [["hh_host", "hu_user"], ["hu_user", "hh_host"]])
def test_a_plugin_implements_a_hook_another_distribution_adds(site, tmp_path, order):
    result = run(site, tmp_path, order)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert lines == [
        {"epoch": 1, "results": [{"double_epoch": 2}]},
        {"epoch": 2, "results": [{"double_epoch": 4}]},
    ]


def test_the_added_hook_is_unknown_without_the_plugin_that_adds_it(site, tmp_path):
    result = run(site, tmp_path, ["hu_user"])
    assert result.returncode == 2
    assert "plugin 'hu_user' is refused: unknown hook 'hh_extra_metrics'" in result.stderr


def test_a_misspelled_argument_of_an_added_hook_is_refused(site, tmp_path):
    result = run(site, tmp_path, ["hh_host", "hu_typo"])
    assert result.returncode == 2
    assert "hook 'hh_extra_metrics' has no argument(s) 'epoc'" in result.stderr
    assert "did you mean 'epoch'" in result.stderr
