"""Each process its own part of every stream: how the loop shards a run's streams.

On several processes the loop replaces each stream by this rank's shard (:func:`shard_stream`):

- an object with ``shard(rank, size, remainder)`` (:class:`epochal.data.BatchStream`,
  :class:`epochal.torch.LoaderStream`, so every ``DataLoader``, or a stream of the user's own)
  returns its part; every rank derives the same order of an epoch and takes its share of it;
- a list or tuple of batches is shared out batch by batch (``batches[rank::size]``);
- a zero-argument callable is sharded when called (its result by the rules above).

The train stream must give every rank the same number of batches (DDP all-reduces gradients
at every step: a rank with a batch more would wait forever), so its remainder is the
``[loop] uneven_shards`` policy: ``"error"`` (the default: a clear error before training),
``"drop"`` or ``"pad"``. Evaluation streams are shared out without dropping or repeating
anything (``"keep"``), so metrics reduced over the ranks are those of the whole stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from epochal.data import Remainder, UnevenShardsError, shard_indices
from epochal.errors import ConfigError

__all__ = ["shard_stream"]


def shard_stream(
    name: str,
    stream: Any,
    rank: int,
    size: int,
    uneven: str = "error",
    seed: int | None = None,
    where: str = "",
) -> Any:
    """Rank *rank*'s part of the stream *name* of a run on *size* processes.

    :param uneven: the train stream's remainder policy (``[loop] uneven_shards``); evaluation
        streams always keep every item.
    :param seed: the run's seed (a DataLoader made by a callable stream is made resumable with it).
    :param where: the configuration file, for messages.
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
        if callable(shard):
            return shard(rank, size, remainder)
        if isinstance(stream, (list, tuple)):
            return [stream[i] for i in shard_indices(range(len(stream)), rank, size, remainder, "batches")]  # type: ignore[arg-type]
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

    def __call__(self) -> Any:
        stream = self.factory()
        if callable(stream) and not hasattr(stream, "__iter__"):
            raise ConfigError(f"[data] stream {self.name!r}: its callable returned another callable")
        return shard_stream(self.name, stream, self.rank, self.size, self.uneven, self.seed, self.where)
