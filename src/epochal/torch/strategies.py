"""The strategies of :class:`~epochal.torch.TorchModel` on several processes, and their checks.

``"ddp"`` (a replica of each trained module on every rank) or ``"fsdp"`` (each sharded by FSDP2:
:mod:`epochal.torch.fsdp`). Kept apart from :mod:`epochal.torch.fsdp`, which imports
``torch.distributed.checkpoint`` and DTensor (about a second of CPU): a model is made and checked
without them, and only a run that shards imports them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from epochal.errors import ConfigError

__all__ = ["STRATEGIES", "Strategy", "check_strategy"]

#: the values of ``TorchModel(strategy=...)`` (Lightning's names).
Strategy = Literal["ddp", "fsdp"]
STRATEGIES = ("ddp", "fsdp")


def check_strategy(strategy: str, precision: str, ddp_options: Mapping[str, Any] | None = None) -> None:
    """Refuse what FSDP2 cannot run with these options, before any training.

    :raises ConfigError: ``16-mixed`` under ``fsdp`` (float16 needs a gradient scaler that
        works on sharded gradients, which epochal does not provide for FSDP2), ``ddp_options``
        under ``fsdp``, or a ``ddp_options`` key that ``DistributedDataParallel`` does not take
        (checked on one process too: the mistake shows before a run on several).
    """
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
