"""Empty batches and empty streams: the ``[loop] on_empty_batch`` / ``on_empty_stream`` policies.

``error`` raises :class:`EmptyDataError`, ``warn`` warns once per stream (then skips), ``ignore``
skips. A stream whose ``len()`` is 0 is known before training: :meth:`EmptyData.check_sized`
applies the stream policy before any hook runs, so nothing is written and no epoch is spent
before an empty evaluation stream is found (emloop's empty-stream policy, checked early).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from epochal.errors import EpochalError


class EmptyDataError(EpochalError):
    """A stream yielded an empty batch or no batch at all, and the policy is ``error``."""


def says_empty(stream: Any) -> bool:
    """Whether *stream*'s ``len()`` is 0 (without one, or when it fails: found at its first pass)."""
    try:  # an IterableDataset's DataLoader raises TypeError: its length is unknown
        return hasattr(type(stream), "__len__") and len(stream) == 0
    except Exception:
        return False


class EmptyData:
    """Applies the policies of one run; each warning is given once per stream."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        #: the streams that say (``len()``) they hold no batch, as given (not a rank's shard).
        self.sized_empty = [name for name, stream in data.items() if says_empty(stream)]
        self._warned: set[str] = set()

    def check_sized(self, policy: str, evaluated: Mapping[str, int], at_start: bool) -> None:
        """Before training: *policy* for every empty sized stream that will be read (the train
        stream, an evaluation stream that is scheduled (*evaluated*) or evaluated *at_start*)."""
        for stream in self.sized_empty:
            if stream == "train" or evaluated.get(stream) or at_start:
                message = (
                    f"stream {stream!r} yielded no batch: it is empty (its len() is 0; found before training)"
                )
                if policy == "error":
                    raise EmptyDataError(
                        f'{message}; set [loop] on_empty_stream = "warn" or "ignore" to run anyway'
                    )
                self.apply(policy, message, f"stream:{stream}")

    def batch(self, policy: str, stream: str, epoch: int, iteration: int) -> None:
        """An empty batch of *stream*: *policy* applied (the caller skips the batch)."""
        self.apply(
            policy,
            f"stream {stream!r} yielded an empty batch (epoch {epoch}, iteration {iteration})",
            f"batch:{stream}",
        )

    def stream(self, policy: str, stream: str, epoch: int) -> None:
        """A pass over *stream* that yielded no batch: *policy* applied."""
        self.apply(policy, f"stream {stream!r} yielded no batch (epoch {epoch})", f"stream:{stream}")

    def apply(self, policy: str, message: str, key: str) -> None:
        if policy == "error":
            raise EmptyDataError(message + "; set [loop] on_empty_batch/on_empty_stream to warn or ignore")
        if policy == "warn" and key not in self._warned:
            self._warned.add(key)
            warnings.warn(message + " (reported once)", RuntimeWarning, stacklevel=4)
