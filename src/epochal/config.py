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
import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from epochal._options import check_options
from epochal.errors import ConfigError, PluginError, did_you_mean
from epochal.imports import add_import_paths, resolve
from epochal.plugins import PluginSet, load_plugins

SECTIONS = ("loop", "model", "data", "plugins", "distributed")
#: the keys of ``[distributed]``: the options of :func:`epochal.distributed.init_from_env`.
DISTRIBUTED_KEYS = ("backend", "timeout", "agree_every_n_batches")


def plugins_section(order: list[str] = [], disable: list[str] = [], autoload: bool = True) -> None:  # noqa: B006
    """The keys of ``[plugins]`` besides its ``[plugins.NAME]`` tables (the schema of the table).

    :param order: plugins in call order: these first, as listed; other loaded plugins after.
    :param disable: plugins not to load this run.
    :param autoload: load every installed plugin not disabled (false: only those in ``order``).
    """


class RunConfig(dict[str, Any]):
    """A run configuration (a plain dict of its TOML tables) that remembers its file.

    ``source`` names the file in error messages; ``directory`` is where ``factory`` modules are
    imported from first.
    """

    source: str = "<config>"
    directory: Path | None = None
    #: the ``--set`` overrides applied to the file (blamed for the errors they cause).
    overrides: tuple[str, ...] = ()


def source_of(config: Mapping[str, Any]) -> str:
    """The file a configuration was read from, for error messages."""
    return getattr(config, "source", "<config>")


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
    from_file = copy.deepcopy(config) if overrides else config
    for override in overrides:
        apply_override(config, override)
    spell_none(config)
    run_config = RunConfig(config)
    run_config.source, run_config.directory = str(path), path.parent
    run_config.overrides = tuple(overrides)
    add_import_paths(path.parent)
    try:
        check_config(run_config, str(path))
    except ConfigError as error:
        culprit = _culprit(from_file, overrides, str(path))
        if culprit is None:
            raise
        # the file is fine: the --set that made the config invalid is named, not the file
        raise ConfigError(f"--set {culprit!r}: {str(error).removeprefix(f'{path}: ')}") from None
    run_config.setdefault("loop", {}).setdefault("run_dir", str(Path("runs") / path.stem))
    return run_config


def _culprit(from_file: dict[str, Any], overrides: Sequence[str], source: str) -> str | None:
    """The first of *overrides* after which *from_file* no longer checks (None: the file itself
    does not, or none of them alone is to blame)."""
    config = copy.deepcopy(from_file)
    try:
        check_config(spell_none(config), source)
    except ConfigError:
        return None
    for override in overrides:
        apply_override(config, override)
        spell_none(config)
        try:
            check_config(config, source)
        except ConfigError:
            return override
    return None


def spell_none(config: dict[str, Any]) -> dict[str, Any]:
    """*config* with ``"none"`` read as None in ``[loop]`` and ``[distributed]``, for a key whose
    annotation accepts None and no string (as in a plugin's table: TOML has no null)."""
    from epochal._options import NONE_SPELLING, option_hints, spelled_none
    from epochal.distributed.world import init_from_env
    from epochal.loop import Loop

    targets: tuple[tuple[str, Callable[..., Any]], ...] = (("loop", Loop), ("distributed", init_from_env))
    for section, target in targets:
        table = config.get(section)
        if isinstance(table, dict) and NONE_SPELLING in table.values():
            hints = option_hints(target)
            for key, value in table.items():
                if key in hints and spelled_none(value, hints[key]):
                    table[key] = None
    return config


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
    from epochal.distributed.world import init_from_env
    from epochal.loop import OPTIONS as LOOP_OPTIONS
    from epochal.loop import Loop

    tables: tuple[tuple[str, Callable[..., Any], Sequence[str]], ...] = (
        ("loop", Loop, LOOP_OPTIONS),
        ("distributed", init_from_env, DISTRIBUTED_KEYS),
    )
    for section, target, keys in tables:
        check_options(
            section, target, config.get(section, {}), f"{source}: [{section}]", ConfigError, keys=keys
        )
    plugins = config.get("plugins", {})
    keys = ("order", "disable", "autoload")  # a table of any other name is a plugin's options
    top = {k: v for k, v in plugins.items() if k in keys or not isinstance(v, dict)}
    check_options("plugins", plugins_section, top, f"{source}: [plugins]", ConfigError, keys=keys)
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
        resolve(table["factory"], f"{source}: [plugins.{name}]", modules=True)


def call_factory(config: Mapping[str, Any], section: str) -> Any:
    """Call ``[section] factory`` with the section's other keys as keyword arguments.

    ``[loop] seed`` is passed as ``seed`` when the factory takes one and the section has none.
    """
    factory, table = factory_arguments(config, section)
    try:
        check_options(factory.__name__, factory, table, where=f"[{section}]", error=ConfigError)
    except ConfigError as error:
        raise blame(config, error) from None
    try:
        return factory(**table)
    except ValueError as error:  # the factory refused a value (batch_size = 0): name the section
        raise blame(config, ConfigError(f"[{section}] {config[section]['factory']}: {error}")) from error


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
    """``[plugins.NAME] factory = "module:attr"`` (or ``"module"``, a module of ``@hookimpl``
    functions): the plugins from the user's own code, by name."""
    where = source_of(config)
    return {
        name: resolve(table["factory"], f"{where}: [plugins.{name}]", modules=True)
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
        named = name_the_file(config, error)
        if named is error:
            raise
        raise named from error.__cause__
    for info in plugin_set.infos:
        name = info.parent or info.name
        if name in local:
            info.distribution = info.distribution or "(local)"
            info.entry_point = section[name]["factory"]
    if order is None and section.get("autoload", True) is False:
        _warn_unloaded_tables(config, plugin_set)
    return plugin_set


def name_the_file(config: Mapping[str, Any], error: PluginError) -> PluginError:
    """*error* with its culprit in front: the ``--set`` that set the key it names, else the
    configuration's file (itself when it names it already, or there is none)."""
    override = _override_of(config, str(error))
    if override is not None:
        return PluginError(f"--set {override!r}: {error}")
    source = getattr(config, "source", None)
    if source is None or str(error).startswith(source) or "EPOCHAL_PLUGINS" in str(error):
        return error
    return PluginError(f"{source}: {error}")


def _override_of(config: Mapping[str, Any], message: str) -> str | None:
    """The ``--set`` of *config* whose table and key *message* names (None: none)."""
    for override in reversed(getattr(config, "overrides", ())):
        path = [part.strip() for part in override.partition("=")[0].split(".")]
        if len(path) < 2:
            continue
        key, table = path[-1], ".".join(path[:-1])
        # the key as the culprit: "unknown option 'k'", "option 'k' of", "[table]: k must be"
        # (not a "did you mean 'k'" or a list of valid options)
        named = f"option '{key}'" in message or f"key '{key}'" in message or f"]: {key} " in message
        if named and (f"[{table}]" in message or (path[0] == "plugins" and f"'{path[1]}'" in message)):
            return override
    return None


def blame(config: Mapping[str, Any], error: ConfigError) -> ConfigError:
    """*error* (about a ``[model]``/``[data]`` table) with its culprit in front: the ``--set``
    that set the key it names, else the configuration's file."""
    override = _override_of(config, str(error))
    if override is not None:
        return ConfigError(f"--set {override!r}: {error}")
    source = getattr(config, "source", None)
    if source is None or str(error).startswith(source):
        return error
    return ConfigError(f"{source}: {error}")


def _warn_unloaded_tables(config: Mapping[str, Any], plugin_set: PluginSet) -> None:
    """Warn (rank 0) about each ``[plugins.NAME]`` table whose plugin this run does not load
    because the configuration's ``autoload = false`` and ``order`` leave it out: the user
    configured a feature that will not run (a disabled plugin or ``--only`` is a choice made)."""
    from epochal.distributed.world import current_world

    if not current_world().is_zero:
        return
    import warnings

    tables = plugin_options(config)
    for info in plugin_set.infos:
        if info.parent is None and info.status == "available" and tables.get(info.name):
            warnings.warn(
                f"{source_of(config)}: [plugins.{info.name}] is set, but plugin {info.name!r} does not "
                "run: [plugins] autoload = false and it is not in [plugins] order (add it there, or "
                "remove the table)",
                UserWarning,
                stacklevel=2,
            )
