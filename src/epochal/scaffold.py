"""``epochal new-plugin NAME``: a plugin distribution that installs, lists and tests at once."""

from __future__ import annotations

import re
from pathlib import Path

from epochal.errors import ConfigError

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

PYPROJECT = """\
[build-system]
requires = ["hatchling>=1.21"]
build-backend = "hatchling.build"

[project]
name = "{dist}"
version = "0.1.0"
description = "An epochal plugin: {name}"
readme = "README.md"
requires-python = ">=3.11"
dependencies = ["{core}", "click>=8.1"]  # click: the group register_commands(cli) receives

[project.optional-dependencies]
test = ["pytest>=8"]

[project.entry-points."epochal.plugins"]
{name} = "{package}.plugin:{cls}"

[tool.hatch.build.targets.wheel]
packages = ["src/{package}"]
"""

README = """\
# {dist}

An [epochal](https://github.com/epochal/epochal) plugin registering `{name}`: it counts the
training batches of every epoch and writes them to the training log as `{name}.batches`.

```sh
pip install -e ".[test]"
epochal plugins            # {name} is listed
pytest                     # its tests
epochal run example.toml --plugins {name} --set plugins.{name}.every_n_epochs=2
```

## Options (`[plugins.{name}]`)

| option | type | default | meaning |
|---|---|---|---|
| `key` | str | `"{name}.batches"` | the record it writes |

It only records, so it loads in every run once installed. If you make it stop runs, change
the learning rate or load weights, declare `autoload = False` in its class: the generated test
`test_the_autoload_rule` fails until you do.

Like every plugin's table, it also takes the shared trigger keys (`every_n_epochs = 2`,
`after_n_epochs`, `when = "valid.loss < 0.1"`, ...): epochal calls its hooks only then.
"""

PLUGIN = '''\
"""The `{name}` plugin for epochal."""

from __future__ import annotations

from typing import Any

from epochal import hookimpl


class {cls}:
    """Counts the training batches of each epoch and logs them as ``{name}.batches``.

    When it runs is the shared trigger keys' business (``every_n_epochs = 2`` in its table):
    no option of its own for that.

    :param key: the record it writes.
    """

    #: it writes a record in after_epoch: it runs with the measurements, before the plugins that
    #: save, decide or report the epoch (a checkpoint then holds this epoch's count)
    phase = "measure"
    # it only records, so it may load in every run once installed; a plugin that stops runs,
    # changes the learning rate or loads weights says autoload = False (the autoload rule,
    # checked by tests/test_{name}.py)

    def __init__(self, key: str = "{name}.batches") -> None:
        self.key = key
        self.batches = 0

    @hookimpl
    def before_epoch(self) -> None:
        """Called at the start of every epoch: start counting again."""
        self.batches = 0

    @hookimpl
    def after_batch(self) -> None:
        """Called after every training batch."""
        self.batches += 1

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        """Called after every epoch: write the count."""
        loop.log.current_row[self.key] = self.batches

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: the count of the epoch in progress."""
        return {{"batches": self.batches}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.batches = state["batches"]
'''

TEST = '''\
"""Tests of the `{name}` plugin, with epochal's pytest plugin."""

from __future__ import annotations

from epochal.testing import check_autoload_rule
from {package}.plugin import {cls}

pytest_plugins = ["epochal.testing"]


def test_logs_the_batches_of_every_epoch(epochal_run):
    result = epochal_run({{"{name}": {cls}()}}, max_epochs=2)
    assert result.log.history("{name}.batches") == [(4, 4), (8, 4)]


def test_key_option(epochal_run):
    result = epochal_run({{"{name}": {cls}(key="counted")}}, max_epochs=1)
    assert result.log.last("counted") == 4


def test_installed_entry_point_loads_by_name_with_a_trigger_key(epochal_run):
    # every_n_epochs is epochal's, as for every plugin: its epoch hooks run every 2nd epoch
    result = epochal_run(["{name}"], options={{"{name}": {{"every_n_epochs": 2}}}}, max_epochs=4)
    assert [iteration for iteration, _ in result.log.history("{name}.batches")] == [8, 16]


def test_the_autoload_rule():
    # installed, {name} runs in every run unless it declares autoload = False: then it must not
    # change what is trained (stop the run, change the learning rate, load weights). Give it
    # options that make it act.
    check_autoload_rule({cls}(), "{name}")
'''

EXAMPLE = """\
# A small run to try the plugin on (epochal's tiny numpy regression):
#   epochal run example.toml --plugins {name}
[loop]
max_epochs = 3
seed = 0
run_dir = "runs/example"

[model]
factory = "epochal.examples.tiny:TinyModel"

[data]
factory = "epochal.examples.tiny:tiny_data"
"""


def core_range() -> str:
    """The requirement on epochal a new plugin declares: this release series (``epochal>=0.1,<0.2``)."""
    from importlib.metadata import version

    major, minor = (int(part) for part in version("epochal").split(".")[:2])
    return f"epochal>={major}.{minor},<{major}.{minor + 1}"


def _installed_as(dist: str, package: str, name: str) -> str | None:
    """Why *dist* (distribution), *package* (import package) or *name* (plugin) are taken (None: free)."""
    import importlib.util
    from importlib import metadata

    replaced = "is installed already, and the new package would replace it when installed"
    try:
        metadata.distribution(dist)
        return f"the distribution {dist!r} {replaced}"
    except metadata.PackageNotFoundError:
        pass
    if importlib.util.find_spec(package) is not None:
        return f"the package {package!r} {replaced}"
    from epochal.discovery import installed

    entry = installed().get(name)
    if entry is None:
        return None
    return f"the plugin {name!r} (from {entry.distribution}) is installed already: the two would conflict"


def new_plugin(name: str, directory: Path) -> Path:
    """Write the plugin distribution for *name* into ``directory / epochal-NAME``; return it."""
    if not _NAME.match(name):
        raise ConfigError(
            f"plugin name {name!r} must start with a lowercase letter and hold only a-z, 0-9 and _"
        )
    dist = "epochal-" + name.replace("_", "-")
    package = "epochal_" + name
    cls = "".join(part.capitalize() for part in name.split("_"))  # loss_guard: LossGuard
    root = directory / dist
    if root.exists():
        raise ConfigError(f"{root} already exists; choose another name or --dir")
    taken = _installed_as(dist, package, name)
    if taken:
        raise ConfigError(f"plugin name {name!r}: {taken}; choose another name")
    values = {"name": name, "dist": dist, "package": package, "cls": cls, "core": core_range()}
    files = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        f"src/{package}/__init__.py": '"""The `{name}` epochal plugin."""\n',
        f"src/{package}/plugin.py": PLUGIN,
        f"tests/test_{name}.py": TEST,
        "example.toml": EXAMPLE,
    }
    for relative, template in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**values), encoding="utf-8")
    return root
