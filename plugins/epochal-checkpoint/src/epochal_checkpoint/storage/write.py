"""Writing a checkpoint atomically: files, concurrent fsyncs, the rename that publishes it.

The files go into a temporary directory beside the target (``<name>.epochal-tmp-<hex>``); they
and the directory are fsynced together (:class:`Flushes`: concurrently, one journal commit),
then the directory is renamed into place and its parent fsynced. A reader therefore sees a
complete checkpoint or none; leftovers carry the temporary suffix and only those are ever
cleaned up (:func:`~epochal_checkpoint.storage.layout.clean_temporaries`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from epochal_checkpoint.errors import CheckpointWriteError, CorruptCheckpointError
from epochal_checkpoint.storage import sign
from epochal_checkpoint.storage.codec import (
    DATA,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SEGMENTS,
    Snapshot,
    crc32,
    encode,
    manifest_text,
    seal,
)
from epochal_checkpoint.storage.layout import POINTER, CheckpointInfo, temp_name, unique_name
from epochal_checkpoint.storage.read import SEGMENT_RE, verified
from epochal_checkpoint.storage.segments import (
    LinkedSegment,
    MergedSegment,
    NewSegment,
    Segment,
    encode_segment,
    merged_pieces,
)
from epochal_checkpoint.storage.sharded import SHARDED

__all__ = [
    "Flushes",
    "fsync_dir",
    "in_background",
    "make_directory",
    "write_checkpoint",
    "write_file",
    "write_pointer",
    "writev_all",
]


def writev_all(fd: int, pieces: Sequence[memoryview | bytes]) -> None:
    """Write *pieces* in order with as few system calls as the kernel allows (no joined copy)."""
    views = [memoryview(piece).cast("B") for piece in pieces if len(piece)]
    first = 0
    while first < len(views):
        written = os.writev(fd, views[first : first + 1024])  # IOV_MAX
        while written and first < len(views):
            if written >= views[first].nbytes:
                written -= views[first].nbytes
                first += 1
            else:
                views[first], written = views[first][written:], 0


def write_file(path: Path, pieces: Sequence[memoryview | bytes], sync: bool = True) -> dict[str, Any]:
    """Write *pieces* to the new file *path* (and fsync it with *sync*); return its size and CRC-32."""
    crc = 0
    for piece in pieces:
        crc = crc32(piece, crc)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        writev_all(fd, pieces)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": sum(memoryview(p).nbytes for p in pieces), "crc32": f"{crc:08x}"}


def fsync_dir(path: Path) -> None:
    """fsync *path*, a directory (to make a rename or deletion inside it durable) or a file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_sync_pool: Any = None
_sync_pool_lock = threading.Lock()


def _pool() -> Any:
    global _sync_pool
    with _sync_pool_lock:
        if _sync_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _sync_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="epochal-fsync")
        return _sync_pool


def _submit(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` on the fsync pool; a future. Where no pool takes work (the
    interpreter is exiting), it runs here, and the future is already done."""
    for _ in range(2):
        try:
            return _pool().submit(function, *args)
        except RuntimeError:  # that pool was shut down before a fork (below): a new one
            continue
    from concurrent.futures import Future

    done: Future[Any] = Future()
    try:
        done.set_result(function(*args))
    except OSError as error:
        done.set_exception(error)
    return done


def in_background(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` on the threads that run the fsyncs (started once, kept idle); a
    ``concurrent.futures.Future``."""
    return _submit(function, *args)


def _before_fork() -> None:
    """No idle fsync thread survives into a fork: a forked child (a DataLoader worker) has no
    use for them, and Python 3.12+ warns about forking a process with threads."""
    global _sync_pool
    with _sync_pool_lock:
        pool, _sync_pool = _sync_pool, None
    if pool is not None:
        pool.shutdown(wait=True)  # fsyncs in flight end first


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork)


class Flushes:
    """fsyncs issued concurrently, each as soon as its file is complete, awaited together.

    One after another, each fsync of a new file waits for its own journal commit (ext4 and
    XFS commit one transaction per fsync): four fsyncs cost four disk flushes. Issued together
    they join one commit, and the first starts the data's writeback while the rest of the
    checkpoint is still being encoded, so a checkpoint's files and its directory cost about
    what a single file's write+fsync costs (see bench/README.md). Nothing is published until
    :meth:`wait` returns: the order among these fsyncs does not matter, only that all end
    before the rename that publishes them.
    """

    def __init__(self) -> None:
        self._futures: list[Any] = []

    def start(self, path: Path) -> None:
        """Begin the fsync of *path* (a file or a directory) in the background."""
        self._futures.append(_submit(fsync_dir, path))

    def wait(self) -> None:
        """Return when every fsync started has ended; raise the first error, after all ended."""
        futures, self._futures = self._futures, []
        errors: list[BaseException] = []
        for future in futures:
            try:
                future.result()
            except BaseException as error:  # raised below, once none is running
                errors.append(error)
        if errors:
            raise errors[0]


def make_directory(directory: Path) -> None:
    """Create *directory* and its missing parents, fsyncing each new one's parent (power loss)."""
    missing: list[Path] = []
    path = directory
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:
            if not path.is_dir():
                raise
            continue
        fsync_dir(path.parent)


def write_pointer(directory: Path, name: str) -> None:
    """Point ``<directory>/latest`` at checkpoint *name* atomically: a symbolic link holding the
    name (no data to sync), renamed over the old one, the directory fsynced."""
    tmp = directory / temp_name(POINTER)
    try:
        os.symlink(name, tmp)
        os.replace(tmp, directory / POINTER)
        fsync_dir(directory)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise CheckpointWriteError(
            f"cannot update {str(directory / POINTER)!r}: {error.strerror or error}"
        ) from error


def _add_segment(tmp: Path, source: LinkedSegment | NewSegment | MergedSegment) -> tuple[Segment, bool]:
    """Put a log segment into the temporary checkpoint directory *tmp*; return what it is and
    whether its bytes were written here (not yet fsynced) rather than hard-linked."""
    if isinstance(source, MergedSegment):
        pieces, rows = merged_pieces(source)
        written = write_file(tmp / source.name, pieces, sync=False)
        return Segment(source.name, written["size"], written["crc32"], rows), True
    if isinstance(source, NewSegment):
        rows = [int(i) for i in source.rows]
        written = write_file(tmp / source.name, [encode_segment(source.rows)], sync=False)
        return Segment(source.name, written["size"], written["crc32"], rows), True
    linked = source.segment  # the same file here: its own bytes (no origin elsewhere)
    segment = Segment(linked.name, linked.size, linked.crc32, linked.rows, None, linked.mac)
    target, origin = tmp / segment.name, source.where / segment.name
    try:
        os.link(origin, target)  # its bytes were fsynced when first written; the checksum is reused
    except FileNotFoundError:
        raise
    except OSError:  # no hard links here (or too many): copy it, verifying it on the way
        try:
            data = verified(source.where, segment.name, {"size": segment.size, "crc32": segment.crc32})
        except CorruptCheckpointError as error:
            raise CheckpointWriteError(f"cannot reuse a log segment: {error}") from None
        write_file(target, [bytes(data)], sync=False)
        return segment, True
    size = os.stat(target).st_size
    if size != segment.size:
        raise CheckpointWriteError(
            f"cannot reuse log segment {str(origin)!r}: it has {size} bytes, {segment.size} were written"
        )
    return segment, False


def write_checkpoint(
    directory: Path,
    name: str,
    snapshot: Snapshot,
    manifest: Mapping[str, Any],
    pointer: bool = True,
    segments: Sequence[LinkedSegment | NewSegment | MergedSegment] = (),
    prepared: tuple[Path, Mapping[str, Mapping[str, Any]]] | None = None,
) -> CheckpointInfo:
    """Write *snapshot* atomically as checkpoint *name* in *directory*; return where and what.

    When *name* is taken (a checkpoint of another run at the same counters), ``-v2``, ``-v3``...
    is appended; an existing checkpoint is never overwritten. With *pointer*, ``latest`` (a
    symbolic link holding the checkpoint's name) is replaced atomically to name the new
    checkpoint, in the same directory sync as its rename.

    The order: ``data.bin`` (arrays written straight from memory, then the state), the new log
    segment and the manifest (its commit record last) are written, the earlier segments
    hard-linked; every new file and the temporary directory are fsynced together
    (:class:`Flushes`: each begins as soon as its file is complete); only then is the
    directory renamed into place (the publish point) and the parent directory fsynced. With
    ``EPOCHAL_CHECKPOINT_KEY`` set, ``signature.json`` (every file's HMAC-SHA256) is written
    beside the manifest before that (:mod:`~epochal_checkpoint.storage.sign`).

    *prepared* ``(tmp, files)``: a temporary directory (:func:`temp_name` of *name*) that
    already holds *files* ``{name: {size, crc32}}``, durable: the DCP files of a sharded
    checkpoint, written by every rank (:mod:`~epochal_checkpoint.storage.sharded`); the
    manifest lists them under ``sharded`` and ``files``, and the rest is written beside them.

    :raises CheckpointWriteError: naming the path, when the disk is full, permission is denied
        or any other OS error occurs; the temporary directory is removed and every earlier
        checkpoint is left as it was.
    """
    names = [s.segment.name if isinstance(s, LinkedSegment) else s.name for s in segments]
    if len(set(names)) != len(names) or not all(SEGMENT_RE.match(n) for n in names):
        raise ValueError(f"log segment names must be unique and match {SEGMENT_RE.pattern}: {names}")
    flushes = Flushes()
    tmp = directory / temp_name(name) if prepared is None else prepared[0]
    shards = dict(prepared[1]) if prepared is not None else {}
    pointer_tmp = directory / temp_name(POINTER) if pointer else None
    current = tmp
    try:
        if prepared is None:
            tmp.mkdir()
        final_name = unique_name(directory, name)
        pieces, data = encode(snapshot)
        current = tmp / DATA
        fd = os.open(current, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            writev_all(fd, pieces)
        finally:
            os.close(fd)
        flushes.start(current)
        current = tmp
        key = sign.signing_key()
        macs = {DATA: sign.file_mac(key, DATA, pieces)} if key is not None else {}
        if key is not None and shards:  # each rank signed its own DCP files (sharded.describe)
            unsigned = sorted(n for n, e in shards.items() if not isinstance(e.get("mac"), str))
            if unsigned:
                raise CheckpointWriteError(
                    f"cannot write checkpoint {str(directory / name)!r}: {', '.join(unsigned)} written "
                    f"by a rank without {sign.KEY_ENV}: set it on every rank (every node)"
                )
            macs.update({n: e["mac"] for n, e in shards.items()})
        written = []
        for source in segments:
            segment, wrote = _add_segment(tmp, source)
            written.append(segment)
            if wrote:  # hard-linked ones were fsynced when first written
                flushes.start(tmp / segment.name)
            if key is not None:
                if segment.mac is None:  # written here, or linked from an unsigned checkpoint
                    segment.mac = sign.file_mac(key, segment.name, [(tmp / segment.name).read_bytes()])
                macs[segment.name] = segment.mac
        now = time.time_ns()
        document = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "name": final_name,
            **manifest,
            "saved_at": datetime.datetime.fromtimestamp(now / 1e9, datetime.UTC).isoformat(),
            "saved_at_ns": now,
            **({SEGMENTS: [segment.name for segment in written]} if written else {}),
            **({SHARDED: sorted(shards)} if shards else {}),
            "files": {
                DATA: data,
                **{s.name: {"size": s.size, "crc32": s.crc32} for s in written},
                **{n: {"size": e["size"], "crc32": e["crc32"]} for n, e in shards.items()},
            },
        }
        current = tmp / MANIFEST  # its commit record is its last key: written last
        sealed = seal(manifest_text(document))
        write_file(current, [sealed], sync=False)
        flushes.start(current)
        if key is not None:
            macs[MANIFEST] = sign.file_mac(key, MANIFEST, [sealed])
            current = tmp / sign.SIGNATURE
            write_file(current, [sign.signature_text(macs)], sync=False)
            flushes.start(current)
        current = tmp
        flushes.start(tmp)
        flushes.wait()  # unpublished until the rename below: every new file and the directory durable
        final = directory / final_name
        current = final
        os.rename(tmp, final)
        if pointer_tmp is not None:
            current = directory / POINTER
            os.symlink(final_name, pointer_tmp)  # a name, no data: made durable by the directory sync
            os.replace(pointer_tmp, current)
        current = directory
        fsync_dir(directory)
        return CheckpointInfo(final, document, written)
    except BaseException as error:
        with contextlib.suppress(OSError):  # the error that matters is the one being handled
            flushes.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        if pointer_tmp is not None:
            pointer_tmp.unlink(missing_ok=True)
        if not isinstance(error, OSError):
            raise
        where = error.filename or current
        raise CheckpointWriteError(
            f"cannot write checkpoint {str(directory / name)!r}: {error.strerror or error} "
            f"({where}); earlier checkpoints are kept"
        ) from error
