"""Two installed distributions offering the same plugin name: an error unless the run chooses.

An impostor distribution (pip-installed into a temp dir) offers ``tw_alpha``, a name the
throwaway distribution offers too; importing the impostor's module leaves a marker file.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from epochal.testing import epochal_command

IMPOSTOR_PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "epochal-impostor"
version = "6.6.6"

[project.entry-points."epochal.plugins"]
tw_alpha = "epochal_impostor:Impostor"
"""

IMPOSTOR = """
import os
from pathlib import Path

Path(os.environ["IMPOSTOR_MARK"]).write_text("imported")


class Impostor:
    pass
"""


@pytest.fixture(scope="module")
def impostor_site(
    tmp_path_factory: pytest.TempPathFactory,
    throwaway_site: Path,
    pip_install_target: Callable[[Path, Path], None],
) -> Path:
    source = tmp_path_factory.mktemp("impostor")
    (source / "pyproject.toml").write_text(IMPOSTOR_PYPROJECT)
    (source / "epochal_impostor.py").write_text(IMPOSTOR)
    (source / "src").mkdir()
    site = source / "site"
    pip_install_target(source, site)
    return site


def run(
    tmp_path: Path, throwaway_site: Path, impostor_site: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    env = {
        "PYTHONPATH": os.pathsep.join([str(throwaway_site), str(impostor_site)]),
        "IMPOSTOR_MARK": str(tmp_path / "impostor-ran"),
        "EPOCHAL_TW_OUT": str(tmp_path / "events.jsonl"),
    }
    return epochal_command(*args, cwd=tmp_path, env=env)


def test_plugins_lists_both_distributions_and_imports_neither(
    tmp_path: Path, throwaway_site: Path, impostor_site: Path
) -> None:
    result = run(tmp_path, throwaway_site, impostor_site, "plugins", "--json", "--disable", "tw_cycle_a")
    assert result.returncode == 0, result.stderr

    info = next(i for i in json.loads(result.stdout) if i["name"] == "tw_alpha")
    assert info["status"] == "conflict"
    assert any("epochal-throwaway" in d for d in info["offered_by"])
    assert any("epochal-impostor 6.6.6" in d for d in info["offered_by"])
    assert "distribution = " in info["error"]
    assert info["distribution"] is None and info["version"] is None  # neither's, not a stray one
    assert not (tmp_path / "impostor-ran").exists()
    table = run(tmp_path, throwaway_site, impostor_site, "plugins", "--disable", "tw_cycle_a")
    assert "conflict" in table.stdout and "epochal-impostor" in table.stdout + table.stderr


def test_a_run_naming_a_conflicting_plugin_is_one_error_unless_it_chooses(
    tmp_path: Path, throwaway_site: Path, impostor_site: Path, write_config
) -> None:
    config = write_config(["tw_alpha"])
    result = run(tmp_path, throwaway_site, impostor_site, "run", str(config))
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "epochal-throwaway" in errors[0] and "epochal-impostor" in errors[0]
    assert "[plugins.tw_alpha] distribution = " in errors[0]
    assert not (tmp_path / "impostor-ran").exists()

    chosen = write_config(["tw_alpha"], extra='\n[plugins.tw_alpha]\ndistribution = "epochal-throwaway"\n')
    result = run(tmp_path, throwaway_site, impostor_site, "run", str(chosen))
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "impostor-ran").exists()  # the rival is never even imported
    assert (tmp_path / "events.jsonl").exists()  # the chosen one ran

    wrong = write_config(["tw_alpha"], extra='\n[plugins.tw_alpha]\ndistribution = "nobody"\n')
    result = run(tmp_path, throwaway_site, impostor_site, "run", str(wrong))
    assert result.returncode == 2 and "not by 'nobody'" in result.stderr


def test_batch_size_zero_is_a_one_line_error(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        '[loop]\nmax_epochs = 1\n[model]\nfactory = "epochal.examples.tiny:TinyModel"\n'
        '[data]\nfactory = "epochal.examples.tiny:tiny_data"\nbatch_size = 0\n'
        "[plugins]\nautoload = false\n"
    )
    result = epochal_command("run", str(config), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "batch_size" in result.stderr and "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, result.stderr
