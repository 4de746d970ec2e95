"""The PyTorch adapter: train a ``torch.nn.Module`` in an epochal loop (``epochal[torch]``).

:class:`TorchModel` wraps a module, an optimizer and a loss function into an object with the
model protocol of epochal (``train_step``, ``eval_step``, ``state_dict``, ``load_state_dict``)::

    model = TorchModel(net, torch.optim.AdamW(net.parameters()), torch.nn.functional.cross_entropy,
                       metrics={"accuracy": accuracy, "f1": torchmetrics.F1Score(...)},
                       device="auto", precision="bf16-mixed", accumulate_grad_batches=4,
                       gradient_clip_val=1.0)

Its state holds numpy arrays and plain values only (:mod:`epochal.torch.state`), so a
checkpoint needs neither pickle nor torch to be read, and restoring it is bitwise exact. Saving
and loading copy no tensor on CPU (issue 32): the state's arrays are read-only views of the
tensors, and a state just read from a checkpoint becomes the tensors' memory.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch.nn.parallel import DistributedDataParallel

from epochal._options import PositiveFloat, PositiveInt, check_options
from epochal.errors import ConfigError
from epochal.torch import sharded_state
from epochal.torch.checks import check_module, check_optimizer, check_steps, compare_keys
from epochal.torch.device import Precision, move_to, resolve_device
from epochal.torch.fsdp import Sharded, Strategy, check_strategy
from epochal.torch.loading import load_module, loads_plainly
from epochal.torch.state import (
    destinations,
    from_plain,
    from_plain_or_live,
    pinned_host_copies,
    to_plain,
)
from epochal.torch.train_metrics import TrainMetrics

__all__ = ["TorchModel"]

Metric = Callable[[Any, Any], Any]


def is_stream_metric(metric: Any) -> bool:
    """Whether *metric* follows torchmetrics' protocol (``update``/``compute``/``reset``)."""
    return all(callable(getattr(metric, name, None)) for name in ("update", "compute", "reset"))


class TorchModel:
    """A ``torch.nn.Module`` with its optimizer and loss, as an epochal model.

    :param module: the network; it is called with the inputs of a batch (``module(x)``, or
        ``module(*x)`` for a tuple, ``module(**x)`` for a dict). A ``torch.compile``\\ d module
        works; its state is saved under the original module's names.
    :param optimizer: the optimizer of the module's parameters (made before or after moving
        the module: the parameters are moved in place).
    :param loss_fn: ``loss_fn(outputs, targets)`` returns the scalar loss tensor.
    :param metrics: ``{name: metric}``: a function ``(outputs, targets) -> number`` (a batch
        mean, averaged over a stream weighted by batch sizes), or an object with
        ``update(outputs, targets)``/``compute()``/``reset()`` (torchmetrics' protocol), computed
        over a whole evaluation stream. Functions apply to training and evaluation batches,
        metric objects to evaluation streams (and to training epochs with
        *train_stream_metrics*).
    :param device: ``"auto"`` (cuda, else mps, else cpu), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
    :param precision: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"`` or ``"bf16-true"``.
    :param accumulate_grad_batches: step the optimizer every N batches, gradients summed over
        them (each batch's loss divided by N). The windows run over consecutive batches of the
        run, across epoch boundaries; a partial window is saved in checkpoints (under FSDP
        periodic checkpoints wait for the window's optimizer step: :attr:`state_exact`).
    :param gradient_clip_val: clip gradients before each optimizer step (None: no clipping).
    :param gradient_clip_algorithm: ``"norm"`` (total 2-norm) or ``"value"`` (each element).
    :param ddp_options: keyword arguments for ``DistributedDataParallel`` on several processes
        (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``, ...).
    :param strategy: on several processes, ``"ddp"`` (a replica of the module on every rank) or
        ``"fsdp"`` (the module sharded across the ranks by FSDP2: :mod:`epochal.torch.fsdp`).
        On one process both train the module as it is.
    :param train_stream_metrics: also compute the metric objects over each training epoch
        (updated with every training batch, computed and reset at the epoch's end, logged as
        ``train.<name>`` in the epoch's row; Lightning's ``self.log(metric, on_epoch=True)``):
        :mod:`epochal.torch.train_metrics`. False: metric objects serve evaluation only.
    :param pinned_state_copies: on CUDA, :meth:`state_dict` (a checkpoint's save) copies the
        tensors into page-locked host memory, all copies queued before one wait, and torch's
        caching host allocator keeps that memory for the next save: about the state's size of
        host memory that cannot be swapped out, held from the first save on (what
        ``torch.distributed.checkpoint``'s asynchronous stager does). False: pageable copies
        made and freed at each save (``tensor.cpu()``, what ``torch.save`` does), slower.

    A batch is ``(inputs, targets)`` or a mapping with ``"inputs"`` and ``"targets"``; arrays
    and tensors in it (nested in tuples, lists, dicts) are moved to the device. Each step
    returns ``{"loss": tensor, **metrics}``: 0-d tensors left on the device, so a step does
    not wait for the device; ``float(value)`` reads one.

    Between ``backward()`` and the optimizer step, the loop's ``before_optimizer_step`` hook is
    called (gradients unscaled, not yet clipped), so a plugin can read or change gradients.

    On several processes the loop calls :meth:`distribute`: the module is wrapped in
    ``DistributedDataParallel`` (gradients averaged across the ranks at every optimizer step,
    not on the accumulation steps between), evaluation runs the unwrapped module (no
    collectives, so the ranks' evaluation shards may differ in length), metric objects are
    synced across the ranks when computed, and the state keeps the module's own names, so a
    checkpoint of N processes loads on one and the other way round.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        metrics: Mapping[str, Any] | None = None,
        *,
        device: str | torch.device = "auto",
        precision: str = "32-true",
        accumulate_grad_batches: PositiveInt = 1,
        gradient_clip_val: PositiveFloat | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        ddp_options: Mapping[str, Any] | None = None,
        strategy: Strategy = "ddp",
        train_stream_metrics: bool = False,
        pinned_state_copies: bool = True,
    ) -> None:
        options = {
            "accumulate_grad_batches": accumulate_grad_batches,
            "gradient_clip_val": gradient_clip_val,
            "gradient_clip_algorithm": gradient_clip_algorithm,
            "strategy": strategy,
            "train_stream_metrics": train_stream_metrics,
            "pinned_state_copies": pinned_state_copies,
        }
        check_options("TorchModel", TorchModel, options, "TorchModel", ConfigError, keys=list(options))
        check_strategy(strategy, precision, ddp_options)
        _check_stepping(optimizer)
        self.strategy = strategy
        self.device = resolve_device(device)
        self.precision = Precision(precision, self.device)
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        #: the module as given (possibly compiled); its state is the original module's.
        self.module = module.to(self.device)
        if self.precision.param_dtype is not None:
            self.module.to(self.precision.param_dtype)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        metrics = dict(metrics or {})
        self.metrics = metrics
        self._batch_metrics: dict[str, Metric] = {k: m for k, m in metrics.items() if not is_stream_metric(m)}
        self._stream_metrics: dict[str, Any] = {k: m for k, m in metrics.items() if is_stream_metric(m)}
        for metric in self._stream_metrics.values():
            if isinstance(metric, torch.nn.Module):
                metric.to(self.device)
        #: copies of the metric objects over the training epoch (None: evaluation only).
        self._train_metrics = (
            TrainMetrics(self._stream_metrics, self.device)
            if train_stream_metrics and self._stream_metrics
            else None
        )
        self.pinned_state_copies = pinned_state_copies
        #: batches whose gradients are accumulated but not yet applied.
        self.accumulated = 0
        self._left_out_warned = False
        #: optimizer steps taken; ``optimizer_stepped`` tells whether the last batch took one.
        self.optimizer_steps = 0
        self.optimizer_stepped = False
        self._loop: Any = None
        self.ddp_options = dict(ddp_options or {})
        #: the world of :meth:`distribute` (None: one process); ``_ddp`` the DDP wrapper.
        self.world: Any = None
        self._ddp: DistributedDataParallel | None = None
        #: the FSDP2 sharding of :meth:`distribute` under strategy "fsdp" (None: not sharded).
        self._sharded: Sharded | None = None
        #: the module evaluation runs (``module`` without the DDP wrapper).
        self._eval_module: torch.nn.Module = self.module

    def distribute(self, world: Any) -> None:
        """Train on the ranks of *world* (an :class:`epochal.distributed.World`): wrap in DDP, or
        shard with FSDP2 under strategy "fsdp".

        Called once by the loop, before training. On CUDA the module moves to this rank's GPU
        (``cuda:LOCAL_RANK``); rank 0's parameters and buffers are broadcast to every rank (by
        DDP, or before FSDP2 shards them).

        :raises ConfigError: a CPU module under the NCCL backend; "fsdp" on a module without
            parameters.
        """
        if self._ddp is not None or self._sharded is not None or world.size < 2:
            return
        device = self.device
        if device.type == "cuda":
            device = torch.device("cuda", world.local_rank % torch.cuda.device_count())
        elif world.backend == "nccl":
            raise ConfigError(
                f"TorchModel device {str(device)!r} cannot train under the NCCL backend (GPUs only): "
                "use device = 'auto' or 'cuda', or [distributed] backend = 'gloo'"
            )
        if device != self.device:
            self.device = device
            self.precision = Precision(self.precision.name, device)
            self.module.to(device)
            for metric in self._stream_metrics.values():
                if isinstance(metric, torch.nn.Module):
                    metric.to(device)
            if self._train_metrics is not None:
                self._train_metrics.to(device)
        for name, metric in self._stream_metrics.items():
            if not callable(getattr(metric, "sync", None)):  # torchmetrics' Metric syncs in compute()
                warnings.warn(
                    f"TorchModel metric {name!r} ({type(metric).__name__}) has no sync(): on "
                    f"{world.size} processes its value is computed over this rank's shard of each "
                    "stream only (torchmetrics' metrics sync across the ranks)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if self.strategy == "fsdp":
            self._sharded = Sharded(self.raw_module, self.optimizer, world, device, self.precision.name)
            self.world = world
            return
        options: dict[str, Any] = {"device_ids": [device] if device.type == "cuda" else None}
        options.update(self.ddp_options)
        self._eval_module = self.module
        self._ddp = DistributedDataParallel(self.module, **options)
        self.module = self._ddp
        self.world = world

    # -- the loop -----------------------------------------------------------------------------

    def attach(self, loop: Any) -> None:
        """Called by the loop that runs this model, so that steps can call its hooks."""
        self._loop = loop

    @property
    def sharded(self) -> bool:
        """Whether the module is sharded across the ranks by FSDP2 (strategy "fsdp", several
        processes, after :meth:`distribute`)."""
        return self._sharded is not None

    @property
    def raw_module(self) -> torch.nn.Module:
        """The module whose parameters are trained (inside the DDP and ``torch.compile`` wrappers)."""
        module = self.module
        while True:
            if isinstance(module, DistributedDataParallel):
                module = module.module
                continue
            inner = getattr(module, "_orig_mod", None)
            if not isinstance(inner, torch.nn.Module):
                return module
            module = inner

    def summary(self) -> str:
        """One line: the module, its parameters (trainable), their size, precision and device."""
        from epochal.torch.describe import describe

        return describe(self)

    def _split(self, batch: Any) -> tuple[Any, Any]:
        batch = move_to(batch, self.device, self.precision.param_dtype)
        if isinstance(batch, Mapping):
            return batch["inputs"], batch["targets"]
        inputs, targets = batch
        return inputs, targets

    @staticmethod
    def _forward(module: torch.nn.Module, inputs: Any) -> Any:
        if isinstance(inputs, Mapping):
            return module(**inputs)
        if isinstance(inputs, (tuple, list)):
            return module(*inputs)
        return module(inputs)

    # -- steps --------------------------------------------------------------------------------

    def train_step(self, batch: Any) -> dict[str, Any]:
        """Forward, backward, and (every ``accumulate_grad_batches``) an optimizer step."""
        inputs, targets = self._split(batch)
        if not self.module.training:  # train() walks every submodule: only when needed
            self.module.train()
        precision = self.precision
        window = self.accumulate_grad_batches
        # DDP all-reduces in backward(): only on the batch that steps the optimizer
        sync = self._ddp is None or self.accumulated + 1 >= window
        if self._sharded is not None:
            self._sharded.before_train_step(self.accumulated + 1 >= window if window > 1 else None)
        with contextlib.nullcontext() if sync else self._ddp.no_sync():  # type: ignore[union-attr]
            with precision.autocast():
                outputs = self._forward(self.module, inputs)
                loss = self.loss_fn(outputs, targets)
            precision.backward(loss / window if window > 1 else loss)
        self.accumulated += 1
        self.optimizer_stepped = self.accumulated >= window
        if self.optimizer_stepped:
            self._optimizer_step()
        if self._train_metrics is not None:
            self._train_metrics.update(outputs, targets)
        return self._results(loss, outputs, targets)

    def _optimizer_step(self) -> None:
        optimizer = self.optimizer
        self.precision.unscale(optimizer)
        loop = self._loop
        if loop is not None:
            hook = loop.hooks.before_optimizer_step
            if hook is not None:
                hook(loop, optimizer)
        if self.gradient_clip_val is not None:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if self.gradient_clip_algorithm == "norm":
                torch.nn.utils.clip_grad_norm_(params, self.gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_value_(params, self.gradient_clip_val)
        self.precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        self.accumulated = 0
        self.optimizer_steps += 1

    def eval_step(self, batch: Any) -> dict[str, Any]:
        """The loss and batch metrics on *batch* in eval mode, without gradients.

        Metric objects are updated with the batch; :meth:`end_evaluation` computes them. The
        training mode of every submodule is restored afterwards. On several processes the
        module runs without its DDP wrapper: evaluation takes no collective.
        """
        inputs, targets = self._split(batch)
        module = self._eval_module
        modes = [(m, m.training) for m in module.modules()]
        module.eval()
        try:
            with torch.no_grad(), self.precision.autocast():
                outputs = self._forward(module, inputs)
                loss = self.loss_fn(outputs, targets)
                for metric in self._stream_metrics.values():
                    metric.update(outputs, targets)
        finally:
            for submodule, mode in modes:
                submodule.training = mode
        return self._results(loss, outputs, targets)

    def begin_evaluation(self, stream: str) -> None:
        """Reset the metric objects before an evaluation stream (under FSDP, gather the
        parameters for the stream: a collective)."""
        if self._sharded is not None:
            self._sharded.begin_evaluation()
        for metric in self._stream_metrics.values():
            metric.reset()

    def end_evaluation(self, stream: str) -> dict[str, Any]:
        """The metric objects' values over the whole stream (numbers, or lists for tensors).

        On several processes torchmetrics' ``compute()`` gathers the states of every rank (a
        collective: every rank calls this), so each value is that of the whole stream.
        """
        if self._sharded is not None:
            self._sharded.end_evaluation()
        results: dict[str, Any] = {}
        for name, metric in self._stream_metrics.items():
            value = metric.compute()
            if isinstance(value, torch.Tensor):
                value = value.item() if value.numel() == 1 else value.tolist()
            results[name] = value
        return results

    def end_train_epoch(self) -> dict[str, Any]:
        """With *train_stream_metrics*: the metric objects' values over the training epoch that
        just ended (a collective on several processes, as :meth:`end_evaluation`), then reset."""
        return self._train_metrics.end_epoch() if self._train_metrics is not None else {}

    def _results(self, loss: torch.Tensor, outputs: Any, targets: Any) -> dict[str, Any]:
        results: dict[str, Any] = {"loss": loss.detach()}
        if self._batch_metrics:
            if isinstance(outputs, torch.Tensor):
                outputs = outputs.detach()
            with torch.no_grad():
                for name, fn in self._batch_metrics.items():
                    value = fn(outputs, targets)
                    results[name] = value.detach() if isinstance(value, torch.Tensor) else value
        return results

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"module", "optimizer", "steps"}`` (+ ``"scaler"`` under 16-mixed) as plain data.

        Like torch's ``state_dict``, the arrays of CPU tensors are views of them, not copies
        (read-only): they change as training goes on. ``copy.deepcopy`` the state to keep it.

        ``steps`` holds the accumulation window's position and, inside a window, the
        gradients gathered so far, so a run resumed mid-window continues exactly. On several
        processes those are each rank's own (``steps.rank_grads``, gathered from every rank: a
        collective inside a window, so every rank calls this); the rest is the same on every rank.
        Under FSDP the same full state is gathered to rank 0's host (a collective; the other ranks
        get empty parts); inside an accumulation window it leaves the window out, with a warning
        (:attr:`state_exact`).
        """
        if self._sharded is not None:
            return self._sharded_state()
        module = self.raw_module
        optimizer = self.optimizer.state_dict()
        with pinned_host_copies(self.pinned_state_copies and self.device.type == "cuda"):
            state: dict[str, Any] = {
                "module": {k: to_plain(v, share=True) for k, v in module.state_dict().items()},
                "optimizer": {
                    "state": {str(pid): to_plain(s, share=True) for pid, s in optimizer["state"].items()},
                    "param_groups": [to_plain(group) for group in optimizer["param_groups"]],
                },
            }
        state.update(self.rest_state_dict())
        return state

    def rest_state_dict(self) -> dict[str, Any]:
        """The state besides the module's and optimizer's tensors: ``steps`` (+ ``scaler``).

        Inside an accumulation window on several processes a collective (every rank calls it).
        """
        if self._sharded is not None:
            state: dict[str, Any] = {"steps": self._sharded_steps()}
        else:
            state = {"steps": {"accumulated": self.accumulated, "optimizer_steps": self.optimizer_steps}}
        module = self.raw_module
        if self.accumulated and self._sharded is None:
            params = module.named_parameters()
            grads = {name: to_plain(p.grad, share=True) for name, p in params if p.grad is not None}
            if self._ddp is not None:
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
        return sharded_state.sharded_state(self.raw_module, self.optimizer)

    def load_sharded_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put a :meth:`sharded_state_dict` that DCP loaded back into the module and optimizer."""
        sharded_state.load_sharded_state(self.raw_module, self.optimizer, state)

    @property
    def state_exact(self) -> bool:
        """Whether a state taken now holds all a resumed run needs to continue bitwise.

        False only under FSDP inside a gradient accumulation window: FSDP holds the window's
        gradients unsharded inside the module, and a state taken then leaves the window out
        (:meth:`state_dict` warns). A checkpoint plugin defers its periodic saves until it is
        True again, at the window's optimizer step.
        """
        return self._sharded is None or not self.accumulated

    def _sharded_steps(self) -> dict[str, int]:
        """``steps`` of a state taken under FSDP: inside a window, the window left out (warned)."""
        steps = {"accumulated": 0, "optimizer_steps": self.optimizer_steps}
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
        assert self._sharded is not None
        steps = self._sharded_steps()
        module_state, optimizer = self._sharded.full_state()
        state: dict[str, Any] = {
            "module": {k: to_plain(v, share=True) for k, v in module_state.items()},
            "optimizer": {
                "state": {str(pid): to_plain(s, share=True) for pid, s in optimizer.get("state", {}).items()},
                "param_groups": [to_plain(group) for group in optimizer.get("param_groups", [])],
            },
            "steps": steps,
        }
        if self._train_metrics is not None:
            state["train_metrics"] = self._train_metrics.by_rank(self.world)
        return state

    def load_destinations(self) -> dict[str, Any]:
        """Where a reader may read a state of :meth:`state_dict` straight into (issue 32): the
        same tree with, for each CPU tensor that can take its saved bytes as they are, a
        writable array on that tensor's own memory (the module's parameters and buffers, the
        optimizer's existing state). :meth:`load_state_dict` then finds those values in place
        and copies nothing. Empty under FSDP, and for the module when its
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
        states = {str(pid): destinations(s) for pid, s in self.optimizer.state_dict()["state"].items()}
        out["optimizer"] = {"state": {pid: views for pid, views in states.items() if views}}
        return out

    def check_state(self, state: Any) -> list[str]:
        """Every reason *state* cannot be loaded into this model (empty: it fits).

        ``steps`` may be missing (a state saved by an earlier epochal) and ``scaler`` present
        or missing (a state saved under another precision: the scaler starts afresh).
        """
        sharded = isinstance(state, Mapping) and "dcp" in state
        tensors = {"dcp"} if sharded else {"module", "optimizer"}
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
            if not problems:
                problems += check_optimizer(self.optimizer, state["optimizer"])
        steps = state.get("steps", {"accumulated": 0})
        processes = self.world.size if self._ddp is not None else 1
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
        if "dcp" in state:  # a sharded checkpoint: its tensors are in that DCP directory
            only = state.get("dcp_only") == "model"  # the weights only (fine-tuning)
            options = state.get("dcp_storage")  # dcp is a URL: its filesystem's options
            sharded_state.load_from(
                module, self.optimizer, state["dcp"], model_only=only, storage_options=options
            )
            if not only:
                self._load_rest(state)
            return
        saved = state["optimizer"]
        if self._sharded is not None:
            groups = self.optimizer.state_dict()["param_groups"]
            self._sharded.load_full_state(  # copies on the host; each rank keeps its shards
                {k: from_plain(v) for k, v in state["module"].items()},
                {
                    "state": {int(pid): from_plain(s) for pid, s in saved["state"].items()},
                    "param_groups": [
                        from_plain(group, template)
                        for group, template in zip(saved["param_groups"], groups, strict=True)
                    ],
                },
            )
            self.accumulated = 0
            self.optimizer_steps = int(state.get("steps", {}).get("optimizer_steps", 0))
            self._warn_left_out(state.get("steps", {}))
            if self._train_metrics is not None:
                self._train_metrics.load_by_rank(state.get("train_metrics"), self.world)
            return
        load_module(module, state["module"], may_share=self._ddp is None)
        current = self.optimizer.state_dict()
        live = current["state"]
        # on the host: torch moves each value where its parameter's policy wants it (no copy
        # where it is there already); a value read into the live tensor (load_destinations) is
        # that tensor
        values = {int(pid): from_plain_or_live(s, live.get(int(pid))) for pid, s in saved["state"].items()}
        self.optimizer.load_state_dict(
            {
                "state": values,
                "param_groups": [
                    from_plain(group, template)
                    for group, template in zip(saved["param_groups"], current["param_groups"], strict=True)
                ],
            }
        )
        self._keep_saved_dtypes(values)
        self._load_rest(state)

    def _keep_saved_dtypes(self, values: Mapping[int, Mapping[str, Any]]) -> None:
        """Give the optimizer's state back the dtypes it was saved in.

        torch's ``Optimizer.load_state_dict`` casts floating state to its parameter's dtype; a
        state an optimizer made before the module was cast (Adagrad's float32 ``sum`` beside
        ``bf16-true`` parameters) would come back bf16 and the resumed run compute otherwise.
        """
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for pid, entry in values.items():
            loaded = self.optimizer.state.get(params[pid]) if pid < len(params) else None
            if not loaded:
                continue
            for key, value in entry.items():
                now = loaded.get(key)
                if (
                    isinstance(value, torch.Tensor)
                    and isinstance(now, torch.Tensor)
                    and now.dtype != value.dtype
                ):
                    loaded[key] = now.to(value.dtype)

    def load_weights(self, state: Mapping[str, Any]) -> None:
        """Load only the module's weights of a :meth:`state_dict` (fine-tuning: the ``load``
        plugin's ``weights_only``): the optimizer, its learning rates and state, the step count
        and the accumulation window stay this model's own, as configured.

        :raises ValueError: naming every missing or unexpected key and every shape or dtype
            mismatch of the module, before anything is changed.
        """
        module = self.raw_module
        if "dcp" in state:  # a sharded checkpoint: its module's tensors, read by every rank
            options = state.get("dcp_storage")
            sharded_state.load_from(
                module, self.optimizer, state["dcp"], model_only=True, storage_options=options
            )
            return
        problems = check_module("module.", module.state_dict(), state.get("module"))
        if problems:
            raise ValueError("cannot load TorchModel weights: " + "; ".join(problems))
        if self._sharded is not None:
            self._sharded.load_full_module({k: from_plain(v) for k, v in state["module"].items()})
        else:
            load_module(module, state["module"], may_share=self._ddp is None)

    def _load_rest(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`rest_state_dict` saved: the accumulation window, the scaler."""
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
        if self.precision.scaler is not None and "scaler" in state:
            self.precision.scaler.load_state_dict(from_plain(state["scaler"]))
        if self._train_metrics is not None:
            self._train_metrics.load_by_rank(state.get("train_metrics"), self.world)


def _check_stepping(optimizer: Any) -> None:
    """Refuse an optimizer whose ``step`` needs a closure (LBFGS): TorchModel steps it once per
    optimizer step, without re-evaluating the loss.

    :raises ConfigError: naming the optimizer.
    """
    import inspect

    step = getattr(type(optimizer), "step", None)
    try:
        closure = inspect.signature(step).parameters.get("closure") if step is not None else None
    except (TypeError, ValueError):  # a step without a signature to read: it may still work
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ConfigError(
            f"TorchModel: optimizer {type(optimizer).__name__} needs a closure at every step (it "
            "re-evaluates the loss, as LBFGS does); TorchModel steps without one: use another "
            "optimizer, or a model of your own with train_step (see the Model protocol)"
        )
