"""Each process its own part of every stream: how the loop shards a run's streams.

On several processes the loop replaces each stream by this rank's shard (:func:`shard_stream`):

- an object with ``shard(rank, size, remainder)`` (:class:`epochal.data.BatchStream`,
  :class:`epochal.torch.LoaderStream`, so every ``DataLoader``, or a stream of the user's own)
  returns its part; every rank derives the same order of an epoch and takes its share of it;
- a list or tuple of batches is shared out batch by batch (``batches[rank::size]``);
- a zero-argument callable is sharded when called (its result by the rules above).

The train stream must give every rank the same number of batches (DDP all-reduces gradients
at every step: a rank with a batch more would wait forever), so its remainder is the
``[loop] uneven_shards`` policy: ``"pad"`` (the default, as ``DistributedSampler(drop_last=False)``
does: the first examples of each epoch's order are repeated, and rank 0 says once how many),
``"drop"`` or ``"error"`` (a clear error before training). Evaluation streams are shared out
without dropping or repeating anything (``"keep"``), so metrics reduced over the ranks are those
of the whole stream.

``[loop] shard_order = "distributed_sampler"`` (:func:`in_shard_order`) makes the streams of
examples (:class:`~epochal.data.BatchStream`, DataLoaders) visit each epoch in the exact order of
``torch.utils.data.DistributedSampler``, so that a port of a DDP script trains on the same
examples in the same order as the original, on one process or several.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from epochal.adapters import adapt_stream
from epochal.data import Remainder, ShardOrder, UnevenShardsError, shard_indices
from epochal.errors import ConfigError

__all__ = ["in_shard_order", "shard_stream"]


def in_shard_order(
    name: str, stream: Any, order: ShardOrder, seed: int | None = None, where: str = ""
) -> Any:
    """*stream*, its epochs visited in *order* (``[loop] shard_order``), before any sharding.

    A stream with ``use_shard_order(order)`` (:class:`~epochal.data.BatchStream`,
    :class:`~epochal.torch.LoaderStream`) is told; a zero-argument callable's every result is.
    An evaluation stream without the method keeps its order (evaluation covers the whole
    stream, whatever the order); the train stream is refused.

    :raises ConfigError: the train stream cannot take the order, or a loader that cannot.
    """
    if order == "epochal":
        return stream
    prefix = f"{where}: " if where else ""
    if callable(stream) and not hasattr(stream, "__iter__"):
        return _OrderedFactory(stream, name, order, seed, where)
    use = getattr(stream, "use_shard_order", None)
    try:
        if callable(use):
            use(order)
            return stream
    except ValueError as error:
        raise ConfigError(
            f'{prefix}[loop] shard_order = "{order}": [data] stream {name!r}: {error}'
        ) from None
    if name != "train":
        return stream
    raise ConfigError(
        f'{prefix}[loop] shard_order = "{order}": [data] stream {name!r} ({type(stream).__name__}) has '
        "no order of examples to take it: return an epochal.data.BatchStream or a torch DataLoader, "
        "or give the stream a use_shard_order(order) method"
    )


class _OrderedFactory:
    """A zero-argument callable stream whose every result visits its epochs in ``order``."""

    def __init__(
        self, factory: Callable[[], Any], name: str, order: ShardOrder, seed: int | None, where: str
    ):
        self.factory, self.name, self.order, self.seed, self.where = factory, name, order, seed, where

    def __call__(self) -> Any:
        stream = adapt_stream(self.factory(), self.seed, self.name)
        return in_shard_order(self.name, stream, self.order, self.seed, self.where)


def shard_stream(
    name: str,
    stream: Any,
    rank: int,
    size: int,
    uneven: str = "pad",
    seed: int | None = None,
    where: str = "",
    tell: bool = True,
) -> Any:
    """Rank *rank*'s part of the stream *name* of a run on *size* processes.

    :param uneven: the train stream's remainder policy (``[loop] uneven_shards``); evaluation
        streams always keep every item.
    :param seed: the run's seed (a DataLoader made by a callable stream is made resumable with it).
    :param where: the configuration file, for messages.
    :param tell: under ``"pad"``, rank 0 says how many examples the train stream repeats.
    :raises ConfigError: the train stream cannot be shared evenly under ``"error"``, or a
        stream cannot be sharded at all.
    """
    remainder: Remainder = uneven if name == "train" else "keep"  # type: ignore[assignment]
    prefix = f"{where}: " if where else ""
    if type(stream).__module__.startswith("torch.utils.data"):
        from epochal.torch.data import LoaderStream, is_dataloader

        if is_dataloader(stream):
            stream = LoaderStream(stream, seed=seed or 0)
    try:
        shard = getattr(stream, "shard", None)
        if callable(shard) or isinstance(stream, (list, tuple)):
            if remainder == "pad":  # the remainder "error" would refuse is what padding repeats
                try:
                    return _shard(stream, rank, size, "error")
                except UnevenShardsError as error:
                    if tell and rank == 0:
                        print(_padded(name, error, where), file=sys.stderr, flush=True)
            return _shard(stream, rank, size, remainder)
    except UnevenShardsError as error:
        per_epoch = "per epoch" if error.unit == "examples" else "per pass"
        raise ConfigError(
            f"{prefix}[data] stream {name!r}: {error}, and every process must train on the same "
            f'number of batches. Set [loop] uneven_shards = "drop" (leave out {error.left_over} of the '
            f'{error.unit} {per_epoch}) or "pad" (repeat {size - error.left_over} of them {per_epoch}), '
            f"or make the number of {error.unit} a multiple of {size}"
        ) from None
    except ValueError as error:
        raise ConfigError(f"{prefix}[data] stream {name!r} cannot be sharded: {error}") from None
    if callable(stream) and not hasattr(stream, "__iter__"):
        return _ShardedFactory(stream, name, rank, size, uneven, seed, where)
    raise ConfigError(
        f"{prefix}[data] stream {name!r} ({type(stream).__name__}) cannot be sharded across {size} "
        "processes: return an epochal.data.BatchStream, a torch DataLoader or a list of batches, "
        "or give the stream a shard(rank, size, remainder) method that returns this rank's part"
    )


def _shard(stream: Any, rank: int, size: int, remainder: Remainder) -> Any:
    shard = getattr(stream, "shard", None)
    if callable(shard):
        return shard(rank, size, remainder)
    return [stream[i] for i in shard_indices(range(len(stream)), rank, size, remainder, "batches")]  # type: ignore[arg-type]


def _padded(name: str, error: UnevenShardsError, where: str) -> str:
    """The one notice of a padded train stream: how many of its items are repeated."""
    repeated = error.size - error.left_over
    per_epoch = "per epoch" if error.unit == "examples" else "per pass"
    prefix = f"{where}: " if where else ""
    return (
        f"epochal: {prefix}[data] stream {name!r}: {error.count} {error.unit} on {error.size} processes: "
        f"{repeated} of them repeated {per_epoch} so that every process trains on as many "
        f'(uneven_shards = "pad", as DistributedSampler does; "drop" leaves {error.left_over} out)'
    )


class _ShardedFactory:
    """A zero-argument callable stream whose every result is sharded."""

    def __init__(
        self,
        factory: Callable[[], Any],
        name: str,
        rank: int,
        size: int,
        uneven: str,
        seed: int | None,
        where: str,
    ) -> None:
        self.factory, self.name, self.rank, self.size = factory, name, rank, size
        self.uneven, self.seed, self.where = uneven, seed, where
        self._told = False  # the padding notice is said once, not every epoch

    def __call__(self) -> Any:
        stream = self.factory()
        if callable(stream) and not hasattr(stream, "__iter__"):
            raise ConfigError(f"[data] stream {self.name!r}: its callable returned another callable")
        tell, self._told = not self._told, True
        return shard_stream(self.name, stream, self.rank, self.size, self.uneven, self.seed, self.where, tell)
