"""The core reaches plugins only through hooks: no import, file name or attribute of a plugin.

import-linter (``tox -e lint``) checks the imports; this test checks what it cannot see: the
standard plugins' file names (``ckpt-*``, ``latest``, ``.sqlite``) and attributes
(``db_path``, ``resumed_path``, ``loaded``, ``directory(``) and their names in ``plugins.get``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "src" / "epochal"
PLUGIN_NAMES = (
    "checkpoint",
    "load",
    "monitor",
    "progress",
    "printing",
    "timing",
    "early_stopping",
    "finish_after",
    "sqlite_log",
    "lr_scheduler",
    "tensorboard",
    "mlflow",
)
LEAKS = {
    "a plugin distribution's module": re.compile(
        r"\bepochal_(checkpoint|earlystop|mlflow|monitor|printing|progress|schedule|sqlite|tensorboard"
        r"|timing|guarded)\b"
    ),
    "the checkpoint plugin's file names": re.compile(r"""["']ckpt-|glob\(["']ckpt"""),
    "a plugin's attribute": re.compile(r"\.(db_path|resumed_path|loaded|_checkpoints|_database)\b"),
    "a plugin looked up by name": re.compile(
        r"""plugins(\.get\(|\[)["']({})["']""".format("|".join(PLUGIN_NAMES))
    ),
}
#: the scaffold writes a new plugin distribution's files: naming epochal_<name> is its job.
EXEMPT = {"scaffold.py"}


def core_files() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py") if p.name not in EXEMPT)


@pytest.mark.parametrize("what", sorted(LEAKS))
def test_no_core_module_names_a_plugin(what: str) -> None:
    pattern = LEAKS[what]
    found = [
        f"{path.relative_to(CORE)}:{number}: {line.strip()}"
        for path in core_files()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]
    assert not found, f"the core names {what}:\n" + "\n".join(found)


def test_the_scan_finds_what_it_looks_for() -> None:
    # the patterns match the lines the core had before the plugins spoke through hooks
    before = [
        "    from epochal_checkpoint import storage",
        '    found = sorted(p.name for p in directory.glob("ckpt-*") if p.is_dir())',
        '    path = getattr(loop.plugins.get("sqlite_log"), "db_path", None)',
        '        plugin = loop.plugins.get("checkpoint")',
    ]
    assert all(any(p.search(line) for p in LEAKS.values()) for line in before)
