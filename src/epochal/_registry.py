"""Registering one plugin with pluggy safely: hook names and arguments checked first, no half state.

pluggy refuses a misspelled hook *argument* at ``register()`` but leaves the plugin's earlier
hooks registered and its name taken (pluggy #733), and notices a misspelled hook *name* only in
``check_pending()``. :func:`register` checks both before pluggy sees the plugin and undoes a
partial registration.
"""

from __future__ import annotations

import inspect

import pluggy

from epochal import hookspecs
from epochal._dispatch import HOOK_ARGS
from epochal._markers import PROJECT
from epochal.errors import PluginError, did_you_mean


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


def validate(name: str, plugin: object) -> None:
    """Raise :class:`PluginError` if *plugin* implements an unknown hook or argument.

    pluggy itself only notices a misspelled hook name in ``check_pending()``.
    """
    problems = []
    for attr, hook in _implementations(plugin):
        if hook not in HOOK_ARGS:
            problems.append(f"unknown hook {hook!r}{did_you_mean(hook, HOOK_ARGS)}")
            continue
        function = getattr(plugin, attr)
        params = [
            p.name
            for p in inspect.signature(function).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        if params and params[0] == "self" and not inspect.ismethod(function):
            params = params[1:]
        extra = [a for a in params if a not in HOOK_ARGS[hook]]
        if extra:
            problems.append(
                f"hook {hook!r} has no argument(s) {', '.join(map(repr, extra))}"
                f"{did_you_mean(extra[0], HOOK_ARGS[hook])}; its arguments: {', '.join(HOOK_ARGS[hook])}"
            )
    if problems:
        raise PluginError(f"plugin {name!r} is refused: {'; '.join(problems)} (see `epochal hooks`)")


def new_plugin_manager() -> pluggy.PluginManager:
    """A pluggy manager that knows epochal's hook specifications."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def register(pm: pluggy.PluginManager, name: str, plugin: object) -> None:
    """Register *plugin* under *name*, or raise :class:`PluginError` leaving nothing behind.

    Refuses an implementation of an unknown hook (pluggy would only notice in
    ``check_pending``) and a hook argument the specification does not have.
    """
    validate(name, plugin)
    try:
        pm.register(plugin, name=name)
    except Exception as error:
        if pm.get_plugin(name) is plugin:  # pluggy leaves a partial registration (pluggy #733)
            pm.unregister(name=name)
        detail = str(error).strip().splitlines()
        raise PluginError(
            f"plugin {name!r} cannot be registered: {detail[-1] if detail else error}"
        ) from None
