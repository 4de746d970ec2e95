"""The checkpoint directory: names, the ``latest`` pointer, listing, deletion and leftovers.

A checkpoint is a directory ``ckpt-e<epoch>-i<iteration>`` (``_<formatted filename template>``
when one is set; ``-v2``, ``-v3``... when the name is taken) beside the others; ``latest`` is a
symbolic link holding the newest one's bare name.
:func:`list_checkpoints` finds the complete ones (a manifest that verifies) in their save order
and says why it ignored the others. Temporary names carry the suffix ``.epochal-tmp-<hex>``:
writes happen under them, deletions rename to them first, and :func:`clean_temporaries`
removes only those, never anything that merely looks like a checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epochal_checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError, ForeignCheckpointError
from epochal_checkpoint.storage.read import read_manifest

if TYPE_CHECKING:
    from epochal_checkpoint.storage.segments import Segment

__all__ = [
    "NAME_RE",
    "POINTER",
    "TMP_MARK",
    "TMP_RE",
    "CheckpointInfo",
    "checkpoint_name",
    "clean_temporaries",
    "delete_checkpoint",
    "finish_deletions",
    "list_checkpoints",
    "read_pointer",
    "temp_name",
    "unique_name",
]

POINTER = "latest"
TMP_MARK = ".epochal-tmp-"
TMP_RE = re.compile(r"\.epochal-tmp-[0-9a-f]{32}$")
#: a checkpoint's name: the counters, the ``filename`` template's text after ``_`` (letters,
#: digits and ``._=+-``; see :mod:`epochal_checkpoint.naming`), a ``-vN`` suffix when taken.
NAME_RE = re.compile(r"^ckpt-e(\d+)-i(\d+)(?:_([A-Za-z0-9._=+-]{1,160}?))?(?:-v(\d+))?$")


def checkpoint_name(epoch: int, iteration: int, tag: str = "") -> str:
    """The directory name of a checkpoint taken after *epoch* epochs and *iteration* batches,
    with *tag* (the formatted ``filename`` template) after an underscore when given."""
    name = f"ckpt-e{epoch:04d}-i{iteration:06d}"
    return f"{name}_{tag}" if tag else name


def temp_name(name: str) -> str:
    """A fresh temporary name for *name* carrying the suffix only this plugin uses."""
    return f"{name}{TMP_MARK}{uuid.uuid4().hex}"


def unique_name(directory: Path, name: str) -> str:
    """*name*, or *name* with the first free ``-vN`` suffix."""
    candidate, version = name, 1
    while (directory / candidate).exists():
        version += 1
        candidate = f"{name}-v{version}"
    return candidate


def read_pointer(directory: Path) -> str | None:
    """The checkpoint name ``<directory>/latest`` points at (None if absent or unreadable).

    ``latest`` is a symbolic link holding a bare name. Only a checkpoint name
    (``ckpt-e<epoch>-i<iteration>[_<tag>][-v<n>]``, no path) is accepted, so the pointer never leads out
    of *directory*; anything else (a regular file, a FIFO, a link to a path) is not followed.
    """
    try:
        name = os.readlink(directory / POINTER)
    except (OSError, ValueError):
        return None
    return name if NAME_RE.match(name) else None


@dataclass
class CheckpointInfo:
    """A complete checkpoint found in a directory (its manifest read, files not yet verified)."""

    path: Path
    manifest: dict[str, Any]
    #: its log segments, once written or read (None: not read yet).
    segments: list[Segment] | None = None
    #: the log rows kept in the state rather than in segments, once read.
    inline_rows: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The checkpoint's directory name."""
        return self.path.name

    @property
    def order(self) -> tuple[int, int, int]:
        """Sort key: save sequence, then save time (both verified integers); a copy under
        another name (:attr:`renamed`) sorts before the checkpoint it copies."""
        sequence, saved = int(self.manifest.get("sequence", 0)), int(self.manifest.get("saved_at_ns", 0))
        return sequence, saved, 0 if self.renamed else 1

    @property
    def renamed(self) -> bool:
        """Whether the directory is not the name it was written under (a user's copy)."""
        written = self.manifest.get("name")
        return written is not None and written != self.path.name


def list_checkpoints(
    directory: Path, clean: bool = False
) -> tuple[list[CheckpointInfo], list[tuple[str, str]]]:
    """The complete checkpoints in *directory*, oldest first, and the ignored entries with why.

    A checkpoint counts as complete when its directory (not a link) has its final name and a
    manifest of this format that verifies against its commit record; the order is the verified
    manifests' save sequence. Its other files are verified when it is read. Every directory or
    link with a checkpoint's name that is not counted is in the ignored list, with why.

    With *clean*, the leftovers of interrupted writes and deletions found in the same listing
    are deleted first (what :func:`clean_temporaries` does, without listing the directory twice).

    :raises CheckpointNotFoundError: when *directory* exists but cannot be listed.
    """
    found: list[CheckpointInfo] = []
    ignored: list[tuple[str, str]] = []
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except FileNotFoundError:
        return found, ignored
    except OSError as error:
        raise CheckpointNotFoundError(
            f"cannot list checkpoint directory {str(directory)!r}: {error.strerror or error}"
        ) from None
    if clean:
        removed = set(_remove_temporaries(entries))
        entries = [entry for entry in entries if entry.name not in removed]
    for entry in entries:
        if not NAME_RE.match(entry.name):
            continue
        if entry.is_symlink():
            ignored.append((entry.name, "a symbolic link, not a checkpoint written here"))
            continue
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            found.append(CheckpointInfo(Path(entry.path), read_manifest(Path(entry.path))))
        except (ForeignCheckpointError, CorruptCheckpointError) as error:
            ignored.append((entry.name, str(error)))
    found.sort(key=lambda info: info.order)
    return found, ignored


#: deletions still running in the background (see :func:`delete_checkpoint`): futures.
_reapers: list[Any] = []


def delete_checkpoint(path: Path, wait: bool = True) -> None:
    """Remove a checkpoint: rename it to a temporary name (atomic), then delete that.

    With *wait* false the files are deleted in the background, on the threads that run the
    saves' fsyncs (unlinking a directory costs as much as a save on a busy disk, and nothing
    waits for it; no thread is started per deletion): the checkpoint is gone from its name at
    once, the temporary leftovers are removed later, or at the next start after a crash.
    :func:`finish_deletions` waits for them.
    """
    doomed = path.parent / temp_name(path.name)
    os.rename(path, doomed)
    if wait:
        shutil.rmtree(doomed, ignore_errors=True)
        return
    from epochal_checkpoint.storage.write import in_background  # write imports this module

    _reapers.append(in_background(shutil.rmtree, doomed, True))  # ignore_errors


def finish_deletions(keep: int = 0) -> None:
    """Wait for the deletions :func:`delete_checkpoint` runs in the background (the oldest
    first) until at most *keep* are still running."""
    while len(_reapers) > keep:
        _reapers.pop(0).result()


def clean_temporaries(directory: Path) -> list[str]:
    """Delete the leftovers of interrupted writes and deletions (only names with our suffix)."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    return _remove_temporaries(entries)


def _remove_temporaries(entries: list[os.DirEntry[str]]) -> list[str]:
    """Delete the *entries* that carry our temporary suffix; their names."""
    removed: list[str] = []
    for entry in entries:
        if TMP_RE.search(entry.name):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                Path(entry.path).unlink(missing_ok=True)
            removed.append(entry.name)
    return removed
