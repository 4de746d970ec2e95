"""Streams of other libraries as epochal streams (a torch ``DataLoader`` resumes mid-epoch, a
loader or dataset with a state of its own resumes from it).

The loop passes every stream through :func:`adapt_stream`; a library's module is imported only
when a stream of that library is given.
"""

from __future__ import annotations

import secrets
from typing import Any


class DrawnSeed(int):
    """The seed of a run's data order drawn afresh because ``[loop] seed`` is unset: each fresh
    run orders its DataLoaders differently, as torch does unseeded. A stream saves it in its
    state, and one made with a drawn seed takes the saved one when it resumes."""


def draw_seed() -> DrawnSeed:
    """A fresh :class:`DrawnSeed` in 1 … 2**31 - 1 (never 0, which ``seed or 0`` would lose)."""
    return DrawnSeed(secrets.randbelow(2**31 - 1) + 1)


def orders_itself(stream: Any) -> bool:
    """Whether *stream* takes its order from the run's seed: a torch DataLoader, or a callable
    that makes a stream each epoch (it may make one)."""
    if type(stream).__module__.startswith("torch.utils.data"):
        return True
    return callable(stream) and not hasattr(stream, "__iter__")


def adapt_stream(stream: Any, seed: int | None, name: str = "") -> Any:
    """A torch DataLoader as a resumable :class:`epochal.torch.LoaderStream`; a loader or
    dataset with a state of its own (torchdata's ``StatefulDataLoader``, a Hugging Face
    ``IterableDataset``) as a :class:`epochal.stateful.StatefulStream` named *name*; others as
    given."""
    if type(stream).__module__.startswith("torch.utils.data"):
        from epochal.torch.data import LoaderStream, is_dataloader

        if is_dataloader(stream):
            return LoaderStream(stream, seed=seed if seed is not None else draw_seed())
    from epochal.stateful import StatefulStream, is_stateful_source

    if is_stateful_source(stream):
        return StatefulStream(stream, name)
    return stream
