"""epochal: a training loop whose every feature is a plugin.

The public surface: :class:`Loop` runs training; plugins implement the hooks of
:mod:`epochal.hookspecs` with :data:`hookimpl`; :class:`CompositePlugin` groups plugins;
:func:`load_plugins` builds a run's plugin set from the installed ``epochal.plugins`` entry
points; :mod:`epochal.triggers` says when a plugin should act.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from epochal._markers import hookimpl, hookspec
from epochal.composite import CompositePlugin
from epochal.errors import ConfigError, EpochalError, OrderError, PluginError
from epochal.log import TrainingLog
from epochal.plugins import PluginSet, compose, load_plugins

if TYPE_CHECKING:
    from epochal.loop import EmptyDataError, Loop, Model


def __getattr__(name: str) -> Any:
    # The loop imports numpy; importing it lazily keeps `from epochal import hookimpl` (every
    # plugin module) and the CLI's listing commands fast.
    if name in ("EmptyDataError", "Loop", "Model"):
        from epochal import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'epochal' has no attribute {name!r}")


try:
    __version__ = version("epochal")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

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
    "compose",
    "hookimpl",
    "hookspec",
    "load_plugins",
]
