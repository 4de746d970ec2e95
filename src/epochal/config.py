"""The run configuration: a TOML file, ``--set`` overrides, and building a loop from it.

Sections: ``[loop]`` (the loop's options), ``[model]`` and ``[data]`` (a ``factory =
"module:callable"`` and its keyword arguments), ``[plugins]`` (``order``, ``disable``,
``autoload``, and one ``[plugins.NAME]`` table of options per plugin; a table with a
``factory = "module:attr"`` key is a plugin from the user's own code).

Every ``factory`` is imported as ``python -m`` would find it: from the configuration file's
directory, then the current directory, then ``sys.path`` (no ``PYTHONPATH=.`` needed).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from epochal._options import check_options, describe, matches
from epochal.errors import ConfigError, PluginError, did_you_mean
from epochal.plugins import PluginSet, load_plugins

SECTIONS = ("loop", "model", "data", "plugins", "distributed")
#: the keys of ``[loop]`` and their types.
LOOP_OPTIONS: dict[str, Any] = {
    "max_epochs": int | None,
    "max_iterations": int | None,
    "seed": int | None,
    "eval_every_n_epochs": int | dict[str, int],
    "epoch_size": int | None,
    "eval_at_start": bool,
    "on_empty_batch": Literal["error", "warn", "ignore"],
    "on_empty_stream": Literal["error", "warn", "ignore"],
    "run_dir": str,
    "uneven_shards": Literal["error", "drop", "pad"],
}
PLUGINS_OPTIONS: dict[str, Any] = {"order": list[str], "disable": list[str], "autoload": bool}
#: the keys of ``[distributed]`` (runs on several processes) and their types.
DISTRIBUTED_OPTIONS: dict[str, Any] = {
    "backend": Literal["auto", "gloo", "nccl"],
    "timeout": float,
    "agree_every_n_batches": int,
}


class RunConfig(dict[str, Any]):
    """A run configuration (a plain dict of its TOML tables) that remembers its file.

    ``source`` names the file in error messages; ``directory`` is where ``factory`` modules are
    imported from first.
    """

    source: str = "<config>"
    directory: Path | None = None


def source_of(config: Mapping[str, Any]) -> str:
    """The file a configuration was read from, for error messages."""
    return getattr(config, "source", "<config>")


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


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Read a run configuration, apply ``section.key=value`` overrides and check it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read config file {str(path)!r}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:  # TOML is UTF-8
        raise ConfigError(
            f"{path}: not UTF-8 text: byte {error.object[error.start]:#04x} at offset {error.start} "
            "(TOML files are UTF-8; re-save it as UTF-8)"
        ) from None
    import tomllib  # only where a file is read: not for `epochal plugins`

    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    for override in overrides:
        apply_override(config, override)
    run_config = RunConfig(config)
    run_config.source, run_config.directory = str(path), path.parent
    add_import_paths(path.parent)
    check_config(run_config, str(path))
    run_config.setdefault("loop", {}).setdefault("run_dir", str(Path("runs") / path.stem))
    return run_config


def apply_override(config: dict[str, Any], override: str) -> None:
    """Apply ``section.key=value`` (the value read as TOML, else as a string) to *config*."""
    dotted, sep, raw = override.partition("=")
    keys = [k.strip() for k in dotted.strip().split(".")]
    if not sep or len(keys) < 2 or not all(keys):
        raise ConfigError(f"--set {override!r}: expected section.key=value, e.g. loop.max_epochs=5")
    import tomllib

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
    _check_table(config.get("distributed", {}), DISTRIBUTED_OPTIONS, f"{source}: [distributed]")
    every = config.get("distributed", {}).get("agree_every_n_batches")
    if every is not None and every < 1:
        raise ConfigError(
            f"{source}: [distributed] agree_every_n_batches must be a positive integer, not {every!r}"
        )
    timeout = config.get("distributed", {}).get("timeout")
    if timeout is not None and not timeout > 0:
        raise ConfigError(
            f"{source}: [distributed] timeout must be a positive number of seconds, not {timeout!r}"
        )
    plugins = config.get("plugins", {})
    _check_table(
        {k: v for k, v in plugins.items() if not isinstance(v, dict)},
        PLUGINS_OPTIONS,
        f"{source}: [plugins]",
    )
    for section in ("model", "data"):
        if "factory" not in config.get(section, {}):
            raise ConfigError(f'{source}: [{section}] needs factory = "module:callable"')
    check_plugin_tables(plugins, source)


def check_plugin_tables(plugins: Mapping[str, Any], source: str) -> None:
    """Check every local plugin's ``[plugins.NAME] factory``.

    The factory must import and the name must not be an installed plugin's. (Trigger keys are
    checked when the plugins are loaded, where each plugin's own options are known.)
    """
    from epochal.plugins import installed

    tables = {k: v for k, v in plugins.items() if isinstance(v, dict)}
    names = None
    for name, table in tables.items():
        if "factory" not in table:
            continue
        names = installed() if names is None else names
        if name in names:
            raise ConfigError(
                f"{source}: [plugins.{name}] factory: a local plugin cannot be named {name!r}, "
                f"the name of the installed plugin from {names[name].distribution}; rename the table "
                f"(e.g. [plugins.my_{name}]) or drop the factory key to configure the installed one"
            )
        resolve(table["factory"], f"{source}: [plugins.{name}]")


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
        raise ConfigError(
            f"{where}: factory {spec!r}: cannot import {module_name!r}: {error} (modules are "
            "looked up beside the config file, in the current directory and on sys.path)"
        ) from None
    except Exception as error:  # the module itself raised on import
        raise ConfigError(
            f"{where}: factory {spec!r}: importing {module_name!r} raised {type(error).__name__}: {error}"
        ) from None
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
    factory = resolve(table.pop("factory", None), f"{source_of(config)}: [{section}]")
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
    """``[plugins.NAME]`` tables by plugin name (a local plugin's without its ``factory``)."""
    return {
        k: {key: value for key, value in v.items() if key != "factory"}
        for k, v in config.get("plugins", {}).items()
        if isinstance(v, dict)
    }


def local_plugins(config: Mapping[str, Any]) -> dict[str, Callable[..., Any]]:
    """``[plugins.NAME] factory = "module:attr"``: the plugins from the user's own code, by name."""
    where = source_of(config)
    return {
        name: resolve(table["factory"], f"{where}: [plugins.{name}]")
        for name, table in config.get("plugins", {}).items()
        if isinstance(table, dict) and "factory" in table
    }


def plugins_for(
    config: Mapping[str, Any], order: Sequence[str] | None = None, disable: Sequence[str] = ()
) -> PluginSet:
    """The plugin set a run of *config* uses; *order* (``--plugins``) replaces the config's."""
    section = config.get("plugins", {})
    local = local_plugins(config)
    try:
        plugin_set = load_plugins(
            order=list(order) if order is not None else section.get("order", []),
            disable=[*section.get("disable", []), *disable],
            autoload=section.get("autoload", True),
            options=plugin_options(config),
            extra=local,
        )
    except PluginError as error:
        source = getattr(config, "source", None)
        if source is None or str(error).startswith(source):
            raise
        raise PluginError(f"{source}: {error}") from error.__cause__
    for info in plugin_set.infos:
        name = info.parent or info.name
        if name in local:
            info.distribution = info.distribution or "(local)"
            info.entry_point = section[name]["factory"]
    return plugin_set
