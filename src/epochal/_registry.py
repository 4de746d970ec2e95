"""Registering one plugin with pluggy safely: hook names and arguments checked first, no half state.

pluggy refuses a misspelled hook *argument* at ``register()`` but leaves the plugin's earlier
hooks registered and its name taken (pluggy #733), and notices a misspelled hook *name* only in
``check_pending()``. :func:`register` checks both before pluggy sees the plugin and undoes a
partial registration.

A plugin may add hook specifications that other plugins implement (pytest's
``pytest_addhooks``): its class or module sets ``epochal_hookspecs`` to a module or class whose
functions carry ``@epochal.hookspec``. :func:`added_hookspecs` collects them before any plugin of
the run is checked, so the order of the plugins does not matter.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import pluggy

from epochal import hookspecs
from epochal._dispatch import HOOK_ARGS
from epochal._markers import PROJECT
from epochal.errors import PluginError, did_you_mean
from epochal.protocol import declared


def _implementations(plugin: object) -> list[tuple[str, str]]:
    """``(attribute, hook)`` for every hook implementation on *plugin*, without calling it."""
    found = []
    for attr in dir(plugin):
        if attr.startswith("_"):
            continue
        try:
            value = inspect.getattr_static(plugin, attr)
        except AttributeError:
            continue
        opts = getattr(getattr(value, "__func__", value), f"{PROJECT}_impl", None)
        if isinstance(opts, dict):
            found.append((attr, opts.get("specname") or attr))
    return found


def hook_names(plugin: object) -> list[str]:
    """The hooks *plugin* (instance, class or module) implements."""
    return [hook for _, hook in _implementations(plugin)]


#: An added hook specification: the hook name → (the spec holder, its argument names).
AddedSpecs = Mapping[str, tuple[object, tuple[str, ...]]]


def added_hookspecs(plugins: Mapping[str, object]) -> dict[str, tuple[object, tuple[str, ...]]]:
    """The hooks that *plugins* (name → class, module or instance) add with ``epochal_hookspecs``.

    :raises PluginError: for a hook that is already specified (by the core or another plugin),
        or an ``epochal_hookspecs`` that specifies no hook.
    """
    added: dict[str, tuple[object, tuple[str, ...]]] = {}
    owners: dict[str, str] = {}
    for name, plugin in plugins.items():
        holder = declared(plugin, "epochal_hookspecs")
        if holder is None:
            continue
        specs = {
            attr: fn
            for attr in dir(holder)
            if not attr.startswith("_") and hasattr(fn := getattr(holder, attr), f"{PROJECT}_spec")
        }
        if not specs:
            raise PluginError(
                f"plugin {name!r}: epochal_hookspecs = {holder!r} specifies no hook "
                "(mark each hook function with @epochal.hookspec)"
            )
        for hook, fn in specs.items():
            if hook in HOOK_ARGS or hook in added:
                other = "epochal itself" if hook in HOOK_ARGS else f"plugin {owners[hook]!r}"
                raise PluginError(f"plugin {name!r} adds hook {hook!r}, which {other} already specifies")
            added[hook] = (holder, tuple(a for a in inspect.signature(fn).parameters if a != "self"))
            owners[hook] = name
    return added


def validate(name: str, plugin: object, added: AddedSpecs | None = None) -> None:
    """Raise :class:`PluginError` if *plugin* implements an unknown hook or argument.

    pluggy itself only notices a misspelled hook name in ``check_pending()``. *added* are the
    hooks other plugins of the run specify (:func:`added_hookspecs`).
    """
    known = {**HOOK_ARGS, **{hook: args for hook, (_, args) in (added or {}).items()}}
    problems = []
    for attr, hook in _implementations(plugin):
        if hook not in known:
            problems.append(f"unknown hook {hook!r}{did_you_mean(hook, known)}")
            continue
        function = getattr(plugin, attr)
        params = [
            p.name
            for p in inspect.signature(function).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        if params and params[0] == "self" and not inspect.ismethod(function):
            params = params[1:]
        extra = [a for a in params if a not in known[hook]]
        if extra:
            problems.append(
                f"hook {hook!r} has no argument(s) {', '.join(map(repr, extra))}"
                f"{did_you_mean(extra[0], known[hook])}; its arguments: {', '.join(known[hook])}"
            )
    if problems:
        raise PluginError(f"plugin {name!r} is refused: {'; '.join(problems)} (see `epochal hooks`)")


def new_plugin_manager(added: AddedSpecs | None = None) -> pluggy.PluginManager:
    """A pluggy manager that knows epochal's hook specifications (and the *added* ones)."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for holder in dict.fromkeys(holder for holder, _ in (added or {}).values()):
        pm.add_hookspecs(holder)  # type: ignore[arg-type]  # a module or class in practice
    return pm


def register(pm: pluggy.PluginManager, name: str, plugin: object, added: AddedSpecs | None = None) -> None:
    """Register *plugin* under *name*, or raise :class:`PluginError` leaving nothing behind.

    Refuses an implementation of an unknown hook (pluggy would only notice in
    ``check_pending``) and a hook argument the specification does not have.
    """
    validate(name, plugin, added)
    try:
        pm.register(plugin, name=name)
    except Exception as error:
        if pm.get_plugin(name) is plugin:  # pluggy leaves a partial registration (pluggy #733)
            pm.unregister(name=name)
        detail = str(error).strip().splitlines()
        raise PluginError(
            f"plugin {name!r} cannot be registered: {detail[-1] if detail else error}"
        ) from None
