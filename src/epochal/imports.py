"""Importing what a run configuration names: ``"module:attr"`` specs, and where modules are found.

A leaf module (it imports nothing of epochal's but its errors): the configuration, the option
converter and the triggers all resolve names through it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from epochal.errors import ConfigError, did_you_mean

__all__ = ["add_import_paths", "resolve"]


def add_import_paths(*directories: str | Path | None) -> None:
    """Put *directories* (and the current directory) at the front of ``sys.path``, once each.

    This is what ``python -m`` does for the current directory; a run configuration's
    directory comes first so that ``factory = "mymodel:make"`` finds ``mymodel.py`` beside it.
    """
    wanted = [str(Path(d).resolve()) for d in directories if d is not None]
    wanted.append(str(Path.cwd()))
    present = {str(Path(p or ".").resolve()) for p in sys.path}
    for directory in reversed(list(dict.fromkeys(wanted))):
        if directory not in present:
            sys.path.insert(0, directory)
            present.add(directory)


def resolve(spec: Any, where: str, modules: bool = False) -> Callable[..., Any]:
    """Import ``"module:attr"`` and return the callable it names.

    :param modules: a spec without ``:`` names a module, returned itself (a plugin module whose
        functions carry ``@hookimpl``).
    """
    if modules and isinstance(spec, str) and spec and ":" not in spec:
        return _import(spec, spec, where)  # the module is the plugin
    if not isinstance(spec, str) or ":" not in spec:
        wanted = '"module:callable" or "module"' if modules else '"module:callable"'
        raise ConfigError(f"{where}: factory must be {wanted}, not {spec!r}")
    module_name, _, attr = spec.partition(":")
    module = _import(module_name, spec, where)
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(module) if not n.startswith("_")]
            raise ConfigError(
                f"{where}: factory {spec!r}: {module_name!r} has no attribute {attr!r}"
                f"{did_you_mean(attr, names)}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{where}: factory {spec!r} is not callable")
    return target


def _import(module_name: str, spec: str, where: str) -> Any:
    """Import *module_name* for the factory *spec*, or raise one error naming *where*."""
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"{where}: factory {spec!r}: cannot import {module_name!r}: {error} (modules are "
            "looked up beside the config file, in the current directory and on sys.path)"
        ) from None
    except Exception as error:  # the module itself raised on import
        raise ConfigError(
            f"{where}: factory {spec!r}: importing {module_name!r} raised {type(error).__name__}: {error}"
        ) from None
