"""The ``load`` plugin, and reading a checkpoint named by a path or URL.

``load`` starts a run from a given checkpoint: the full state, or the model's arrays only.
:func:`read_from` reads the checkpoint a user names (a checkpoint, its manifest or ``latest``
file, a directory of checkpoints, an fsspec URL); ``checkpoint --resume PATH``, ``export`` and
``load`` all go through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epochal import hookimpl
from epochal.protocol import checked_options
from epochal_checkpoint import storage
from epochal_checkpoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    StateMismatchError,
)
from epochal_checkpoint.fit import check_fits, check_model
from epochal_checkpoint.storage import store

if TYPE_CHECKING:
    from epochal.loop import Loop

__all__ = ["Load", "read_from"]


@checked_options("load")
class Load:
    """Start a run from a given checkpoint: its full state, or the model's arrays only.

    :param path: a checkpoint directory, or a directory of checkpoints (its newest complete one
        is used); a local path or an fsspec URL (``s3://bucket/run/ckpt-e0002-i000046``). None:
        do nothing.
    :param storage_options: keyword arguments of the URL's filesystem (endpoint, credentials).
    :param weights_only: load only the model's weights (fine-tuning): counters, log, RNG,
        streams and plugin states start afresh, and a model with ``load_weights(state)``
        (:class:`epochal.torch.TorchModel`) keeps its own optimizer, learning rate and steps.

    A run started with ``--resume`` continues from its own newest checkpoint when the
    ``checkpoint`` plugin is part of the run; ``load`` then does nothing.
    """

    #: it restores weights: it runs only when a run names it (a table, order, --plugins).
    autoload = False
    writes_to = ()  # it reads its path and writes nothing

    def __init__(
        self,
        path: str | None = None,
        weights_only: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.path = path
        self.weights_only = weights_only
        self.storage_options = storage_options
        #: the checkpoint that was loaded (None until then).
        self.loaded: Path | None = None

    @hookimpl
    def resume_state(self, loop: Loop, resume: bool) -> dict[str, Any] | None:
        """The full state of the checkpoint at ``path`` (None for weights_only)."""
        if self.path is None or self.weights_only:
            return None
        from epochal_checkpoint.plugin import Checkpoint  # the plugin module imports this one

        if resume and any(isinstance(p, Checkpoint) for p in loop.plugins.values()):
            return None
        state, where = read_from(self.path, storage_options=self.storage_options)
        check_fits(loop, state, where)
        self.loaded = where
        loop.resumed_source = f"checkpoint {store.shown(where)}"
        return state

    @hookimpl
    def before_training(self, loop: Loop) -> None:
        """With weights_only: copy the checkpoint's model arrays into the model."""
        if self.path is None or not self.weights_only or loop.resumed:
            return
        state, where = read_from(self.path, model_only=True, storage_options=self.storage_options)
        load_weights = getattr(loop.model, "load_weights", None)
        if callable(load_weights):  # its weights alone: the optimizer stays as configured
            try:
                load_weights(state.get("model"))
            except (ValueError, TypeError, KeyError) as error:
                raise StateMismatchError(
                    f"checkpoint {str(where)!r} does not fit the model: {error}"
                ) from error
        else:
            check_model(loop, state.get("model"), where)
        self.loaded = where


def read_from(
    path: str | Path,
    model_only: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    known: store.RemoteStore | None = None,
    into: Any = None,
) -> tuple[dict[str, Any], Path]:
    """Read the checkpoint at *path*: a checkpoint, its manifest or ``latest`` file, or a
    directory of checkpoints (its newest complete one). Return ``(state, checkpoint path)``.
    *into*: where a local checkpoint's arrays may be read straight into (:func:`load_destinations`).

    *path* may be an fsspec URL (opened with *storage_options*; *known*, a store already open,
    is used when the URL is its own): the checkpoint is downloaded into the store's staging
    directory, the path returned (:func:`~epochal_checkpoint.storage.store.shown` names its URL).

    :raises CheckpointError: one error naming the path, also when the path cannot be looked at
        (a name too long, a link loop...).
    """
    if store.is_remote(path):
        read = store.read_url(str(path), model_only, storage_options, known)
        return read.state, read.path
    path = store.local_path(path)
    try:
        return _read_from(path, model_only, into)
    except OSError as error:  # pathlib's checks raise for a name too long, permission denied...
        raise CheckpointNotFoundError(
            f"cannot read a checkpoint at {str(error.filename or path)!r:.300}: {error.strerror or error}"
        ) from None


def load_destinations(loop: Loop) -> dict[str, Any] | None:
    """The loop's model's ``load_destinations()`` as a loop state's tree (``{"model": ...}``):
    the live tensors a resume reads the checkpoint's arrays straight into, once it verified
    (issue 32); None when the model offers none."""
    offer = getattr(loop.model, "load_destinations", None)
    if not callable(offer):
        return None
    destinations = offer()
    return {"model": destinations} if destinations else None


def _read_from(path: Path, model_only: bool, into: Any = None) -> tuple[dict[str, Any], Path]:
    if not path.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {str(path)!r} (the path does not exist)")
    if path.is_file() and path.name == storage.MANIFEST:
        path = path.parent
    elif path.name == storage.POINTER and (path.is_symlink() or not path.is_dir()):
        name = storage.read_pointer(path.parent)  # a bare checkpoint name: never leaves the directory
        if name is None:
            raise CheckpointNotFoundError(
                f"{str(path)!r} names no checkpoint of its directory (it must hold a checkpoint name)"
            )
        path = path.parent / name
        if path.is_symlink():
            raise CorruptCheckpointError(f"{str(path)!r} named by {storage.POINTER} is a symbolic link")
    if path.is_dir() and not (path / storage.MANIFEST).exists():
        infos, _ = storage.list_checkpoints(path)
        if not infos:
            raise ForeignCheckpointError(
                f"{str(path)!r} is neither an epochal checkpoint (no {storage.MANIFEST}) nor a "
                "directory of checkpoints"
            )
        read, _ = storage.find_latest(path, model_only=model_only, into=into)
        return read.state, read.path
    state, _ = storage.read_checkpoint(path, model_only=model_only, into=into)
    return state, path
