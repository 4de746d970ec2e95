"""Loaders and datasets that keep their own position: resumed from their state, never replayed.

torchdata's ``StatefulDataLoader`` and Hugging Face's ``datasets.IterableDataset`` (a streaming
dataset) have ``state_dict()``/``load_state_dict(state)``: the state says where the iteration
is (which file, which example, each worker's progress), so a resume reads on from there in a
time that does not grow with the position in the epoch, where a stream without a state is
replayed up to the batch it stopped at (O(epoch) on a long stream). The loop wraps such a
stream in a :class:`StatefulStream` (:func:`epochal.adapters.adapt_stream`), which

- counts the epoch and the batches of it already yielded (the loop's own bookkeeping), and
  tells the source the epoch before each pass (``set_epoch``: the dataset's, the sampler's),
  as a hand-written loop does: a Hugging Face dataset reshuffles per epoch, and applies a loaded
  state to the epoch it was saved in only (it would otherwise restart every later epoch there);
- saves the source's state in a checkpoint's plain form (tensors, tuples and dicts with other
  than string keys tagged, nothing pickled) with what the data looked like: the number of
  batches of an epoch where the source knows it, the dataset's number of shards (files), the
  loader's workers, the pipeline of a Hugging Face dataset (shuffled, mapped, batched);
- on a resume inside an epoch refuses a state that does not match the data (another number of
  files, batches or workers, another pipeline) with one line naming the stream, and also
  turns an error of the source reading its state back into that line; a state saved at an
  epoch's end that no longer matches is left out (the next epoch starts afresh);
- leaves torch's global generator where the checkpoint left it when the resumed pass starts
  (a ``DataLoader`` draws its workers' seed and its sampler's seed from it when an iterator is
  made, which the loaded state then overrides: the draws would shift every later random number),
  and after a loader's state of an epoch's end moves it as the straight run's next epoch did.

On several processes :meth:`StatefulStream.shard` gives each rank its part: a Hugging Face
dataset through ``datasets.distributed.split_dataset_by_node`` (inside a ``StatefulDataLoader``
too: the loader is made again over the rank's part, with its options); a ``StatefulDataLoader``
over a map-style dataset needs a ``DistributedSampler`` for the rank (torchdata's
``StatefulDistributedSampler`` keeps its position). A stream of unknown length cannot be padded
or cut: every rank must get as many batches (files of equal length, a multiple of the world size).

Known limits, the libraries' own: a Hugging Face dataset's shuffle buffer is not part of its
state (a resumed shuffled stream refills it: other batches than the straight run's), and a
loader's prefetched batches are read again after a resume (they are not yet counted as seen).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

from epochal.data import check_shard, check_world_size

__all__ = ["StatefulStream", "is_stateful_source"]

#: the sources resumed from their own state: (module, class) anywhere in a stream's class's MRO.
SOURCES = frozenset(
    {
        ("torchdata.stateful_dataloader.stateful_dataloader", "StatefulDataLoader"),
        ("datasets.iterable_dataset", "IterableDataset"),
    }
)
_KEYS = frozenset({"epoch", "position", "state"})
_FINGERPRINT = ("source", "batches", "shards", "workers", "pipeline")
_OPTIONAL = frozenset({*_FINGERPRINT, "world_size"})
#: the tag of a value the plain form cannot hold as it is (a tensor, a tuple, a dict with
#: other than string keys).
TAG = "__epochal_stateful__"


def is_stateful_source(stream: Any) -> bool:
    """Whether *stream* is a loader or dataset that a :class:`StatefulStream` resumes from its state."""
    return any((kind.__module__, kind.__qualname__) in SOURCES for kind in type(stream).__mro__)


def _is_hf_dataset(value: Any) -> bool:
    return any(
        (kind.__module__, kind.__qualname__) == ("datasets.iterable_dataset", "IterableDataset")
        for kind in type(value).__mro__
    )


class StatefulStream:
    """A loader or dataset with its own ``state_dict``/``load_state_dict`` as an epochal stream.

    :param source: a torchdata ``StatefulDataLoader`` or a Hugging Face ``IterableDataset``.
    :param name: the stream's name in ``[data]``, for messages.
    """

    def __init__(self, source: Any, name: str = "") -> None:
        self.source = source
        self.name = name
        self._epoch = 0
        self._position = 0
        #: the next pass continues a state loaded inside an epoch.
        self._resumed = False
        #: the next pass starts an epoch after a loader's state of a finished epoch was loaded.
        self._primed = False
        self.shards = 1

    # -- what the data looks like --------------------------------------------------------------

    def _dataset(self) -> Any:
        return getattr(self.source, "dataset", self.source)

    def _length(self) -> int | None:
        try:
            return len(self.source)
        except TypeError:
            return None

    def fingerprint(self) -> dict[str, Any]:
        """What the state of a pass depends on: the source's class, and where known its batches
        per epoch, its dataset's shards, its workers and a Hugging Face dataset's pipeline."""
        found: dict[str, Any] = {"source": type(self.source).__name__}
        batches = self._length()
        if batches is not None:
            found["batches"] = batches
        dataset = self._dataset()
        shards = getattr(dataset, "num_shards", None)
        if isinstance(shards, int):
            found["shards"] = shards
        workers = getattr(self.source, "num_workers", None)
        if isinstance(workers, int):
            found["workers"] = workers
        if _is_hf_dataset(dataset):
            found["pipeline"] = pipeline(dataset.state_dict())
        return found

    def __len__(self) -> int:
        """The batches of an epoch (a ``TypeError`` where the source does not know them)."""
        return len(self.source)

    # -- iteration ------------------------------------------------------------------------------

    def _tell_epoch(self, epoch: int) -> None:
        told = set()
        for target in (
            self.source,
            getattr(self.source, "dataset", None),
            getattr(self.source, "sampler", None),
        ):
            set_epoch = getattr(target, "set_epoch", None)
            if target is not None and id(target) not in told and callable(set_epoch):
                set_epoch(epoch)
                told.add(id(target))

    def __iter__(self) -> Iterator[Any]:
        """Yield the rest of the current epoch (all of it, unless a state was loaded inside it)."""
        epoch, position = self._epoch, self._position
        self._tell_epoch(epoch)
        resumed, self._resumed = self._resumed, False
        primed, self._primed = self._primed, False
        if resumed:
            iterator = self._resumed_iterator()
            first = self._first(iterator)
        elif primed:
            iterator = self._after_end_state()
            first = None
        else:
            iterator = iter(self.source)
            first = None
        k = position
        if first is not None:
            k += 1
            self._position = k
            yield first[0]
        for batch in iterator:
            if (self._epoch, self._position) != (epoch, k):
                raise RuntimeError(f"the state of the stream {self.name!r} changed during an iteration")
            k += 1
            self._position = k
            yield batch
        if (self._epoch, self._position) == (epoch, k):
            self._epoch, self._position = epoch + 1, 0

    def _resumed_iterator(self) -> Iterator[Any]:
        """The source's iterator on its loaded state, torch's global generator left as it was."""
        torch = sys.modules.get("torch")
        kept = torch.get_rng_state() if torch is not None else None
        try:
            return iter(self.source)
        except Exception as error:
            raise self._mismatch(f"{type(error).__name__}: {error}") from error
        finally:
            if kept is not None:
                torch.set_rng_state(kept)  # type: ignore[union-attr]

    def _after_end_state(self) -> Iterator[Any]:
        """A loader's next epoch after a state of an epoch's end was loaded (its sampler's
        generator), torch's global generator moved as the straight run moved it.

        torchdata's loader reads a loaded state when it makes its next iterator and, that
        state's epoch being over, makes a second one: two draws from the global generator (each
        iterator's workers' base seed) where the straight run made one. So the generator is put
        back and drawn from once. The workers' base seed of that epoch is then the second draw's
        (random numbers drawn inside the workers differ from the straight run's)."""
        torch = sys.modules.get("torch")
        kept = torch.get_rng_state() if torch is not None else None
        try:
            iterator = iter(self.source)
        except Exception as error:
            raise self._mismatch(f"{type(error).__name__}: {error}") from error
        finally:
            if kept is not None:
                torch.set_rng_state(kept)  # type: ignore[union-attr]
                torch.empty((), dtype=torch.int64).random_()  # type: ignore[union-attr]
        # torchdata 0.11's StatefulDistributedSampler takes a loaded position when its iterator
        # first runs, which the dropped first iterator never did: the new epoch would start at
        # the old one's end (empty); the new epoch starts at its beginning
        sampler = getattr(self.source, "sampler", None)
        if getattr(sampler, "next_yielded", None) is not None:
            sampler.next_yielded = None  # type: ignore[union-attr]
        return iterator

    def _first(self, iterator: Iterator[Any]) -> tuple[Any] | None:
        """The first batch after a resume (a source reads its state back lazily: its error is
        the state's, said in one line)."""
        try:
            return (next(iterator),)
        except StopIteration:
            return None
        except Exception as error:
            raise self._mismatch(f"{type(error).__name__}: {error}") from error

    def _mismatch(self, detail: str) -> Exception:
        from epochal.errors import StreamStateError

        return StreamStateError(
            f"[data] stream {self.name!r} ({type(self.source).__name__}): its saved state does not "
            f"match the data: {detail}; resume with the data, loader options and number of processes "
            "it was saved with, or from a checkpoint saved at the end of an epoch"
        )

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "state"}`` (``state``: the source's own, in plain form) with
        the :meth:`fingerprint` of the data (and ``world_size`` for a shard)."""
        # between epochs a Hugging Face dataset's state says nothing the next epoch reads (a
        # loaded state applies to its own epoch): not kept, so that a resumed run's state is the
        # straight run's (the library's counters differ)
        scoped = self._position == 0 and _is_hf_dataset(self._dataset())
        state: dict[str, Any] = {
            "epoch": self._epoch,
            "position": self._position,
            "state": None if scoped else to_plain(self.source.state_dict()),
            **self.fingerprint(),
        }
        if self.shards > 1:
            state["world_size"] = self.shards
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from *state* (of :meth:`state_dict`): the source loads its own.

        :raises StreamStateError: inside an epoch, a state of other data (its fingerprint
            differs), or one the source refuses.
        :raises ValueError: a state that is not one of a StatefulStream.
        """
        keys = set(state)
        if not keys >= _KEYS or keys - _KEYS - _OPTIONAL:
            raise ValueError(
                f"invalid state of the stream {self.name!r}: keys {sorted(map(str, keys))}, expected "
                f"{sorted(_KEYS)} and some of {sorted(_OPTIONAL)} (saved by another kind of stream?)"
            )
        for key in ("epoch", "position"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"invalid state of the stream {self.name!r}: {key!r} must be a non-negative int"
                )
        check_world_size(state, self.shards, f"stream {self.name!r}")
        position = int(state["position"])
        now = self.fingerprint()
        differences = [
            _difference(key, state.get(key), now.get(key))
            for key in _FINGERPRINT
            if state.get(key) != now.get(key)
        ]
        if differences and position:
            raise self._mismatch("; ".join(differences))
        loaded = not differences and state["state"] is not None  # at an epoch's end: if it fits
        if loaded:
            try:
                self.source.load_state_dict(from_plain(state["state"]))
            except Exception as error:
                raise self._mismatch(f"{type(error).__name__}: {error}") from error
        self._epoch, self._position = int(state["epoch"]), position
        self._resumed = position > 0
        finished = isinstance(state["state"], Mapping) and state["state"].get("_iterator_finished") is True
        self._primed = loaded and not position and finished

    # -- several processes ----------------------------------------------------------------------

    def shard(self, rank: int, size: int, remainder: str = "keep") -> StatefulStream:
        """This rank's part of the stream for *size* processes (the module's docstring).

        :raises ValueError: a source that cannot be shared out here (said how to do it).
        """
        check_shard(rank, size, remainder)
        source = self.source
        if _is_hf_dataset(source):
            part = StatefulStream(_split(source, rank, size), self.name)
        else:
            part = StatefulStream(_loader_part(source, rank, size), self.name)
        part.shards = size
        return part

    def __repr__(self) -> str:
        """The source and the position."""
        return f"StatefulStream({self.source!r}, epoch={self._epoch}, position={self._position})"


def _difference(key: str, saved: Any, now: Any) -> str:
    words = {"batches": "batches per epoch", "shards": "dataset shards (files)", "workers": "workers"}
    if key in words:
        return f"saved with {saved} {words[key]}, now {now}"
    if key == "pipeline":
        return f"saved from the pipeline {' > '.join(saved or [])}, now {' > '.join(now or [])}"
    return f"saved from a {saved}, now a {now}"


def pipeline(state: Any) -> list[str]:
    """The ``type`` names of a Hugging Face dataset's state, outermost first (what the stream
    does: rebatched, shuffled, mapped, ...), not counting the states it kept to go back to."""
    names: list[str] = []
    while isinstance(state, Mapping):
        kind = state.get("type")
        if isinstance(kind, str):
            names.append(kind)
        state = state.get("examples_iterable")
    return names


def _split(dataset: Any, rank: int, size: int) -> Any:
    """*dataset*'s part for rank *rank* of *size* (``split_dataset_by_node``), or the dataset
    itself when it is already that part."""
    done = getattr(dataset, "_distributed", None)
    if done is not None:
        if (done.rank, done.world_size) != (rank, size):
            raise ValueError(
                f"its dataset is split for rank {done.rank} of {done.world_size} processes, but this is "
                f"rank {rank} of {size}"
            )
        return dataset
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(dataset, rank=rank, world_size=size)


def _loader_part(loader: Any, rank: int, size: int) -> Any:
    """A StatefulDataLoader's part: as it is with a DistributedSampler for this rank, made again
    over the rank's part of a Hugging Face dataset."""
    sampler: Any = getattr(loader, "sampler", None)
    if hasattr(sampler, "num_replicas") and hasattr(sampler, "rank"):
        if (sampler.rank, sampler.num_replicas) != (rank, size):
            raise ValueError(
                f"its DistributedSampler is for rank {sampler.rank} of {sampler.num_replicas} processes, "
                f"but this is rank {rank} of {size}"
            )
        return loader
    dataset = loader.dataset
    if not _is_hf_dataset(dataset):
        raise ValueError(
            f"a {type(loader).__name__} over a map-style dataset is shared out by its sampler: give it "
            f"sampler=DistributedSampler(dataset, num_replicas={size}, rank=<this rank>) (torchdata's "
            "StatefulDistributedSampler keeps its position; epochal.distributed.current_world() "
            "tells the rank), or use a torch DataLoader, which epochal shards by itself"
        )
    part = _split(dataset, rank, size)
    if part is dataset:
        return loader
    options: dict[str, Any] = {
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
        "in_order": loader.in_order,
        "snapshot_every_n_steps": loader.snapshot_every_n_steps,
    }
    if loader.num_workers:
        options["prefetch_factor"] = loader.prefetch_factor
    return type(loader)(part, **options)


# -- the plain form of a source's state ----------------------------------------------------------


def to_plain(value: Any) -> Any:
    """*value* as a checkpoint holds it: tensors, tuples and dicts with other than string keys
    tagged (:data:`TAG`); numbers, strings, None, numpy arrays, lists and dicts as they are."""
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {k: to_plain(v) for k, v in value.items()}
        return {TAG: "items", "items": [[to_plain(k), to_plain(v)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [to_plain(v) for v in value]}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        from epochal.torch.state import tensor_to_plain

        return {TAG: "tensor", "value": tensor_to_plain(value)}
    return value


def from_plain(value: Any) -> Any:
    """Undo :func:`to_plain`."""
    if isinstance(value, Mapping):
        tag = value.get(TAG)
        if tag == "items":
            return {_key(from_plain(k)): from_plain(v) for k, v in value["items"]}
        if tag == "tuple":
            return tuple(from_plain(v) for v in value["items"])
        if tag == "tensor":
            from epochal.torch.state import plain_to_tensor

            return plain_to_tensor(value["value"], None)
        return {k: from_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    return value


def _key(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
