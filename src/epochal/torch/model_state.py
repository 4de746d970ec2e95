"""The state of a :class:`~epochal.torch.TorchModel`: what a checkpoint saves, checks and loads.

:class:`TorchState` is the part of TorchModel that turns its modules, optimizers and counters
into plain data (numpy arrays and JSON values, :mod:`epochal.torch.state`) and back:

- ``module``: the root module's state (several modules: each key prefixed with its module's
  name, as an ``nn.ModuleDict`` names them);
- ``optimizer`` (one optimizer) or ``optimizers`` (``{name: state}``, several): each
  ``{"state", "param_groups"}`` as ``Optimizer.state_dict()`` numbers them;
- ``steps``: the accumulation window's position, the optimizer steps taken and the gradients
  held between batches (inside an accumulation window, or left by a step of its own under
  manual optimization), so a run resumed from any batch continues bitwise;
- ``scaler`` (``16-mixed``) and ``train_metrics`` (with ``train_stream_metrics``).

A sharded checkpoint (DCP) holds the tensors in its own files (:meth:`sharded_state_dict`) and
the rest here (:meth:`rest_state_dict`); its plain state then names the DCP directory
(``dcp``) in place of ``module`` and ``optimizer``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from epochal.torch import sharded_state
from epochal.torch.checks import check_module, check_optimizer, check_steps, compare_keys
from epochal.torch.loading import load_module, loads_plainly
from epochal.torch.state import destinations, from_plain, from_plain_or_live, pinned_host_copies, to_plain

__all__ = ["TorchState"]


def _plain_optimizer(state: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "state": {str(pid): to_plain(s, share=True) for pid, s in state.get("state", {}).items()},
        "param_groups": [to_plain(group) for group in state.get("param_groups", [])],
    }


class TorchState:
    """The state methods of :class:`~epochal.torch.TorchModel` (see the module's docstring)."""

    # set by TorchModel
    parts: Any
    precision: Any
    device: torch.device
    world: Any
    accumulated: int
    accumulate_grad_batches: int
    optimizer_steps: int
    pinned_state_copies: bool
    automatic_optimization: bool
    _sharded: Any
    _train_metrics: Any
    _left_out_warned: bool

    @property
    def raw_module(self) -> torch.nn.Module:
        """The module whose parameters are trained (inside the DDP and ``torch.compile``
        wrappers); with several modules, an ``nn.ModuleDict`` of them by name."""
        root: torch.nn.Module = self.parts.root
        return root

    @property
    def _optimizer_key(self) -> str:
        return "optimizers" if self.parts.several_optimizers else "optimizer"

    def _by_key(self, states: Mapping[str, Any]) -> dict[str, Any]:
        """``{"optimizer": state}`` for one optimizer, ``{"optimizers": {name: state}}`` for several."""
        if self.parts.several_optimizers:
            return {"optimizers": dict(states)}
        return {"optimizer": next(iter(states.values()))}

    def _saved_optimizers(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The saved optimizer states of *state* by name (as :meth:`_by_key` wrote them)."""
        if self.parts.several_optimizers:
            return dict(state["optimizers"])
        return {next(iter(self.parts.optimizers)): state["optimizer"]}

    # -- saving -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"module", "optimizer" | "optimizers", "steps"}`` (+ ``"scaler"`` under 16-mixed)
        as plain data.

        Like torch's ``state_dict``, the arrays of CPU tensors are views of them, not copies
        (read-only): they change as training goes on. ``copy.deepcopy`` the state to keep it.

        ``steps`` holds the accumulation window's position and the gradients held between
        batches, so a run resumed there continues exactly. On several processes the
        gradients of an accumulation window are each rank's own (``steps.rank_grads``,
        gathered from every rank: a collective inside a window, so every rank calls this); the
        rest is the same on every rank. Under FSDP the same full state is gathered to rank 0's
        host (a collective; the other ranks get empty parts); inside an accumulation window it
        leaves the window out, with a warning (:attr:`state_exact`).
        """
        if self._sharded is not None:
            return self._sharded_state()
        module = self.raw_module
        with pinned_host_copies(self.pinned_state_copies and self.device.type == "cuda"):
            state: dict[str, Any] = {
                "module": {k: to_plain(v, share=True) for k, v in module.state_dict().items()},
                **self._by_key(
                    {name: _plain_optimizer(opt.state_dict()) for name, opt in self.parts.optimizers.items()}
                ),
            }
        state.update(self.rest_state_dict())
        return state

    def rest_state_dict(self) -> dict[str, Any]:
        """The state besides the modules' and optimizers' tensors: ``steps`` (+ ``scaler``).

        Inside an accumulation window on several processes a collective (every rank calls it).
        """
        if self._sharded is not None:
            state: dict[str, Any] = {"steps": self._sharded_steps()}
        else:
            state = {"steps": {"accumulated": self.accumulated, "optimizer_steps": self.optimizer_steps}}
        if self._sharded is None:
            grads = {
                name: to_plain(p.grad, share=True)
                for name, p in self.raw_module.named_parameters()
                if p.grad is not None
            }
            if grads and not self.automatic_optimization:
                # every gradient a manual step left is the same on every rank (never no_sync)
                state["steps"]["grads"] = grads
            elif self.accumulated:
                if self.world is not None and self.parts.ddp:
                    state["steps"]["rank_grads"] = self.world.all_gather_object(grads)
                else:
                    state["steps"]["grads"] = grads
        if self.precision.scaler is not None:
            state["scaler"] = to_plain(self.precision.scaler.state_dict())
        if self._train_metrics is not None:
            state["train_metrics"] = self._train_metrics.by_rank(self.world)
        return state

    def sharded_state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` for ``torch.distributed.checkpoint``: this rank's
        tensors (DTensor shards under FSDP), never gathered (:mod:`epochal.torch.sharded_state`)."""
        return sharded_state.sharded_state(self.raw_module, list(self.parts.optimizers.values()))

    def load_sharded_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put a :meth:`sharded_state_dict` that DCP loaded back into the modules and optimizers."""
        sharded_state.load_sharded_state(self.raw_module, list(self.parts.optimizers.values()), state)

    @property
    def state_exact(self) -> bool:
        """Whether a state taken now holds all a resumed run needs to continue bitwise.

        False only under FSDP inside a gradient accumulation window: FSDP holds the window's
        gradients unsharded inside the module, and a state taken then leaves the window out
        (:meth:`state_dict` warns). A checkpoint plugin defers its periodic saves until it is
        True again, at the window's optimizer step.
        """
        return self._sharded is None or not self.accumulated

    def _sharded_steps(self) -> dict[str, Any]:
        """``steps`` of a state taken under FSDP: every rank's own buffers (``rank_buffers``: a
        collective); inside a window, the window left out (warned)."""
        steps: dict[str, Any] = {"accumulated": 0, "optimizer_steps": self.optimizer_steps}
        buffers = self._sharded.rank_buffers()
        if any(buffers):
            steps["rank_buffers"] = [{k: to_plain(v) for k, v in rank.items()} for rank in buffers]
        if self.accumulated:
            steps["left_out"] = self.accumulated
        if self.accumulated and not self._left_out_warned:  # once per run: every rank takes it
            self._left_out_warned = True
            warnings.warn(
                f"TorchModel strategy 'fsdp': a state taken inside a gradient accumulation window "
                f"leaves the window out ({self.accumulated} of {self.accumulate_grad_batches} batches: "
                "FSDP holds their gradients unsharded inside the module). Its weights and optimizer "
                "state are exact; a run resumed from it starts a new window, so it is not bitwise a "
                "straight run. Periodic checkpoints wait for the window's optimizer step; a final, "
                "interrupt or error save cannot",
                RuntimeWarning,
                stacklevel=4,
            )
        return steps

    def _warn_left_out(self, steps: Mapping[str, Any]) -> None:
        if steps.get("left_out"):
            warnings.warn(
                f"TorchModel: the state was saved under FSDP inside a gradient accumulation window, "
                f"whose {steps['left_out']} batch(es) of gradients it left out: training continues "
                "with a new window, so this run is not bitwise the straight run",
                RuntimeWarning,
                stacklevel=4,
            )

    def _sharded_state(self) -> dict[str, Any]:
        """:meth:`state_dict` under FSDP: the full state on rank 0 (the other ranks' is empty)."""
        steps = self._sharded_steps()
        module_state, optimizers = self._sharded.full_state()
        state: dict[str, Any] = {
            "module": {k: to_plain(v, share=True) for k, v in module_state.items()},
            **self._by_key(
                {name: _plain_optimizer(optimizers.get(name, {})) for name in self.parts.optimizers}
            ),
            "steps": steps,
        }
        if self._train_metrics is not None:
            state["train_metrics"] = self._train_metrics.by_rank(self.world)
        return state

    # -- loading ------------------------------------------------------------------------------

    def load_destinations(self) -> dict[str, Any]:
        """Where a reader may read a state of :meth:`state_dict` straight into (issue 32): the
        same tree with, for each CPU tensor that can take its saved bytes as they are, a
        writable array on that tensor's own memory (the modules' parameters and buffers, the
        optimizers' existing state). :meth:`load_state_dict` then finds those values in place
        and copies nothing. Empty under FSDP, and for the modules when their
        ``load_state_dict`` does more than copy (hooks, custom loaders).

        A reader must fill the destinations only once the whole checkpoint has verified
        (the standard checkpoint plugin does): they are the live model.
        """
        if self._sharded is not None:
            return {}
        module = self.raw_module
        out: dict[str, Any] = {}
        if loads_plainly(module):
            out["module"] = destinations(module.state_dict(keep_vars=True))
        states = {}
        for name, opt in self.parts.optimizers.items():
            views = {str(pid): destinations(s) for pid, s in opt.state_dict()["state"].items()}
            states[name] = {"state": {pid: v for pid, v in views.items() if v}}
        out.update(self._by_key(states))
        return out

    def check_state(self, state: Any) -> list[str]:
        """Every reason *state* cannot be loaded into this model (empty: it fits).

        ``steps`` may be missing (a state saved by an earlier epochal) and ``scaler`` present
        or missing (a state saved under another precision: the scaler starts afresh).
        """
        sharded = isinstance(state, Mapping) and "dcp" in state
        tensors = {"dcp"} if sharded else {"module", self._optimizer_key}
        extra = {"dcp_only", "dcp_storage"} if sharded else set()
        problems = compare_keys(
            "", {*tensors, *extra, "steps", "scaler", "train_metrics"}, state, missing_ok=True
        )
        if isinstance(state, Mapping) and (missing := tensors - set(state)):
            problems.append(f"missing keys {sorted(missing)}")
        if problems:
            return problems
        if sharded:  # DCP checks the tensors when it loads them (every rank, a collective)
            if not isinstance(state["dcp"], str):
                problems.append(f"dcp must be a checkpoint directory, not {state['dcp']!r:.100}")
            if state.get("dcp_only", "model") != "model":
                problems.append(f"dcp_only must be 'model', not {state['dcp_only']!r:.100}")
            if not isinstance(state.get("dcp_storage", {}), Mapping):
                problems.append("dcp_storage must be a table of the URL's filesystem options")
        else:
            problems += check_module("module.", self.raw_module.state_dict(), state["module"])
            if self.parts.several_optimizers:
                problems += compare_keys("optimizers.", self.parts.optimizers, state["optimizers"])
            if not problems:
                for name, saved in self._saved_optimizers(state).items():
                    prefix = f"optimizers.{name}." if self.parts.several_optimizers else "optimizer."
                    problems += check_optimizer(self.parts.optimizers[name], saved, prefix)
        steps = state.get("steps", {"accumulated": 0})
        processes = self.world.size if self.parts.ddp else 1
        problems += check_steps(steps, self.accumulate_grad_batches, self._sharded is not None, processes)
        return problems

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state returned by :meth:`state_dict`, bitwise, onto the model's device.

        On CPU, writable arrays (a checkpoint just read) become the memory of the parameters,
        buffers and optimizer state, without a copy, and are marked read-only: a second load of
        the same state copies. Other arrays are copied once, into the tensors.

        :raises ValueError: naming every missing or unexpected key and every shape or dtype
            mismatch, before anything is changed.
        """
        problems = self.check_state(state)
        if problems:
            raise ValueError("cannot load TorchModel state: " + "; ".join(problems))
        module = self.raw_module
        optimizers = self.parts.optimizers
        if "dcp" in state:  # a sharded checkpoint: its tensors are in that DCP directory
            only = state.get("dcp_only") == "model"  # the weights only (fine-tuning)
            options = state.get("dcp_storage")  # dcp is a URL: its filesystem's options
            sharded_state.load_from(
                module, list(optimizers.values()), state["dcp"], model_only=only, storage_options=options
            )
            if not only:
                self._load_rest(state)
            return
        saved = self._saved_optimizers(state)
        if self._sharded is not None:
            self._sharded.load_full_state(  # copies on the host; each rank keeps its shards
                {k: from_plain(v) for k, v in state["module"].items()},
                {
                    name: {
                        "state": {int(pid): from_plain(s) for pid, s in saved[name]["state"].items()},
                        "param_groups": [
                            from_plain(group, template)
                            for group, template in zip(
                                saved[name]["param_groups"], opt.state_dict()["param_groups"], strict=True
                            )
                        ],
                    }
                    for name, opt in optimizers.items()
                },
            )
            self.accumulated = 0
            self.optimizer_steps = int(state.get("steps", {}).get("optimizer_steps", 0))
            self._warn_left_out(state.get("steps", {}))
            self._load_rank_buffers(state.get("steps", {}))
            if self._train_metrics is not None:
                self._train_metrics.load_by_rank(state.get("train_metrics"), self.world)
            return
        load_module(module, state["module"], may_share=not self.parts.ddp)
        for name, opt in optimizers.items():
            current = opt.state_dict()
            live = current["state"]
            # on the host: torch moves each value where its parameter's policy wants it (no copy
            # where it is there already); a value read into the live tensor (load_destinations)
            # is that tensor
            values = {
                int(pid): from_plain_or_live(s, live.get(int(pid))) for pid, s in saved[name]["state"].items()
            }
            opt.load_state_dict(
                {
                    "state": values,
                    "param_groups": [
                        from_plain(group, template)
                        for group, template in zip(
                            saved[name]["param_groups"], current["param_groups"], strict=True
                        )
                    ],
                }
            )
            _keep_saved_dtypes(opt, values)
        self._load_rest(state)

    def load_weights(self, state: Mapping[str, Any]) -> None:
        """Load only the modules' weights of a :meth:`state_dict` (fine-tuning: the ``load``
        plugin's ``weights_only``): the optimizers, their learning rates and state, the step
        count and the accumulation window stay this model's own, as configured.

        :raises ValueError: naming every missing or unexpected key and every shape or dtype
            mismatch of the modules, before anything is changed.
        """
        module = self.raw_module
        if "dcp" in state:  # a sharded checkpoint: its modules' tensors, read by every rank
            options = state.get("dcp_storage")
            sharded_state.load_from(
                module,
                list(self.parts.optimizers.values()),
                state["dcp"],
                model_only=True,
                storage_options=options,
            )
            return
        problems = check_module("module.", module.state_dict(), state.get("module"))
        if problems:
            raise ValueError("cannot load TorchModel weights: " + "; ".join(problems))
        if self._sharded is not None:
            self._sharded.load_full_module({k: from_plain(v) for k, v in state["module"].items()})
        else:
            load_module(module, state["module"], may_share=not self.parts.ddp)

    def _load_rank_buffers(self, steps: Mapping[str, Any]) -> None:
        """Under FSDP, this rank's own buffers of a state saved on as many ranks (on another
        number of processes every rank keeps the saved ones: rank 0's)."""
        ranks = steps.get("rank_buffers")
        if self._sharded is None or not isinstance(ranks, list) or len(ranks) != self.world.size:
            return
        self._sharded.load_rank_buffers([{k: from_plain(v) for k, v in rank.items()} for rank in ranks])

    def _load_rest(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`rest_state_dict` saved: the accumulation window, the gradients,
        the scaler."""
        module = self.raw_module
        steps = state.get("steps", {})
        self.accumulated = int(steps.get("accumulated", 0))
        self.optimizer_steps = int(steps.get("optimizer_steps", 0))
        self._warn_left_out(steps)
        grads = steps.get("grads", {})
        if "rank_grads" in steps:
            grads = steps["rank_grads"][self.world.rank]
        for name, param in module.named_parameters():
            param.grad = from_plain(grads[name], param, share=True) if name in grads else None
        self._load_rank_buffers(steps)
        if self.precision.scaler is not None and "scaler" in state:
            self.precision.scaler.load_state_dict(from_plain(state["scaler"]))
        if self._train_metrics is not None:
            self._train_metrics.load_by_rank(state.get("train_metrics"), self.world)


def _keep_saved_dtypes(optimizer: torch.optim.Optimizer, values: Mapping[int, Mapping[str, Any]]) -> None:
    """Give the optimizer's state back the dtypes it was saved in.

    torch's ``Optimizer.load_state_dict`` casts floating state to its parameter's dtype; a
    state an optimizer made before the module was cast (Adagrad's float32 ``sum`` beside
    ``bf16-true`` parameters) would come back bf16 and the resumed run compute otherwise.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for pid, entry in values.items():
        loaded = optimizer.state.get(params[pid]) if pid < len(params) else None
        if not loaded:
            continue
        for key, value in entry.items():
            now = loaded.get(key)
            if isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor) and now.dtype != value.dtype:
                loaded[key] = now.to(value.dtype)
