"""The modules and optimizers of a :class:`~epochal.torch.TorchModel`, by name.

A TorchModel trains one module with one optimizer (``TorchModel(net, opt, loss_fn)``) or several
of each, named (``TorchModel({"generator": g, "discriminator": d}, {"generator": opt_g,
"discriminator": opt_d}, training_step=...)``). :class:`Parts` checks them once and holds:

- the **root**: the one module itself, or an ``nn.ModuleDict`` of the several (each inside any
  ``torch.compile`` wrapper). Its ``state_dict`` is the model's module state (the keys of
  several modules are prefixed with their names, ``generator.main.0.weight``), and FSDP's and
  DCP's fully qualified names are its names;
- the **views** the steps call: on several processes the training view of a trained module is
  its ``DistributedDataParallel`` wrapper, the evaluation view the module itself (evaluation
  takes no collective); on one process both are the module as given;
- which modules are **trained** (some optimizer holds their parameters) and which are
  **frozen** (a teacher, an EMA copy): frozen modules run in eval mode and are never wrapped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from epochal.errors import ConfigError

__all__ = ["ONE_MODULE", "ONE_OPTIMIZER", "Parts", "unwrap"]

#: the name of the module and of the optimizer of a model given one of each.
ONE_MODULE, ONE_OPTIMIZER = "module", "optimizer"


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module whose parameters are trained, inside DDP and ``torch.compile`` wrappers."""
    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
            continue
        inner = getattr(module, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner


def _named(value: Any, one: str, kind: type, what: str) -> tuple[dict[str, Any], bool]:
    """``({name: value}, named)``: *value* as a mapping by name; *named* whether it was one."""
    if isinstance(value, kind):
        return {one: value}, False
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"TorchModel {what} must be a {kind.__module__}.{kind.__qualname__} or a mapping of names "
            f"to them, not {type(value).__name__}"
        )
    if not value:
        raise ConfigError(f"TorchModel {what}: the mapping is empty (give at least one)")
    for name, item in value.items():
        if not isinstance(name, str) or not name or "." in name:
            raise ConfigError(f"TorchModel {what}: {name!r} is not a name (a non-empty string without '.')")
        if not isinstance(item, kind):
            raise ConfigError(
                f"TorchModel {what} {name!r} must be a {kind.__module__}.{kind.__qualname__}, "
                f"not {type(item).__name__}"
            )
    return dict(value), True


class Parts:
    """The named modules and optimizers of a model, checked (see the module's docstring).

    :raises ConfigError: a value of the wrong type, an empty mapping, a bad name, an optimizer
        given twice, a parameter in two optimizers, or an optimizer holding a tensor that is no
        parameter of the modules.
    """

    def __init__(self, module: Any, optimizer: Any) -> None:
        self.modules, self.several_modules = _named(module, ONE_MODULE, torch.nn.Module, "module")
        self.optimizers, self.several_optimizers = _named(
            optimizer, ONE_OPTIMIZER, torch.optim.Optimizer, "optimizer"
        )
        raw = {name: unwrap(m) for name, m in self.modules.items()}
        self.root: torch.nn.Module = (
            torch.nn.ModuleDict(raw) if self.several_modules else raw[next(iter(raw))]
        )
        owner = {id(p): name for name, m in raw.items() for p in m.parameters()}
        held: dict[int, str] = {}
        trained: set[str] = set()
        seen: dict[int, str] = {}
        for name, opt in self.optimizers.items():
            if id(opt) in seen:
                raise ConfigError(
                    f"TorchModel optimizer {name!r} is optimizer {seen[id(opt)]!r} again: give each once"
                )
            seen[id(opt)] = name
            for group in opt.param_groups:
                for param in group["params"]:
                    if id(param) not in owner:
                        modules = ", ".join(repr(m) for m in self.modules)
                        raise ConfigError(
                            f"TorchModel optimizer {name!r} holds a tensor of shape {list(param.shape)} "
                            f"that is no parameter of the module(s) {modules}: make the optimizer over "
                            "the parameters of the modules given to TorchModel"
                        )
                    if held.get(id(param), name) != name:
                        raise ConfigError(
                            f"TorchModel optimizers {held[id(param)]!r} and {name!r} both hold a "
                            f"parameter of shape {list(param.shape)} (of module {owner[id(param)]!r}): "
                            "give each parameter to one optimizer"
                        )
                    held[id(param)] = name
                    trained.add(owner[id(param)])
        #: the names of the modules some optimizer trains, and of the others (frozen).
        self.trained = [name for name in self.modules if name in trained]
        self.frozen = [name for name in self.modules if name not in trained]
        #: what the steps call: the modules as given (DDP wrappers in training after :meth:`wrap`).
        self.train_views: dict[str, torch.nn.Module] = dict(self.modules)
        self.eval_views: dict[str, torch.nn.Module] = dict(self.modules)
        #: the DDP wrappers by module name (empty on one process and under FSDP).
        self.ddp: dict[str, DistributedDataParallel] = {}

    @property
    def raw(self) -> dict[str, torch.nn.Module]:
        """Each module inside its wrappers, by name."""
        if self.several_modules:
            return dict(self.root.named_children())
        return {next(iter(self.modules)): self.root}

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> None:
        """Move every module to *device* (and cast to *dtype*, ``bf16-true``); a module still on
        the meta device is only cast (:mod:`epochal.torch.meta` gives it memory)."""
        from epochal.torch.meta import has_meta

        for module in self.modules.values():
            if not has_meta(module):
                module.to(device)
            if dtype is not None:
                module.to(dtype)

    def wrap(self, device: torch.device, options: Mapping[str, Any]) -> None:
        """Wrap each trained module in ``DistributedDataParallel`` (its own gradient reducer);
        frozen modules stay as they are. The evaluation views stay the unwrapped modules."""
        for name in self.trained:
            ddp_options: dict[str, Any] = {"device_ids": [device] if device.type == "cuda" else None}
            ddp_options.update(options)
            wrapper = DistributedDataParallel(self.modules[name], **ddp_options)
            self.ddp[name] = wrapper
            self.train_views[name] = wrapper

    def train_mode(self) -> None:
        """Trained modules in training mode, frozen ones in eval mode (walks only on a change)."""
        for name in self.trained:
            module = self.modules[name]
            if not module.training:
                module.train()
        for name in self.frozen:
            module = self.modules[name]
            if module.training:
                module.eval()

    def parameters_of(self, name: str) -> list[torch.Tensor]:
        """The parameters optimizer *name* holds (every group)."""
        return [p for group in self.optimizers[name].param_groups for p in group["params"]]
