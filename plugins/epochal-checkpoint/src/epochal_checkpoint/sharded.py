"""Sharded checkpoints: every rank writes its own tensors through torch.distributed.checkpoint.

The checkpoint plugin's ``format = "sharded"`` (or ``"auto"`` with a model whose ``sharded`` is
True) saves the model this way: rank 0 makes the checkpoint's temporary directory and names it
to every rank; every rank hands its part of the model's tensors
(``model.sharded_state_dict()``: DTensor shards under FSDP, a DDP module's replicated tensors,
which DCP writes once) to ``dcp.save`` with a ``FileSystemWriter`` into that directory, in
parallel, then checksums and fsyncs its own files; an all-gather of those entries is the
barrier after which rank 0 knows every file is durable. Rank 0 then writes the rest of the
state (the plain loop state, the model's ``rest_state_dict()``: accumulation counters, grad
scaler) and the manifest listing every file with its size and CRC-32, commit record last, and
renames the directory into place (:func:`epochal_checkpoint.storage.write_checkpoint`). No
rank ever holds another rank's tensors.

With ``async_save`` the same steps run in every rank's writer thread, from a copy of its
tensors in host memory (:mod:`epochal_checkpoint.background`). With the checkpoint directory
an fsspec URL and a run on several machines, rank 0 first settles the checkpoint's name in the
store (its upload marker), every other rank writes into a temporary directory of its own
machine, and every rank uploads its own files before the all-gather (:func:`temporary`,
:func:`uploader`); rank 0's upload of the rest, manifest last, commits.

Reading (:func:`epochal_checkpoint.storage.read_checkpoint_info`) verifies every DCP file
against the manifest, then puts the checkpoint's path in the model state (``model["dcp"]``):
the model's ``load_state_dict`` reads its tensors with ``dcp.load`` on every rank (DCP
reshards to another number of processes).

The model protocol used here: ``sharded_state_dict()`` (a ``state_dict`` for DCP),
``rest_state_dict()`` (plain data) and a ``load_state_dict`` that accepts ``{"dcp": path, ...}``
(:class:`epochal.torch.TorchModel` has all three).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epochal.errors import ConfigError
from epochal_checkpoint import storage
from epochal_checkpoint.errors import CheckpointWriteError
from epochal_checkpoint.storage import sharded as files
from epochal_checkpoint.storage import sign
from epochal_checkpoint.storage.store import shown

if TYPE_CHECKING:
    from epochal.loop import Loop

__all__ = [
    "agree",
    "check_keys",
    "check_model",
    "read_from_store",
    "save_part",
    "temporary",
    "uploader",
    "wanted",
    "write_part",
    "write_tensors",
]

_METHODS = ("sharded_state_dict", "rest_state_dict")


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def wanted(format: str, model: Any) -> bool:
    """Whether ``format`` (``auto``/``single``/``sharded``) saves *model* sharded."""
    if format == "auto":
        return getattr(model, "sharded", False) is True
    return format == "sharded"


def check_model(model: Any, where: str) -> None:
    """Refuse a sharded format for a model that cannot give its tensors to DCP.

    :raises ConfigError: naming the option and the missing methods.
    """
    missing = [name for name in _METHODS if not callable(getattr(model, name, None))]
    if missing:
        kind = type(model)
        raise ConfigError(
            f'{where} format = "sharded" needs a model with {" and ".join(f"{m}()" for m in missing)} '
            f"(epochal.torch.TorchModel has them); {kind.__module__}.{kind.__qualname__} has not: "
            'use format = "single" or "auto"'
        )


def check_keys(world: Any, where: str) -> None:
    """Refuse, before the first batch, a run on several processes whose ranks do not all hold
    the same ``EPOCHAL_CHECKPOINT_KEY``: each rank signs its own DCP files (a collective; the
    ranks compare a MAC of a constant under their keys, never the keys).

    :raises ConfigError: on every rank alike, naming the ranks without the key or with another.
    """
    if not getattr(world, "distributed", False):
        return
    import hashlib
    import hmac

    key = sign.signing_key()
    tag = None if key is None else hmac.new(key, b"epochal-checkpoint key check", hashlib.sha256).hexdigest()
    tags = world.all_gather_object(tag)
    if len(set(tags)) <= 1:
        return
    without = [rank for rank, t in enumerate(tags) if t is None]
    other = [rank for rank, t in enumerate(tags) if t is not None and t != tags[0]]
    said = []
    if without:
        said.append(f"rank(s) {', '.join(map(str, without))} have none")
    if other:
        said.append(f"rank(s) {', '.join(map(str, other))} hold another than rank 0's")
    raise ConfigError(
        f'{where} format = "sharded" with {sign.KEY_ENV}: every rank signs its own DCP files, and '
        f"{'; '.join(said)}: set the same key on every rank (every node)"
    )


def save_part(
    loop: Loop, directory: Path | None, name: str, remote: Any = None
) -> tuple[dict[str, Any], tuple[Path, dict[str, dict[str, Any]]], str]:
    """Every rank's part of a sharded save (a collective: every rank calls it at the same point).

    *directory* is the checkpoint directory on rank 0 (the writer), None elsewhere; *remote*,
    this process's store when the run spans several machines (see :func:`temporary`). Returns
    the plain state (model: its rest), ``(temporary directory, {file: {size, crc32}})`` of every
    rank's DCP files, all durable, and the checkpoint's name.

    :raises CheckpointWriteError: on every rank, when any rank failed to write or fsync its files.
    """
    model: Any = loop.model  # checked by check_model: it has the methods of a sharded save
    state = loop.state_dict(log_rows=False, model=False)
    state["model"] = model.rest_state_dict()
    tmp, name = temporary(loop.world, directory, name, remote)
    mine = write_part(loop.world, tmp, model.sharded_state_dict(), upload=uploader(remote, name))
    return state, (tmp, agree(loop.world.all_gather_object(mine), tmp, directory, name)), name


def write_tensors(
    world: Any, tensors: dict[str, Any], directory: Path | None, name: str
) -> tuple[Path, dict[str, dict[str, Any]]]:
    """Every rank writes its *tensors* with ``dcp.save`` into a temporary directory that rank 0
    (*directory* given: the checkpoint directory) makes for checkpoint *name*; return it and
    every rank's files ``{file: {size, crc32}}``, durable (a collective)."""
    tmp, _ = temporary(world, directory, name)
    mine = write_part(world, tmp, tensors)
    return tmp, agree(world.all_gather_object(mine), tmp, directory, name)


def temporary(world: Any, directory: Path | None, name: str, remote: Any = None) -> tuple[Path, str]:
    """Rank 0 (*directory* given) makes checkpoint *name*'s temporary directory; every rank
    gets its path and the checkpoint's name (a collective on the loop's process group).

    With *remote* (this process's :class:`~epochal_checkpoint.storage.store.RemoteStore`, on
    every rank: a run on several machines writing to a URL), rank 0 settles the name in the
    store first and writes its upload marker, and every other rank makes a temporary directory
    of its own in its local staging directory (its machine has no view of rank 0's).

    :raises CheckpointWriteError: on every rank, when rank 0 cannot make it.
    """
    made: tuple[str | None, str, str | None] = (None, name, None)
    if directory is not None:
        try:
            final = remote.reserve(name) if remote is not None else name
            tmp = directory / storage.temp_name(final)
            tmp.mkdir()
            made = (str(tmp), final, None)
        except Exception as error:  # an OSError, or whatever the store's client raises
            made = (None, name, f"cannot create its temporary directory: {type(error).__name__}: {error}")
    where, name, problem = world.broadcast_object(made)
    if where is None:
        raise CheckpointWriteError(f"cannot write sharded checkpoint {name}: {problem}")
    if remote is not None and directory is None:
        own = remote.staging / storage.temp_name(name)
        own.mkdir()
        return own, name
    return Path(where), name


def uploader(remote: Any, name: str) -> Callable[[Path, list[str]], None] | None:
    """What uploads a rank's own files of checkpoint *name* to *remote* (None: no store)."""
    if remote is None:
        return None
    return lambda tmp, written: remote.put_files(name, tmp, written)


def write_part(
    world: Any,
    tmp: Path,
    tensors: dict[str, Any],
    process_group: Any = None,
    upload: Callable[[Path, list[str]], None] | None = None,
) -> dict[str, dict[str, Any]] | str:
    """This rank's ``dcp.save`` of *tensors* into *tmp* (its collectives on *process_group*,
    default: torch's default group), then its files checksummed and fsynced (and, with
    *upload*, uploaded): their entries, or one line saying why not (each rank reports, none
    waits for a rank that failed)."""
    import torch.distributed.checkpoint as dcp

    from epochal.torch import dcp_io

    try:
        writer = dcp.FileSystemWriter(tmp, sync_files=True, single_file_per_rank=True, overwrite=False)
        with dcp_io.quiet():  # DCP's note that one process saves alone (intended), its log records
            dcp.save(tensors, storage_writer=writer, process_group=process_group, no_dist=not _distributed())
        described = files.describe(tmp, world.rank, coordinator=world.is_zero)
        if upload is not None:
            upload(tmp, sorted(described))
        return described
    except (Exception, dcp_io.checkpoint_exception()) as error:  # DCP's is a BaseException
        return f"rank {world.rank}: {dcp_io.one_line(error)}"[:600]
    finally:
        if upload is not None and not world.is_zero:  # uploaded: no local copy is kept
            shutil.rmtree(tmp, ignore_errors=True)


def agree(
    every: list[dict[str, dict[str, Any]] | str], tmp: Path, directory: Path | None, name: str
) -> dict[str, dict[str, Any]]:
    """Every rank's files from *every* rank's :func:`write_part` (gathered: the barrier after
    which every file is durable), merged.

    :raises CheckpointWriteError: on every rank, naming each rank that failed; rank 0 removes
        the temporary directory.
    """
    failed = [entry for entry in every if isinstance(entry, str)]
    if failed:
        if directory is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(
            f"cannot write sharded checkpoint {str(tmp.parent / name)!r}: {'; '.join(failed)}; "
            "earlier checkpoints are kept"
        )
    return {file: entry for part in every if isinstance(part, dict) for file, entry in part.items()}


def read_from_store(world: Any, state: dict[str, Any], storage_options: Mapping[str, Any] | None) -> None:
    """On several machines, make a sharded checkpoint downloaded from a URL read by every rank
    from the store: *state*'s ``model["dcp"]`` (rank 0's staging copy, verified, is on its
    machine only) becomes the checkpoint's URL, with the store's options."""
    model = state.get("model")
    if not (world.several_nodes and isinstance(model, dict) and isinstance(model.get("dcp"), str)):
        return
    url = shown(Path(model["dcp"]))
    if "://" in url:
        model["dcp"], model["dcp_storage"] = url, dict(storage_options or {})
