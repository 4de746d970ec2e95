"""What the CLI tells a person besides a run: tables fitted to the terminal, hooks as plain
text, install lines that work from this repository, plugin distributions' epochal ranges, and
docs/cli.md listing every command."""

from __future__ import annotations

import configparser
import re
import sys
import tomllib
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from epochal.testing import EpochalCli, epochal_command

pytest_plugins = ["epochal.testing"]
pytestmark = pytest.mark.usefixtures("no_epochal_env")

ROOT = Path(__file__).resolve().parents[1]


def test_plugins_table_fits_80_columns_and_csv_is_whole(epochal_cli: EpochalCli) -> None:
    table = epochal_cli("plugins", env={"COLUMNS": "80"})
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines and all(len(line) <= 80 for line in lines)
    assert re.match(r"name\s+#\s+status\s+loads\s+distribution", lines[0])
    assert "after_evaluation" in table.stdout  # hooks wrapped or split off, never cut
    wide = epochal_cli("plugins")  # a pipe: as wide as the rows
    assert any(len(line) > 80 for line in wide.stdout.splitlines())
    rows = epochal_cli("plugins", "--csv").stdout.splitlines()
    assert rows[0] == "position,name,status,distribution,version,hooks,rank,autoload"
    assert any(row.split(",")[1] == "checkpoint" and "resume_state" in row for row in rows)


def test_hooks_are_plain_text(epochal_cli: EpochalCli) -> None:
    result = epochal_cli("hooks")
    assert result.returncode == 0, result.stderr
    for markup in (":func:", ":class:", ":param", "``", ":meth:"):
        assert markup not in result.stdout, markup
    assert "on_resumption() follows" in result.stdout
    assert re.search(r"^\s+resume: true when the user asked to resume \(--resume\)", result.stdout, re.M)


def test_plugin_distributions_declare_the_core_range() -> None:
    core = version("epochal")
    for pyproject in [*ROOT.glob("plugins/*/pyproject.toml"), *ROOT.glob("examples/*/pyproject.toml")]:
        project = tomllib.loads(pyproject.read_text())["project"]
        (epochal,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "epochal"]
        assert epochal.specifier, f"{pyproject}: epochal without a version range"
        assert epochal.specifier.contains(core), (pyproject, str(epochal.specifier), core)
        assert not epochal.specifier.contains("1.0"), f"{pyproject}: no upper bound"


def test_a_plugin_made_for_another_epochal_is_warned_about(
    tmp_path: Path, pip_install_target: Callable[[Path, Path], None]
) -> None:
    source = tmp_path / "future"
    (source / "epochal_future").mkdir(parents=True)
    (source / "epochal_future" / "__init__.py").write_text(
        "from epochal import hookimpl\n\n\nclass Future:\n    @hookimpl\n"
        "    def after_epoch(self):\n        pass\n"
    )
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "epochal-future"\nversion = "9.0.0"\ndependencies = ["epochal>=9,<10"]\n'
        '[project.entry-points."epochal.plugins"]\nfuture = "epochal_future:Future"\n'
    )
    site = tmp_path / "site"
    pip_install_target(source, site)
    listed = epochal_command("plugins", cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert listed.returncode == 0, listed.stderr
    assert "future" in listed.stdout
    warning = [line for line in listed.stderr.splitlines() if "epochal-future" in line]
    assert warning == [
        f"warning: epochal-future supports epochal<10,>=9, but epochal {version('epochal')} is installed: "
        f"it may fail; install a epochal-future release made for epochal {version('epochal')}"
    ]
    assert "warning" not in epochal_command("plugins", cwd=tmp_path).stderr  # ours all fit


def _install_lines() -> list[tuple[Path, str]]:
    found = []
    for page in [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("plugins/*/README.md")]:
        if "reference" in page.parts:
            continue
        for line in page.read_text().splitlines():
            for command in re.findall(r"pip install ([^`#&;\n]+)", line):  # up to the command's end
                found.append((page, command.strip()))
    return found


#: what a line may install that is not in this repository: from an index, by that name.
FROM_AN_INDEX = {
    "tox",
    "torch==2.13.0",
    "build",
    "twine",
    "matplotlib",
    "hypothesis",
    "hatchling",
    "setuptools",
    "wheel",
}


def _braces(word: str) -> list[str]:
    """A shell's brace expansion of one ``{a,b}`` group: ``x-{a,b}/`` → ``x-a/``, ``x-b/``."""
    match = re.search(r"\{([^{}]*)\}", word)
    if match is None:
        return [word]
    return [word[: match.start()] + part + word[match.end() :] for part in match.group(1).split(",")]


def test_every_install_line_names_something_installable_from_here() -> None:
    lines = _install_lines()
    assert len(lines) >= 10
    for page, command in lines:
        words = [
            w.rstrip(".;,)").strip("\"'").removeprefix("./")
            for w in command.split()
            if not w.startswith("-") and "://" not in w and "$" not in w  # "$d": a shell loop's variable
        ]
        for word in (expanded for listed in words for expanded in _braces(listed)):
            target = re.sub(r"\[[a-z0-9_,-]+\]$", "", word)
            if target in FROM_AN_INDEX or target.startswith("epochal-loss-guard"):
                continue  # the scaffold's example distribution, built by the reader (writing-plugins.md)
            paths = list(ROOT.glob(target)) if "*" in target else [ROOT / target]
            assert paths and all(p.exists() for p in paths), f"{page.name}: pip install {command}: {target}"


def test_the_plot_hint_names_an_install_that_works() -> None:
    commands = (ROOT / "plugins/epochal-sqlite/src/epochal_sqlite/commands.py").read_text()
    assert "pip install epochal-sqlite[plot]" not in commands
    assert "./plugins/epochal-sqlite[plot]" in commands
    extra = tomllib.loads((ROOT / "plugins/epochal-sqlite/pyproject.toml").read_text())["project"]
    assert "plot" in extra["optional-dependencies"]
    examples = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(Requirement(r).name == "matplotlib" for r in examples["examples"])  # the quick start plots


def test_the_torch_extra_and_the_test_pin_agree() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (torch,) = [r for r in map(Requirement, extras["torch"]) if r.name == "torch"]
    tox = configparser.ConfigParser(interpolation=None)
    tox.read_string((ROOT / "tox.ini").read_text())
    pins = []
    for name in tox.sections():
        section = tox[name]
        # an environment that installs the core with its torch extra, or the tests' own: its pin
        # must satisfy the extra (the ports' environment installs the core alone, on newer torch)
        installs_extra = "[torch]" in section.get("commands_pre", "") or "torch" in section.get("extras", "")
        if name == "testenv" or installs_extra:
            pins += re.findall(r"^\s*torch==([0-9.]+)\s*$", section.get("deps", ""), re.M)
    assert len(pins) >= 2 and all(torch.specifier.contains(pin) for pin in pins), (str(torch.specifier), pins)
    readme = (ROOT / "README.md").read_text()
    assert f"pip install torch=={pins[0]} --index-url https://download.pytorch.org/whl/cpu" in readme


def test_docs_cli_lists_every_command_as_click_has_them() -> None:
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import gen_reference
    finally:
        sys.path.remove(str(ROOT / "docs"))
    page = (ROOT / "docs" / "cli.md").read_text()
    assert gen_reference.cli_page_with_table(page) == page, (
        "docs/cli.md is stale: python docs/gen_reference.py"
    )
    paths = [path for path, _, _ in gen_reference.commands()]
    for expected in ("epochal run", "epochal log runs", "epochal log show", "epochal log compare"):
        assert expected in paths
    for path in paths:
        assert f"| `{path}" in page
    assert "`--only`" in page and "`--profile`" in page


def test_no_hint_names_a_distribution_no_index_has() -> None:
    for source in [*ROOT.glob("src/epochal/*.py"), *ROOT.glob("plugins/*/src/*/*.py")]:
        text = source.read_text()
        assert not re.search(r"pip install ['\"]?epochal-", text), source


def test_resume_without_a_checkpoint_plugin_names_the_install(
    tmp_path: Path, epochal_cli: EpochalCli
) -> None:
    from epochal.testing import digits_config

    digits_config(tmp_path / "run.toml", ["monitor"], max_epochs=1)
    result = epochal_cli("run", "run.toml", "--resume")
    assert result.returncode == 2
    assert "pip install plugins/epochal-checkpoint" in result.stderr
