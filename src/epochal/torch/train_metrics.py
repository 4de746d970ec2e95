"""Metric objects over whole training epochs: ``TorchModel(train_stream_metrics=True)``.

Lightning's ``self.log(metric_object, on_epoch=True)``: a torchmetrics object (or any object
with ``update``/``compute``/``reset``) updated with every training batch's outputs and computed
once at the epoch's end, so ``train.f1`` is the F1 of the epoch's predictions, not a mean of batch
F1 values. Each metric object of the model gets a copy here (``copy.deepcopy``), apart from the
one evaluation uses, so an evaluation inside an epoch (``eval_every_n_batches``) never resets the
training epoch's state.

The epoch's partial state is part of the model's state (:meth:`TrainMetrics.state_dict`), so a
run resumed in the middle of an epoch computes the same value as an uninterrupted one: a
torchmetrics object's ``metric_state`` (its tensors), or the ``state_dict``/``load_state_dict``
of an object of the user's own. An object with neither restarts from the resume point (its value
covers the batches since). On several processes each rank's state is its own (its shard's
batches): inside an epoch they are gathered with the rest of the state (a collective, as the
gradients inside an accumulation window are; none between epochs), and ``compute()`` syncs
them across the ranks as in evaluation (torchmetrics does; an object without ``sync`` gives
rank 0's shard's value).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from epochal.torch.state import from_plain, to_plain

__all__ = ["TrainMetrics"]


def _value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value


class TrainMetrics:
    """Copies of a model's metric objects, updated with its training batches.

    :param metrics: ``{name: metric object}`` (the model's stream metrics).
    :param device: where the copies' states live (the model's device).
    """

    def __init__(self, metrics: Mapping[str, Any], device: torch.device) -> None:
        self.metrics = {name: copy.deepcopy(metric) for name, metric in metrics.items()}
        #: training batches added since the last reset (the same on every rank: equal shards).
        self.batches = 0
        self.to(device)
        for metric in self.metrics.values():
            metric.reset()

    def to(self, device: torch.device) -> None:
        """Move the copies that are modules (torchmetrics' metrics) to *device*."""
        for metric in self.metrics.values():
            if isinstance(metric, torch.nn.Module):
                metric.to(device)

    def update(self, outputs: Any, targets: Any) -> None:
        """Add one training batch (outputs detached: no graph is kept)."""
        if isinstance(outputs, torch.Tensor):
            outputs = outputs.detach()
        with torch.no_grad():
            for metric in self.metrics.values():
                metric.update(outputs, targets)
        self.batches += 1

    def end_epoch(self) -> dict[str, Any]:
        """The values over the epoch's batches (synced across the ranks: a collective), then reset."""
        results = {name: _value(metric.compute()) for name, metric in self.metrics.items()}
        for metric in self.metrics.values():
            metric.reset()
        self.batches = 0
        return results

    def state_dict(self) -> dict[str, Any]:
        """``{name: state}`` of the epoch in progress, as plain data (copies)."""
        states: dict[str, Any] = {}
        for name, metric in self.metrics.items():
            if hasattr(metric, "metric_state") and hasattr(metric, "_update_count"):  # torchmetrics
                state = {"tensors": to_plain(metric.metric_state), "updates": int(metric._update_count)}
            elif callable(getattr(metric, "state_dict", None)) and callable(
                getattr(metric, "load_state_dict", None)
            ):
                state = {"own": to_plain(copy.deepcopy(metric.state_dict()))}
            else:
                continue
            states[name] = state
        return states

    def load_state_dict(self, states: Mapping[str, Any] | None) -> None:
        """Continue the epoch :meth:`state_dict` saved (None: start it afresh)."""
        for name, metric in self.metrics.items():
            metric.reset()
            state = (states or {}).get(name)
            if not isinstance(state, Mapping):
                continue  # not saved (an object without state methods): it restarts here
            if "tensors" in state:
                current = metric.metric_state
                for key, value in state["tensors"].items():
                    setattr(metric, key, from_plain(value, current.get(key), self._device(metric)))
                metric._update_count = int(state.get("updates", 0))
                metric._computed = None
            elif "own" in state:
                metric.load_state_dict(from_plain(state["own"]))

    def by_rank(self, world: Any) -> dict[str, Any]:
        """``{"batches", "ranks"}``: the batches of the epoch so far and every rank's
        :meth:`state_dict` by rank (none between epochs). Inside an epoch on several processes
        a collective (*world* None: one process), as the gradients inside an accumulation
        window are: each rank's state is its own shard's."""
        if not self.batches:
            return {"batches": 0, "ranks": []}
        states = self.state_dict()
        ranks = world.all_gather_object(states) if world is not None else [states]
        return {"batches": self.batches, "ranks": ranks}

    def load_by_rank(self, saved: Any, world: Any) -> None:
        """Continue this rank's state from :meth:`by_rank` (none saved: start afresh; saved by
        another number of processes, inside an epoch shared out afresh: start the rest afresh)."""
        rank = world.rank if world is not None else 0
        ranks = saved.get("ranks") if isinstance(saved, Mapping) else None
        if isinstance(ranks, list) and ranks and len(ranks) != (world.size if world is not None else 1):
            ranks = None
        self.load_state_dict(ranks[rank] if isinstance(ranks, list) and rank < len(ranks) else None)
        self.batches = int(saved.get("batches", 0)) if isinstance(saved, Mapping) and ranks else 0

    @staticmethod
    def _device(metric: Any) -> torch.device | None:
        return getattr(metric, "device", None)
