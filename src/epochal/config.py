"""The run configuration: a TOML file, ``--set`` overrides, and building a loop from it.

Sections: ``[loop]`` (the loop's options), ``[model]`` and ``[data]`` (a ``factory =
"module:callable"`` and its keyword arguments), ``[plugins]`` (``order``, ``disable``,
``autoload``, and one ``[plugins.NAME]`` table of options per plugin).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from epochal._options import check_options, describe, matches
from epochal.errors import ConfigError, did_you_mean
from epochal.plugins import PluginSet, load_plugins

SECTIONS = ("loop", "model", "data", "plugins")
#: the keys of ``[loop]`` and their types.
LOOP_OPTIONS: dict[str, Any] = {
    "max_epochs": int | None,
    "max_iterations": int | None,
    "seed": int | None,
    "eval_every_n_epochs": int,
    "eval_at_start": bool,
    "on_empty_batch": Literal["error", "warn", "ignore"],
    "on_empty_stream": Literal["error", "warn", "ignore"],
    "run_dir": str,
}
PLUGINS_OPTIONS: dict[str, Any] = {"order": list[str], "disable": list[str], "autoload": bool}


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Read a run configuration, apply ``section.key=value`` overrides and check it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read config file {str(path)!r}: {error.strerror or error}") from None
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    for override in overrides:
        apply_override(config, override)
    check_config(config, str(path))
    config.setdefault("loop", {}).setdefault("run_dir", str(Path("runs") / path.stem))
    return config


def apply_override(config: dict[str, Any], override: str) -> None:
    """Apply ``section.key=value`` (the value read as TOML, else as a string) to *config*."""
    dotted, sep, raw = override.partition("=")
    keys = [k.strip() for k in dotted.strip().split(".")]
    if not sep or len(keys) < 2 or not all(keys):
        raise ConfigError(f"--set {override!r}: expected section.key=value, e.g. loop.max_epochs=5")
    try:
        value = tomllib.loads(f"value = {raw.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    table = config
    for key in keys[:-1]:
        table = table.setdefault(key, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--set {override!r}: {key!r} is not a table")
    table[keys[-1]] = value


def check_config(config: Mapping[str, Any], source: str) -> None:
    """Raise :class:`ConfigError` naming the file and key of the first problem found."""
    for section in config:
        if section not in SECTIONS:
            raise ConfigError(
                f"{source}: unknown section [{section}]{did_you_mean(section, SECTIONS)}; "
                f"sections: {', '.join(SECTIONS)}"
            )
        if not isinstance(config[section], dict):
            raise ConfigError(f"{source}: {section} must be a table ([{section}])")
    _check_table(config.get("loop", {}), LOOP_OPTIONS, f"{source}: [loop]")
    plugins = config.get("plugins", {})
    _check_table(
        {k: v for k, v in plugins.items() if not isinstance(v, dict)},
        PLUGINS_OPTIONS,
        f"{source}: [plugins]",
    )
    for section in ("model", "data"):
        if "factory" not in config.get(section, {}):
            raise ConfigError(f'{source}: [{section}] needs factory = "module:callable"')


def _check_table(table: Mapping[str, Any], schema: Mapping[str, Any], where: str) -> None:
    for key, value in table.items():
        if key not in schema:
            raise ConfigError(
                f"{where}: unknown key {key!r}{did_you_mean(key, schema)}; valid keys: {', '.join(schema)}"
            )
        if not matches(value, schema[key]):
            raise ConfigError(f"{where}: {key} must be {describe(schema[key])}, not {value!r}")


def resolve(spec: Any, where: str) -> Callable[..., Any]:
    """Import ``"module:attr"`` and return the callable it names."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f'{where}: factory must be "module:callable", not {spec!r}')
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{where}: factory {spec!r}: cannot import {module_name!r}: {error}") from None
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


def call_factory(config: Mapping[str, Any], section: str) -> Any:
    """Call ``[section] factory`` with the section's other keys as keyword arguments.

    ``[loop] seed`` is passed as ``seed`` when the factory takes one and the section has none.
    """
    factory, table = factory_arguments(config, section)
    check_options(factory.__name__, factory, table, where=f"[{section}]", error=ConfigError)
    try:
        return factory(**table)
    except ValueError as error:  # the factory refused a value (batch_size = 0): name the section
        raise ConfigError(f"[{section}] {config[section]['factory']}: {error}") from error


def factory_arguments(config: Mapping[str, Any], section: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The callable ``[section] factory`` names and the keyword arguments it will get."""
    table = dict(config.get(section, {}))
    factory = resolve(table.pop("factory", None), f"[{section}]")
    seed = config.get("loop", {}).get("seed")
    if seed is not None and "seed" not in table:
        try:
            if "seed" in inspect.signature(factory).parameters:
                table["seed"] = seed
        except (TypeError, ValueError):
            pass
    return factory, table


def loop_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``[loop]`` keyword arguments for :class:`epochal.Loop`."""
    return copy.deepcopy(dict(config.get("loop", {})))


def plugin_options(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``[plugins.NAME]`` tables by plugin name."""
    return {k: dict(v) for k, v in config.get("plugins", {}).items() if isinstance(v, dict)}


def plugins_for(
    config: Mapping[str, Any], order: Sequence[str] | None = None, disable: Sequence[str] = ()
) -> PluginSet:
    """The plugin set a run of *config* uses; *order* (``--plugins``) replaces the config's."""
    section = config.get("plugins", {})
    return load_plugins(
        order=list(order) if order is not None else section.get("order", []),
        disable=[*section.get("disable", []), *disable],
        autoload=section.get("autoload", True),
        options=plugin_options(config),
    )
