"""FSDP2 for :class:`~epochal.torch.TorchModel`: ``strategy = "fsdp"`` shards the module.

On several processes ``TorchModel(..., strategy="fsdp").distribute(world)`` shards the module
with :func:`torch.distributed.fsdp.fully_shard` (FSDP2) over a one-dimensional ``DeviceMesh`` of
the world (CPU on gloo, CUDA on NCCL). The wrapping policy: every direct child module that holds
parameters becomes a unit of its own (an ``nn.ModuleList``/``nn.ModuleDict`` is entered, so that
each block of a transformer's ``layers`` is one), then the root takes the rest; or the units
``fsdp_options``' ``wrap_policy`` selects (with FSDP2's other settings: reshard after forward,
explicit prefetching, CPU offload: :class:`~epochal.torch.strategies.FSDPOptions`). Each rank
holds its shard of every parameter (a ``DTensor``); a unit's parameters are all-gathered for its
forward and backward, and gradients are reduce-scattered. A module built on the meta device is
sharded as it is, then each rank gives its own shards memory and initialises them
(:mod:`epochal.torch.meta`).

FSDP2 replaces the module's parameters with new ``DTensor`` parameters. The optimizer the
factory made refers to the old ones: :class:`Sharded` re-points each of its parameter groups at
the new parameters of the same names, in place, so the optimizer keeps its class, its groups and
their hyperparameters (and any scheduler made on it stays valid). An optimizer that keeps
parameters anywhere but in ``param_groups`` (a custom one with its own list) is not re-pointed
there; an optimizer that has already stepped, or one holding a tensor that is not a parameter of
the module, is refused.

The state stays the one of DDP and of one process (plain, full, the module's own names), through
``torch.distributed.checkpoint.state_dict`` with ``full_state_dict=True, cpu_offload=True``:
rank 0 receives the whole state on the host, the other ranks an empty one (a checkpoint is
written by rank 0). A full state loads on each rank without a collective, each slicing its own
shards out of it (``distribute_tensor(..., src_data_rank=None)``): rank 0 checks a checkpoint
by loading it alone before the state goes to the other ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from epochal.errors import ConfigError
from epochal.torch.strategies import STRATEGIES, Strategy, WrapPolicy, check_strategy, wraps

__all__ = ["STRATEGIES", "Sharded", "Strategy", "check_strategy", "shard_units"]

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def _has_parameters(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def shard_units(module: torch.nn.Module, policy: WrapPolicy | None = None) -> list[torch.nn.Module]:
    """The submodules that become FSDP units of their own, in the order they were registered
    (the root not included).

    Each direct child with parameters; the items of an ``nn.ModuleList``/``nn.ModuleDict`` child
    (which has no forward of its own) instead of the container. With a wrap *policy*: every
    submodule it selects.
    """
    if policy is not None:
        return [sub for sub in module.modules() if sub is not module and wraps(policy, sub)]
    units: list[torch.nn.Module] = []
    for child in module.children():
        if isinstance(child, _CONTAINERS):
            units += [item for item in child.children() if _has_parameters(item)]
        elif _has_parameters(child):
            units.append(child)
    return units


def _policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's mixed precision for a precision name: bf16-mixed computes in bfloat16 and reduces
    gradients in float32; the others leave the parameters' dtype as it is."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


class Sharded:
    """Modules sharded by FSDP2 over the ranks of *world*, and their optimizers re-pointed.

    :param root: the model's root module (:class:`epochal.torch.parts.Parts`): the one module,
        or an ``nn.ModuleDict`` of several. Its names are the state's.
    :param modules: the modules to shard in place (each inside any ``torch.compile`` wrapper),
        each an FSDP root of its own: the root itself, or the trained modules of several. The
        root's other modules (frozen ones) stay whole on every rank.
    :param optimizers: the optimizers by name, over the sharded modules' parameters.
    :param options: ``fsdp_options`` (:class:`~epochal.torch.strategies.FSDPOptions`, checked).
    :raises ConfigError: an optimizer that has stepped already or that holds tensors other
        than the modules' parameters (:class:`~epochal.torch.parts.Parts` refuses those first).
    """

    def __init__(
        self,
        root: torch.nn.Module,
        modules: Mapping[str, torch.nn.Module],
        optimizers: Mapping[str, torch.optim.Optimizer],
        world: Any,
        device: torch.device,
        precision: str,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        options = dict(options or {})
        for name, optimizer in optimizers.items():
            if optimizer.state:
                which = "the optimizer" if len(optimizers) == 1 else f"optimizer {name!r}"
                raise ConfigError(
                    f"TorchModel strategy 'fsdp': {which} has already stepped; FSDP2 replaces the "
                    "parameters, so make the optimizer fresh in the model factory"
                )
        names = {id(p): name for name, p in root.named_parameters()}
        for optimizer in optimizers.values():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if id(param) not in names:
                        raise ConfigError(
                            f"TorchModel strategy 'fsdp': the optimizer holds a tensor of shape "
                            f"{list(param.shape)} that is no parameter of the module; FSDP2 shards "
                            "the module's parameters only"
                        )
        #: the fully qualified name of each parameter in each optimizer's order (its state ids).
        self.orders = {
            name: [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
            for name, optimizer in optimizers.items()
        }
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.mesh = init_device_mesh(device.type, (world.size,))
        with torch.no_grad():  # every rank starts from rank 0's values, as under DDP
            for tensor in root.state_dict().values():
                # a meta tensor has no values: each rank initialises its shards (epochal.torch.meta)
                if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                    torch.distributed.broadcast(tensor, src=0)
        #: ``reshard_after_forward`` of every unit but the roots (FSDP2's default: True).
        self.reshard_after_forward = bool(options.get("reshard_after_forward", True))
        #: how many units each unit prefetches before its forward (0: FSDP2's implicit prefetching).
        self.forward_prefetch = int(options.get("forward_prefetch", 0))
        offload: OffloadPolicy = (
            CPUOffloadPolicy(pin_memory=device.type == "cuda")
            if options.get("cpu_offload")
            else OffloadPolicy()
        )
        settings: dict[str, Any] = {
            "mesh": self.mesh,
            "mp_policy": _policy(precision),
            "offload_policy": offload,
        }
        for module in modules.values():
            units = shard_units(module, options.get("wrap_policy"))
            for unit in reversed(units):  # a unit inside another is sharded first
                fully_shard(unit, reshard_after_forward=self.reshard_after_forward, **settings)
            fully_shard(module, **settings)
            _prefetch(units, self.forward_prefetch, int(options.get("backward_prefetch", 0)))
        self.root = root
        #: the FSDP roots: each sharded module.
        self.roots: list[Any] = list(modules.values())
        self.optimizers = dict(optimizers)
        self.world = world
        # the same parameter objects FSDP2 made, by the names the optimizers' ones had
        new = dict(root.named_parameters())
        for optimizer in optimizers.values():
            for group in optimizer.param_groups:
                group["params"] = [new[names[id(p)]] for p in group["params"]]
        self._units = [m for m in root.modules() if isinstance(m, FSDPModule)]
        #: whether :meth:`begin_evaluation` gathered the parameters (until :meth:`end_evaluation`).
        self.gathered = False
        #: the full state :meth:`full_state` gathered since the last training batch or load.
        self._gathered_state: tuple[dict[str, Any], dict[str, dict[int, Any]]] | None = None
        #: every rank's buffers, as :meth:`rank_buffers` gathered them (the same lifetime).
        self._rank_buffers: list[dict[str, torch.Tensor]] | None = None

    # -- training -----------------------------------------------------------------------------

    def before_train_step(self, sync: bool | None) -> None:
        """Before a training batch: free the parameters an evaluation gathered (if its end was
        not called), and with *sync* not None, whether this backward reduce-scatters the
        gradients (False: each rank accumulates them unsharded, FSDP2's ``no_sync``)."""
        self._gathered_state = self._rank_buffers = None
        if self.gathered:
            self.end_evaluation()
        if sync is not None:
            for root in self.roots:
                root.set_requires_gradient_sync(sync)
        if self.forward_prefetch:  # the roots' parameters too, before the first unit's forward
            for root in self.roots:
                root.unshard()

    def begin_evaluation(self) -> None:
        """Gather every parameter once and keep them through the stream's forwards, so that they
        take no collective (the ranks' evaluation shards may differ in length). A collective:
        every rank calls it."""
        for root in self.roots:
            root.set_reshard_after_forward(False)
        for unit in self._units:
            unit.unshard()
        self.gathered = True

    def end_evaluation(self) -> None:
        """Free the gathered parameters; back to the training settings (each root keeps its
        parameters gathered after forward, the other units reshard unless
        ``reshard_after_forward`` is False)."""
        for root in self.roots:
            root.set_reshard_after_forward(self.reshard_after_forward)
            root.set_reshard_after_forward(False, recurse=False)
        for unit in self._units:
            unit.reshard()
        self.gathered = False

    # -- state --------------------------------------------------------------------------------

    def full_state(self) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """The modules' full state and each optimizer's (``{name: {"state", "param_groups"}}``,
        by parameter ids as ``optimizer.state_dict()`` numbers them) on rank 0's host (empty
        on the other ranks). A collective, except when asked again before the next training
        batch or load: the tensors gathered then are kept until that batch (rank 0 alone may
        ask again after the last save, to export the weights), the hyperparameters are read
        afresh."""
        if self._gathered_state is None:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            module_state: dict[str, Any] = dict(get_model_state_dict(self.root, options=options))
            # DCP gives an optimizer without state one by stepping it (lr 0): AdamW's step count
            # would then start at 1. The ranks step together: they agree on which have state.
            stepped = [optimizer for optimizer in self.optimizers.values() if optimizer.state]
            merged: dict[str, Any] = (
                dict(get_optimizer_state_dict(self.root, stepped, options=options)) if stepped else {}
            )
            by_name = merged.get("state", {})
            tensors = {
                name: {i: by_name[fqn] for i, fqn in enumerate(order) if fqn in by_name}
                for name, order in self.orders.items()
            }
            self._gathered_state = (module_state, tensors)
        if not self.world.is_zero:
            return {}, {}
        module_state, tensors = self._gathered_state
        return module_state, {
            # ids and hyperparameters of the optimizer itself (no tensors)
            name: {"state": tensors[name], "param_groups": optimizer.state_dict()["param_groups"]}
            for name, optimizer in self.optimizers.items()
        }

    def rank_buffers(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's persistent buffers by rank, on the host: FSDP2 shards parameters only,
        and a buffer a rank updates itself (a batch norm's running statistics, from its own
        shard of each batch) differs from rank to rank, where a full or DCP state keeps one
        rank's. A collective, except when asked again before the next training batch or load
        (as :meth:`full_state`)."""
        if self._rank_buffers is None:
            names = {name for name, _ in self.root.named_buffers()}
            mine = {
                k: v.detach().cpu().clone()
                for k, v in self.root.state_dict().items()
                if k in names and isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
            }
            self._rank_buffers = self.world.all_gather_object(mine) if self.world.size > 1 else [mine]
        return self._rank_buffers

    def load_rank_buffers(self, ranks: list[Mapping[str, torch.Tensor]]) -> None:
        """Give this rank back its own buffers of :meth:`rank_buffers` (saved on as many ranks)."""
        live = dict(self.root.named_buffers())
        with torch.no_grad():
            for name, value in ranks[self.world.rank].items():
                if name in live:
                    live[name].copy_(value)

    def load_full_module(self, module_state: Mapping[str, Any]) -> None:
        """Load a full module state (tensors on the host): each rank takes its own shards."""
        self._gathered_state = self._rank_buffers = None
        live = self.root.state_dict()
        self.root.load_state_dict({k: _shard_like(v, live.get(k)) for k, v in module_state.items()})

    def load_full_state(
        self, module_state: Mapping[str, Any], optimizer_states: Mapping[str, Mapping[str, Any]]
    ) -> None:
        """Load a full state (tensors on the host): each rank takes its own shards, by local
        slicing: no collective (rank 0 alone loads a checkpoint to check it before the others
        do). *optimizer_states* are by optimizer name, numbered as :meth:`full_state` numbers them."""
        self.load_full_module(module_state)
        for name, optimizer in self.optimizers.items():
            saved = optimizer_states[name]
            params = [p for group in optimizer.param_groups for p in group["params"]]
            state = {
                int(i): {k: _shard_like(v, params[int(i)]) for k, v in entry.items()}
                for i, entry in saved["state"].items()
            }
            optimizer.load_state_dict({"state": state, "param_groups": list(saved["param_groups"])})


def _prefetch(units: list[torch.nn.Module], forward: int, backward: int) -> None:
    """Explicit prefetching, as pytorch/examples' FSDP2 example sets it: each unit all-gathers
    the next *forward* units before its forward, the previous *backward* before its backward."""
    for i, unit in enumerate(units):
        if forward and i + 1 < len(units):
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + forward])  # type: ignore[operator]
        if backward and i > 0:
            unit.set_modules_to_backward_prefetch(units[max(0, i - backward) : i][::-1])  # type: ignore[operator]


def _shard_like(value: Any, template: Any) -> Any:
    """*value* (a full tensor) as this rank's part of a ``DTensor`` placed like *template*, when
    the template is one of its shape; else *value*. Local: each rank slices its own shard."""
    if (
        isinstance(template, DTensor)
        and isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and tuple(value.shape) == tuple(template.shape)
    ):
        value = value.to(device=template.device)
        return distribute_tensor(value, template.device_mesh, template.placements, src_data_rank=None)
    return value
