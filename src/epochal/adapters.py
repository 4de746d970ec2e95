"""Streams of other libraries as epochal streams (a torch ``DataLoader`` resumes mid-epoch).

The loop passes every stream through :func:`adapt_stream`; a library's module is imported only
when a stream of that library is given.
"""

from __future__ import annotations

from typing import Any


def adapt_stream(stream: Any, seed: int | None) -> Any:
    """A torch DataLoader as a resumable :class:`epochal.torch.LoaderStream`; others as given."""
    if type(stream).__module__.startswith("torch.utils.data"):
        from epochal.torch.data import LoaderStream, is_dataloader

        if is_dataloader(stream):
            return LoaderStream(stream, seed=seed or 0)
    return stream
