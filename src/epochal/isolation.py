"""Where a run's plugins write, moved into a directory of its own (``epochal check-resume``).

check-resume trains five runs of the user's configuration; each must write only into its own
temporary directory, or a resumed run could find the straight run's checkpoints (or the user's)
and report a match it did not earn. The run directory is moved; so is every option a plugin
declares to say where it writes (``writes_to = ("directory",)``). A plugin that saves
checkpoints without that declaration cannot be isolated, and the check refuses it rather than
guess; one that saves none keeps the old convention (its ``dir`` and ``path`` options move).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from epochal._registry import hook_names
from epochal.errors import ConfigError

#: the hooks of a plugin that saves and finds checkpoints: its output decides a resume.
SAVING_HOOKS = frozenset({"resume_state", "latest_checkpoint", "check_fresh_run"})
#: the options moved for a plugin that saves nothing and declares nothing (the old convention).
CONVENTIONAL = ("dir", "path")


def output_options(plugin_set: Any, leave_out: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """Plugin name → ``(options, defaults)``: the options of each plugin of *plugin_set* (but
    those in *leave_out*) that say where it writes, and their defaults.

    :raises ConfigError: naming a plugin that saves checkpoints (it implements one of
        :data:`SAVING_HOOKS`) but does not declare ``writes_to``: its output cannot be isolated.
    """
    from epochal._options import option_signature

    places: dict[str, Any] = {}
    for unit in plugin_set.units:
        if unit.name in leave_out:
            continue
        declared = unit.records[unit.name].writes_to
        if declared is None:
            members = [(unit.name, unit.plugin), *unit.members]
            unsaid = [
                name
                for name, plugin in members
                if SAVING_HOOKS & set(hook_names(plugin)) and unit.records[name].writes_to is None
            ]
            if unsaid:
                raise ConfigError(
                    f"check-resume cannot isolate plugin {unsaid[0]!r}: it saves checkpoints but does not "
                    "declare where it writes, so its runs could write into (and resume from) your real "
                    'directory. Its class must declare writes_to = ("OPTION",), the options that name '
                    "where it writes, or writes_to = () when it writes only under the run directory"
                )
            declared = CONVENTIONAL
        signature = option_signature(type(unit.plugin))
        defaults = {}
        if signature is not None:
            defaults = {
                key: p.default
                for key, p in signature.parameters.items()
                if key in declared and p.default is not p.empty
            }
        places[unit.name] = (tuple(declared), defaults)
    return places


def isolated(config: Mapping[str, Any], run_dir: Path, places: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of *config* whose run directory is *run_dir* and whose plugins write under it:
    each option of *places* (:func:`output_options`) set in the plugin's table, or defaulting
    to a place of its own (a string), becomes ``run_dir / PLUGIN / its last part``.

    :raises ConfigError: for an option whose value is no path or URL (nothing to move).
    """
    copied: dict[str, Any] = copy.deepcopy(dict(config))
    copied.setdefault("loop", {})["run_dir"] = str(run_dir)
    tables = copied.get("plugins", {})
    for name, (options, defaults) in places.items():
        table = tables.get(name)
        for key in options:
            given = isinstance(table, dict) and key in table
            value = table[key] if given else defaults.get(key)
            if value is None:
                continue  # unset: the plugin writes under the run directory, moved already
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(
                    f"check-resume cannot isolate plugin {name!r}: its option {key} = {value!r} is no "
                    "path or URL to move into the check's temporary directory"
                )
            last = PurePosixPath(value.rstrip("/").split("://")[-1]).name or key
            if not isinstance(table, dict):
                table = copied.setdefault("plugins", {})[name] = {}
                tables = copied["plugins"]
            place = run_dir / name.replace("/", "_")
            place.mkdir(parents=True, exist_ok=True)  # as the user's own place had a parent
            table[key] = str(place / last)
    return copied


def moved_options(moved: Mapping[str, Any], places: Mapping[str, Any]) -> list[str]:
    """``--set`` arguments (``plugins.NAME.KEY=VALUE``) that give a run on the command line the
    plugin options :func:`isolated` moved."""
    import json

    sets = []
    for name, (options, _) in places.items():
        table = moved.get("plugins", {}).get(name, {})
        sets += [f"plugins.{name}.{key}={json.dumps(table[key])}" for key in options if key in table]
    return sets
