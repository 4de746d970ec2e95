"""The plugins' part of a saved state: each plugin's ``state_dict``, its version, migration.

A plugin that has ``state_dict()``/``load_state_dict(state)`` is saved with its class,
distribution, version and ``state_version``; a state saved with another ``state_version`` is
passed through the plugin's ``migrate_state(state, version)`` first. States of plugins that are
not part of the resumed run are kept (orphans) for the next save.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from epochal.errors import EpochalError
from epochal.protocol import declared


def capture(
    plugins: Mapping[str, object], infos: Iterable[Any], orphans: Mapping[str, Any]
) -> dict[str, Any]:
    """Every plugin's saved entry by name (the orphans' entries too).

    :param infos: the run's :class:`~epochal.plugins.PluginInfo` (distribution and version).
    """
    by_name = {info.name: info for info in infos}
    entries: dict[str, Any] = {}
    for name, plugin in plugins.items():
        get_state = getattr(plugin, "state_dict", None)
        if callable(get_state):
            info = by_name.get(name)
            entries[name] = {
                "class": f"{type(plugin).__module__}.{type(plugin).__qualname__}",
                "distribution": info.distribution if info else None,
                "version": info.version if info else None,
                "state_version": declared(plugin, "state_version"),
                "state": get_state(),
            }
    entries.update({name: entry for name, entry in orphans.items() if name not in entries})
    return entries


def restore(
    plugins: Mapping[str, object],
    entries: Mapping[str, Any],
    own: Mapping[str, Any],
    elsewhere: Iterable[str] = (),
) -> dict[str, Any]:
    """Load each plugin's saved state; return the entries no plugin of this run took (orphans).

    :param own: this process's own plugin states (several processes), preferred to the entries'.
    :param elsewhere: plugins that run on another rank only (no warning for their states).
    """
    orphans: dict[str, Any] = {}
    for name, entry in entries.items():
        plugin = plugins.get(name)
        load = getattr(plugin, "load_state_dict", None)
        if plugin is None or not callable(load):
            orphans[name] = entry
            continue
        state = own.get(name, entry["state"])
        version = declared(plugin, "state_version")
        saved = entry.get("state_version", 1)
        if saved != version:
            migrate = getattr(plugin, "migrate_state", None)
            if migrate is None:
                raise EpochalError(
                    f"plugin {name!r} saved state version {saved} but this version of it reads "
                    f"state version {version} and has no migrate_state"
                )
            state = migrate(state, saved)
        load(state)
    unknown = set(orphans) - set(elsewhere)
    if unknown:
        warnings.warn(
            "the loaded state holds state for plugin(s) not in this run, kept for the next "
            f"save: {', '.join(sorted(unknown))}",
            RuntimeWarning,
            stacklevel=3,
        )
    return orphans
