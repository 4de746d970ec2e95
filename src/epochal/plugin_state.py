"""The plugins' part of a saved state: each plugin's ``state_dict``, its version, migration.

A plugin that has ``state_dict()``/``load_state_dict(state)`` is saved with its class,
distribution, version and ``state_version``; a state saved with another ``state_version`` is
passed through the plugin's ``migrate_state(state, version)`` first. States of plugins that are
not part of the resumed run are kept (orphans) for the next save.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from epochal._dispatch import blame
from epochal.errors import EpochalError, PluginError
from epochal.protocol import declared


def capture(
    plugins: Mapping[str, object],
    infos: Iterable[Any],
    orphans: Mapping[str, Any],
    on_failure: Callable[[BaseException, str, str], bool] | None = None,
) -> dict[str, Any]:
    """Every plugin's saved entry by name (the orphans' entries too).

    :param infos: the run's :class:`~epochal.plugins.PluginInfo` (distribution and version).
    :param on_failure: the run's failure policy (:class:`~epochal.plugins.PluginSet`): a
        plugin whose ``state_dict()`` raises is blamed for it (``state_dict``, not the hook of
        the plugin that asked for the state); when *on_failure* isolates it, its state is left
        out, else the error is raised.
    """
    by_name = {info.name: info for info in infos}
    entries: dict[str, Any] = {}
    for name, plugin in list(plugins.items()):  # an isolated plugin leaves the mapping
        get_state = getattr(plugin, "state_dict", None)
        if callable(get_state):
            try:
                state = get_state()
            except Exception as error:
                blame(error, name, "state_dict")
                if on_failure is not None and on_failure(error, name, "state_dict"):
                    continue
                raise
            info = by_name.get(name)
            entries[name] = {
                "class": f"{type(plugin).__module__}.{type(plugin).__qualname__}",
                "distribution": info.distribution if info else None,
                "version": info.version if info else None,
                "state_version": declared(plugin, "state_version"),
                "state": state,
            }
    entries.update({name: entry for name, entry in orphans.items() if name not in entries})
    return entries


def _release(distribution: Any, version: Any) -> str | None:
    """``"epochal-x 1.2"``, where both are known (a local plugin has no version)."""
    return f"{distribution} {version}" if distribution and version else None


def _migrated(
    name: str, plugin: object, entry: Mapping[str, Any], state: Any, infos: Mapping[str, Any]
) -> Any:
    """*state* in the layout *plugin* reads: as saved, or through its ``migrate_state``.

    :raises EpochalError: naming the plugin, both versions and what to do, when the state was
        saved in a newer layout, or in an older one the plugin cannot migrate.
    """
    version = declared(plugin, "state_version")
    saved = entry.get("state_version", 1)
    if saved == version:
        return state
    info = infos.get(name)
    this = (_release(info.distribution, info.version) if info is not None else None) or "this run's"
    by = _release(entry.get("distribution"), entry.get("version"))
    what = f"cannot resume: plugin {name!r} saved its state in layout state_version = {saved}"
    what += f" (by {by})" if by else ""
    remedy = "resume with the version that saved it, or start afresh (without --resume)"
    migrate = getattr(plugin, "migrate_state", None)
    if saved > version:
        raise EpochalError(f"{what}, newer than the state_version = {version} that {this} reads: {remedy}")
    if not callable(migrate):
        raise EpochalError(
            f"{what}; {this} reads state_version = {version} and has no migrate_state(state, version) "
            f"to bring it up to date: {remedy}"
        )
    try:
        return migrate(state, saved)
    except Exception as error:
        raise EpochalError(
            f"{what}; {this} failed to migrate it to state_version = {version}: "
            f"{type(error).__name__}: {error}"
        ) from error


def restore(
    plugins: Mapping[str, object],
    entries: Mapping[str, Any],
    own: Mapping[str, Any],
    elsewhere: Iterable[str] = (),
    infos: Iterable[Any] = (),
) -> dict[str, Any]:
    """Load each plugin's saved state; return the entries no plugin of this run took (orphans).

    :param own: this process's own plugin states (several processes), preferred to the entries'.
    :param elsewhere: plugins that run on another rank only (no warning for their states).
    :param infos: the run's :class:`~epochal.plugins.PluginInfo` (named in errors).
    :raises EpochalError: when a plugin cannot read its saved state's layout (``state_version``).
    """
    by_name = {info.name: info for info in infos}
    orphans: dict[str, Any] = {}
    for name, entry in entries.items():
        plugin = plugins.get(name)
        load = getattr(plugin, "load_state_dict", None)
        if plugin is None or not callable(load):
            orphans[name] = entry
            continue
        state = _migrated(name, plugin, entry, own.get(name, entry["state"]), by_name)
        try:
            load(state)
        except Exception as error:  # the plugin's code, given a state it cannot read: name it
            by = _release(entry.get("distribution"), entry.get("version"))
            raise PluginError(
                f"cannot resume: plugin {name!r} failed to load its saved state"
                f"{f' (saved by {by})' if by else ''}: {type(error).__name__}: {error}; resume with "
                "the plugin's version that saved it, or start afresh (without --resume)"
            ) from error
    unknown = set(orphans) - set(elsewhere)
    if unknown:
        warnings.warn(
            "the loaded state holds state for plugin(s) not in this run, kept for the next "
            f"save: {', '.join(sorted(unknown))}",
            RuntimeWarning,
            stacklevel=3,
        )
    return orphans
