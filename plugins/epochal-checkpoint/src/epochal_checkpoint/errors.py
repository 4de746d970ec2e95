"""The errors of the checkpoint plugins; each is an :class:`epochal.EpochalError` naming a path.

The CLI prints an ``EpochalError`` as one line (exit status 2), so every message here names
the checkpoint, file or state key at fault.
"""

from __future__ import annotations

from epochal.errors import EpochalError


class CheckpointError(EpochalError):
    """Base class of every checkpoint error."""


class CheckpointNotFoundError(CheckpointError):
    """There is no checkpoint where one was asked for (``--resume``, ``load``'s ``path``)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files are missing, truncated or fail their checksum."""


class UnsignedCheckpointError(CorruptCheckpointError):
    """``EPOCHAL_CHECKPOINT_KEY`` is set and a checkpoint's signature is missing, malformed or
    does not verify (forged, or signed with another key)."""


class ForeignCheckpointError(CheckpointError):
    """A path holds something that is not an epochal checkpoint (or a newer format)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds a pickle payload; loading it could run code, so it is refused."""


class StateMismatchError(CheckpointError):
    """A checkpoint's state does not fit this run's model or streams (keys, shapes, dtypes)."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (disk full, permission denied...); earlier ones are kept."""


class UnsupportedStateError(CheckpointError, TypeError):
    """The state to save holds a value that is not an array, number, string, bool, None, list or dict."""


class CheckpointLockedError(CheckpointError):
    """Another run holds the lock on the checkpoint directory (its pid, host, run id and start named)."""
