"""The strategies of :class:`~epochal.torch.TorchModel` on several processes, and their checks.

``"ddp"`` (a replica of each trained module on every rank) or ``"fsdp"`` (each sharded by FSDP2:
:mod:`epochal.torch.fsdp`), with the options each takes (``ddp_options``, ``fsdp_options``:
:class:`FSDPOptions`). Kept apart from :mod:`epochal.torch.fsdp`, which imports
``torch.distributed.checkpoint`` and DTensor (about a second of CPU): a model is made and checked
without them, and only a run that shards imports them.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal, TypedDict

from epochal._options import PositiveInt, invalid
from epochal.errors import ConfigError, did_you_mean

__all__ = ["STRATEGIES", "FSDPOptions", "Strategy", "check_strategy", "check_wrap_policy", "wraps"]

#: the values of ``TorchModel(strategy=...)`` (Lightning's names).
Strategy = Literal["ddp", "fsdp"]
STRATEGIES = ("ddp", "fsdp")

#: a wrap policy: class names (``"TransformerBlock"``, or with its module ``"pkg.model.Block"``)
#: or classes, or a function ``policy(submodule) -> bool``.
WrapPolicy = Collection[str | type] | Callable[[Any], bool]


class FSDPOptions(TypedDict, total=False):
    r"""``TorchModel(fsdp_options=...)``: the FSDP2 settings torchtitan and Lightning users set.

    - ``wrap_policy``: which submodules become FSDP units of their own (each ``fully_shard``\ ed,
      innermost first, before the root): those of these classes (names or classes), or those a
      function ``policy(submodule) -> bool`` selects. Default: each direct child with
      parameters, the items of an ``nn.ModuleList``/``nn.ModuleDict`` child instead of it.
    - ``reshard_after_forward``: ``fully_shard``'s: free each unit's gathered parameters after its
      forward (True, the default: ZeRO-3) or keep them for the backward (False: ZeRO-2, more
      memory, one all-gather less per unit).
    - ``forward_prefetch`` / ``backward_prefetch``: explicit prefetching (pytorch/examples' FSDP2
      example): each unit all-gathers the next N units (in the order the modules were registered,
      which the forward is taken to follow) before its own forward, or the previous N before its
      own backward; with ``forward_prefetch`` the root's parameters are gathered before each
      training forward (the example's ``model.unshard()``). Default: FSDP2's implicit prefetching.
    - ``cpu_offload``: keep the sharded parameters, gradients and optimizer states in host memory
      and step the optimizer there (FSDP2's ``CPUOffloadPolicy``, pinned memory on CUDA).
    """

    wrap_policy: WrapPolicy
    reshard_after_forward: bool
    forward_prefetch: PositiveInt
    backward_prefetch: PositiveInt
    cpu_offload: bool


def _check_fsdp_options(options: Mapping[str, Any]) -> None:
    hints = typing.get_type_hints(FSDPOptions, include_extras=True)
    for key, value in options.items():
        if key not in hints:
            raise ConfigError(
                f"TorchModel fsdp_options: unknown key {key!r}{did_you_mean(str(key), list(hints))}; "
                f"its keys: {', '.join(hints)}"
            )
        if key == "wrap_policy":
            if callable(value) and not isinstance(value, type):
                continue
            if isinstance(value, (str, type)) or not isinstance(value, Collection) or not value:
                raise ConfigError(
                    "TorchModel fsdp_options: wrap_policy must be a list of module class names (or "
                    f"classes), or a function (submodule) -> bool, not {type(value).__name__} {value!r:.100}"
                )
            for item in value:
                if not (isinstance(item, type) or (isinstance(item, str) and item)):
                    raise ConfigError(
                        f"TorchModel fsdp_options: wrap_policy item {item!r:.100} is no class name or class"
                    )
            continue
        problem = invalid(value, hints[key])
        if problem is not None:
            raise ConfigError(
                f"TorchModel fsdp_options: {key} {problem}, not {type(value).__name__} {value!r:.100}"
            )


def wraps(policy: WrapPolicy, module: Any) -> bool:
    """Whether the wrap *policy* makes *module* an FSDP unit."""
    if callable(policy) and not isinstance(policy, Collection):
        return bool(policy(module))
    kind = type(module)
    for item in policy:
        if isinstance(item, type):
            if isinstance(module, item):
                return True
        elif item in (kind.__name__, f"{kind.__module__}.{kind.__qualname__}"):
            return True
    return False


def check_wrap_policy(policy: WrapPolicy, modules: Mapping[str, Any]) -> None:
    """Refuse a wrap *policy* that selects no submodule of *modules* (the modules FSDP shards),
    or a class it names that none of them holds: one line naming the policy's item.

    :raises ConfigError: naming the class (with the nearest class name the modules hold).
    """
    subs = [sub for module in modules.values() for sub in module.modules() if sub is not module]
    which = (
        f"module {next(iter(modules))!r}" if len(modules) == 1 else f"modules {', '.join(map(repr, modules))}"
    )
    if callable(policy) and not isinstance(policy, Collection):
        if not any(wraps(policy, sub) for sub in subs):
            raise ConfigError(
                f"TorchModel fsdp_options: wrap_policy {getattr(policy, '__name__', policy)!r:.100} selects "
                f"no submodule of the {which}: each would be one FSDP unit only"
            )
        return
    names = sorted({type(sub).__name__ for sub in subs})
    for item in policy:
        if not any(wraps([item], sub) for sub in subs):
            shown = item.__qualname__ if isinstance(item, type) else str(item)
            raise ConfigError(
                f"TorchModel fsdp_options: wrap_policy names {shown!r}, which no submodule of the {which} "
                f"is{did_you_mean(shown, names)}; their classes: {', '.join(names) or 'none'}"
            )


def check_strategy(
    strategy: str,
    precision: str,
    ddp_options: Mapping[str, Any] | None = None,
    fsdp_options: Mapping[str, Any] | None = None,
) -> None:
    """Refuse what FSDP2 cannot run with these options, before any training.

    :raises ConfigError: ``16-mixed`` under ``fsdp`` (float16 needs a gradient scaler that
        works on sharded gradients, which epochal does not provide for FSDP2), ``ddp_options``
        under ``fsdp`` or ``fsdp_options`` under ``ddp``, or a ``ddp_options`` key that
        ``DistributedDataParallel`` does not take, an ``fsdp_options`` key or value that
        :class:`FSDPOptions` does not (checked on one process too: the mistake shows before a
        run on several).
    """
    if strategy == "ddp" and fsdp_options:
        raise ConfigError(
            f"TorchModel strategy 'ddp' takes no fsdp_options (given: {', '.join(map(str, fsdp_options))}); "
            "remove them, or use strategy 'fsdp'"
        )
    if fsdp_options:
        _check_fsdp_options(fsdp_options)
    if strategy == "fsdp" and ddp_options:
        raise ConfigError(
            f"TorchModel strategy 'fsdp' takes no ddp_options (given: {', '.join(map(str, ddp_options))}); "
            "remove them, or use strategy 'ddp'"
        )
    if strategy == "ddp" and ddp_options:
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        from epochal.errors import did_you_mean

        known = [
            p
            for p in inspect.signature(DistributedDataParallel.__init__).parameters
            if p not in ("self", "module")
        ]
        for key in ddp_options:
            if key not in known:
                raise ConfigError(
                    f"TorchModel ddp_options: DistributedDataParallel has no argument {key!r}"
                    f"{did_you_mean(str(key), known)}; its arguments: {', '.join(known)}"
                )
    if strategy == "fsdp" and precision == "16-mixed":
        raise ConfigError(
            "TorchModel strategy 'fsdp' with precision '16-mixed': float16 mixed precision needs a "
            "gradient scaler for sharded (DTensor) gradients, which epochal has not for FSDP2; use "
            "precision 'bf16-mixed' (or 'bf16-true', '32-true'), or strategy 'ddp'"
        )
