"""A training or evaluation step the user owns: what it may return, and what is refused.

A :class:`~epochal.torch.TorchModel` with a ``training_step`` (a method of a subclass, or a
function ``training_step(model, batch)`` given to the constructor) runs it inside everything
TorchModel provides (the batch on the device, autocast, DDP's ``no_sync`` inside an
accumulation window, FSDP's gradient sync) and reads what it returns here:

- a loss tensor (a scalar: 0-d or one element), logged as ``loss``;
- a mapping with ``"loss"`` and any other values to log (tensors of one element, numbers),
  Lightning's ``return {"loss": loss, "acc": acc}`` and ``self.log(...)`` in one;
- ``None`` (manual optimization only: nothing to log).

Under automatic optimization TorchModel back-propagates the loss and steps every optimizer; the
loss must then require gradients. Under manual optimization the step calls
``model.backward(loss)`` and ``model.optimizer_step(name)`` itself, in its own order.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from epochal.errors import ConfigError, did_you_mean

__all__ = ["NO_STEP", "OwnStep", "check_own_step", "check_stepping", "read_step"]

NO_STEP = (
    "TorchModel needs a loss_fn (loss_fn(module(inputs), targets)) or a training_step of your own "
    "(a function training_step(model, batch), or a method of a subclass) to train"
)


def _value(key: str, value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(
                f"TorchModel {where} returned {key!r} as a tensor of shape {list(value.shape)}: a logged "
                "value must be a scalar (reduce it, e.g. .mean())"
            )
        return value.detach()
    return value


def read_step(result: Any, where: str, needs_loss: bool) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """``(loss, values to log)`` of what step *where* returned.

    :param needs_loss: automatic optimization: the loss must be a scalar tensor that requires
        gradients (TorchModel back-propagates it).
    :raises ConfigError: one line naming the step and what it returned.
    """
    if isinstance(result, torch.Tensor):
        loss: Any = result
        logs = {"loss": _value("loss", result, where)}
    elif isinstance(result, Mapping):
        loss = result.get("loss")
        logs = {str(k): _value(str(k), v, where) for k, v in result.items()}
    elif result is None and not needs_loss:
        return None, {}
    else:
        raise ConfigError(
            f"TorchModel {where} returned {type(result).__name__}: return the loss tensor, or a mapping "
            "with 'loss' and the values to log"
        )
    if needs_loss:
        if loss is None:
            keys = ", ".join(map(str, result))
            raise ConfigError(
                f"TorchModel {where} returned a mapping without 'loss' (keys: {keys}): "
                "under automatic optimization TorchModel back-propagates result['loss']; return it, or "
                "use automatic_optimization=False and call model.backward() yourself"
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
            raise ConfigError(
                f"TorchModel {where} returned loss {shape:.100}: the loss must be a scalar tensor "
                "(reduce it, e.g. .mean() or .sum())"
            )
        if not loss.requires_grad:
            raise ConfigError(
                f"TorchModel {where} returned a loss that does not require gradients (computed under "
                "torch.no_grad(), detached, or from frozen parameters only): nothing to back-propagate"
            )
    return loss, logs


def check_own_step(
    *,
    own_step: bool,
    own_eval: bool,
    automatic: bool,
    several_modules: bool,
    batch_metrics: Mapping[str, Any],
    train_stream_metrics: bool,
    accumulate_grad_batches: int,
) -> None:
    """Refuse what a model's steps cannot do together, before any training (a model without
    loss_fn nor step of its own may still load and export states: the loop refuses it).

    :raises ConfigError: naming the option.
    """
    if not own_step:
        if several_modules:
            raise ConfigError(
                "TorchModel with several modules needs a training_step: loss_fn takes the outputs "
                "of one module (give training_step(model, batch), calling model.modules[name])"
            )
        if not automatic:
            raise ConfigError(
                "TorchModel automatic_optimization=False needs a training_step that calls "
                "model.backward(loss) and model.optimizer_step(name) itself"
            )
        if own_eval:
            raise ConfigError(
                "TorchModel validation_step goes with a training_step of your own; with loss_fn, "
                "evaluation computes loss_fn and the metrics"
            )
        return
    if batch_metrics:
        raise ConfigError(
            f"TorchModel metrics {', '.join(map(repr, batch_metrics))}: a metric function takes "
            "(outputs, targets), which a training_step of your own does not give TorchModel; return "
            "the value in the step's mapping instead (metric objects with update/compute/reset may "
            "stay: update them in the step, TorchModel resets and computes them)"
        )
    if train_stream_metrics:
        raise ConfigError(
            "TorchModel train_stream_metrics=True updates the metric objects with (outputs, targets) "
            "of the built-in step; with a training_step of your own, return the values to log instead"
        )
    if not automatic and accumulate_grad_batches > 1:
        raise ConfigError(
            f"TorchModel accumulate_grad_batches={accumulate_grad_batches} with "
            "automatic_optimization=False: a step that steps its optimizers itself decides when "
            "(as in Lightning, accumulation is not automatic under manual optimization); use 1"
        )


def check_stepping(optimizers: Mapping[str, Any], automatic: bool) -> None:
    """Refuse an optimizer whose ``step`` needs a closure (LBFGS) under automatic optimization:
    TorchModel steps it once per optimizer step, without re-evaluating the loss.

    :raises ConfigError: naming the optimizer.
    """
    if not automatic:
        return
    for name, optimizer in optimizers.items():
        step = getattr(type(optimizer), "step", None)
        try:
            closure = inspect.signature(step).parameters.get("closure") if step is not None else None
        except (TypeError, ValueError):  # a step without a signature to read: it may still work
            continue
        if closure is not None and closure.default is inspect.Parameter.empty:
            which = "optimizer" if len(optimizers) == 1 else f"optimizer {name!r}"
            raise ConfigError(
                f"TorchModel: {which} {type(optimizer).__name__} needs a closure at every step (it "
                "re-evaluates the loss, as LBFGS does); TorchModel steps without one: use another "
                "optimizer, or automatic_optimization=False with a training_step that calls "
                "optimizer.step(closure) itself"
            )


class OwnStep:
    """The methods of :class:`~epochal.torch.TorchModel` a step of your own overrides or calls."""

    # set by TorchModel
    automatic_optimization: bool
    precision: Any
    parts: Any
    _stepping: set[str]
    _unscaled: set[str]
    _apply: Callable[[torch.optim.Optimizer], None]

    def training_step(self, batch: Any) -> Any:
        """A training step of your own (override it, or pass ``training_step=``): compute the
        loss of *batch* from :attr:`modules`.

        *batch* is on the model's device already; the step runs in training mode, under the
        precision's autocast and, inside an accumulation window, DDP's ``no_sync``. Return the
        loss tensor, or a mapping with ``"loss"`` and other values to log (each mean over the
        epoch becomes ``train.<key>``); under manual optimization return what to log (or
        None), having called :meth:`backward` and :meth:`optimizer_step`.

        The built-in step (``loss_fn``) runs when this method is not overridden.
        """
        raise NotImplementedError  # pragma: no cover - replaced, or never called

    def validation_step(self, batch: Any) -> Any:
        """An evaluation step of your own (override it, or pass ``validation_step=``): the
        loss and metrics of *batch* (the mapping's values are averaged over the stream,
        weighted by batch size). It runs in eval mode under ``torch.no_grad()`` and autocast;
        metric objects of ``metrics`` are reset before the stream and computed after it.

        Without it, evaluation runs :meth:`training_step` under ``torch.no_grad()`` (automatic
        optimization), as Keras' ``test_step`` follows ``train_step``.
        """
        raise NotImplementedError  # pragma: no cover - replaced, or never called

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate *loss* from a step of your own under manual optimization (Lightning's
        ``manual_backward``): scaled under ``16-mixed``, outside autocast.

        :raises ConfigError: under automatic optimization (TorchModel back-propagates itself).
        """
        if self.automatic_optimization:
            raise ConfigError(
                "TorchModel.backward() is for automatic_optimization=False; under automatic "
                "optimization return the loss and TorchModel back-propagates it"
            )
        self.precision.backward_outside_autocast(loss)

    def optimizer_step(self, name: str | None = None) -> None:
        """Step optimizer *name* (None: the only one) from a step of your own under manual
        optimization: gradients unscaled (``16-mixed``), the ``before_optimizer_step`` hook,
        clipping of its parameters, the step (skipped by the scaler when not finite). Its
        gradients stay: zero them as your loop did (``model.modules[n].zero_grad()``).

        :raises ConfigError: under automatic optimization, or an unknown name.
        """
        if self.automatic_optimization:
            raise ConfigError(
                "TorchModel.optimizer_step() is for automatic_optimization=False; under automatic "
                "optimization TorchModel steps every optimizer itself"
            )
        optimizers = self.parts.optimizers
        if name is None:
            if len(optimizers) > 1:
                raise ConfigError(
                    f"TorchModel.optimizer_step(): name the optimizer ({', '.join(map(repr, optimizers))})"
                )
            name = next(iter(optimizers))
        elif name not in optimizers:
            raise ConfigError(
                f"TorchModel.optimizer_step({name!r}): no optimizer of that name; the model's: "
                f"{', '.join(map(repr, optimizers))}{did_you_mean(name, list(optimizers))}"
            )
        if name in self._unscaled and self.precision.scaler is not None:
            self.precision.update()  # torch's scaler: one unscale per optimizer per update
            self._unscaled.clear()
        self._apply(optimizers[name])
        self._stepping.add(name)
        self._unscaled.add(name)
