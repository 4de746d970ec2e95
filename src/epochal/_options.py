"""Checking a plugin's options (``[plugins.NAME]``) against its constructor's signature.

The annotations of the constructor are the schema. Values TOML cannot spell are converted
first (:func:`convert_options`): ``"none"`` for an option that accepts ``None`` (and no
string), ``"module:attr"`` for a callable, a table for a nested structure (a dataclass, a
``TypedDict`` or a pydantic model, validated by pydantic); then every value is checked against
its annotation with messages naming ``[plugins.NAME] key``. :func:`options_schema` turns the
same signature into the JSON Schema of the table (``epochal schema``).
"""

from __future__ import annotations

import collections.abc as cabc
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epochal.errors import PluginError, did_you_mean


def option_signature(factory: Callable[..., Any]) -> inspect.Signature | None:
    """The signature whose keyword arguments are the plugin's options (None if unknown)."""
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):
        return None


def check_options(
    name: str,
    factory: Callable[..., Any],
    options: Mapping[str, Any],
    where: str | None = None,
    error: type[Exception] = PluginError,
    shared: Sequence[str] = (),
) -> None:
    """Raise *error* unless *options* are valid keyword arguments of *factory*.

    Unknown names, missing required options and values whose type does not match the
    annotation are each reported with the list of valid options. *name* is what the options
    configure (a plugin name) and *where* the config section (default ``[plugins.NAME]``);
    *shared* are the keys every table accepts besides (the trigger keys), for "did you mean".
    """
    signature = option_signature(factory)
    if signature is None:
        return
    params = {
        p.name: p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    try:
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except Exception:  # unresolvable annotations: skip the type check, keep the name check
        hints = {}
    valid = (
        ", ".join(
            f"{p.name}" + (f" (default {p.default!r})" if p.default is not p.empty else " (required)")
            for p in params.values()
        )
        or "none"
    )
    where = where or f"[plugins.{name}]"
    what = f"plugin {name!r}" if where.startswith("[plugins") else repr(name)
    for key, value in options.items():
        if key not in params:
            if takes_any:
                continue
            also = f"; shared keys: {', '.join(shared)}" if shared else ""
            raise error(
                f"{where}: unknown option {key!r} for {what}"
                f"{did_you_mean(key, [*params, *shared])}; valid options: {valid}{also}"
            )
        hint = hints.get(key)
        if hint is not None and not matches(value, hint):
            raise error(
                f"{where}: option {key!r} of {what} must be {describe(hint)}, "
                f"not {type(value).__name__} {value!r}; valid options: {valid}"
            )
    missing = [p.name for p in params.values() if p.default is p.empty and p.name not in options]
    if missing:
        raise error(f"{where}: {what} needs option(s) {', '.join(missing)}; valid options: {valid}")


#: The TOML spelling of None, for an option whose annotation accepts None and no string.
NONE_SPELLING = "none"


def _flatten(hint: Any) -> list[Any]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(hint) for a in _flatten(arg)]
    return [hint]


def _is_structure(hint: Any) -> bool:
    """A dataclass, TypedDict or pydantic model: a nested table pydantic validates."""
    import dataclasses

    if not isinstance(hint, type):
        return False
    if dataclasses.is_dataclass(hint) or typing.is_typeddict(hint):
        return True
    return any(b.__name__ == "BaseModel" and b.__module__.startswith("pydantic") for b in hint.__mro__)


def _is_callable(hint: Any) -> bool:
    return hint is cabc.Callable or typing.get_origin(hint) is cabc.Callable


def option_hints(factory: Callable[..., Any]) -> dict[str, Any]:
    """The resolved annotations of *factory*'s options (empty when they cannot be resolved)."""
    try:
        return typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except Exception:
        return {}


def convert_options(factory: Callable[..., Any], options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """*options* with the values TOML cannot spell converted for *factory*'s annotations.

    :raises PluginError: naming *where* and the key when a nested table is invalid or a
        ``"module:attr"`` does not import.
    """
    hints = option_hints(factory)
    converted = dict(options)
    for key, value in options.items():
        hint = hints.get(key)
        if hint is None:
            continue
        alternatives = _flatten(hint)
        takes_str = str in alternatives or Any in alternatives
        if value == NONE_SPELLING and type(None) in alternatives and not takes_str:
            converted[key] = None
        elif isinstance(value, str) and not takes_str and any(map(_is_callable, alternatives)):
            from epochal.imports import resolve

            try:
                converted[key] = resolve(value, f"{where} {key}")
            except Exception as error:
                raise PluginError(str(error).replace("factory ", "", 1)) from None
        elif isinstance(value, dict) and any(map(_is_structure, alternatives)):
            import pydantic

            try:  # an unknown key of a nested table is an error, as it is in [plugins.NAME]
                adapter = pydantic.TypeAdapter(hint, config=pydantic.ConfigDict(extra="forbid"))
            except pydantic.PydanticUserError:  # a model with its own config
                adapter = pydantic.TypeAdapter(hint)
            try:
                converted[key] = adapter.validate_python(value)
            except pydantic.ValidationError as error:
                problems = "; ".join(
                    f"{'.'.join(map(str, e['loc'])) or key}: {e['msg']}" for e in error.errors()[:5]
                )
                raise PluginError(f"{where} {key}: invalid table: {problems}") from None
    return converted


def matches(value: Any, hint: Any) -> bool:
    """Whether a TOML value fits a type annotation (simple types, containers, unions, Literal)."""
    if hint is Any or hint is object:
        return True
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple, cabc.Sequence):
        if not isinstance(value, (list, tuple)) or isinstance(value, str):
            return False
        inner = args[0] if args and (origin is not tuple or args[-1] is Ellipsis) else Any
        return all(matches(v, inner) for v in value)
    if origin in (dict, cabc.Mapping):
        return isinstance(value, dict)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # an annotation this check does not understand


def describe(hint: Any) -> str:
    """A readable name for a type annotation."""
    if isinstance(hint, type) and typing.get_origin(hint) is None:
        return hint.__name__
    return str(hint).replace("typing.", "")
