"""The PyTorch adapter: train ``torch.nn.Module``\\ s in an epochal loop (``epochal[torch]``).

:class:`TorchModel` wraps modules, optimizers and a step into an object with the model protocol
of epochal (``train_step``, ``eval_step``, ``state_dict``, ``load_state_dict``). The short way,
for a supervised model::

    model = TorchModel(net, torch.optim.AdamW(net.parameters()), torch.nn.functional.cross_entropy,
                       metrics={"accuracy": accuracy, "f1": torchmetrics.F1Score(...)},
                       device="auto", precision="bf16-mixed", accumulate_grad_batches=4,
                       gradient_clip_val=1.0)

and a step of the user's own, with several modules and optimizers (Lightning's
``training_step``, Ignite's ``process_function``, Keras' ``train_step``)::

    def training_step(model, batch):
        return model.modules["net"](**batch).loss          # a Hugging Face model's own loss

    model = TorchModel({"net": net}, {"net": opt}, training_step=training_step)

Under ``automatic_optimization=False`` the step calls ``model.backward(loss)`` and
``model.optimizer_step(name)`` in its own order (a GAN). Either way precision, accumulation,
clipping, ``before_optimizer_step``, DDP/FSDP and exact checkpoints apply to every optimizer.

Its state holds numpy arrays and plain values only (:mod:`epochal.torch.model_state`), so a
checkpoint needs neither pickle nor torch to be read, and restoring it is bitwise exact.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from epochal._options import PositiveFloat, PositiveInt, check_options
from epochal.errors import ConfigError
from epochal.torch.device import Precision, move_to, resolve_device
from epochal.torch.meta import InitWeights, Materializer
from epochal.torch.model_state import TorchState
from epochal.torch.own_step import NO_STEP, OwnStep, check_own_step, check_stepping, read_step
from epochal.torch.parts import Parts
from epochal.torch.strategies import Strategy, check_strategy, check_wrap_policy
from epochal.torch.train_metrics import TrainMetrics

__all__ = ["TorchModel"]

Metric = Callable[[Any, Any], Any]
#: a step of the user's own, given to the constructor: ``step(model, batch)``.
Step = Callable[[Any, Any], Any]


def is_stream_metric(metric: Any) -> bool:
    """Whether *metric* follows torchmetrics' protocol (``update``/``compute``/``reset``)."""
    return all(callable(getattr(metric, name, None)) for name in ("update", "compute", "reset"))


class TorchModel(OwnStep, TorchState):
    """Modules with their optimizers and a step, as an epochal model.

    :param module: the network, or ``{name: module}`` for several (a generator and a
        discriminator, a student and a teacher). The built-in step calls it with the inputs of a
        batch (``module(x)``, ``module(*x)`` for a tuple, ``module(**x)`` for a dict). A
        ``torch.compile``\\ d module works; its state is saved under the original module's names.
        A module no optimizer trains (a teacher) runs in eval mode.
    :param optimizer: the optimizer of the module's parameters, or ``{name: optimizer}`` for
        several (made before or after moving the modules: the parameters are moved in place).
    :param loss_fn: ``loss_fn(outputs, targets)`` returns the scalar loss tensor: the built-in
        step, for a batch ``(inputs, targets)`` or ``{"inputs", "targets"}``. Not needed with
        a *training_step*.
    :param metrics: ``{name: metric}``: a function ``(outputs, targets) -> number`` (a batch
        mean, averaged over a stream weighted by batch sizes; built-in step only), or an object
        with ``update``/``compute``/``reset`` (torchmetrics' protocol), computed over a whole
        evaluation stream: the built-in step updates it with ``(outputs, targets)``, a step of
        your own through ``model.metrics[name].update(...)``; TorchModel resets it before each
        stream and computes it at the stream's end.
    :param training_step: a step of your own, ``training_step(model, batch)`` (or override the
        method in a subclass): see :meth:`training_step`.
    :param validation_step: the evaluation step of your own, ``validation_step(model, batch)``
        (or the method): see :meth:`validation_step`.
    :param automatic_optimization: True: TorchModel back-propagates the loss the training step
        returns and steps every optimizer (each ``accumulate_grad_batches``). False (manual, as
        Lightning's ``automatic_optimization = False``): the step calls :meth:`backward` and
        :meth:`optimizer_step` itself. None: the class attribute (True unless a subclass sets it).
    :param device: ``"auto"`` (cuda, else mps, else cpu), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
    :param precision: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"`` or ``"bf16-true"``.
    :param accumulate_grad_batches: step the optimizers every N batches, gradients summed over
        them (each batch's loss divided by N). The windows run over consecutive batches of the
        run, across epoch boundaries; a partial window is saved in checkpoints (under FSDP
        periodic checkpoints wait for the window's optimizer step: :attr:`state_exact`).
        Automatic optimization only.
    :param gradient_clip_val: clip gradients before each optimizer step, each optimizer's
        parameters apart (None: no clipping).
    :param gradient_clip_algorithm: ``"norm"`` (total 2-norm) or ``"value"`` (each element).
    :param ddp_options: keyword arguments for ``DistributedDataParallel`` on several processes
        (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``, ...).
    :param strategy: on several processes, ``"ddp"`` (a replica of each trained module on every
        rank, each its own DDP wrapper) or ``"fsdp"`` (each trained module sharded across the
        ranks by FSDP2: :mod:`epochal.torch.fsdp`). On one process both train the modules as
        they are.
    :param fsdp_options: FSDP2's settings under ``"fsdp"``: ``wrap_policy``,
        ``reshard_after_forward``, ``forward_prefetch``, ``backward_prefetch``, ``cpu_offload``
        (:class:`~epochal.torch.strategies.FSDPOptions`).
    :param init_weights: ``fn(module)``, the initialiser of modules built on the meta device,
        called after ``to_empty`` (default: each submodule's ``reset_parameters``). Under FSDP
        each rank materialises only its shards: :mod:`epochal.torch.meta`.
    :param pretrained: weights read into the modules before training: a ``.safetensors`` file,
        a directory of them, or a DCP checkpoint directory (under FSDP each rank reads its shards
        only). Names are the modules' state names (several modules: prefixed with their names).
    :param train_stream_metrics: also compute the metric objects over each training epoch
        (updated with every training batch, computed and reset at the epoch's end, logged as
        ``train.<name>`` in the epoch's row; Lightning's ``self.log(metric, on_epoch=True)``):
        :mod:`epochal.torch.train_metrics`. Built-in step only.
    :param pinned_state_copies: on CUDA, :meth:`state_dict` (a checkpoint's save) copies the
        tensors into page-locked host memory, all copies queued before one wait, and torch's
        caching host allocator keeps that memory for the next save (what
        ``torch.distributed.checkpoint``'s asynchronous stager does). False: pageable copies
        made and freed at each save (``tensor.cpu()``, what ``torch.save`` does), slower.

    Arrays and tensors in a batch (nested in tuples, lists, dicts) are moved to the device before
    any step sees it. Each step returns ``{"loss": tensor, **metrics}``: 0-d tensors left on the
    device, so a step does not wait for the device; ``float(value)`` reads one.

    Between ``backward()`` and each optimizer's step, the loop's ``before_optimizer_step`` hook
    is called (gradients unscaled, not yet clipped), so a plugin can read or change gradients.

    On several processes the loop calls :meth:`distribute`: each trained module is wrapped in
    ``DistributedDataParallel`` (gradients averaged across the ranks at every optimizer step,
    not on the accumulation steps between), evaluation runs the unwrapped modules (no
    collectives, so the ranks' evaluation shards may differ in length), metric objects are
    synced across the ranks when computed, and the state keeps the modules' own names, so a
    checkpoint of N processes loads on one and the other way round.
    """

    #: False: the training step steps its optimizers itself (:meth:`backward`, :meth:`optimizer_step`).
    automatic_optimization: bool = True

    def __init__(
        self,
        module: torch.nn.Module | Mapping[str, torch.nn.Module],
        optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer],
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        metrics: Mapping[str, Any] | None = None,
        *,
        training_step: Step | None = None,
        validation_step: Step | None = None,
        automatic_optimization: bool | None = None,
        device: str | torch.device = "auto",
        precision: str = "32-true",
        accumulate_grad_batches: PositiveInt = 1,
        gradient_clip_val: PositiveFloat | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        ddp_options: Mapping[str, Any] | None = None,
        strategy: Strategy = "ddp",
        train_stream_metrics: bool = False,
        pinned_state_copies: bool = True,
        fsdp_options: Mapping[str, Any] | None = None,
        init_weights: InitWeights | None = None,
        pretrained: str | Path | None = None,
    ) -> None:
        options = {
            "accumulate_grad_batches": accumulate_grad_batches,
            "gradient_clip_val": gradient_clip_val,
            "gradient_clip_algorithm": gradient_clip_algorithm,
            "strategy": strategy,
            "train_stream_metrics": train_stream_metrics,
            "pinned_state_copies": pinned_state_copies,
            "automatic_optimization": automatic_optimization,
            "fsdp_options": fsdp_options,
            "init_weights": init_weights,
            "pretrained": pretrained,
        }
        check_options("TorchModel", TorchModel, options, "TorchModel", ConfigError, keys=list(options))
        check_strategy(strategy, precision, ddp_options, fsdp_options)
        self.parts = parts = Parts(module, optimizer)
        self.fsdp_options = dict(fsdp_options or {})
        if "wrap_policy" in self.fsdp_options:  # on one process too, before a run on several shows it
            check_wrap_policy(self.fsdp_options["wrap_policy"], {n: parts.raw[n] for n in parts.trained})
        self._materializer = Materializer(
            parts.raw, parts.root, parts.several_modules, init_weights, pretrained
        )
        for name, step in (("training_step", training_step), ("validation_step", validation_step)):
            if step is None:
                continue
            if not callable(step):
                raise ConfigError(f"TorchModel {name} must be a function (model, batch), not {step!r:.100}")
            if getattr(type(self), name) is not getattr(TorchModel, name):
                raise ConfigError(
                    f"TorchModel {name}: {type(self).__name__} defines the method {name} already; "
                    "give one or the other"
                )
            setattr(self, name, types.MethodType(step, self))
        if automatic_optimization is not None:
            self.automatic_optimization = bool(automatic_optimization)
        #: whether the training/evaluation steps are the user's (else the built-in loss_fn step).
        self.own_step = self._defines("training_step")
        self.own_eval = self._defines("validation_step")
        self.strategy = strategy
        self.device = resolve_device(device)
        self.precision = Precision(precision, self.device)
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        parts.to(self.device, self.precision.param_dtype)
        from epochal.distributed.world import current_world

        if strategy != "fsdp" or current_world().size < 2:  # else each rank its shards (distribute)
            self._materializer.finish(self.device)
        self.loss_fn = loss_fn
        metrics = dict(metrics or {})
        self.metrics = metrics
        self._batch_metrics: dict[str, Metric] = {k: m for k, m in metrics.items() if not is_stream_metric(m)}
        self._stream_metrics: dict[str, Any] = {k: m for k, m in metrics.items() if is_stream_metric(m)}
        self._train_stream_metrics = train_stream_metrics
        self._check_steps()
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
        #: batches in which the optimizers stepped; ``optimizer_stepped`` whether the last one
        #: did, ``stepped_optimizers`` the names of those that stepped in it.
        self.optimizer_steps = 0
        self.optimizer_stepped = False
        self.stepped_optimizers: frozenset[str] = frozenset()
        #: the optimizers a manual step stepped in this batch, and since the scaler's last update.
        self._stepping: set[str] = set()
        self._unscaled: set[str] = set()
        self._loop: Any = None
        self.ddp_options = dict(ddp_options or {})
        #: the world of :meth:`distribute` (None: one process).
        self.world: Any = None
        #: the FSDP2 sharding of :meth:`distribute` under strategy "fsdp" (None: not sharded).
        self._sharded: Any = None
        #: what ``modules`` gives: the training views inside a training step, else the others.
        self._views: dict[str, torch.nn.Module] = parts.eval_views
        #: the one module's training view (the built-in step's module).
        self._train_module = parts.train_views[next(iter(parts.modules))]
        if not self.own_step and loss_fn is None:  # it may load and export states, not train
            self.train_step = self.eval_step = self._no_step  # type: ignore[method-assign]

    @staticmethod
    def _no_step(batch: Any) -> dict[str, Any]:
        raise ConfigError(NO_STEP)

    def _check_steps(self) -> None:
        """Refuse steps that cannot work together (again when the loop attaches: a subclass may
        set ``automatic_optimization`` in its ``__init__`` after TorchModel's, as in Lightning)."""
        check_own_step(
            own_step=self.own_step,
            own_eval=self.own_eval,
            automatic=self.automatic_optimization,
            several_modules=self.parts.several_modules,
            batch_metrics=self._batch_metrics,
            train_stream_metrics=self._train_stream_metrics,
            accumulate_grad_batches=self.accumulate_grad_batches,
        )
        check_stepping(self.parts.optimizers, self.automatic_optimization)

    def _defines(self, name: str) -> bool:
        return name in self.__dict__ or getattr(type(self), name) is not getattr(TorchModel, name)

    # -- the parts ----------------------------------------------------------------------------

    @property
    def modules(self) -> Mapping[str, torch.nn.Module]:
        """The modules by name, as a step calls them: inside a training step on several
        processes, the DDP wrapper of each trained module (call it so that its gradients are
        averaged); elsewhere (evaluation, plugins) the modules themselves. One module is
        named ``"module"``."""
        return self._views

    @property
    def module(self) -> torch.nn.Module:
        """The one module as a step calls it (see :attr:`modules`); with several modules, an
        ``nn.ModuleDict`` of them (:attr:`raw_module`)."""
        if self.parts.several_modules:
            return self.raw_module
        return next(iter(self._views.values()))

    @property
    def optimizers(self) -> Mapping[str, torch.optim.Optimizer]:
        """The optimizers by name (one optimizer is named ``"optimizer"``)."""
        return self.parts.optimizers

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The one optimizer (None when there are several: see :attr:`optimizers`)."""
        if self.parts.several_optimizers:
            return None
        return next(iter(self.parts.optimizers.values()))

    @property
    def loop(self) -> Any:
        """The loop that runs this model (None before it attaches): ``loop.epoch``,
        ``loop.iteration``, ``loop.batch_in_epoch`` (Lightning's ``batch_idx``)."""
        return self._loop

    @property
    def sharded(self) -> bool:
        """Whether the modules are sharded across the ranks by FSDP2 (strategy "fsdp", several
        processes, after :meth:`distribute`)."""
        return self._sharded is not None

    def distribute(self, world: Any) -> None:
        """Train on the ranks of *world* (an :class:`epochal.distributed.World`): wrap each
        trained module in DDP, or shard it with FSDP2 under strategy "fsdp".

        Called once by the loop, before training. On CUDA the modules move to this rank's GPU
        (``cuda:LOCAL_RANK``); rank 0's parameters and buffers are broadcast to every rank (by
        DDP, or before FSDP2 shards them).

        :raises ConfigError: a CPU model under the NCCL backend.
        """
        if self.world is not None or world.size < 2:
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
            self.parts.to(device)
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
        parts = self.parts
        if self.strategy == "fsdp":
            from epochal.torch.fsdp import Sharded  # DCP and DTensor: imported by runs that shard

            raw = parts.raw
            shard = {name: raw[name] for name in parts.trained} if parts.several_modules else raw
            self._sharded = sharded = Sharded(
                parts.root, shard, parts.optimizers, world, device, self.precision.name, self.fsdp_options
            )
            self._materializer.finish(device, list(shard), sharded.mesh, world.rank)
        else:
            parts.wrap(device, self.ddp_options)
            self._train_module = parts.train_views[next(iter(parts.modules))]
        self.world = world

    # -- the loop -----------------------------------------------------------------------------

    def attach(self, loop: Any) -> None:
        """Called by the loop that runs this model, so that steps can call its hooks.

        :raises ConfigError: steps that cannot work together (:func:`check_own_step`);
            evaluation streams for a model that cannot evaluate (manual optimization without a
            validation_step).
        """
        self._loop = loop
        self._check_steps()
        streams = getattr(loop, "eval_streams", ())
        if streams and self.own_step and not self.own_eval and not self.automatic_optimization:
            raise ConfigError(
                f"TorchModel automatic_optimization=False has no validation_step to evaluate the "
                f"stream(s) {', '.join(map(repr, streams))}: define one (its training_step steps "
                "the optimizers and cannot serve evaluation)"
            )

    def summary(self) -> str:
        """One line: the modules, their parameters (trainable), their size, precision and device."""
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
        """Forward, backward, and (every ``accumulate_grad_batches``) the optimizers' steps."""
        if self.own_step:
            return self._own_train_step(batch)
        inputs, targets = self._split(batch)
        module = self._train_module
        if not module.training:  # train() walks every submodule: only when needed
            module.train()
        precision = self.precision
        window = self.accumulate_grad_batches
        closing = self.accumulated + 1 >= window
        if self._sharded is not None:
            self._sharded.before_train_step(closing if window > 1 else None)
        # DDP all-reduces in backward(): only on the batch that steps the optimizer
        with contextlib.nullcontext() if closing else self._no_sync():
            with precision.autocast():
                outputs = self._forward(module, inputs)
                loss = self.loss_fn(outputs, targets)  # type: ignore[misc]
            precision.backward(loss / window if window > 1 else loss)
        self._after_backward(closing)
        if self._train_metrics is not None:
            self._train_metrics.update(outputs, targets)
        return self._results(loss, outputs, targets)

    def _own_train_step(self, batch: Any) -> dict[str, Any]:
        batch = move_to(batch, self.device, self.precision.param_dtype)
        parts = self.parts
        parts.train_mode()
        precision = self.precision
        automatic = self.automatic_optimization
        window = self.accumulate_grad_batches
        closing = self.accumulated + 1 >= window
        if self._sharded is not None:
            self._sharded.before_train_step(closing if window > 1 else None)
        self._views = parts.train_views
        try:
            with contextlib.nullcontext() if closing else self._no_sync():
                with precision.autocast():
                    loss, logs = read_step(self.training_step(batch), "training_step", automatic)
                if automatic:
                    precision.backward(loss / window if window > 1 else loss)  # type: ignore[operator]
        finally:
            self._views = parts.eval_views
        if automatic:
            self._after_backward(closing)
        else:
            stepped = self._stepping
            self.optimizer_stepped = bool(stepped)
            self.stepped_optimizers = frozenset(stepped)
            if stepped:
                if self._unscaled:
                    precision.update()
                self.optimizer_steps += 1
                self._stepping, self._unscaled = set(), set()
        return logs

    def _no_sync(self) -> contextlib.ExitStack:
        """DDP's ``no_sync`` of every wrapped module (inside an accumulation window)."""
        stack = contextlib.ExitStack()
        for wrapper in self.parts.ddp.values():
            stack.enter_context(wrapper.no_sync())
        return stack

    def _after_backward(self, closing: bool) -> None:
        """Automatic optimization after a batch's backward: at a window's end, step every
        optimizer, update the scaler once, zero the gradients."""
        self.accumulated += 1
        self.optimizer_stepped = closing
        if not closing:
            self.stepped_optimizers = frozenset()
            return
        optimizers = self.parts.optimizers
        for optimizer in optimizers.values():
            self._apply(optimizer)
        self.precision.update()
        for optimizer in optimizers.values():
            optimizer.zero_grad(set_to_none=True)
        self.stepped_optimizers = frozenset(optimizers)
        self.accumulated = 0
        self.optimizer_steps += 1

    def _apply(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale, ``before_optimizer_step``, clip, step: one optimizer's step."""
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

    def eval_step(self, batch: Any) -> dict[str, Any]:
        """The loss and metrics on *batch* in eval mode, without gradients.

        Metric objects are updated with the batch (by the built-in step, or by a step of your
        own); :meth:`end_evaluation` computes them. The training mode of every submodule is
        restored afterwards. On several processes the modules run without their DDP wrappers:
        evaluation takes no collective.
        """
        if self.own_step:
            batch = move_to(batch, self.device, self.precision.param_dtype)
            step = self.validation_step if self.own_eval else self.training_step
            with self._evaluating(self.raw_module):
                return read_step(step(batch), "validation_step" if self.own_eval else "training_step", False)[
                    1
                ]
        inputs, targets = self._split(batch)
        module = self.parts.eval_views[next(iter(self.parts.modules))]
        with self._evaluating(module):
            outputs = self._forward(module, inputs)
            loss = self.loss_fn(outputs, targets)  # type: ignore[misc]
            for metric in self._stream_metrics.values():
                metric.update(outputs, targets)
        return self._results(loss, outputs, targets)

    @contextlib.contextmanager
    def _evaluating(self, module: torch.nn.Module) -> Any:
        """Eval mode (every submodule's mode restored after), no gradients, autocast."""
        modes = [(m, m.training) for m in module.modules()]
        module.eval()
        try:
            with torch.no_grad(), self.precision.autocast():
                yield
        finally:
            for submodule, mode in modes:
                submodule.training = mode

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
