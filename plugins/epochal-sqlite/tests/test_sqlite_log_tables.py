"""``epochal log`` as a person and a script read it: tables fitted to 80 columns, split rather
than cut; CSV for scripts; the runs of two configs of one project in one database."""

from __future__ import annotations

import csv
import io
import subprocess
from pathlib import Path

import pytest

from epochal.testing import digits_config, epochal_command

pytestmark = pytest.mark.usefixtures("no_epochal_env")
pytest_plugins = ["epochal.testing"]


def epochal(cwd: Path, *args: str, columns: int | None = None) -> subprocess.CompletedProcess[str]:
    done = epochal_command(*args, cwd=cwd, env={"COLUMNS": str(columns)} if columns else None)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project with two configs, each run once into its own runs/<name> directory."""
    cwd = tmp_path_factory.mktemp("project")
    for name, batch_size in (("small", 32), ("wide", 128)):
        plugins = ["monitor", "sqlite_log", "timing"]
        digits_config(cwd / f"{name}.toml", plugins, run_dir=f"runs/{name}", batch_size=batch_size)
        epochal(cwd, "run", f"{name}.toml")
    return cwd


def test_two_configs_share_the_project_log(project: Path) -> None:
    assert (project / "runs" / "epochal.sqlite").is_file()
    assert not (project / "runs" / "small" / "epochal.sqlite").exists()
    rows = list(csv.reader(io.StringIO(epochal(project, "log", "runs", "--csv").stdout)))
    assert rows[0][:3] == ["run_id", "status", "started"] and len(rows) == 3
    ids = [row[0] for row in rows[1:]]
    compared = list(csv.reader(io.StringIO(epochal(project, "log", "compare", *ids, "--csv").stdout)))
    assert compared[0] == ["key", "best is", *(f"{i} final" for i in ids), *(f"{i} best" for i in ids)]
    assert any(row[0] == "valid.accuracy" and row[1] == "max" for row in compared)


def test_wide_tables_are_split_not_cut_at_80_columns(project: Path) -> None:
    shown = epochal(project, "log", "show", "latest", "--timing", columns=80).stdout
    lines = shown.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    headers = [line for line in lines if line.startswith("iteration")]
    assert len(headers) > 1  # the 30-odd keys (timing's too) went into several tables, each led by iteration
    keys = (
        epochal(project, "log", "show", "latest", "--timing", "--csv").stdout.splitlines()[0].split(",")[2:]
    )
    for key in keys:
        assert key in shown, key  # every column is there, whole
    runs = epochal(project, "log", "runs", columns=80).stdout
    assert all(len(line) <= 80 for line in runs.splitlines())
    for column in ("run_id", "status", "started", "epochs", "iterations", "reason"):
        assert column in runs
    assert "max_epochs=2 reached" in runs
