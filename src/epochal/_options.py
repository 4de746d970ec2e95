"""The one validator: options checked against the annotations of what they configure.

The annotations of a constructor or function are the schema of its options: a type, a
``Literal[...]``, a union, ``None``, and constraints as pydantic writes them
(``Annotated[int, annotated_types.Ge(1)]`` or ``pydantic.Field(ge=1)``, or the aliases below). Every table of
a run configuration is checked this way: ``[loop]`` against :class:`epochal.Loop`,
``[distributed]`` against :func:`epochal.distributed.init_from_env`, ``[model]``/``[data]``
against their factories, ``[plugins.NAME]`` against the plugin's constructor. Values TOML cannot
spell are converted first (:func:`convert_options`): ``"none"`` for an option that accepts
``None`` (and no string), ``"module:attr"`` for a callable, a table for a nested structure (a
dataclass, a ``TypedDict`` or a pydantic model); then pydantic validates each value in strict
mode (a string is never taken for a number, nor ``true`` for 1), and the first problem is one
line naming the table and the key. ``epochal schema`` turns the same annotations into JSON
Schema, so an editor rejects what a run rejects.
"""

from __future__ import annotations

import collections.abc as cabc
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, TypeVar

from annotated_types import Ge, Gt, Le, Lt, MinLen

from epochal.errors import PluginError, did_you_mean

_F = TypeVar("_F", bound=Callable[..., Any])

#: Annotations for options, with their constraints (the JSON Schema carries them too).
NonNegativeInt = Annotated[int, Ge(0)]
PositiveInt = Annotated[int, Ge(1)]
NonNegativeFloat = Annotated[float, Ge(0)]
PositiveFloat = Annotated[float, Gt(0)]
#: a fraction of a whole, above 0 and at most 1 (of an epoch's batches, say).
Fraction = Annotated[float, Gt(0), Le(1)]
#: a string that is not empty (a record's name, a path).
NonEmptyStr = Annotated[str, MinLen(1)]
#: a seed every generator takes (numpy's legacy one refuses a negative seed or one of 2**32 or more).
Seed = Annotated[int, Ge(0), Lt(2**32)]


def option_signature(factory: Callable[..., Any]) -> inspect.Signature | None:
    """The signature whose keyword arguments are the plugin's options (None if unknown)."""
    return _cached(_SIGNATURES, factory, _signature)


def _signature(factory: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):
        return None


#: a callable's signature and resolved annotations, read once (``Loop()`` checks its options at
#: every construction: ``typing.get_type_hints`` alone costs ~0.5 ms).
_SIGNATURES: dict[Any, Any] = {}
_HINTS: dict[Any, Any] = {}


def _cached(cache: dict[Any, Any], factory: Callable[..., Any], compute: Callable[[Any], Any]) -> Any:
    try:
        return cache[factory]
    except KeyError:
        value = cache[factory] = compute(factory)
        return value
    except TypeError:  # not hashable: computed each time
        return compute(factory)


def check_options(
    name: str,
    factory: Callable[..., Any],
    options: Mapping[str, Any],
    where: str | None = None,
    error: type[Exception] = PluginError,
    shared: Sequence[str] = (),
    keys: Sequence[str] | None = None,
) -> None:
    """Raise *error* unless *options* are valid keyword arguments of *factory*.

    Unknown names, missing required options and values that do not fit the annotation (its
    type or its constraints) are each reported with the list of valid options. *name* is what
    the options configure (a plugin name) and *where* the config section (default
    ``[plugins.NAME]``); *shared* are the keys every table accepts besides (the trigger keys),
    for "did you mean". *keys*: the only parameters a table may set (a table of a callable's
    options, such as ``[loop]`` of :class:`epochal.Loop`): the messages then say "key".
    """
    signature = option_signature(factory)
    if signature is None:
        return
    params = {
        p.name: p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and (keys is None or p.name in keys)
    }
    if keys is not None:
        _check_table(options, params, option_hints(factory), where or name, error)
        return
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    hints = option_hints(factory)
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
        problem = None if hint is None else invalid(value, hint)
        if problem is not None:  # the key is right: its value is the culprit, not the key list
            choices = [
                choice
                for alternative in _flatten(hint)
                if typing.get_origin(alternative) is typing.Literal
                for choice in typing.get_args(alternative)
                if isinstance(choice, str) and isinstance(value, str)
            ]
            raise error(
                f"{where}: option {key!r} of {what} {problem}, "
                f"not {type(value).__name__} {value!r}{did_you_mean(value, choices) if choices else ''}"
            )
    missing = [p.name for p in params.values() if p.default is p.empty and p.name not in options]
    if missing:
        raise error(f"{where}: {what} needs option(s) {', '.join(missing)}; valid options: {valid}")


def _check_table(
    table: Mapping[str, Any],
    params: Mapping[str, inspect.Parameter],
    hints: Mapping[str, Any],
    where: str,
    error: type[Exception],
) -> None:
    """A configuration table of a callable's options: ``[loop]``, ``[distributed]``."""
    for key, value in table.items():
        if key not in params:
            raise error(
                f"{where}: unknown key {key!r}{did_you_mean(key, params)}; valid keys: {', '.join(params)}"
            )
        problem = invalid(value, hints.get(key, Any))
        if problem is not None:
            raise error(f"{where}: {key} {problem}, not {value!r}")


def checked_options(name: str) -> Callable[[_F], _F]:
    """Make a plugin's class (or factory function) check its options when called from Python,
    as a ``[plugins.NAME]`` table is checked: ``EarlyStopping(mode="maximum")`` is refused with
    the message the same value in TOML gets, and nothing else needs writing. *name* is the
    plugin's name (its entry point's) in the messages.

    ::

        @checked_options("loss_guard")
        class LossGuard:
            def __init__(self, limit: PositiveFloat = 1e3) -> None: ...

    Positional arguments are checked under their names; a ``**kwargs`` plugin's extra keys are
    its own to check. A run's loader checks the table first (with the table's name); the
    constructor's check then passes.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(
            f'checked_options takes the plugin\'s name, e.g. @checked_options("my_plugin"), not {name!r}'
        )

    def decorate(target: _F) -> _F:
        import functools

        function: Callable[..., Any] = target.__init__ if inspect.isclass(target) else target
        signature = inspect.signature(function)

        @functools.wraps(function)
        def checking(*args: Any, **kwargs: Any) -> Any:
            options = _called_with(signature, args, kwargs, skip_first=inspect.isclass(target))
            if options is not None:
                check_options(name, target, options)
            return function(*args, **kwargs)

        if inspect.isclass(target):
            target.__init__ = checking  # type: ignore[method-assign]
            return target
        return checking  # type: ignore[return-value]

    return decorate


def _called_with(
    signature: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any], skip_first: bool
) -> dict[str, Any] | None:
    """The options of a call by name (None: the call does not fit the signature: Python's own
    TypeError says so)."""
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:  # an unknown option is named as a table's is; else Python's error
        unknown = {k: v for k, v in kwargs.items() if k not in signature.parameters}
        return unknown or None
    options: dict[str, Any] = {}
    parameters = list(signature.parameters.values())
    for position, parameter in enumerate(parameters):
        if (skip_first and position == 0) or parameter.name not in bound.arguments:
            continue
        value = bound.arguments[parameter.name]
        if parameter.kind is parameter.VAR_KEYWORD:
            options.update(value)
        elif parameter.kind is not parameter.VAR_POSITIONAL:
            options[parameter.name] = value
    return options


#: The TOML spelling of None, for an option whose annotation accepts None and no string.
NONE_SPELLING = "none"


def _flatten(hint: Any) -> list[Any]:
    """The alternatives of a union (the hint itself when it is none)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(hint) for a in _flatten(arg)]
    return [hint]


def _is_structure(hint: Any) -> bool:
    """A dataclass, TypedDict or pydantic model: a nested table pydantic validates."""
    import dataclasses

    if not isinstance(hint, type):
        return False
    if dataclasses.is_dataclass(hint) or _is_typeddict(hint):
        return True
    return any(b.__name__ == "BaseModel" and b.__module__.startswith("pydantic") for b in hint.__mro__)


def _is_typeddict(hint: Any) -> bool:
    """``typing``'s TypedDict or ``typing_extensions``' (which pydantic needs before 3.12)."""
    if typing.is_typeddict(hint):
        return True
    try:
        import typing_extensions
    except ImportError:  # pragma: no cover - pydantic brings it
        return False
    return bool(typing_extensions.is_typeddict(hint))


def _bare(hint: Any) -> Any:
    """*hint* without its ``Annotated`` constraints."""
    return typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint


def _fields(structure: type) -> dict[str, Any] | None:
    """The keys a table for *structure* may hold, each with its annotation (None: any key, for
    a pydantic model that allows extra ones)."""
    import dataclasses

    if dataclasses.is_dataclass(structure):
        hints = typing.get_type_hints(structure, include_extras=True)
        return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(structure) if f.init}
    if _is_typeddict(structure):
        return typing.get_type_hints(structure, include_extras=True)
    model: Any = structure
    if model.model_config.get("extra") == "allow":
        return None
    return {name: field.annotation for name, field in model.model_fields.items()}


def table_problem(table: Mapping[str, Any], hint: Any, path: str) -> str | None:
    """What is wrong in a nested *table* for the structure *hint* names (``"window.sise: unknown
    key ..."``), or None: unknown keys at any depth, and values checked as strictly as an
    option's (pydantic would take ``"8"`` for 8 and ignore an unknown key of a dataclass)."""
    structures = [a for a in _flatten(_bare(hint)) if _is_structure(a)]
    fields = _fields(structures[0]) if len(structures) == 1 else None
    if fields is None:
        return None  # several structures, or any key: pydantic decides
    for key, value in table.items():
        if key not in fields:
            return (
                f"{path}.{key}: unknown key{did_you_mean(str(key), list(fields))}; "
                f"keys: {', '.join(fields) or 'none'}"
            )
        field = fields[key]
        if isinstance(value, dict) and any(_is_structure(a) for a in _flatten(_bare(field))):
            problem = table_problem(value, field, f"{path}.{key}")
        elif _holds_structure(field):  # a list of tables (list[Window]): pydantic builds it
            problem = None
        else:
            wrong = invalid(value, field)
            problem = None if wrong is None else f"{path}.{key} {wrong}, not {type(value).__name__} {value!r}"
        if problem is not None:
            return problem
    return None


def _holds_structure(hint: Any) -> bool:
    """Whether a structure appears inside *hint* (``list[Window]``, ``dict[str, Window]``)."""
    return any(_is_structure(arg) or _holds_structure(arg) for arg in typing.get_args(hint))


def _is_callable(hint: Any) -> bool:
    return hint is cabc.Callable or typing.get_origin(hint) is cabc.Callable


def option_hints(factory: Callable[..., Any]) -> dict[str, Any]:
    """The resolved annotations of *factory*'s options, constraints included (empty when they
    cannot be resolved)."""
    hints: dict[str, Any] = _cached(_HINTS, factory, _hints)
    return hints


def _hints(factory: Callable[..., Any]) -> dict[str, Any]:
    target = factory.__init__ if inspect.isclass(factory) else factory
    try:
        return typing.get_type_hints(target, include_extras=True)
    except Exception:  # one annotation that does not resolve (a local class): the others do
        pass
    hints: dict[str, Any] = {}
    for name, annotation in getattr(inspect.unwrap(target), "__annotations__", {}).items():
        try:
            hints.update(typing.get_type_hints(_Annotated(target, name, annotation), include_extras=True))
        except Exception:
            continue
    return hints


class _Annotated:
    """One annotation of *function*, for ``typing.get_type_hints`` to resolve on its own."""

    def __init__(self, function: Callable[..., Any], name: str, annotation: Any) -> None:
        self.__annotations__ = {name: annotation}
        self.__wrapped__ = inspect.unwrap(function)
        self.__globals__ = getattr(self.__wrapped__, "__globals__", {})


def spelled_none(value: Any, hint: Any) -> bool:
    """Whether *value* is TOML's spelling of None for an annotation that accepts None and no
    string (``"none"``)."""
    alternatives = [_bare(a) for a in _flatten(hint)]  # a NonEmptyStr takes a string too
    return (
        value == NONE_SPELLING
        and type(None) in alternatives
        and str not in alternatives
        and Any not in alternatives
    )


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
        if spelled_none(value, hint):
            converted[key] = None
        elif isinstance(value, str) and not takes_str and any(map(_is_callable, alternatives)):
            from epochal.imports import resolve

            try:
                converted[key] = resolve(value, f"{where} {key}")
            except Exception as error:
                raise PluginError(str(error).replace("factory ", "", 1)) from None
        elif isinstance(value, dict) and any(map(_is_structure, alternatives)):
            import pydantic

            problem = table_problem(value, hint, key)
            if problem is not None:
                raise PluginError(f"{where} {problem}")
            try:  # an unknown key of a nested table is an error, as it is in [plugins.NAME]
                adapter = pydantic.TypeAdapter(hint, config=pydantic.ConfigDict(extra="forbid"))
            except pydantic.PydanticUserError:  # a model with its own config
                try:
                    adapter = pydantic.TypeAdapter(hint)
                except pydantic.PydanticUserError as error:  # typing.TypedDict before 3.12, say
                    raise PluginError(
                        f"{where} {key}: pydantic cannot validate {describe(hint)}: {error}"
                    ) from None
            try:
                converted[key] = adapter.validate_python(value)
            except pydantic.ValidationError as error:
                problems = "; ".join(
                    f"{'.'.join(map(str, e['loc'])) or key}: {e['msg']}" for e in error.errors()[:5]
                )
                raise PluginError(f"{where} {key}: invalid table: {problems}") from None
    return converted


#: pydantic's errors that a constraint, not the type, was not met.
_CONSTRAINTS = ("greater_than", "less_than", "multiple_of", "too_short", "too_long", "string_pattern")
_ADAPTERS: dict[int, Any] = {}


def _adapter(hint: Any) -> Any:
    """A strict pydantic validator of *hint* (None when pydantic cannot build one)."""
    key = id(hint)
    if key not in _ADAPTERS:
        import pydantic

        config = pydantic.ConfigDict(strict=True, arbitrary_types_allowed=True)
        try:
            adapter: Any = pydantic.TypeAdapter(hint, config=config)
        except pydantic.PydanticUserError:  # a type with its own config (a pydantic model)
            adapter = pydantic.TypeAdapter(hint)
        except Exception:  # a hint pydantic cannot check (a Protocol, say): the value passes
            adapter = None
        _ADAPTERS[key] = (hint, adapter)  # the hint is kept alive: its id stays its own
    return _ADAPTERS[key][1]


def invalid(value: Any, hint: Any) -> str | None:
    """What is wrong with *value* for the annotation *hint* (``"must be int ≥ 1"``), or None."""
    if hint is Any or hint is object:
        return None
    adapter = _adapter(hint)
    if adapter is None:
        return None
    import pydantic

    try:
        adapter.validate_python(value)
    except pydantic.ValidationError as error:
        for problem in error.errors():
            if problem["type"].startswith(_CONSTRAINTS):
                return "must be " + problem["msg"].removeprefix("Input should be ")
        return f"must be {describe(hint)}"
    return None


def _bounds(metadata: Sequence[Any]) -> str:
    """``≥ 1``, ``> 0``: the constraints of an ``Annotated`` type, as a person writes them."""
    words = []
    for item in metadata:
        for constraint in getattr(item, "metadata", [item]):
            for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
                if getattr(constraint, attr, None) is not None:
                    words.append(f"{sign} {getattr(constraint, attr)}")
    return " ".join(words)


def describe(hint: Any) -> str:
    """A readable name for a type annotation (``int ≥ 1 | None``, ``'min' or 'max'``)."""
    origin = typing.get_origin(hint)
    if origin is Annotated:
        base, *metadata = typing.get_args(hint)
        constraints = [c for item in metadata for c in getattr(item, "metadata", [item])]
        non_empty = any(getattr(c, "min_length", None) == 1 for c in constraints)
        return f"{'non-empty ' if non_empty else ''}{describe(base)} {_bounds(metadata)}".strip()
    if origin is typing.Literal or origin in (typing.Union, types.UnionType):
        values: list[str] = []  # literal values and None: 'auto', 'gloo', 'nccl' or None
        kinds: list[str] = []
        for arg in _flatten(hint):
            if typing.get_origin(arg) is typing.Literal:
                values += [repr(v) for v in typing.get_args(arg)]
            elif arg is type(None):
                values.append("None")
            else:
                kinds.append(describe(arg))
        if values:
            kinds.append(values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}")
        return " | ".join(kinds)
    if hint is type(None):
        return "None"
    if isinstance(hint, type) and origin is None:
        return hint.__name__
    return str(hint).replace("typing.", "").replace("collections.abc.", "")
