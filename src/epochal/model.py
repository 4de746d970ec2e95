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
