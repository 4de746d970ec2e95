"""The JSON Schema of a run configuration (``epochal schema``), for editors' TOML completion.

Built from the same sources the checks use: ``[loop]``'s option types, and every installed
plugin's constructor signature and docstring (``:param name: text``), plus the shared trigger
keys. Editors with a TOML language server (taplo, VS Code's Even Better TOML) read it from a
``#:schema ./epochal.schema.json`` first line or their schema settings.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epochal._options import NONE_SPELLING, _flatten, option_hints

TRIGGER_SCHEMAS: dict[str, dict[str, Any]] = {
    "every_n_batches": {
        "type": "integer",
        "minimum": 0,
        "description": "Call the plugin's batch hooks "
        "(before_batch, after_batch) only on every n-th training batch.",
    },
    "after_n_batches": {
        "type": "integer",
        "minimum": 0,
        "description": "Call the plugin's batch hooks only from the n-th training batch on.",
    },
    "every_n_epochs": {
        "type": "integer",
        "minimum": 0,
        "description": "Call the plugin's epoch hooks (before_epoch, after_epoch) only on every n-th epoch.",
    },
    "after_n_epochs": {
        "type": "integer",
        "minimum": 0,
        "description": "Call the plugin's epoch hooks only from the n-th epoch on.",
    },
    "before_first_epoch": {"type": "boolean", "description": "false: do not call its before_training."},
    "on_resumption": {"type": "boolean", "description": "false: do not call its on_resumption."},
    "after_training": {"type": "boolean", "description": "false: do not call its after_training."},
    "when": {
        "type": "string",
        "description": 'A condition on the log ("valid.loss < 0.1") or a '
        '"module:callable" predicate; gates the batch and epoch hooks.',
    },
    "on_failure": {
        "enum": ["fatal", "isolate"],
        "description": "What an exception in the plugin's hooks does.",
    },
    "distribution": {
        "type": "string",
        "description": "The distribution whose plugin of this name to load (where two offer it).",
    },
}


def param_docs(obj: Any) -> dict[str, str]:
    """``:param name: text`` entries of a class's (or its ``__init__``'s) or function's docstring."""
    # the __init__'s own docstring: inspect.getdoc would give one without it object's
    # ("Initialize self. See help(type(self))...")
    own = getattr(getattr(obj, "__init__", None), "__doc__", None)
    init_doc = inspect.cleandoc(own) if isinstance(own, str) and own != object.__init__.__doc__ else None
    text = "\n".join(filter(None, [inspect.getdoc(obj), init_doc]))
    docs: dict[str, str] = {}
    for match in re.finditer(r":param (\w+):(.*?)(?=\n\s*:\w|\n\s*\n|\Z)", text, re.S):
        docs[match.group(1)] = " ".join(match.group(2).split())
    return docs


def type_schema(hint: Any) -> dict[str, Any]:
    """The JSON Schema of one annotation (empty when pydantic cannot express it)."""
    import pydantic

    alternatives = _flatten(hint)
    if any(getattr(a, "__origin__", a) is Callable or "Callable" in str(a) for a in alternatives):
        return {"type": "string", "pattern": r"^[\w.]+:[\w.]+$", "description": '"module:attr"'}
    try:
        schema = _closed(pydantic.TypeAdapter(hint).json_schema())
    except Exception:
        return {}
    if type(None) in alternatives and str not in alternatives:
        schema = {"anyOf": [schema, {"const": NONE_SPELLING}]}
    return schema


def _closed(schema: Any) -> Any:
    """*schema* with every object of named properties closed (``additionalProperties: false``,
    unless it says otherwise): a run refuses unknown keys of nested tables, so editors do too."""
    if isinstance(schema, dict):
        schema = {key: _closed(value) for key, value in schema.items()}
        if schema.get("type") == "object" and "properties" in schema:
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_closed(value) for value in schema]
    return schema


def options_schema(factory: Callable[..., Any], local: bool = False) -> dict[str, Any]:
    """The schema of a ``[plugins.NAME]`` table for a plugin built by *factory*."""
    properties: dict[str, Any] = dict(TRIGGER_SCHEMAS)
    required: list[str] = []
    open_ended = not (inspect.isclass(factory) or inspect.isfunction(factory))
    if not open_ended:
        hints = option_hints(factory)
        docs = param_docs(factory)
        for p in inspect.signature(factory).parameters.values():
            if p.kind is p.VAR_KEYWORD:
                open_ended = True
            if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                continue
            schema = type_schema(hints[p.name]) if p.name in hints else {}
            if p.name in docs:
                schema["description"] = docs[p.name]
            if p.default is not p.empty:
                try:
                    json.dumps(p.default)
                    schema["default"] = p.default
                except (TypeError, ValueError):
                    pass
            else:
                required.append(p.name)
            properties[p.name] = schema
    doc = (inspect.getdoc(factory) or "").split("\n\n")[0]
    if local:
        properties["factory"] = {"type": "string", "description": 'The plugin\'s "module:attr".'}
        required.append("factory")
    table: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": open_ended}
    if doc:
        table["description"] = " ".join(doc.split())
    if required:
        table["required"] = required
    return table


def properties(target: Callable[..., Any], keys: Sequence[str]) -> dict[str, Any]:
    """The JSON Schema of *keys*, options of *target*: their annotations and ``:param:`` docs."""
    docs = param_docs(target)
    hints = option_hints(target)
    props: dict[str, Any] = {}
    for key in keys:
        schema = type_schema(hints.get(key, Any))
        if key in docs:
            schema["description"] = docs[key]
        props[key] = schema
    return props


def run_schema(config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON Schema of a whole run configuration, with every installed plugin's table."""
    from epochal.config import DISTRIBUTED_KEYS, local_plugins, plugins_section
    from epochal.discovery import PluginLoadWarning, import_plugins, installed
    from epochal.distributed.world import init_from_env
    from epochal.loop import OPTIONS, Loop

    loop_props = properties(Loop, OPTIONS)
    distributed_props = properties(init_from_env, DISTRIBUTED_KEYS)
    factory = {
        "type": "object",
        "properties": {"factory": {"type": "string", "pattern": r"^[\w.]+:[\w.]+$"}},
        "required": ["factory"],
        "additionalProperties": True,
    }
    available = installed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)
        objects = import_plugins(sorted(available), available, set(), {})
    plugin_props = properties(plugins_section, ("order", "disable", "autoload"))
    for name, obj in objects.items():
        plugin_props[name] = refined(obj, options_schema(obj))  # type: ignore[arg-type]
    for name, local in (local_plugins(config) if config else {}).items():
        plugin_props[name] = options_schema(local, local=True)
    for name in _unknown_tables(config, plugin_props):
        plugin_props[name] = _refused(_unknown_table_text(name, objects))
    generic_local = options_schema(lambda **options: None, local=True)
    generic_local["description"] = 'A plugin from your own code: factory = "module:attr" and its options.'
    # a table of no installed plugin's name is a local plugin's: it needs a factory, and one
    # a letter away from an installed name is most likely that plugin's, misspelt
    misspelt = {
        _near(name, [*plugin_props]): _local_or(generic_local, _unknown_table_text(name, objects, near=True))
        for name in objects
    }
    unknown = (
        "no installed plugin has this name (installed: "
        f'{", ".join(sorted(objects)) or "none"}), and it has no factory = "module:attr"'
    )
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "epochal run configuration",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "loop": {"type": "object", "properties": loop_props, "additionalProperties": False},
            "distributed": {
                "type": "object",
                "properties": distributed_props,
                "additionalProperties": False,
                "description": "Runs on several processes (epochal run --nproc N, torchrun).",
            },
            "model": _factory_schema(
                config, "model", factory, "The model factory and its keyword arguments."
            ),
            "data": _factory_schema(config, "data", factory, "The data factory and its keyword arguments."),
            "plugins": {
                "type": "object",
                "properties": plugin_props,
                "patternProperties": misspelt,
                "additionalProperties": _local_or(generic_local, unknown),
            },
        },
        "required": ["model", "data"],
    }


def _factory_schema(
    config: Mapping[str, Any] | None, section: str, generic: dict[str, Any], description: str
) -> dict[str, Any]:
    """``[model]``/``[data]``: with a config whose factory imports, that factory's own options
    (the keys the run accepts: unknown ones are refused unless it takes ``**kwargs``), else any keys."""
    if config is not None and isinstance(config.get(section), Mapping) and "factory" in config[section]:
        from epochal.config import factory_arguments

        try:
            target, _ = factory_arguments(config, section)
        except Exception:  # an unimportable factory: the run names it; the schema stays generic
            target = None
        if target is not None:
            table = options_schema(target)
            for key in TRIGGER_SCHEMAS:
                table["properties"].pop(key)
            table["properties"] = {"factory": generic["properties"]["factory"], **table["properties"]}
            table["required"] = ["factory", *table.get("required", [])]
            table.setdefault("description", description)
            return table
    return {**generic, "description": description}


def _unknown_tables(config: Mapping[str, Any] | None, known: Mapping[str, Any]) -> list[str]:
    """The ``[plugins.NAME]`` tables of *config* that name no installed plugin and no factory."""
    tables = (config or {}).get("plugins", {})
    if not isinstance(tables, Mapping):
        return []
    return [
        name
        for name, table in tables.items()
        if isinstance(table, Mapping) and name not in known and "factory" not in table
    ]


def _unknown_table_text(name: str, installed: Mapping[str, Any], near: bool = False) -> str:
    """Why a ``[plugins.NAME]`` table names nothing; *near*: the text for any name a letter away
    from the installed *name*."""
    if near:
        return f"no installed plugin has this name; did you mean {name!r}? (or give it a factory)"
    import difflib

    close = difflib.get_close_matches(name, list(installed), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ' (or give it a factory = "module:attr")'
    return f"no installed plugin is named {name!r}{hint}"


def _refused(text: str) -> dict[str, Any]:
    """A schema no table meets, whose validators' message carries *text* (jsonschema prints the
    schema a ``not`` refuses; editors show the description)."""
    return {"not": {"description": text}, "description": text}


def _local_or(local: dict[str, Any], text: str) -> dict[str, Any]:
    """A local plugin's table (with a factory), else refused with *text*."""
    return {"if": {"required": ["factory"]}, "then": local, "else": _refused(text)}


def _near(name: str, taken: Sequence[str]) -> str:
    """A regular expression matching the names one edit (a letter left out, added, replaced or
    two swapped) away from *name*, except the names in *taken*."""
    import re

    variants = set()
    for i in range(len(name) + 1):
        variants.add(re.escape(name[:i]) + "." + re.escape(name[i:]))  # one added
        if i < len(name):
            variants.add(re.escape(name[:i] + name[i + 1 :]))  # one left out
            variants.add(re.escape(name[:i]) + "." + re.escape(name[i + 1 :]))  # one replaced
        if i < len(name) - 1:
            variants.add(re.escape(name[:i] + name[i + 1] + name[i] + name[i + 2 :]))  # two swapped
    exact = "|".join(re.escape(t) for t in sorted({name, *taken}))
    return f"^(?!(?:{exact})$)(?:{'|'.join(sorted(variants))})$"


def refined(plugin: Any, table: dict[str, Any]) -> dict[str, Any]:
    """*table* as the plugin's ``refine_schema`` declaration refines it (unchanged without one,
    or when it fails: the annotations' schema stands)."""
    from epochal.protocol import declared

    refine = declared(plugin, "refine_schema")
    if not callable(refine):
        return table
    try:
        result = refine(copy.deepcopy(table))
    except Exception as error:
        warnings.warn(
            f"a plugin's refine_schema failed ({type(error).__name__}: {error}): its table "
            "keeps the schema of its annotations",
            stacklevel=2,
        )
        return table
    return result if isinstance(result, dict) else table
