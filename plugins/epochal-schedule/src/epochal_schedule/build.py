"""Scheduler classes of ``torch.optim.lr_scheduler`` by name, their arguments checked.

Imported only when a run names the ``lr_scheduler`` plugin, so that an installed but unused
epochal-schedule costs a numpy run no torch import.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import lr_scheduler

from epochal import ConfigError, PluginError
from epochal.config import resolve
from epochal.errors import did_you_mean

__all__ = ["SCHEDULERS", "build", "check_arguments", "hyperparameters", "options_schema", "scheduler_class"]


def _is_scheduler(value: Any) -> bool:
    return inspect.isclass(value) and (
        issubclass(value, lr_scheduler.LRScheduler) or value is lr_scheduler.ReduceLROnPlateau
    )


#: the scheduler classes of torch.optim.lr_scheduler, by name.
SCHEDULERS: dict[str, type] = {
    name: cls
    for name, cls in vars(lr_scheduler).items()
    if not name.startswith("_") and _is_scheduler(cls) and name != "LRScheduler"
}
_CALLABLE_ARGUMENTS = ("lr_lambda", "scale_fn")


def scheduler_class(name: Any, where: str) -> type:
    if not isinstance(name, str) or name not in SCHEDULERS:
        raise PluginError(
            f"{where} name = {name!r} is not a scheduler of torch.optim.lr_scheduler"
            f"{did_you_mean(str(name), SCHEDULERS)}; schedulers: {', '.join(sorted(SCHEDULERS))}"
        )
    return SCHEDULERS[name]


def check_arguments(cls: type, arguments: Mapping[str, Any], where: str) -> None:
    params = dict(inspect.signature(cls).parameters)
    params.pop("optimizer", None)
    valid = ", ".join(params) or "none"
    for key in arguments:
        if key not in params:
            raise PluginError(
                f"{where} {key!r} is not an argument of {cls.__name__}{did_you_mean(key, params)}; "
                f"its arguments: {valid}"
            )
    missing = [n for n, p in params.items() if p.default is p.empty and n not in arguments]
    if missing:
        raise PluginError(f"{where} {cls.__name__} needs {', '.join(missing)}; its arguments: {valid}")
    _check_types(cls, arguments, where)


def _check_types(cls: type, arguments: Mapping[str, Any], where: str) -> None:
    """Refuse a value of the wrong type for the scheduler's annotations (``T_max = "abc"``), which
    torch itself takes and fails on at its first step, an epoch into the run. Values the plugin
    converts first (``"auto"`` lengths, ``"module:function"`` callables, nested scheduler tables)
    and annotations that do not resolve are left to torch."""
    import typing

    import pydantic

    try:
        hints = typing.get_type_hints(cls.__init__)  # type: ignore[misc]
    except Exception:  # annotations naming what the module does not import
        return
    config = pydantic.ConfigDict(strict=True, arbitrary_types_allowed=True)
    for key, value in arguments.items():
        converted = (key in LENGTH_ARGUMENTS and value == "auto") or key in _CALLABLE_ARGUMENTS
        if converted or key == "schedulers" or key not in hints:
            continue
        try:
            adapter = pydantic.TypeAdapter(hints[key], config=config)
        except Exception:  # a hint pydantic cannot check
            continue
        try:
            adapter.validate_python(value)
        except pydantic.ValidationError:
            wanted = str(hints[key]).replace("typing.", "").replace("<class '", "").replace("'>", "")
            raise PluginError(f"{where} {key} = {value!r}: {cls.__name__} takes {wanted} there") from None


#: the arguments that say how long a schedule runs: ``"auto"`` makes them the run's length.
LENGTH_ARGUMENTS = ("total_steps", "T_max", "total_iters")


def build(
    name: str,
    arguments: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    where: str,
    length: float = math.inf,
) -> Any:
    """The scheduler *name* of *optimizer*; a length argument given as ``"auto"`` becomes
    *length* (the steps the schedule takes in this run; ``math.inf``: the run is unbounded)."""
    cls = scheduler_class(name, where)
    check_arguments(cls, arguments, where)
    kwargs = dict(arguments)
    for key in LENGTH_ARGUMENTS:
        if kwargs.get(key) == "auto":
            if length == math.inf or length < 1:
                raise ConfigError(
                    f"{where} {key} = 'auto' needs a run of known length: set [loop] max_epochs "
                    "(with a train stream that has a len()) or [loop] max_iterations"
                    + ("" if length == math.inf else f" (this run takes {int(length)} steps of it)")
                )
            kwargs[key] = int(length)
    for key in _CALLABLE_ARGUMENTS:
        if isinstance(kwargs.get(key), str):
            kwargs[key] = resolve(kwargs[key], f"{where} {key}")
    if "schedulers" in kwargs:
        children = kwargs["schedulers"]
        tables = isinstance(children, list) and all(isinstance(c, Mapping) and "name" in c for c in children)
        if not tables:
            raise ConfigError(f"{where} schedulers must be a list of tables, each with a name")
        kwargs["schedulers"] = [
            build(
                c["name"],
                {k: v for k, v in c.items() if k != "name"},
                optimizer,
                f"{where} schedulers[{n}]",
                length,
            )
            for n, c in enumerate(children)
        ]
    try:
        return cls(optimizer, **kwargs)
    except Exception as error:  # whatever torch's constructor raises, it is the arguments' fault
        message = str(error).strip("'\"")
        raise ConfigError(f"{where} torch refused {name}({_describe(arguments)}): {message}") from None


def options_schema(table: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of a ``[plugins.lr_scheduler]`` table (*table*, made from the plugin's
    annotations) with each scheduler's own arguments: with ``name = "CosineAnnealingLR"`` the
    table takes the plugin's options and ``T_max``, ``eta_min``, ``last_epoch``, nothing else
    (``T_mx`` is refused as the run refuses it), typed by the class's annotations."""
    import typing

    from epochal.schema import type_schema

    own = table["properties"]
    own["name"] = {**own.get("name", {}), "enum": sorted(SCHEDULERS)}
    branches = []
    for name, cls in sorted(SCHEDULERS.items()):
        params = dict(inspect.signature(cls).parameters)
        params.pop("optimizer", None)
        try:
            hints = typing.get_type_hints(cls.__init__)  # type: ignore[misc]
        except Exception:  # annotations naming what the module does not import
            hints = {}
        arguments: dict[str, Any] = {}
        for key in params:
            schema = type_schema(hints[key]) if key in hints else {}
            if key in LENGTH_ARGUMENTS and schema:
                schema = {"anyOf": [schema, {"const": "auto"}]}
            elif key in _CALLABLE_ARGUMENTS or key == "schedulers":
                schema = {}  # "module:function", a list of scheduler tables: checked by the run
            arguments[key] = schema
        required = [key for key, p in params.items() if p.default is p.empty]
        branch: dict[str, Any] = {"properties": {**own, **arguments}, "additionalProperties": False}
        if required:
            branch["required"] = required
        branches.append(
            {"if": {"properties": {"name": {"const": name}}, "required": ["name"]}, "then": branch}
        )
    table["allOf"] = branches
    return table


def _without_name(table: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in table.items() if k != "name"}


def _describe(arguments: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in arguments.items())


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
