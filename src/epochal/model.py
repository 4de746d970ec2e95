"""The model protocol: what the loop needs from a model (framework-agnostic steps and state)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class Model(Protocol):
    """What the loop needs from a model: framework-agnostic steps and state.

    Step results are numbers, or scalars the loop need not read at once (0-d tensors left on
    their device: ``float(value)`` reads one). A model may also have these methods, which the
    loop calls when present: ``attach(loop)`` once when the loop is made (so that the model can
    call hooks of its own, such as ``before_optimizer_step``), ``begin_evaluation(stream)``
    before an evaluation stream, and ``end_evaluation(stream) -> Mapping[str, Any]`` after it,
    whose values (metrics over the whole stream) replace the batch means of the same name, and
    ``end_train_epoch() -> Mapping[str, Any]`` when a training epoch ends (before its
    evaluations), whose values are logged as ``train.<name>`` in the epoch's row (metric objects
    over the epoch's training batches: :class:`epochal.torch.TorchModel`'s
    ``train_stream_metrics``).

    On several processes (``torchrun``, ``epochal run --nproc``) the loop calls the model's
    ``distribute(world)`` once, before ``attach``: the model makes its training steps agree
    across the ranks of *world* (an :class:`epochal.distributed.World`), e.g. by averaging its
    gradients (:class:`epochal.torch.TorchModel` wraps its module in ``DistributedDataParallel``).
    A model without it cannot train on several processes (a ``ConfigError`` says so). Each rank
    trains on its own shard of the data; ``end_evaluation`` values must be those of the whole
    stream (sync metric objects across the ranks, as torchmetrics does by itself).
    """

    def train_step(self, batch: Any) -> Mapping[str, Any]:
        """Train on one batch; return metrics (``{"loss": 0.3}``)."""

    def eval_step(self, batch: Any) -> Mapping[str, Any]:
        """Evaluate one batch without training; return metrics."""

    def state_dict(self) -> dict[str, Any]:
        """The model's state: arrays, numbers, strings, lists and dicts."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state returned by :meth:`state_dict`."""


def check_model(model: Any, data: Any, where: str | None) -> None:
    """Refuse, before training, a *model* or *data* the loop cannot use.

    :param where: the run configuration's file (its ``[model]`` and ``[data]`` factories are
        named in the error), or None for a loop made in Python (``Loop(model=...)`` is named).
    :raises ConfigError: *data* is not a mapping of streams, a stream is neither iterable nor a
        zero-argument callable, *model* has no ``train_step``, or no ``eval_step`` while *data*
        has evaluation streams.
    """
    from epochal.errors import ConfigError

    if where:
        model_is, data_from = f"{where}: [model] factory returned", f"{where}: [data] factory"
        data_must = "must return"
    else:
        model_is, data_from, data_must = "Loop(model=...) is", "Loop(data=...)", "must be"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{data_from} {data_must} a mapping of streams, not {type(data).__name__}")
    for name, stream in data.items():
        kind = type(stream)
        if not (callable(stream) or hasattr(kind, "__iter__") or hasattr(kind, "__getitem__")):
            raise ConfigError(
                f"{data_from}: stream {name!r} is of type {kind.__name__}, not an iterable of batches "
                "(or a zero-argument callable returning one)"
            )
    needed = ["train_step"] + (["eval_step"] if any(name != "train" for name in data) else [])
    missing = [method for method in needed if not callable(getattr(model, method, None))]
    if missing:
        why = " (the data has evaluation streams)" if missing == ["eval_step"] else ""
        raise ConfigError(
            f"{model_is} an object of type {type(model).__name__} with no {' and no '.join(missing)} "
            f"method{why}: a model needs train_step(batch) and eval_step(batch), each returning a "
            "mapping of metrics, and state_dict() / load_state_dict(state)"
        )


def check_outputs(outputs: Any, step: str) -> None:
    """Raise a ``TypeError`` naming the model when its *step* returned something other than a
    mapping of metrics; called where a consumer of *outputs* failed, so that the model, not the
    plugin that read them, is named."""
    if not isinstance(outputs, Mapping):
        raise TypeError(
            f"the model's {step}(batch) returned a {type(outputs).__name__}, not a mapping of "
            'metrics ({"loss": 0.3}, values numbers or 0-d tensors)'
        ) from None
