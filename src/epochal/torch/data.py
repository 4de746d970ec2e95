"""A ``torch.utils.data.DataLoader`` as a resumable stream: same order, also mid-epoch.

A DataLoader that shuffles draws its order from torch's global generator each time an epoch
starts, and so does its choice of worker seeds: a run resumed in the middle of an epoch would
see other batches, and its model another random stream. :class:`LoaderStream` derives both
from ``(seed, epoch)`` alone, as :class:`epochal.data.BatchStream` does, and keeps its position
in the epoch as state. Resuming at batch *k* builds a one-off DataLoader over the remaining
batches of the same order (same dataset, collate function, workers, pinning), so no sample is
loaded twice. The loop wraps every DataLoader it is given in a LoaderStream by itself.

Worker processes get seeds from ``(seed, epoch)`` too (and the rank, on several processes);
which worker loads which batch after a mid-epoch resume differs, so random augmentations drawn
inside workers repeat exactly only when they derive from the sample (not from the worker's
generator).

On several processes the loop gives each rank its shard (:meth:`LoaderStream.shard`), as
``DistributedSampler`` would: the epoch's order is the same on every rank and rank ``r`` takes
every ``size``-th example of it (every ``size``-th batch for a custom ``batch_sampler``).

With ``[loop] shard_order = "torch"`` (one process) the loader draws as torch draws in a plain
loop: when an epoch starts, its iterator takes the workers' base seed and then its sampler's
seed from torch's global generator, so a port of a script that shuffles with a seeded global
generator sees the script's batches, and whatever the script draws next (noise, dropout) stays
in step with it. The generator's state at the epoch's start is part of the stream's state
(``torch_rng``): a run resumed inside the epoch replays those draws on a copy to rebuild the
epoch's order, leaving the global generator where the checkpoint left it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from epochal.adapters import DrawnSeed
from epochal.data import (
    OPTIONAL_STATE_KEYS,
    Remainder,
    ShardOrder,
    UnevenShardsError,
    check_epoch_length,
    check_shard,
    distributed_sampler_order,
    resplit_start,
    shard_indices,
)
from epochal.stateful import from_plain, to_plain

__all__ = ["LoaderStream", "is_dataloader"]

_STATE_KEYS = frozenset({"seed", "epoch", "position"})


def is_dataloader(stream: Any) -> bool:
    """Whether *stream* is a ``torch.utils.data.DataLoader``."""
    return isinstance(stream, DataLoader)


#: seconds a DataLoader worker keeps serving after a SIGTERM before it leaves by itself.
WORKER_GRACE = 10.0


class QuietWorker:
    """A DataLoader's ``worker_init_fn`` that first makes the worker outlive a scheduler's signal.

    A scheduler's SIGTERM (SLURM, ``timeout``, a container stop) reaches the workers too (the
    process group, the job's processes): a worker killed by it makes torch raise "DataLoader
    worker ... killed by signal" in the training process, which then cannot finish its batch and
    save. So a worker ignores SIGINT (the training process handles Ctrl-C) and, on SIGTERM, keeps
    serving for :data:`WORKER_GRACE` seconds, then leaves with status 0 (which torch does not
    count as a failure); the training process shuts its workers down itself when training ends
    (:meth:`LoaderStream.close_workers`), and torch's watchdog ends them if it is gone. *inner* is the
    loader's own ``worker_init_fn``.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _leave_after_grace)
        if self.inner is not None:
            self.inner(worker_id)


def _leave_after_grace(signum: int, frame: Any) -> None:
    """A worker's SIGTERM: leave with status 0 after :data:`WORKER_GRACE` seconds (once)."""
    import os
    import signal
    import threading
    import time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one countdown

    def leave() -> None:
        time.sleep(WORKER_GRACE)
        os._exit(0)

    threading.Thread(target=leave, name="epochal-worker-grace", daemon=True).start()


def _generator(seed: int, epoch: int, purpose: int, *rank: int) -> torch.Generator:
    value = int(np.random.SeedSequence([seed, epoch, purpose, *rank]).generate_state(1, np.uint64)[0] >> 1)
    return torch.Generator().manual_seed(value)


class _Batches(torch.utils.data.Sampler[list[int]]):
    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class LoaderStream:
    """A DataLoader whose order and position derive from ``(seed, epoch)`` and are its state.

    :param loader: the DataLoader (map-style or iterable dataset, any sampler, any workers).
    :param seed: with the epoch, determines the shuffling and the workers' seeds (a
        :class:`epochal.adapters.DrawnSeed`, drawn for an unseeded run, gives way to the seed
        of a state it loads).

    A map-style dataset resumes by building the remaining batches; an iterable dataset (no
    sampler) with a state of its own (``state_dict``/``load_state_dict``, as a Hugging Face
    streaming dataset has) and no workers resumes from that state, told each epoch
    (``set_epoch``); any other iterable dataset by skipping the batches already seen. A
    sampler with ``set_epoch`` (such as ``DistributedSampler``) is told the epoch instead of
    being given a generator.
    """

    #: a state saved inside an epoch by another number of processes continues here: the rest of
    #: that epoch's order is shared out afresh (map-style datasets; :meth:`_resplit`).
    elastic = True

    def __init__(self, loader: DataLoader[Any], seed: int = 0) -> None:
        if not is_dataloader(loader):
            raise TypeError(f"LoaderStream needs a torch DataLoader, not {type(loader).__name__}")
        if loader.num_workers and not isinstance(loader.worker_init_fn, QuietWorker):
            loader.worker_init_fn = QuietWorker(loader.worker_init_fn)
        self.loader = loader
        #: a seed drawn for an unseeded run (a DrawnSeed) gives way to the saved one on resume.
        self._seed: int = seed if isinstance(seed, DrawnSeed) else int(seed)
        self._epoch = 0
        self._position = 0
        #: the loader's iterator of the epoch being read (its workers), None between epochs.
        self._open: Any = None
        #: this stream's shard: rank ``rank`` of ``shards`` (0 of 1: the whole data).
        self.rank, self.shards = 0, 1
        self.remainder: Remainder = "keep"
        self._shard_batches: int | None = None
        #: how each epoch's order is derived (:meth:`use_shard_order`).
        self.shard_order: ShardOrder = "epochal"
        #: under shard_order "torch": the global generator's state when the epoch started.
        self._epoch_rng: torch.Tensor | None = None
        #: an iterable dataset's own state, loaded for the next pass to read on from.
        self._dataset_state: Any = None
        #: the examples of the current epoch's order consumed before it was shared out among
        #: these shards (a resume on another number of processes; 0 otherwise).
        self._start = 0

    def use_shard_order(self, order: ShardOrder) -> None:
        """Derive every epoch's order as *order* says from now on (``[loop] shard_order``).

        ``"distributed_sampler"``: the order of ``DistributedSampler(dataset, num_replicas,
        rank, shuffle, seed=<this stream's seed>).set_epoch(epoch)``, where ``shuffle`` is
        whether the loader shuffles (a ``RandomSampler``) or not (a ``SequentialSampler``); a
        loader whose sampler is a ``DistributedSampler`` already keeps it.

        ``"torch"``: the loader's own draws from torch's global generator (the module's
        docstring), one process only.

        :raises ValueError: for ``"distributed_sampler"``, another sampler (weighted, with
            replacement, a custom batch sampler): DistributedSampler's order is of a plain
            dataset, shuffled or not; for ``"torch"``, a loader or sampler with a generator of
            its own, or an iterable dataset.
        """
        if order == "distributed_sampler":
            self._sampler_shuffles()  # refuse what DistributedSampler's order cannot stand for
        if order == "torch":
            loader = self.loader
            own = loader.generator is not None or getattr(loader.sampler, "generator", None) is not None
            if own or isinstance(loader.dataset, IterableDataset):
                what = "a generator of its own" if own else "an IterableDataset"
                raise ValueError(
                    f"shard_order 'torch' replays the draws a DataLoader makes from torch's global "
                    f"generator; this one has {what} (use shard_order 'epochal')"
                )
        self.shard_order = order

    def _sampler_shuffles(self) -> bool | None:
        """Whether the loader's sampler shuffles, for DistributedSampler's order (None: the
        loader's sampler is a DistributedSampler, used as it is)."""
        loader = self.loader
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            return None
        if loader.batch_size is not None and type(sampler) is SequentialSampler:
            return False
        plain = type(sampler) is RandomSampler and not sampler.replacement
        whole = plain and sampler.num_samples == len(loader.dataset)  # type: ignore[arg-type, union-attr]
        if loader.batch_size is not None and whole:
            return True
        raise ValueError(
            f"DistributedSampler's order is of a DataLoader with shuffle=True or False; this one has "
            f"{type(sampler).__name__ if loader.batch_size is not None else 'a custom batch_sampler'}"
            " (with replacement or num_samples for a RandomSampler)"
        )

    def shard(self, rank: int, size: int, remainder: Remainder = "keep") -> LoaderStream:
        """A stream over rank *rank*'s part of every epoch, for *size* processes.

        Map-style datasets: the sampler's order of an epoch (the same on every rank, from
        ``(seed, epoch)``) is shared out example by example (``order[rank::size]``, *remainder*
        as in :func:`epochal.data.shard_indices`) and each rank's part is cut into batches of the
        loader's ``batch_size`` and ``drop_last``; with a custom ``batch_sampler`` whole batches
        are shared out. A loader whose sampler is already a ``DistributedSampler`` for this
        rank and size is used as it is. The workers' seeds include the rank.

        :raises UnevenShardsError: *remainder* is ``"error"`` and *size* does not divide the data.
        :raises ValueError: a DataLoader over an ``IterableDataset``, or a ``DistributedSampler``
            for another rank or size.
        """
        check_shard(rank, size, remainder)
        if self.shard_order == "torch" and size > 1:
            raise ValueError(
                "shard_order 'torch' draws each epoch's order from each process's own global "
                f"generator: one process only ({size} here); use 'distributed_sampler' or 'epochal'"
            )
        loader = self.loader
        part = LoaderStream(loader, seed=self._seed)
        part.rank, part.shards, part.remainder = rank, size, remainder
        part.shard_order = self.shard_order
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            if (sampler.rank, sampler.num_replicas) != (rank, size):
                raise ValueError(
                    f"the DataLoader's DistributedSampler is for rank {sampler.rank} of "
                    f"{sampler.num_replicas} processes, but this is rank {rank} of {size}"
                )
            return part  # torch's sampler shards it already (told the epoch each time)
        if isinstance(loader.dataset, IterableDataset):
            raise ValueError(
                "a DataLoader over an IterableDataset cannot be sharded by epochal (it has no "
                "indices to share out): give the stream a shard(rank, size, remainder) method that "
                "returns this rank's part, or use a map-style dataset"
            )
        if loader.batch_size is None:  # a custom batch_sampler: share out whole batches
            count = len(loader.batch_sampler)  # type: ignore[arg-type]
            if remainder == "error" and count % size:
                raise UnevenShardsError(count, size, "batches")
            part._shard_batches = len(shard_indices(np.arange(count), rank, size, remainder))
        else:
            n = len(shard_indices(np.arange(len(sampler)), rank, size, remainder))  # type: ignore[arg-type]
            b = loader.batch_size
            part._shard_batches = n // b if loader.drop_last else -(-n // b)
        return part

    def __len__(self) -> int:
        """The number of batches per epoch (when the DataLoader knows it; of the current epoch's
        rest, for an epoch resumed on another number of processes)."""
        if self._start:
            b = self.loader.batch_size or 1
            rest = np.arange(self._examples() - self._start)
            count = len(shard_indices(rest, self.rank, self.shards, self.remainder))
            return count // b if self.loader.drop_last else -(-count // b)
        if self._shard_batches is not None:
            return self._shard_batches
        return len(self.loader)

    def _batches(self) -> list[list[int]]:
        """This shard's batches of the epoch the loader is prepared for."""
        loader = self.loader
        if loader.batch_size is None:
            batches = list(loader.batch_sampler)  # type: ignore[arg-type]
            chosen = shard_indices(np.arange(len(batches)), self.rank, self.shards, self.remainder)
            return [list(batches[i]) for i in chosen]
        shuffles = self._sampler_shuffles() if self.shard_order == "distributed_sampler" else None
        if shuffles is not None:
            order = distributed_sampler_order(len(loader.dataset), self._seed, self._epoch, shuffles)  # type: ignore[arg-type]
        else:
            order = np.asarray(list(loader.sampler), dtype=np.int64)
        mine = shard_indices(order[self._start :], self.rank, self.shards, self.remainder).tolist()
        b = loader.batch_size
        batches = [mine[i : i + b] for i in range(0, len(mine), b)]
        if loader.drop_last and batches and len(batches[-1]) < b:
            batches.pop()
        return batches

    def _prepare(self, epoch: int) -> None:
        if self.shard_order == "torch":
            return  # the loader draws from torch's global generator, as it does on its own
        loader = self.loader
        sampler = getattr(loader, "sampler", None)
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)  # type: ignore[union-attr]
        elif sampler is not None and hasattr(sampler, "generator"):
            sampler.generator = _generator(self._seed, epoch, 0)  # the same order on every rank
        ranks = (self.rank,) if self.shards > 1 else ()
        loader.generator = _generator(self._seed, epoch, 1, *ranks)  # the workers' seeds

    def __iter__(self) -> Iterator[Any]:
        """Yield the remaining batches of the current epoch, advancing the stored position."""
        epoch, position = self._epoch, self._position
        self._prepare(epoch)
        loader = self.loader
        if self.shard_order == "torch":
            iterator = self._torch_order(position)
        elif self._shard_batches is not None or self.shard_order != "epochal" or self._start:
            batches = self._batches()[position:]
            self._prepare(epoch)  # the workers' seeds as the full epoch's loader had them
            iterator = iter(self._rest(batches))
        elif self._keeps_dataset_state():
            self._tell_dataset(epoch)
            if position and self._dataset_state is not None:  # read on from the dataset's state
                loader.dataset.load_state_dict(from_plain(self._dataset_state))  # type: ignore[attr-defined]
                iterator = iter(loader)
            else:
                iterator = self._skipping(position)
        elif position == 0:
            iterator = iter(loader)
        elif not isinstance(loader.dataset, IterableDataset) and loader.batch_sampler is not None:
            # map-style: the rest of this epoch's batches
            batches = list(loader.batch_sampler)[position:]
            self._prepare(epoch)  # the workers' seeds as the full epoch's loader had them
            iterator = iter(self._rest(batches))
        else:
            iterator = self._skipping(position)
        self._dataset_state = None
        self._open = iterator
        k = position
        for batch in iterator:
            if (self._epoch, self._position) != (epoch, k):
                raise RuntimeError("the state of the LoaderStream changed during an iteration")
            k += 1
            self._position = k
            yield batch
        self._open = None
        if (self._epoch, self._position) == (epoch, k):
            self._epoch, self._position, self._start = epoch + 1, 0, 0

    def _skipping(self, position: int) -> Iterator[Any]:
        """The loader's iterator past the *position* batches of the epoch already seen (read again)."""
        iterator = iter(self.loader)
        for _ in range(position):
            next(iterator, None)
        return iterator

    def _keeps_dataset_state(self) -> bool:
        """Whether the loader's dataset is an iterable one with a state of its own, read in this
        process (no workers: theirs are copies, whose state never comes back)."""
        dataset = self.loader.dataset
        return (
            isinstance(dataset, IterableDataset)
            and not self.loader.num_workers
            and callable(getattr(dataset, "state_dict", None))
            and callable(getattr(dataset, "load_state_dict", None))
        )

    def _tell_dataset(self, epoch: int) -> None:
        set_epoch = getattr(self.loader.dataset, "set_epoch", None)
        if callable(set_epoch):  # a loaded state applies to its own epoch only (Hugging Face's)
            set_epoch(epoch)

    def _torch_order(self, position: int) -> Iterator[Any]:
        """The epoch's iterator under shard_order "torch": at its start, the loader's own (its
        draws from the global generator, whose state is kept first); inside it, the rest of the
        order those draws gave, rebuilt on the kept state without touching the global generator."""
        if position == 0 or self._epoch_rng is None:
            self._epoch_rng = torch.get_rng_state()
            return iter(self.loader)
        now = torch.get_rng_state()
        torch.set_rng_state(self._epoch_rng)
        try:
            base = int(torch.empty((), dtype=torch.int64).random_().item())  # the iterator's first draw
            batches = [list(b) for b in self.loader.batch_sampler][position:]  # type: ignore[union-attr]
        finally:
            torch.set_rng_state(now)
        # its own generator: the rest takes no draw from the global one (workers seeded from base)
        return iter(self._rest(batches, torch.Generator().manual_seed(base)))

    def _rest(self, batches: list[list[int]], generator: torch.Generator | None = None) -> DataLoader[Any]:
        loader = self.loader
        options: dict[str, Any] = {
            "batch_sampler": _Batches(batches),
            "num_workers": loader.num_workers,
            "collate_fn": loader.collate_fn,
            "pin_memory": loader.pin_memory,
            "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "generator": generator if generator is not None else loader.generator,
        }
        if loader.num_workers:
            options["prefetch_factor"] = loader.prefetch_factor
        return DataLoader(loader.dataset, **options)

    def close_workers(self) -> None:
        """Shut the loader's workers down now (persistent ones, or those of an epoch cut short),
        rather than leave them to the interpreter's exit. The loop calls it when training ends."""
        # the persistent workers' iterator, and that of an epoch cut short (torch's own method)
        for iterator in (getattr(self.loader, "_iterator", None), self._open):
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()
        if getattr(self.loader, "_iterator", None) is not None:
            self.loader._iterator = None  # a later pass starts workers afresh
        self._open = None

    def state_dict(self) -> dict[str, Any]:
        """``{"seed", "epoch", "position"}`` as plain ints, with ``"batches"`` (of an epoch) where
        the loader knows its length (a shard adds ``"world_size"``; inside an epoch under shard
        order "torch", ``"torch_rng"``: the global generator's state at the epoch's start)."""
        state: dict[str, Any] = {"seed": int(self._seed), "epoch": self._epoch, "position": self._position}
        if self.shard_order == "torch" and self._position and self._epoch_rng is not None:
            state["torch_rng"] = self._epoch_rng.numpy().copy()
        batches = self._epoch_length()
        if batches is not None:
            state["batches"] = batches
        if self._keeps_dataset_state():
            state["dataset"] = to_plain(self.loader.dataset.state_dict())  # type: ignore[attr-defined]
        if self.shards > 1:
            state["world_size"] = self.shards
        if self._start:
            state["start"] = self._start
        return state

    def _epoch_length(self) -> int | None:
        """The batches of an epoch, or None where the loader cannot tell (an iterable dataset)."""
        try:
            return len(self)
        except TypeError:
            return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` of a stream with the same seed.

        :raises ValueError: on missing or unknown keys, another seed, a bad epoch/position, or a
            position beyond the epoch or inside an epoch whose length changed.
        """
        if set(state) - OPTIONAL_STATE_KEYS != _STATE_KEYS:
            raise ValueError(
                f"invalid LoaderStream state: keys {sorted(map(str, state))}, expected {sorted(_STATE_KEYS)}"
            )
        for key in sorted(_STATE_KEYS):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"invalid LoaderStream state: {key!r} must be a non-negative int, got {value!r}"
                )
        if isinstance(self._seed, DrawnSeed):  # an unseeded run continues the saved order
            self._seed = DrawnSeed(state["seed"])
        elif state["seed"] != self._seed:
            raise ValueError(
                f"cannot load the state of a LoaderStream seeded with {state['seed']} into one seeded "
                f"with {self._seed}: the batches would differ"
            )
        start = self._resplit(state)
        if start is not None:  # saved inside an epoch by another number of processes
            self._epoch, self._position, self._start, self._dataset_state = (
                int(state["epoch"]),
                0,
                start,
                None,
            )
            return
        self._start = int(state.get("start", 0)) if state.get("world_size", 1) == self.shards else 0
        position = check_epoch_length(state, self._epoch_length(), "LoaderStream")
        saved_rng = state.get("torch_rng")
        if self.shard_order == "torch" and position:
            if not isinstance(saved_rng, np.ndarray) or saved_rng.dtype != np.uint8:
                raise ValueError(
                    "invalid LoaderStream state: shard_order 'torch' inside an epoch needs 'torch_rng', "
                    "the generator's state at the epoch's start (saved under another shard_order?)"
                )
            self._epoch_rng = torch.from_numpy(saved_rng.copy())
        self._dataset_state = state.get("dataset") if self._keeps_dataset_state() else None
        self._epoch, self._position = int(state["epoch"]), position

    def _examples(self) -> int:
        """The number of examples in an epoch's order (before sharding)."""
        if self.shard_order == "distributed_sampler" and self._sampler_shuffles() is not None:
            return len(self.loader.dataset)  # type: ignore[arg-type]
        return len(self.loader.sampler)  # type: ignore[arg-type]

    def _resplit(self, state: Mapping[str, Any]) -> int | None:
        """Where the rest of an epoch saved inside it by another number of processes starts in
        the epoch's order (:func:`epochal.data.resplit_start`); None: *state* continues as it is.

        :raises ValueError: a loader whose epoch cannot be shared out afresh by examples (an
            iterable dataset, a custom ``batch_sampler``, a ``DistributedSampler`` of its own,
            shard order ``"torch"``), or a rest that the remainder ``"error"`` refuses.
        """
        loader = self.loader
        saved = state.get("world_size", 1)
        if saved == self.shards or not state.get("position") or state.get("position") == state.get("batches"):
            return resplit_start(state, self.shards, 0, 1, False, "LoaderStream")  # checks its keys
        what = (
            "an IterableDataset"
            if isinstance(loader.dataset, IterableDataset)
            else "a custom batch_sampler"
            if loader.batch_size is None
            else "a DistributedSampler of its own"
            if isinstance(getattr(loader, "sampler", None), DistributedSampler)
            else "shard_order 'torch'"
            if self.shard_order == "torch"
            else None
        )
        if what is not None:
            raise ValueError(
                f"cannot resume a LoaderStream saved inside an epoch on {saved} process(es) on "
                f"{self.shards}: its DataLoader has {what}, whose rest of an epoch cannot be shared "
                f"out afresh example by example; resume on {saved} process(es), or from a checkpoint "
                "saved at the end of an epoch"
            )
        examples = self._examples()
        size = int(loader.batch_size)  # type: ignore[arg-type]  # not None: refused above
        start = resplit_start(state, self.shards, examples, size, loader.drop_last, "LoaderStream")
        rest = examples - (start or 0)
        if self.remainder == "error" and rest % self.shards:
            raise ValueError(
                f"the rest of the epoch, {rest} examples, cannot be shared evenly by {self.shards} "
                f'processes ({rest % self.shards} left over) and [loop] uneven_shards is "error"'
            )
        return start

    def __repr__(self) -> str:
        """A summary of the stream's loader and state."""
        where = f"epoch={self._epoch}, position={self._position}"
        return f"LoaderStream({self.loader!r}, seed={self._seed}, {where})"
