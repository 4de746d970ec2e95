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
from collections.abc import Mapping
from typing import Any

import torch

from epochal.errors import ConfigError

__all__ = ["NO_STEP", "check_own_step", "check_stepping", "read_step"]

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
