"""An evaluation stream's run and metrics, and when the loop evaluates.

:func:`evaluate` runs one stream for :meth:`epochal.loop.Loop.evaluate`.

The metrics are batch-size-weighted means of the step results.

Each step's numbers are summed weighted by the batch's size; a host number (a float, a numpy
scalar, a CPU tensor) is read at once and summed in double precision, a device scalar (a CUDA
tensor) is summed where it is and read once at the end, so evaluation forces no host sync per
batch. Values that are not numbers (strings, arrays of several values) are left out of the means:
hooks still see them in the step's outputs.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from epochal.batch_rules import batch_size
from epochal.errors import ConfigError, did_you_mean
from epochal.model import check_outputs


class MetricSums:
    """The running, batch-size-weighted sums of one evaluation's step results."""

    def __init__(self) -> None:
        #: metric name → sum of value × batch size (a float, or a device scalar).
        self.totals: dict[str, Any] = {}
        #: metric name → the examples of the batches that returned it (its mean's weight).
        self.weights: dict[str, int] = {}
        #: examples seen.
        self.seen = 0
        self._skipped: set[str] = set()

    def add(self, outputs: Mapping[str, Any], size: int) -> None:
        """Add one batch's step results, weighted by its *size*."""
        totals, weights, skipped = self.totals, self.weights, self._skipped
        for key, value in outputs.items():
            if key in skipped:
                continue
            if type(value) is not float:
                if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
                    skipped.add(key)
                    continue
                device = getattr(value, "device", None)
                if device is None or getattr(device, "type", "cpu") == "cpu":
                    try:  # a host number: read now, summed in double precision
                        value = float(value)
                    except (TypeError, ValueError):  # e.g. an array of several values
                        skipped.add(key)
                        continue
            try:  # a device scalar is summed where it is, read at the end
                totals[key] = totals.get(key, 0.0) + value * size
            except TypeError:
                skipped.add(key)
                continue
            weights[key] = weights.get(key, 0) + size
        self.seen += size


def means(totals: Mapping[str, Any], weights: Mapping[str, int]) -> dict[str, float]:
    """Each metric's sum over the examples of the batches that returned it (*weights*), read
    as a float (none for a metric no example weighed)."""
    metrics: dict[str, float] = {}
    for key, total in totals.items():
        weight = weights.get(key, 0)
        if not weight:
            continue
        try:
            metrics[key] = float(total / weight)
        except (TypeError, ValueError):  # e.g. an array of several values
            continue
    return metrics


def schedule(every: int | Mapping[str, int], streams: Sequence[str], where: str) -> dict[str, int]:
    """``[loop] eval_every_n_epochs`` as ``stream → n`` (0: never) for the evaluation *streams*.

    :raises ConfigError: naming *where*, for a stream of the mapping that is not one of *streams*.
    """
    if not isinstance(every, Mapping):
        return dict.fromkeys(streams, every)
    for stream in every:
        if stream not in streams:
            raise ConfigError(
                f"{where}: no evaluation stream {stream!r}{did_you_mean(stream, list(streams))}; "
                f"streams: {', '.join(streams) or 'none'}"
            )
    return {stream: every.get(stream, 1) for stream in streams}


def due(streams: Mapping[str, int], epoch: int) -> list[str]:
    """The streams a schedule (``stream → n``) evaluates in epoch number *epoch* (from 1)."""
    return [stream for stream, every in streams.items() if every and epoch % every == 0]


def over_run(streams: Mapping[str, int]) -> bool:
    """Whether in-epoch evaluation counts batches over the whole run, not from each epoch's
    start: the epoch schedule *streams* evaluates no stream (``eval_every_n_epochs = 0``, as
    Lightning's ``check_val_every_n_epoch=None``)."""
    return bool(streams) and not any(streams.values())


def due_inside(streams: Mapping[str, int], epoch: int) -> list[str]:
    """The streams evaluated at an in-epoch point of epoch number *epoch* (from 1)."""
    return list(streams) if over_run(streams) else due(streams, epoch)


def next_point(
    interval: int | None, streams: Mapping[str, int], epoch: int, start: int, iteration: int
) -> int:
    """The iteration of the next in-epoch evaluation after *iteration* (``sys.maxsize``: none in
    this epoch), for epoch number *epoch* + 1, which started at iteration *start*."""
    if not interval:
        return sys.maxsize
    if over_run(streams):
        return (iteration // interval + 1) * interval
    if not due(streams, epoch + 1):
        return sys.maxsize
    return start + ((iteration - start) // interval + 1) * interval


def batch_interval(
    every: int | float | None, epoch_size: int | None, train: Any, streams: Mapping[str, int], where: str
) -> int | None:
    """``[loop] eval_every_n_batches`` as a number of batches (None: no evaluation in an epoch).

    An int n evaluates after batches n, 2n, ... of each epoch (counted from its start), in the
    epochs the epoch schedule *streams* evaluates; no evaluation then follows an epoch's end
    unless its last batch is such a point. When the epoch schedule evaluates no stream
    (``eval_every_n_epochs = 0``), n counts batches over the whole run instead and every stream
    is evaluated there (Lightning's ``val_check_interval`` with ``check_val_every_n_epoch=None``).

    A float is a fraction of the epoch's batches (Lightning's ``val_check_interval``):
    ``max(1, int(batches * every))``, an epoch being *epoch_size* batches, else ``len(train)``.

    :raises ConfigError: naming *where*, when it contradicts *streams* (the epoch schedule
        evaluates no stream), needs an epoch length that is not known, or exceeds an epoch.
    """
    if every is None:
        return None
    try:
        batches: int | None = epoch_size or len(train)
    except TypeError:  # a stream without len()
        batches = None
    if not streams:
        raise ConfigError(
            f"{where}: eval_every_n_batches = {every} evaluates inside epochs, but the run has no "
            "evaluation stream to evaluate (no stream but 'train')"
        )
    if over_run(streams):
        if isinstance(every, float):
            raise ConfigError(
                f"{where}: eval_every_n_batches = {every} is a fraction of an epoch, and "
                "eval_every_n_epochs = 0 counts batches over the whole run: give a number of batches"
            )
        return every
    if isinstance(every, float):
        if batches is None:
            raise ConfigError(
                f"{where}: eval_every_n_batches = {every} is a fraction of an epoch, and the train "
                "stream has no len(): set [loop] epoch_size, or give a number of batches"
            )
        return max(1, int(batches * every))
    if batches is not None and every > batches:
        raise ConfigError(
            f"{where}: eval_every_n_batches = {every} is more than the {batches} batches of an "
            "epoch: no evaluation would ever run"
        )
    return every


def evaluate(loop: Any, stream: str) -> dict[str, float]:
    """Run the evaluation stream *stream* of *loop*; log and return its metrics
    (:meth:`epochal.loop.Loop.evaluate`, which says how the metrics are computed)."""
    if stream not in loop.data or stream == "train":
        raise ConfigError(f"no evaluation stream {stream!r}; streams: {', '.join(loop.eval_streams)}")
    hooks = loop.hooks
    if hooks.before_evaluation is not None:
        hooks.before_evaluation(loop, stream)
    model = loop.model
    begin = getattr(model, "begin_evaluation", None)
    if callable(begin):
        begin(stream)
    sums = MetricSums()
    eval_step = model.eval_step
    declared = getattr(model, "batch_size", None)
    size_of = declared if callable(declared) else batch_size
    for batch in loop._iterate(stream):
        size = size_of(batch)
        if size == 0 and loop._empty_batch(stream):
            continue
        outputs = eval_step(batch)
        try:
            sums.add(outputs, size)
        except Exception:
            check_outputs(outputs, "eval_step")
            raise
        if hooks.after_eval_batch is not None:
            hooks.after_eval_batch(loop, stream, batch, outputs)
    seen, totals, weights = loop.strategy.reduce_evaluation(stream, sums.seen, sums.totals, sums.weights)
    if seen == 0:
        loop._empty_stream(stream)
    metrics: dict[str, Any] = means(totals, weights) if seen else {}
    end = getattr(model, "end_evaluation", None)
    if seen and callable(end):
        metrics.update(end(stream))
    row = loop.log.current_row
    for key, value in metrics.items():
        row[f"{stream}.{key}"] = value
    loop.last_metrics[stream] = metrics
    if hooks.after_evaluation is not None:
        hooks.after_evaluation(loop, stream, metrics)
    return metrics
