"""epochal: a training loop whose every feature is a plugin.

The public surface: :class:`Loop` runs training; plugins implement the hooks of
:mod:`epochal.hookspecs` with :data:`hookimpl`; :class:`CompositePlugin` groups plugins;
:func:`load_plugins` builds a run's plugin set from the installed ``epochal.plugins`` entry
points; :mod:`epochal.triggers` says when a plugin should act.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epochal._markers import hookimpl, hookspec
    from epochal._options import checked_options
    from epochal.composite import CompositePlugin
    from epochal.empty import EmptyDataError
    from epochal.errors import ConfigError, EpochalError, OrderError, PluginError
    from epochal.log import TrainingLog
    from epochal.loop import Loop
    from epochal.model import Model
    from epochal.plugins import PluginSet, compose, load_plugins

    __version__: str

# Every name is imported when first used (PEP 562): `import epochal` (the CLI, every plugin
# module's `from epochal import hookimpl`) then costs only what is used, not pluggy, numpy and
# the plugin machinery. Name -> the module defining it.
_LAZY = {
    "hookimpl": "epochal._markers",
    "hookspec": "epochal._markers",
    "CompositePlugin": "epochal.composite",
    "checked_options": "epochal._options",
    "ConfigError": "epochal.errors",
    "EpochalError": "epochal.errors",
    "OrderError": "epochal.errors",
    "PluginError": "epochal.errors",
    "TrainingLog": "epochal.log",
    "EmptyDataError": "epochal.empty",
    "Loop": "epochal.loop",
    "Model": "epochal.model",
    "PluginSet": "epochal.plugins",
    "compose": "epochal.plugins",
    "load_plugins": "epochal.plugins",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value: Any = version("epochal")
        except PackageNotFoundError:  # pragma: no cover - running from a source tree
            value = "0.0.0"
    elif name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'epochal' has no attribute {name!r}")
    globals()[name] = value  # the next lookup finds it without calling __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "CompositePlugin",
    "ConfigError",
    "EmptyDataError",
    "EpochalError",
    "Loop",
    "Model",
    "OrderError",
    "PluginError",
    "PluginSet",
    "TrainingLog",
    "__version__",
    "checked_options",
    "compose",
    "hookimpl",
    "hookspec",
    "load_plugins",
]
