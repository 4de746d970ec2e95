"""Finding the installed plugins without importing them, and importing the ones a run uses.

Plugins are entry points of the ``epochal.plugins`` group: :func:`installed` lists them from the
distributions' metadata, :func:`choose` picks one where several distributions offer a name, and
:func:`import_plugins` imports only the chosen ones through stevedore. Plugins may also add
subcommands to the ``epochal`` CLI (:func:`register_commands`, :func:`declared_command`).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from epochal._registry import added_hookspecs, hook_names, new_plugin_manager, register
from epochal.errors import PluginError

GROUP = "epochal.plugins"
ENV_NO_AUTOLOAD = "EPOCHAL_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "EPOCHAL_PLUGINS"


class PluginLoadWarning(UserWarning):
    """An autoloaded plugin failed to import or to start; the run goes on without it."""


@dataclass
class PluginInfo:
    """What ``epochal plugins`` reports about one plugin."""

    name: str
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None
    status: str = "available"  # loaded | disabled | failed | available | conflict | replaced
    error: str | None = None
    hooks: list[str] = field(default_factory=list)
    position: int | None = None
    parent: str | None = None
    #: every distribution offering this name when there are several (``distribution version (ep)``).
    offered_by: list[str] = field(default_factory=list)
    #: where it runs on several processes: ``all`` ranks or rank ``zero`` only (None: not loaded).
    rank: str | None = None
    #: False: it loads only when a run names it (its class attribute ``autoload``); None: not
    #: imported (disabled, failed, or not selected with autoloading off).
    autoload: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        """The info as a JSON-able dict."""
        return dict(vars(self))


@dataclass
class EntryPoint:
    """An installed entry point of the ``epochal.plugins`` group and its distribution."""

    name: str
    value: str
    distribution: str | None
    version: str | None
    #: other distributions' entry points of the same name (a conflict unless the run chooses).
    rivals: list[EntryPoint] = field(default_factory=list)
    #: the importlib entry point, to load exactly this one when the name has rivals.
    source: Any = field(default=None, repr=False, compare=False)

    def describe(self) -> str:
        """``distribution version (name = value)``."""
        return f"{self.distribution} {self.version or ''}".rstrip() + f" ({self.name} = {self.value})"


def installed() -> dict[str, EntryPoint]:
    """Every installed plugin entry point by name, without importing any plugin.

    When two distributions provide the same name, the first found is returned with the others
    in its ``rivals``: a run must choose one (``[plugins.NAME] distribution = "..."``, see
    :func:`choose`).
    """
    found: dict[str, EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=GROUP):
        dist = getattr(ep, "dist", None)
        entry = EntryPoint(
            ep.name,
            ep.value,
            dist.metadata["Name"] if dist is not None else None,
            dist.version if dist is not None else None,
            source=ep,
        )
        first = found.get(ep.name)
        if first is None:
            found[ep.name] = entry
        elif (first.value, first.distribution) != (entry.value, entry.distribution) and all(
            (r.value, r.distribution) != (entry.value, entry.distribution) for r in first.rivals
        ):
            first.rivals.append(entry)
    return found


def _normal(distribution: str | None) -> str:
    return re.sub(r"[-_.]+", "-", distribution or "").lower()


def choose(ep: EntryPoint, wanted: Any) -> EntryPoint:
    """The entry point of plugin *ep.name* that a run may use.

    :param wanted: the ``[plugins.NAME] distribution`` option (None: not given).
    :raises PluginError: when *wanted* names no distribution offering the name, or when several
        distributions offer it and *wanted* is not given (naming each of them).
    """
    offers = [ep, *ep.rivals]
    if wanted is not None:
        picked = [o for o in offers if _normal(o.distribution) == _normal(str(wanted))]
        if not picked:
            raise PluginError(
                f"[plugins.{ep.name}] distribution = {wanted!r}: plugin {ep.name!r} is offered by "
                f"{'; '.join(o.describe() for o in offers)}, not by {wanted!r}"
            )
        return replace(picked[0], rivals=[])
    if ep.rivals:
        raise PluginError(
            f"plugin name {ep.name!r} is offered by {len(offers)} distributions: "
            f"{'; '.join(o.describe() for o in offers)}; name the one this run uses with "
            f'[plugins.{ep.name}] distribution = "{ep.distribution}" (or uninstall the other)'
        )
    return ep


def env_list(name: str) -> list[str]:
    """A comma-separated list from environment variable *name* (empty when unset)."""
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def autoload_disabled() -> bool:
    """Whether ``EPOCHAL_DISABLE_PLUGIN_AUTOLOAD`` is set to a true value."""
    return os.environ.get(ENV_NO_AUTOLOAD, "").strip().lower() not in ("", "0", "false", "no")


def mark_failed(info: PluginInfo, message: str) -> None:
    info.status, info.error = "failed", message
    warnings.warn(message + "; the run goes on without it", PluginLoadWarning, stacklevel=3)


def import_plugins(
    names: list[str],
    available: Mapping[str, EntryPoint],
    explicit: set[str],
    infos: dict[str, PluginInfo],
    exact: Iterable[str] = (),
) -> dict[str, object]:
    """Import the entry points *names* through stevedore, isolating failures.

    A name in *exact* (chosen among several distributions) is loaded from its own entry point
    only: stevedore would import every entry point of that name, the rival's too.
    """
    if not names:
        return {}
    from stevedore import NamedExtensionManager  # imported only when a plugin is loaded

    exact = set(exact)
    failures: dict[str, BaseException] = {}
    chosen: dict[str, object] = {}
    for name in [n for n in names if n in exact]:
        try:
            chosen[name] = available[name].source.load()
        except Exception as problem:
            failures[name] = problem
    names = [n for n in names if n not in exact] + [n for n in names if n in exact]

    def on_failure(_manager: object, entry_point: Any, error: BaseException) -> None:
        failures[entry_point.name] = error

    manager: NamedExtensionManager[Any] = NamedExtensionManager(
        GROUP,
        names=[n for n in names if n not in exact],
        name_order=True,
        invoke_on_load=False,
        on_load_failure_callback=on_failure,
        on_missing_entrypoints_callback=lambda missing: None,
    )
    loaded: dict[str, object] = {ext.name: ext.plugin for ext in manager.extensions if ext.name not in exact}
    loaded.update(chosen)
    for name in names:
        if name in loaded:
            continue
        ep = available[name]
        error = failures.get(name)
        detail = f"{type(error).__name__}: {error}" if error else "not found by stevedore"
        message = (
            f"plugin {name!r} (entry point {name} = {ep.value!r} of distribution "
            f"{ep.distribution}) failed to load: {detail}"
        )
        if name in explicit:
            raise PluginError(message)
        mark_failed(infos[name], message)
    return loaded


#: entry points naming the command objects ``register_commands`` adds, by command name.
COMMANDS_GROUP = "epochal.commands"


def declared_command(name: str) -> Any | None:
    """The click command *name* as a plugin distribution declares it in the entry-point group
    ``epochal.commands`` (``log = "mydist.commands:log_group"``), importing only that
    module; None when no distribution or several declare it, when autoloading is off (then
    only the plugins in ``EPOCHAL_PLUGINS`` may add commands), or when it cannot be loaded (the
    caller then asks every plugin's ``register_commands``, which reports why)."""
    if autoload_disabled():
        return None
    found = [ep for ep in importlib.metadata.entry_points(group=COMMANDS_GROUP) if ep.name == name]
    if len({ep.value for ep in found}) != 1:
        return None
    try:
        command = found[0].load()
    except Exception:  # reported by the full path
        return None
    import click

    return command if isinstance(command, click.Command) and command.name == name else None


def register_commands(cli: Any) -> None:
    """Let installed plugins add subcommands to the ``epochal`` click group *cli*.

    Every installed plugin is asked (only those in ``EPOCHAL_PLUGINS`` when autoload is
    disabled). A plugin that fails to import or whose hook raises is reported as a warning and
    the other plugins' commands are still added.
    """
    from epochal._dispatch import each_implementation

    available = installed()
    names = env_list(ENV_PLUGINS) if autoload_disabled() else sorted(available)
    names = [name for name in names if name in available and not available[name].rivals]
    infos = {name: PluginInfo(name, available[name].distribution) for name in names}
    imported = import_plugins(names, available, set(), infos)
    try:
        added = added_hookspecs(imported)
    except PluginError as error:
        warnings.warn(str(error), PluginLoadWarning, stacklevel=2)
        added = {}
    pm = new_plugin_manager(added)
    for name, obj in imported.items():
        if "register_commands" not in hook_names(obj):
            continue
        try:
            impl = inspect.getattr_static(obj, "register_commands")
            if inspect.isclass(obj) and not isinstance(impl, (staticmethod, classmethod)):
                obj = obj()  # an instance method: the class must build with its defaults
            register(pm, name, obj, added)
        except Exception as error:
            mark_failed(infos[name], f"plugin {name!r} cannot add commands: {error}")
    for name, call in each_implementation(pm, "register_commands", cli=cli):
        try:
            call()
        except Exception as error:
            mark_failed(infos[name], f"plugin {name!r} raised in register_commands: {error!r}")
