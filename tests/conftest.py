"""Shared fixtures: the throwaway plugin distribution, pip-installed into a temp dir."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from epochal.testing import epochal_command

HERE = Path(__file__).parent


Install = Callable[[Path, Path], None]


@pytest.fixture(scope="session", autouse=True)
def cache_in_a_temp_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``epochal plugins`` caches its listing under ``$XDG_CACHE_HOME``: the tests' commands
    keep theirs in a temp folder, not in the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield


@pytest.fixture(scope="session")
def pip_install_target() -> Install:
    """``install(source, target)``: pip-install the distribution at *source* into the directory
    *target* (put it on PYTHONPATH), without dependencies, as a third-party package would be."""

    def install(source: Path, target: Path) -> None:
        subprocess.run(
            [
                sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                "--disable-pip-version-check", "--target", str(target), str(source),
            ],
            check=True,
            capture_output=True,
        )  # fmt: skip

    return install


@pytest.fixture(scope="session")
def throwaway_site(tmp_path_factory: pytest.TempPathFactory, pip_install_target: Install) -> Path:
    """A directory holding the throwaway distribution installed by pip (put it on PYTHONPATH)."""
    root = tmp_path_factory.mktemp("throwaway")
    source = root / "src"
    shutil.copytree(HERE / "throwaway", source)
    site = root / "site"
    pip_install_target(source, site)
    assert list(site.glob("epochal_throwaway-1.2.3.dist-info/entry_points.txt"))
    return site


Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def throwaway_cli(throwaway_site: Path, tmp_path: Path) -> Run:
    """Run ``python -m epochal ARGS`` in tmp_path with the throwaway plugins installed."""

    def run(
        *args: str, env: dict[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        extra = {"PYTHONPATH": str(throwaway_site), "EPOCHAL_TW_OUT": str(tmp_path / "events.jsonl")}
        return epochal_command(*args, cwd=tmp_path, env={**extra, **(env or {})}, timeout=timeout)

    return run


@pytest.fixture
def events(tmp_path: Path) -> Callable[[], list[dict[str, Any]]]:
    """Read the hook calls the throwaway plugins recorded."""

    def read() -> list[dict[str, Any]]:
        path = tmp_path / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    return read


TINY_CONFIG = """
[loop]
max_epochs = 2
seed = 0

[model]
factory = "epochal_throwaway.model:make_model"

[data]
factory = "epochal_throwaway.model:make_data"
n = 16
batch_size = 4

[plugins]
order = {order}
autoload = false
"""


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[..., Path]:
    """Write a tiny run config into tmp_path; `extra` is appended TOML."""

    def write(order: list[str] | None = None, extra: str = "", name: str = "run.toml") -> Path:
        path = tmp_path / name
        path.write_text(TINY_CONFIG.format(order=json.dumps(order or [])) + extra)
        return path

    return write
