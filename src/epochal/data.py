"""Resumable batch streams of numpy arrays.

:class:`BatchStream` cuts arrays into (optionally shuffled) batches. The order of an epoch is
derived only from ``(seed, epoch)`` and the stream's position inside the epoch is part of its
state, so a run stopped in the middle of an epoch resumes with exactly the batches it would have
seen::

    stream = BatchStream(x, y, batch_size=64, seed=0)
    for xb, yb in stream:            # one epoch per iteration
        ...
        state = stream.state_dict()  # {"seed": 0, "epoch": 0, "position": k} at the k-th batch

    fresh = BatchStream(x, y, batch_size=64, seed=0)
    fresh.load_state_dict(state)     # iterating `fresh` yields batch k+1 onward
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from numbers import Integral
from typing import Any, Literal

import numpy as np

from epochal.batch_rules import batch_size as batch_size  # re-exported: plugins import it here

_STATE_KEYS = frozenset({"seed", "epoch", "position"})
#: what a shard does with the examples left over when the world size does not divide them.
Remainder = Literal["error", "drop", "pad", "keep"]
REMAINDERS = ("error", "drop", "pad", "keep")
#: how an epoch's order of the examples is derived (``[loop] shard_order``): epochal's own
#: permutation, ``torch.utils.data.DistributedSampler``'s, or a DataLoader's own draws from torch's
#: global generator (one process; what a plain PyTorch loop does: :class:`epochal.torch.LoaderStream`).
ShardOrder = Literal["epochal", "distributed_sampler", "torch"]


def distributed_sampler_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order ``DistributedSampler(dataset, shuffle=shuffle, seed=seed).set_epoch(epoch)``
    shares out (before its padding and its ``[rank::size]``, which :func:`shard_indices` does):
    ``torch.randperm(n)`` of a generator seeded with ``seed + epoch``, or ``range(n)``.

    :raises ValueError: torch is not installed (the order is torch's generator's).
    """
    if not shuffle:
        return np.arange(n)
    try:
        import torch
    except ImportError:
        raise ValueError("the DistributedSampler order needs torch (pip install torch)") from None
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator).numpy().astype(np.int64)


class UnevenShardsError(ValueError):
    """The processes would get different numbers of batches (remainder ``"error"``).

    :param count: the number of items (examples, or batches) to share.
    :param size: the number of processes.
    :param unit: what is counted (``"examples"`` or ``"batches"``).
    """

    def __init__(self, count: int, size: int, unit: str = "examples") -> None:
        self.count, self.size, self.unit = count, size, unit
        self.left_over = count % size
        super().__init__(
            f"{count} {unit} cannot be shared evenly by {size} processes ({self.left_over} left over)"
        )


def shard_indices(
    order: np.ndarray, rank: int, size: int, remainder: Remainder, unit: str = "examples"
) -> np.ndarray:
    """The part of *order* that rank *rank* of *size* takes: ``order[rank::size]``.

    Like ``torch.utils.data.DistributedSampler``: every rank derives the same *order*, the
    ranks take interleaved items, so the first ``k`` items of every rank together are the first
    ``k * size`` items of *order*. With a remainder (``len(order) % size``), ``"drop"`` leaves
    the last items of *order* out, ``"pad"`` repeats its first items, ``"keep"`` lets the first
    ranks have one item more, and ``"error"`` raises :class:`UnevenShardsError`.
    """
    n = len(order)
    extra = n % size
    if extra:
        if remainder == "error":
            raise UnevenShardsError(n, size, unit)
        if remainder == "drop":
            order = order[: n - extra]
        elif remainder == "pad":
            order = np.resize(order, n + size - extra) if n else order
    return order[rank::size]


def check_shard(rank: int, size: int, remainder: str) -> None:
    """Raise ValueError unless ``0 <= rank < size`` and *remainder* is one of :data:`REMAINDERS`."""
    if not _is_int(size) or size < 1 or not _is_int(rank) or not 0 <= rank < size:
        raise ValueError(f"a shard needs 0 <= rank < size, got rank {rank!r} of size {size!r}")
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder must be one of {', '.join(REMAINDERS)}, not {remainder!r}")


class BatchStream:
    """A seeded, shuffling stream of batches over arrays sharing their first dimension.

    Each iteration runs over one epoch, starting at the stored position: a batch counts as
    consumed as soon as it is yielded, and when the epoch is exhausted the epoch counter
    increments and the position returns to 0. An iteration started at the end of an epoch (a
    state saved while the last batch was being processed) yields nothing and only moves on to the
    next epoch. Epoch ``e`` visits the examples in the order
    ``np.random.default_rng([seed, e]).permutation(n)`` (in their stored order when ``shuffle``
    is false); global RNG state is never used.

    :param arrays: the arrays to batch, all with the same length.
    :param batch_size: the number of examples per batch (the last one may be smaller).
    :param shuffle: whether each epoch visits the examples in a fresh random order.
    :param seed: a non-negative integer that, with the epoch, determines the order.
    :param drop_last: drop the last batch of an epoch when it is smaller than ``batch_size``.

    Batches are tuples with one array per input array, or the batch array itself when a single
    array was given. Every batch is a fresh array (fancy indexing), never a view of the inputs.

    On several processes the loop trains each on its own shard (:meth:`shard`): every rank
    derives the same order of an epoch and takes every ``size``-th example of it, then cuts its
    part into batches of ``batch_size`` (a batch size per process, as with torch's
    ``DistributedSampler``).
    """

    #: a state saved inside an epoch by another number of processes continues here: the rest of
    #: that epoch's order is shared out afresh (:func:`resplit_start`).
    elastic = True

    def __init__(
        self,
        *arrays: np.ndarray,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not arrays:
            raise ValueError("BatchStream needs at least one array")
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not _is_int(seed) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        lengths = [len(a) for a in arrays]
        if len(set(lengths)) != 1:
            raise ValueError(
                "all arrays must have the same first dimension, got lengths "
                + ", ".join(f"{n} (array {i})" for i, n in enumerate(lengths))
            )
        self.arrays = tuple(arrays)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.num_examples = lengths[0]
        self._seed = int(seed)
        self._epoch = 0
        self._position = 0
        n, b = self.num_examples, self.batch_size
        self._num_batches = n // b if drop_last else -(-n // b)
        #: this stream's shard: rank ``rank`` of ``shards`` (0 of 1: the whole data).
        self.rank, self.shards = 0, 1
        self.remainder: Remainder = "keep"
        #: how each epoch's order is derived (:meth:`use_shard_order`).
        self.shard_order: ShardOrder = "epochal"
        #: the examples of the current epoch's order consumed before it was shared out among
        #: these shards (a resume on another number of processes; 0 otherwise).
        self._start = 0

    def use_shard_order(self, order: ShardOrder) -> None:
        """Derive every epoch's order as *order* says from now on (``[loop] shard_order``):
        ``"distributed_sampler"`` visits (and shards) the examples exactly as
        ``DistributedSampler(dataset, num_replicas, rank, shuffle, seed).set_epoch(epoch)`` does.

        :raises ValueError: ``"distributed_sampler"`` without torch installed; ``"torch"`` for a
            shuffling stream (its order is its seed's, never torch's generator's).
        """
        if order == "torch" and self.shuffle:
            raise ValueError(
                "a shuffling BatchStream draws each epoch's order from its own seed, never from "
                "torch's global generator: shard_order 'torch' is for torch DataLoaders"
            )
        if order == "distributed_sampler" and self.shuffle:
            distributed_sampler_order(0, self._seed, 0, True)  # torch is there, or say so now
        self.shard_order = order

    def shard(self, rank: int, size: int, remainder: Remainder = "keep") -> BatchStream:
        """A stream over rank *rank*'s part of every epoch, for *size* processes.

        Epoch ``e``'s order is the same on every rank; rank ``r`` takes ``order[r::size]`` (see
        :func:`shard_indices` for *remainder*, applied to the examples). The shard starts at
        epoch 0, position 0, with this stream's seed and options; its state adds
        ``"world_size"``, and a state saved on another number of processes loads only at an
        epoch boundary (position 0).

        :raises UnevenShardsError: *remainder* is ``"error"`` and *size* does not divide the examples.
        """
        check_shard(rank, size, remainder)
        part = BatchStream(
            *self.arrays, batch_size=self.batch_size, shuffle=self.shuffle, seed=self._seed,
            drop_last=self.drop_last,
        )  # fmt: skip
        part.rank, part.shards, part.remainder = rank, size, remainder
        part.shard_order = self.shard_order
        n = len(shard_indices(np.arange(self.num_examples), rank, size, remainder))
        part._num_batches = n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        return part

    @property
    def seed(self) -> int:
        """The seed the order of every epoch derives from."""
        return self._seed

    @property
    def epoch(self) -> int:
        """The number of epochs exhausted so far."""
        return self._epoch

    @property
    def position(self) -> int:
        """The number of batches of the current epoch already yielded."""
        return self._position

    def __len__(self) -> int:
        """Return the number of batches per epoch (of the current epoch's rest, for an epoch
        resumed on another number of processes)."""
        if self._start:
            count = len(
                shard_indices(
                    np.arange(self.num_examples - self._start), self.rank, self.shards, self.remainder
                )
            )
            return count // self.batch_size if self.drop_last else -(-count // self.batch_size)
        return self._num_batches

    def order(self, epoch: int) -> np.ndarray:
        """Return the indices of the examples in the order *epoch* visits them."""
        if self.shard_order == "distributed_sampler":
            return distributed_sampler_order(self.num_examples, self._seed, epoch, self.shuffle)
        if self.shuffle:
            return np.random.default_rng([self._seed, epoch]).permutation(self.num_examples)
        return np.arange(self.num_examples)

    def indices(self, epoch: int, start: int = 0) -> np.ndarray:
        """The indices of the examples this stream's shard visits in *epoch*, in order (of the
        epoch's order past its first *start* examples: the rest of an epoch resumed on another
        number of processes)."""
        order = self.order(epoch)[start:]
        if self.shards == 1:
            return order
        return shard_indices(order, self.rank, self.shards, self.remainder)

    def __iter__(self) -> Iterator[Any]:
        """Yield the remaining batches of the current epoch, advancing the stored position."""
        epoch, position = self._epoch, self._position
        order = self.indices(epoch, self._start)
        arrays, size, single = self.arrays, self.batch_size, len(self.arrays) == 1
        batches = len(self)
        for k in range(position, batches):
            if (self._epoch, self._position) != (epoch, k):
                raise RuntimeError(
                    "the state of the BatchStream changed during an iteration "
                    "(load_state_dict or another iterator)"
                )
            index = order[k * size : (k + 1) * size]
            self._position = k + 1
            yield arrays[0][index] if single else tuple(a[index] for a in arrays)
        if (self._epoch, self._position) == (epoch, batches):
            self._epoch, self._position, self._start = epoch + 1, 0, 0

    def state_dict(self) -> dict[str, int]:
        """Return ``{"seed", "epoch", "position", "batches"}``: the stream's state, as plain ints
        (``batches``: of an epoch, so that a resume inside one can tell the epoch changed).

        A shard adds ``"world_size"``. Every rank's train shard has the same state (the
        ranks take the same number of batches), so one rank's state stands for all. An epoch
        resumed on another number of processes adds ``"start"``: the examples of its order
        consumed before (by every process), which its batches come after.
        """
        state = {"seed": self._seed, "epoch": self._epoch, "position": self._position}
        state["batches"] = len(self)
        if self.shards > 1:
            state["world_size"] = self.shards
        if self._start:
            state["start"] = self._start
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state returned by :meth:`state_dict` of a stream with the same seed.

        :raises ValueError: on missing or unknown keys, a different seed, a negative or
            out-of-range epoch or position, or a position inside an epoch whose length changed.
        """
        keys = set(state) - OPTIONAL_STATE_KEYS
        if keys != _STATE_KEYS:
            problems = []
            if missing := _STATE_KEYS - keys:
                problems.append(f"missing keys {sorted(missing)}")
            if unknown := keys - _STATE_KEYS:
                problems.append(f"unknown keys {sorted(map(str, unknown))}")
            raise ValueError("invalid BatchStream state: " + "; ".join(problems))
        for key in sorted(_STATE_KEYS):
            if not _is_int(state[key]) or state[key] < 0:
                raise ValueError(
                    f"invalid BatchStream state: {key!r} must be a non-negative int, got {state[key]!r}"
                )
        if state["seed"] != self._seed:
            raise ValueError(
                f"cannot load the state of a BatchStream seeded with {state['seed']} into one "
                f"seeded with {self._seed}: the batches would differ"
            )
        start = resplit_start(
            state, self.shards, self.num_examples, self.batch_size, self.drop_last, "BatchStream"
        )
        if start is not None:  # saved inside an epoch by another number of processes
            self._check_rest(start)
            self._epoch, self._position, self._start = int(state["epoch"]), 0, start
            return
        self._start = int(state.get("start", 0)) if state.get("world_size", 1) == self.shards else 0
        position = check_epoch_length(state, len(self), "BatchStream")
        self._epoch, self._position = int(state["epoch"]), position

    def _check_rest(self, start: int) -> None:
        """Refuse (remainder ``"error"``) the rest of an epoch that these shards cannot share evenly."""
        rest = self.num_examples - start
        if self.remainder == "error" and rest % self.shards:
            raise ValueError(
                f"the rest of the epoch, {rest} examples, cannot be shared evenly by {self.shards} "
                f'processes ({rest % self.shards} left over) and [loop] uneven_shards is "error"'
            )

    def __repr__(self) -> str:
        """Return a summary of the stream's configuration and state."""
        return (
            f"BatchStream(n={self.num_examples}, arrays={len(self.arrays)}, "
            f"batch_size={self.batch_size}, shuffle={self.shuffle}, seed={self._seed}, "
            f"drop_last={self.drop_last}, epoch={self._epoch}, position={self._position})"
        )


def resplit_start(
    state: Mapping[str, Any], size: int, examples: int, batch_size: int, drop_last: bool, what: str
) -> int | None:
    """Where the rest of an epoch saved by another number of processes starts: the number of
    examples of the epoch's order that every process together consumed (None: *state* was saved
    by *size* processes, or at an epoch boundary, and continues as it is).

    The shards of ``N`` processes take ``order[r::N]`` and cut it into batches of *batch_size*,
    so after ``k`` batches each they consumed the first ``k * batch_size * N`` examples of the
    order (padding repeats only examples at its end, never reached inside an epoch): the rest,
    ``order[start:]``, is shared out afresh among the new processes. A state of an epoch
    resumed before adds its ``start``.

    :raises ValueError: a bad ``world_size`` or ``start``, or an epoch whose length on the
        saving processes is not the one this batch size and data give (either changed).
    """
    saved = state.get("world_size", 1)
    if not _is_int(saved) or saved < 1:
        raise ValueError(f"invalid {what} state: 'world_size' must be a positive int, got {saved!r}")
    start = state.get("start", 0)
    if not _is_int(start) or start < 0:
        raise ValueError(f"invalid {what} state: 'start' must be a non-negative int, got {start!r}")
    position, batches = state.get("position"), state.get("batches")
    if saved == size or not position or position == batches:
        return None
    rest = examples - start
    counts = {-(-rest // saved), rest // saved}  # per process: padded or kept, dropped
    expected = {c // batch_size if drop_last else -(-c // batch_size) for c in counts}
    consumed = start + int(position) * batch_size * saved
    if (batches is not None and batches not in expected) or start >= examples or consumed >= examples:
        raise ValueError(
            f"cannot resume a {what} saved at batch {position} of an epoch of {batches} batches on "
            f"{saved} process(es) on {size}: with {examples} examples and a batch size of {batch_size} "
            "that epoch would have another length (the batch size or the data changed); resume with "
            "the same batch size and data, or from a checkpoint saved at the end of an epoch"
        )
    return consumed


def check_world_size(state: Mapping[str, Any], size: int, what: str) -> None:
    """Refuse a stream *state* saved mid-epoch on another number of processes than *size*.

    At an epoch boundary (position 0) the next epoch is sharded afresh for *size* processes.
    """
    saved = state.get("world_size", 1)
    if not _is_int(saved) or saved < 1:
        raise ValueError(f"invalid {what} state: 'world_size' must be a positive int, got {saved!r}")
    if saved != size and state.get("position"):
        raise ValueError(
            f"cannot resume a {what} saved in the middle of an epoch on {saved} process(es) on "
            f"{size}: the shards of that epoch differ; resume on {saved} process(es), or from a "
            "checkpoint saved at the end of an epoch"
        )


#: the optional keys of a stream's state, beside ``seed``, ``epoch`` and ``position``.
OPTIONAL_STATE_KEYS = frozenset({"world_size", "batches", "torch_rng", "dataset", "start"})


def check_epoch_length(state: Mapping[str, Any], batches: int | None, what: str) -> int:
    """The position at which a stream of *batches* per epoch continues *state*.

    A state saved at the end of its epoch continues at the end of this stream's epoch (the next
    epoch starts afresh, whatever its length). Refused: a position beyond the *batches* of the
    epoch, or one inside an epoch that had another number of batches (``batches``, saved since
    2026-11: a batch size or the data changed, so the rest of that epoch would be other
    examples). *batches* None: the stream does not know its length (nothing is checked).
    """
    saved = state.get("batches")
    position = int(state["position"])
    if saved is not None and (not _is_int(saved) or saved < 0):
        raise ValueError(f"invalid {what} state: 'batches' must be a non-negative int, got {saved!r}")
    if batches is None:
        return position
    if saved is not None and position == saved:
        return batches  # the saved epoch was complete
    if saved is not None and 0 < position < saved and saved != batches:
        raise ValueError(
            f"cannot resume a {what} saved at batch {position} of an epoch of {saved} batches: its "
            f"epoch now has {batches} (another batch size or other data), so the rest of that epoch "
            "cannot be continued; resume with the same batch size and data, or from a checkpoint "
            "saved at the end of an epoch"
        )
    if position > batches:
        raise ValueError(
            f"invalid {what} state: position {position} is beyond the {batches} batches of an epoch"
        )
    return position


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)
