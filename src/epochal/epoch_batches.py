"""The batches an epoch iterates: the streams as given, made ready for this run's processes,
and each pass over them.

A stream is an iterable iterated afresh each pass, or a zero-argument callable returning one.
A stream that keeps no position of its own is replayed to a resumed position; one with a
``state_dict`` (``BatchStream``, ``LoaderStream``, a stateful loader) was put there when the
state was loaded. With ``[loop] epoch_size`` an epoch is that many batches of a stream iterated
on across epochs (:class:`SizedEpochs`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from epochal.adapters import adapt_stream, orders_itself
from epochal.data import Remainder, ShardOrder
from epochal.distributed.sharding import in_shard_order


def prepare(
    data: Mapping[str, Any],
    seed: int | None,
    shard_order: ShardOrder,
    uneven_shards: Remainder,
    strategy: Any,
    source: str | None,
) -> dict[str, Any]:
    """*data*'s streams as the loop iterates them: adapted (a DataLoader becomes a resumable
    stream), in the ``shard_order`` asked for, and shared out among the processes."""
    # unseeded: drawn, so each run orders its DataLoaders afresh as torch does; with
    # DistributedSampler's order, 0 as that sampler's own default
    order = 0 if seed is None and shard_order == "distributed_sampler" else seed
    if order is None and any(map(orders_itself, data.values())):
        order = strategy.order_seed(None)
    wrapped = {name: adapt_stream(stream, order, name) for name, stream in data.items()}
    if shard_order != "epochal":
        wrapped = {n: in_shard_order(n, s, shard_order, order, source or "") for n, s in wrapped.items()}
    shared: dict[str, Any] = strategy.shard_data(wrapped, uneven_shards, order, source or "")
    return shared


def iterate(source: Any, skip: int = 0) -> Iterator[Any]:
    """A fresh pass over *source*; a stream without a position of its own has its first *skip*
    batches replayed (where a resumed epoch stopped)."""
    if not hasattr(source, "__iter__") and callable(source):
        source = source()
    iterator = iter(source)
    if skip and not hasattr(source, "state_dict"):
        for _ in range(skip):
            next(iterator, None)
    return iterator


class SizedEpochs:
    """Epochs of ``epoch_size`` batches over a train stream iterated on across epochs (an endless
    stream, or one longer or shorter than an epoch): a pass goes on into the next epoch, and the
    stream restarts only when it ends."""

    def __init__(self) -> None:
        self.iterator: Iterator[Any] | None = None

    def rest(self, source: Any, epoch_size: int, done: int) -> Iterator[Any]:
        """The rest of an epoch of which *done* batches were trained."""
        remaining = epoch_size - done
        skip = done if self.iterator is None else 0  # no pass under way: a resumed epoch
        while remaining > 0:
            created = self.iterator is None
            if self.iterator is None:
                self.iterator, skip = iterate(source, skip), 0
            yielded = False
            for batch in self.iterator:
                yielded = True
                yield batch
                remaining -= 1
                if remaining <= 0:
                    return
            self.iterator = None  # the stream ended: start it again
            if created and not yielded:
                return  # a fresh pass gave no batch: the stream is empty
