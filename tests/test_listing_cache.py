"""The cache of ``epochal plugins``: a hit prints exactly what building the listing prints, and
installing, upgrading, removing or editing a plugin (pip-installed for real) invalidates it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from epochal import _listing_cache
from epochal.plugins import PluginInfo
from epochal.testing import epochal_command

pytestmark = pytest.mark.usefixtures("no_epochal_env")
pytest_plugins = ["epochal.testing"]

PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "{version}"
requires-python = ">=3.11"
dependencies = ["epochal>=99"]  # made for another epochal: `epochal plugins` warns

[project.entry-points."epochal.plugins"]
{name} = "{package}.plugin:Plugin"

[tool.setuptools.packages.find]
where = ["src"]
"""

PLUGIN = """\
import os

from epochal import hookimpl

# every import of this module leaves a line: a listing served from the cache imports nothing
if os.environ.get("LISTING_TEST_IMPORTS"):
    with open(os.environ["LISTING_TEST_IMPORTS"], "a") as marks:
        marks.write(__name__ + "\\n")


class Plugin:
    rank = "zero"

    @hookimpl
    def after_epoch(self, loop):
        pass
"""

FORMS = [(), ("--json",), ("--csv",), ("--order",), ("--order", "--json")]


class Site:
    """A folder on PYTHONPATH that plugin distributions are pip-installed into, and the runs of
    ``python -m epochal`` that see it (with their own cache folder)."""

    def __init__(self, root: Path, pip_install: Callable[[Path, Path], None]):
        self.root = root
        self._pip_install = pip_install
        self.site = root / "site"
        self.site.mkdir()
        self.cache = root / "cache"
        self.marks = root / "imports.txt"
        self.cwd = root / "work"
        self.cwd.mkdir()

    def source(self, name: str, version: str = "1.0") -> Path:
        """The source tree of a plugin distribution ``epochal-NAME`` offering plugin *name*."""
        package = f"epochal_{name}"
        source = self.root / "sources" / f"{name}-{version}"
        (source / "src" / package).mkdir(parents=True)
        (source / "pyproject.toml").write_text(
            PYPROJECT.format(dist=f"epochal-{name}", version=version, name=name, package=package)
        )
        (source / "src" / package / "__init__.py").write_text("")
        (source / "src" / package / "plugin.py").write_text(PLUGIN)
        return source

    def install(self, name: str, version: str = "1.0") -> None:
        self._pip_install(self.source(name, version), self.site)

    def uninstall(self, name: str) -> None:
        """What ``pip uninstall`` does (it refuses a --target folder): remove every file the
        distribution's RECORD lists, then its metadata folder."""
        (record,) = self.site.glob(f"epochal_{name}-*.dist-info/RECORD")
        for line in record.read_text().splitlines():
            path = self.site / line.split(",")[0]
            if path.is_file():
                path.unlink()
        shutil.rmtree(self.site / f"epochal_{name}", ignore_errors=True)
        shutil.rmtree(record.parent)

    def plugin_file(self, name: str) -> Path:
        return self.site / f"epochal_{name}" / "plugin.py"

    def epochal(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        environ = {
            "PYTHONPATH": str(self.site),
            "XDG_CACHE_HOME": str(self.cache),
            "LISTING_TEST_IMPORTS": str(self.marks),
            **(env or {}),
        }
        return epochal_command(*args, cwd=self.cwd, env=environ, timeout=120)

    def imports(self) -> int:
        """How many times the test plugins' modules were imported so far."""
        return len(self.marks.read_text().splitlines()) if self.marks.exists() else 0

    def cache_files(self) -> list[Path]:
        return sorted((self.cache / "epochal").glob("plugins-*.json"))


@pytest.fixture
def site(tmp_path: Path, pip_install_target: Callable[[Path, Path], None]) -> Site:
    found = Site(tmp_path, pip_install_target)
    found.install("cachealpha")
    return found


def same(a: subprocess.CompletedProcess[str], b: subprocess.CompletedProcess[str]) -> None:
    assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr)


def listing(site: Site, *args: str) -> Any:
    result = site.epochal("plugins", "--json", *args)
    assert result.returncode == 0, result.stderr
    return {info["name"]: info for info in json.loads(result.stdout)}


def test_a_hit_prints_exactly_what_building_the_listing_prints(site: Site) -> None:
    for form in FORMS:
        built = site.epochal("plugins", "--no-cache", *form)
        assert built.returncode == 0, built.stderr
        first = site.epochal("plugins", *form)  # builds the listing and stores it
        imports = site.imports()
        hit = site.epochal("plugins", *form)
        assert site.imports() == imports, f"epochal plugins {' '.join(form)} imported a plugin: no hit"
        same(built, first)
        same(built, hit)
    table = site.epochal("plugins")
    assert "cachealpha" in table.stdout and "epochal-cachealpha 1.0" in table.stdout
    # the warning about a distribution made for another epochal is replayed from the cache
    assert "warning: epochal-cachealpha supports epochal>=99" in table.stderr
    assert len(site.cache_files()) == 1


def test_installing_upgrading_and_removing_a_plugin_invalidate_the_cache(site: Site) -> None:
    assert set(listing(site)) >= {"cachealpha"}
    site.install("cachebeta")
    after_install = listing(site)
    assert after_install["cachebeta"]["distribution"] == "epochal-cachebeta"
    assert after_install["cachebeta"]["status"] == "loaded"

    listing(site)  # a hit, then an upgrade as pip makes it in an environment: out, then in
    site.uninstall("cachebeta")
    site.install("cachebeta", version="2.0")
    assert listing(site)["cachebeta"]["version"] == "2.0"

    listing(site)
    site.uninstall("cachebeta")
    after_removal = listing(site)
    assert "cachebeta" not in after_removal and "cachealpha" in after_removal
    same(site.epochal("plugins"), site.epochal("plugins", "--no-cache"))


def test_editing_an_installed_plugin_invalidates_the_cache(site: Site) -> None:
    assert listing(site)["cachealpha"]["hooks"] == ["after_epoch"]
    listing(site)
    imports = site.imports()
    plugin = site.plugin_file("cachealpha")
    code = plugin.read_text().replace(
        "    @hookimpl\n    def after_epoch", "    @hookimpl\n    def before_epoch(self, loop):\n"
        "        pass\n\n    @hookimpl\n    def after_epoch"
    )  # fmt: skip
    plugin.write_text(code.replace('rank = "zero"', 'rank = "all"'))
    edited = listing(site)["cachealpha"]
    assert site.imports() > imports
    assert edited["hooks"] == ["after_epoch", "before_epoch"]
    assert edited["rank"] == "all"
    same(site.epochal("plugins", "--order"), site.epochal("plugins", "--order", "--no-cache"))

    # a new module in the plugin's package (the folder is stamped too)
    (plugin.parent / "extra.py").write_text("")
    imports = site.imports()
    listing(site)
    assert site.imports() > imports


def test_the_environment_is_part_of_the_key(site: Site) -> None:
    everything = listing(site)
    only = site.epochal("plugins", "--json", env={"EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    built = site.epochal("plugins", "--json", "--no-cache", env={"EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    same(only, built)
    assert json.loads(only.stdout) != list(everything.values())
    assert all(info["status"] == "available" for info in json.loads(only.stdout))
    assert listing(site) == everything


def test_a_broken_or_unwritable_cache_is_ignored_and_rebuilt(site: Site) -> None:
    built = site.epochal("plugins", "--no-cache")
    site.epochal("plugins")
    (cache,) = site.cache_files()
    valid = json.loads(cache.read_text())
    broken = [
        "not json {",
        "",
        json.dumps({"key": valid["key"]}),  # no stamps
        json.dumps({**valid, "listing": {"infos": [{"name": 1}], "order": {}, "warnings": []}}),
        json.dumps({**valid, "stamps": "abc"}),
    ]
    for text in broken:
        cache.write_text(text)
        same(site.epochal("plugins"), built)
        assert json.loads(cache.read_text())["listing"] == valid["listing"]  # rebuilt
    cache.unlink()
    cache.mkdir()  # a folder where the file should be: cannot be read nor replaced
    same(site.epochal("plugins"), built)
    same(site.epochal("plugins"), built)
    shutil.rmtree(site.cache)
    site.cache.write_text("a file where the cache folder should be")
    same(site.epochal("plugins"), built)


def test_no_cache_and_epochal_no_cache_neither_read_nor_write(site: Site) -> None:
    built = site.epochal("plugins", "--json", "--no-cache")
    assert site.cache_files() == []
    site.epochal("plugins", "--json", env={"EPOCHAL_NO_CACHE": "1"})
    assert site.cache_files() == []
    site.epochal("plugins", "--json")
    (cache,) = site.cache_files()
    # a cache file whose listing says something else (its stamps still hold): read only without
    # the switches, which proves that a hit serves the file and that the switches skip it
    data = json.loads(cache.read_text())
    for info in data["listing"]["infos"]:
        if info["name"] == "cachealpha":
            info["version"] = "9.9-from-the-cache"
    cache.write_text(json.dumps(data))
    assert listing(site)["cachealpha"]["version"] == "9.9-from-the-cache"
    imports = site.imports()
    same(site.epochal("plugins", "--json", "--no-cache"), built)
    same(site.epochal("plugins", "--json", env={"EPOCHAL_NO_CACHE": "1"}), built)
    assert site.imports() == imports + 2


def test_a_listing_with_run_choices_or_a_failed_plugin_is_not_cached(site: Site) -> None:
    for args in (("--disable", "cachealpha"), ("--plugins", "cachealpha"), ("--only", "cachealpha")):
        result = site.epochal("plugins", *args)
        assert result.returncode == 0, result.stderr
    assert site.cache_files() == []
    (site.plugin_file("cachealpha")).write_text("raise RuntimeError('broken on purpose')\n")
    for _ in range(2):
        result = site.epochal("plugins")
        assert result.returncode == 0, result.stderr
        assert "cachealpha: plugin 'cachealpha'" in result.stderr and "broken on purpose" in result.stderr
    assert site.cache_files() == []


def test_the_cache_lives_under_xdg_cache_home(site: Site, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    site.epochal("plugins", env={"XDG_CACHE_HOME": str(other)})
    assert len(list((other / "epochal").glob("plugins-*.json"))) == 1


def test_the_cache_checks_every_field_of_a_listed_plugin() -> None:
    assert list(_listing_cache.FIELDS) == list(PluginInfo("x").as_dict())


@pytest.mark.skipif(sys.platform in ("darwin", "win32"), reason="the XDG layout of Linux and the BSDs")
def test_the_cache_folder_follows_xdg_cache_home_when_it_is_absolute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
    assert _listing_cache.cache_dir() == "/somewhere/cache/epochal"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored, as XDG says
    monkeypatch.setenv("HOME", "/home/someone")
    assert _listing_cache.cache_dir() == "/home/someone/.cache/epochal"
