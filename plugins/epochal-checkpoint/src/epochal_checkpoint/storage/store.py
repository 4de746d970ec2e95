"""Checkpoints on an fsspec URL (``s3://``, ``gs://``, ``memory://``...): committed by their manifest.

A local directory (a path, or a ``file://`` URL) keeps the engine of
:mod:`~epochal_checkpoint.storage.write`: temporary directory, fsyncs, one atomic rename,
``latest`` a symbolic link, a lock file. Object stores have none of these (no rename, no
symbolic link, no lock), so a :class:`RemoteStore` publishes a checkpoint the way Orbax does on
GCS: by the object written last.

Writing
    The checkpoint is first written locally, by the same engine, into a staging directory (a
    temporary directory of this process); then its objects are uploaded under their final
    names ``<url>/ckpt-e<E>-i<I>/``: an upload marker (``.epochal-upload.json``: run, host, pid,
    time), ``data.bin``, the log segments (a segment the previous checkpoint already holds is
    copied inside the store, not uploaded again), ``signature.json`` if any, and **the manifest
    last**: a checkpoint is complete when its manifest exists and verifies (its commit record,
    the CRC-32 of every byte before it, is its last key), so a kill at any moment of the upload
    leaves objects that no reader counts. ``latest`` is a small object holding the newest
    checkpoint's name, written after the manifest.
Deleting
    The upload marker is rewritten (this process now owns the prefix), the manifest deleted
    first, then the other objects, the marker last: a half-deleted checkpoint never reads as
    complete, and its leftovers still say whose they are.
Leftovers
    A prefix with a checkpoint's name and no manifest is an upload or deletion that did not
    finish. It is deleted (at the start of a run) only when its marker proves that the process
    that wrote it is dead: the same host, and no process with that pid; on S3 the incomplete
    multipart uploads under it (the parts of a file whose upload was killed: no object, but
    billed) are aborted first. Anything else (another host, no marker) may be someone's live
    write: it is left alone, with a warning.
Reading
    A checkpoint is downloaded into the staging directory (its manifest first, bounded in size;
    then each file after its size in the store was checked against the manifest, so nothing
    larger than declared is ever fetched) and read by the local reader, which verifies every
    checksum. Errors name the URL, not the staging directory.

Only the local directory has a lock: two runs writing one URL are not detected.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import re
import shutil
import socket
import tempfile
import uuid
import warnings
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epochal.errors import ConfigError
from epochal_checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    ForeignCheckpointError,
)
from epochal_checkpoint.storage.codec import MANIFEST
from epochal_checkpoint.storage.layout import NAME_RE, POINTER, CheckpointInfo, temp_name
from epochal_checkpoint.storage.read import MAX_MANIFEST_BYTES, read_manifest
from epochal_checkpoint.storage.sign import SIGNATURE, signing_key

if TYPE_CHECKING:
    from epochal_checkpoint.storage.load import ReadCheckpoint

__all__ = ["UPLOAD", "RemoteStore", "is_remote", "local_path", "read_url", "shown"]

#: the upload marker: who writes (or deletes) the checkpoint whose prefix holds it.
UPLOAD = ".epochal-upload.json"
PROBE = ".epochal-probe-"
#: the staging directories' prefix, in the system's temporary directory.
STAGING = "epochal-checkpoint-"
MAX_SMALL_BYTES = 1 << 20

#: staging directory -> URL of its store, so that messages name the URL (see :func:`shown`).
_URLS: dict[str, str] = {}


def _protocol(location: str) -> str | None:
    if "://" not in location and "::" not in location:
        return None
    try:
        from fsspec.core import split_protocol
    except ImportError:  # a URL all the same: RemoteStore says that fsspec is missing
        return location.split("::")[0].split("://", 1)[0] if "://" in location else "chained"
    return split_protocol(location.split("::")[0])[0]


def is_remote(location: str | os.PathLike[str] | None) -> bool:
    """Whether *location* is an fsspec URL of a non-local filesystem (``file://`` is local)."""
    if location is None or not isinstance(location, str):
        return False
    return _protocol(location) not in (None, "file", "local")


def local_path(location: str | os.PathLike[str]) -> Path:
    """*location* as a local path (a ``file://`` URL stripped of its scheme)."""
    text = os.fspath(location)
    if _protocol(text) in ("file", "local"):
        text = text.split("://", 1)[1]
    return Path(text).expanduser()


def shown(path: Path) -> str:
    """*path*, or the URL it was downloaded from when it lies in a store's staging directory."""
    text = str(path)
    for staging, url in _URLS.items():
        if text == staging or text.startswith(staging + os.sep):
            return url + text[len(staging) :].replace(os.sep, "/")
    return text


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64]


def _clean_stale_staging() -> list[str]:
    """Remove the staging directories of this host's dead processes (a run killed with
    SIGKILL leaves its own behind: up to one checkpoint's size each); return their names."""
    pattern = re.compile(rf"^{re.escape(STAGING + _host_tag())}-(\d+)-[^/]+$")
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(tempfile.gettempdir()):
            found = pattern.match(entry.name)
            if found and entry.is_dir(follow_symlinks=False) and _pid_dead(int(found[1])):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.name)
    return removed


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or "no detail"
    return f"{type(error).__name__}: {text[:300]}"


def _pid_dead(pid: Any) -> bool:
    if type(pid) is not int or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


class RemoteStore:
    """The checkpoints under an fsspec URL, with a local staging directory.

    :param url: ``s3://bucket/prefix``, ``gs://...``, ``memory://...``: any fsspec URL.
    :param options: keyword arguments of the filesystem (``fsspec.url_to_fs``): endpoint,
        credentials... (s3fs also reads ``AWS_ENDPOINT_URL`` and the AWS key variables).
    :raises ConfigError: the URL's backend is not installed (naming the pip package, as fsspec
        says), its protocol is unknown, or *options* are refused.
    """

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        try:
            import fsspec
        except ImportError:
            raise ConfigError(
                f"checkpoint store {self.url!r}: fsspec is not installed (pip install fsspec)"
            ) from None
        try:
            self.fs, root = fsspec.url_to_fs(self.url, **dict(options or {}))
        except ImportError as error:  # fsspec names the package: "Install s3fs to access S3"
            raise ConfigError(f"checkpoint store {self.url!r}: {error}") from None
        except (ValueError, TypeError) as error:
            raise ConfigError(f"checkpoint store {self.url!r}: {_one_line(error)}") from None
        self.root = str(root).rstrip("/")
        self._staging: Path | None = None
        #: checkpoint names with objects but no manifest, found by the last :meth:`checkpoints`.
        self.uncommitted: list[str] = []

    # -- places -----------------------------------------------------------------------------------

    @property
    def staging(self) -> Path:
        """This process's local staging directory (created on first use, removed at exit)."""
        if self._staging is None or not self._staging.is_dir():
            prefix = f"{STAGING}{_host_tag()}-{os.getpid()}-"
            _clean_stale_staging()
            self._staging = Path(tempfile.mkdtemp(prefix=prefix))
            _URLS[str(self._staging)] = self.url
            atexit.register(self.close)
        return self._staging

    def close(self) -> None:
        """Remove the staging directory (the next use makes a new one)."""
        staging, self._staging = self._staging, None
        if staging is not None:
            _URLS.pop(str(staging), None)
            shutil.rmtree(staging, ignore_errors=True)

    def where(self, name: str = "") -> str:
        """The URL of checkpoint *name* (of the store with no name)."""
        return f"{self.url}/{name}" if name else self.url

    def _key(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _name_error(self, error: CheckpointError) -> CheckpointError:
        """*error* with the staging directory replaced by the URL in its message."""
        message = str(error)
        if self._staging is not None:
            message = message.replace(str(self._staging), self.url)
        return type(error)(message)

    # -- checks -----------------------------------------------------------------------------------

    def probe(self) -> None:
        """Write and delete a small object: the store is reachable, the bucket exists and the
        credentials may write.

        :raises CheckpointWriteError: one line naming the URL and what the store answered.
        """
        key = self._key(f"{PROBE}{uuid.uuid4().hex}")
        try:
            self.fs.pipe_file(key, b"")
            self.fs.rm_file(key)
        except Exception as error:  # botocore's errors are no OSError: whatever the backend raises
            raise CheckpointWriteError(
                f"cannot write to checkpoint store {self.url!r}: {_one_line(error)}"
            ) from None

    # -- listing ----------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The names under the URL that are checkpoint names (complete or not), sorted."""
        with contextlib.suppress(Exception):  # other processes write here: no listing cached
            self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        except Exception as error:
            raise CheckpointNotFoundError(
                f"cannot list checkpoint store {self.url!r}: {_one_line(error)}"
            ) from None
        found = {str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries}
        return sorted(name for name in found if NAME_RE.match(name))

    def _exists(self, key: str) -> bool:
        try:
            return bool(self.fs.exists(key))
        except Exception:
            return False

    def checkpoints(self) -> tuple[list[CheckpointInfo], list[tuple[str, str]]]:
        """The committed checkpoints, oldest first (paths in the staging directory, where they
        are downloaded), and the ignored ones with why (a manifest that does not verify).

        Names without a manifest (an upload that did not finish) go to :attr:`uncommitted`.
        """
        found: list[CheckpointInfo] = []
        ignored: list[tuple[str, str]] = []
        self.uncommitted = []
        for name in self.names():
            peek = self.staging / temp_name(name)
            try:
                if not self._get_small(name, MANIFEST, peek, MAX_MANIFEST_BYTES):
                    self.uncommitted.append(name)
                    continue
                found.append(CheckpointInfo(self.staging / name, read_manifest(peek)))
            except (ForeignCheckpointError, CorruptCheckpointError) as error:
                message = str(error).replace(str(peek), self.where(name))
                ignored.append((name, message))
            finally:
                shutil.rmtree(peek, ignore_errors=True)
        found.sort(key=lambda info: info.order)
        return found, ignored

    def read_pointer(self) -> str | None:
        """The checkpoint name the ``latest`` object holds (None: absent or not a name)."""
        try:
            if self.fs.size(self._key(POINTER)) > 256:
                return None
            name = self.fs.cat_file(self._key(POINTER)).decode("ascii").strip()
        except Exception:
            return None
        return name if NAME_RE.match(name) else None

    # -- reading ----------------------------------------------------------------------------------

    def _get_small(self, name: str, file: str, into: Path, limit: int) -> bool:
        """Download *file* of checkpoint *name* into directory *into* if it exists and holds at
        most *limit* bytes; whether it existed.

        :raises CorruptCheckpointError: it is larger than *limit*, or cannot be read.
        """
        key = self._key(name, file)
        try:
            size = self.fs.size(key)
        except FileNotFoundError:
            return False
        except Exception as error:
            raise CorruptCheckpointError(
                f"checkpoint {self.where(name)!r}: {file} cannot be read: {_one_line(error)}"
            ) from None
        if size is None or size > limit:
            raise CorruptCheckpointError(
                f"checkpoint {self.where(name)!r}: {file} has {size} bytes, more than the {limit} allowed"
            )
        into.mkdir(parents=True, exist_ok=True)
        self._download(name, file, into / file)
        return True

    def _download(self, name: str, file: str, target: Path) -> None:
        try:
            self.fs.get_file(self._key(name, file), str(target))
        except Exception as error:
            raise CorruptCheckpointError(
                f"checkpoint {self.where(name)!r}: {file} cannot be read: {_one_line(error)}"
            ) from None

    def fetch(self, name: str) -> Path:
        """Download committed checkpoint *name* into the staging directory; return its path
        there (already there: as it is). Only the files its manifest lists are fetched, each
        after its size in the store matched the manifest's.

        :raises ForeignCheckpointError: *name* has no manifest (not committed).
        :raises CorruptCheckpointError: a file is missing or of another size than declared.
        """
        final = self.staging / name
        if (final / MANIFEST).is_file():
            return final
        tmp = self.staging / temp_name(name)
        try:
            if not self._get_small(name, MANIFEST, tmp, MAX_MANIFEST_BYTES):
                raise ForeignCheckpointError(
                    f"{self.where(name)!r} is not a committed checkpoint (no {MANIFEST}: an upload "
                    "that did not finish, or not a checkpoint)"
                )
            manifest = read_manifest(tmp)
            if signing_key() is not None:
                self._get_small(name, SIGNATURE, tmp, MAX_SMALL_BYTES)
            for file, entry in manifest["files"].items():
                try:
                    size = self.fs.size(self._key(name, file))
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"checkpoint {self.where(name)!r}: {file} is missing"
                    ) from None
                except Exception as error:
                    raise CorruptCheckpointError(
                        f"checkpoint {self.where(name)!r}: {file} cannot be read: {_one_line(error)}"
                    ) from None
                if size != entry["size"]:
                    raise CorruptCheckpointError(
                        f"checkpoint {self.where(name)!r}: {file} has {size} bytes, the manifest says "
                        f"{entry['size']} (truncated or overwritten)"
                    )
                self._download(name, file, tmp / file)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        except CheckpointError as error:
            raise self._name_error(error) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def read(self, name: str, model_only: bool = False) -> ReadCheckpoint:
        """Download and verify checkpoint *name*
        (:func:`~epochal_checkpoint.storage.load.read_checkpoint_info`)."""
        from epochal_checkpoint.storage.load import read_checkpoint_info

        path = self.fetch(name)
        try:
            return read_checkpoint_info(path, model_only=model_only)
        except CheckpointError as error:
            raise self._name_error(error) from None

    def find_latest(self, model_only: bool = False) -> tuple[ReadCheckpoint, list[tuple[Path, str]]]:
        """The newest committed checkpoint that verifies (as
        :func:`~epochal_checkpoint.storage.load.find_latest`), and the newer ones that failed."""
        from epochal_checkpoint.storage.load import newest_that_verifies

        infos, ignored = self.checkpoints()
        return newest_that_verifies(
            infos, ignored, self.url, lambda info: self.read(info.name, model_only=model_only)
        )

    # -- writing ----------------------------------------------------------------------------------

    def free_name(self, name: str) -> str:
        """*name*, or *name* with the first ``-vN`` suffix free both in the store and in staging."""
        taken = set(self.names())
        candidate, version = name, 1
        while candidate in taken or (self.staging / candidate).exists():
            version += 1
            candidate = f"{name}-v{version}"
        return candidate

    def reserve(self, name: str) -> str:
        """Settle checkpoint *name*'s name in the store (:meth:`free_name`) and write its upload
        marker, before several processes upload their files into it (a sharded checkpoint
        written from several machines); :meth:`upload` then commits it."""
        final = self.free_name(name)
        self._mark(final, "upload")
        return final

    def put_files(self, name: str, directory: Path, files: list[str]) -> None:
        """Upload *files* of *directory* into checkpoint *name*'s prefix (not committed: only
        :meth:`upload` writes its manifest)."""
        for file in files:
            self.fs.put_file(str(directory / file), self._key(name, file))

    def _mark(self, name: str, doing: str) -> None:
        record = {
            "doing": doing,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": datetime.datetime.now(datetime.UTC).isoformat(),
        }
        self.fs.pipe_file(self._key(name, UPLOAD), json.dumps(record).encode())

    def upload(
        self, info: CheckpointInfo, linked: Mapping[str, str] | None = None, uploaded: Collection[str] = ()
    ) -> None:
        """Upload checkpoint *info* (written in the staging directory): the marker, its files,
        the manifest last, then ``latest``; drop the older checkpoints from staging.

        *linked* maps a log segment's name to the checkpoint in the store that already holds
        it: copied there inside the store instead of uploaded. Files in *uploaded* are in the
        store already (:meth:`put_files` by every process of a sharded save).

        :raises CheckpointWriteError: naming the URL; the objects of this upload are deleted
            and every earlier checkpoint is kept.
        """
        name, local = info.name, info.path
        try:
            self._mark(name, "upload")
            for file in info.manifest["files"]:
                if file in uploaded:
                    continue
                origin = (linked or {}).get(file)
                if origin is not None:
                    try:
                        self.fs.cp_file(self._key(origin, file), self._key(name, file))
                        continue
                    except Exception:  # gone from the store, or no server-side copy: upload it
                        pass
                self.fs.put_file(str(local / file), self._key(name, file))
            if (local / SIGNATURE).is_file():
                self.fs.put_file(str(local / SIGNATURE), self._key(name, SIGNATURE))
            self.fs.put_file(str(local / MANIFEST), self._key(name, MANIFEST))  # the commit
        except Exception as error:
            with contextlib.suppress(Exception):  # ours, and we are alive: nobody else's write
                self.fs.rm(self._key(name), recursive=True)
            shutil.rmtree(local, ignore_errors=True)
            raise CheckpointWriteError(
                f"cannot upload checkpoint {self.where(name)!r}: {_one_line(error)}; earlier "
                "checkpoints are kept"
            ) from None
        try:
            self.fs.pipe_file(self._key(POINTER), name.encode("ascii"))
        except Exception as error:
            raise CheckpointWriteError(
                f"cannot update {self.where(POINTER)!r}: {_one_line(error)} (checkpoint {name} is "
                "committed and is found without it)"
            ) from None
        for entry in self.staging.iterdir():  # only the newest is kept: its log segments are the base
            if entry.name != name and NAME_RE.match(entry.name):
                shutil.rmtree(entry, ignore_errors=True)

    def put_extra(self, path: Path) -> None:
        """Upload a file beside the checkpoints (``best.safetensors``...)."""
        try:
            self.fs.put_file(str(path), self._key(path.name))
        except Exception as error:
            raise CheckpointWriteError(
                f"cannot upload {self.where(path.name)!r}: {_one_line(error)}"
            ) from None

    def get_extra(self, name: str, into: Path) -> Path | None:
        """Download file *name* from beside the checkpoints into *into* (None: absent)."""
        try:
            self.fs.get_file(self._key(name), str(into / name))
        except Exception:
            return None
        return into / name

    def delete(self, name: str) -> None:
        """Delete checkpoint *name*: the marker rewritten, the manifest first, the marker last.

        :raises OSError: the store refused (the checkpoint may be half-deleted: never complete).
        """
        try:
            self._mark(name, "delete")
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._key(name, MANIFEST))
            self._remove_prefix(name)
        except OSError:
            raise
        except Exception as error:
            raise OSError(_one_line(error)) from None
        shutil.rmtree(self.staging / name, ignore_errors=True)

    def _remove_prefix(self, name: str) -> None:
        keys = [k for k in self.fs.find(self._key(name)) if not str(k).endswith("/" + UPLOAD)]
        if keys:
            self.fs.rm(keys)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._key(name, UPLOAD))
        with contextlib.suppress(Exception):  # a directory where the store keeps them (memory://)
            self.fs.rm(self._key(name), recursive=True)

    def _open_uploads(self, name: str) -> list[tuple[str, str]]:
        """The incomplete multipart uploads (key, upload id) under checkpoint *name*'s prefix: on
        S3, a process killed during an upload leaves its parts in the store (billed) until the
        upload is aborted; they are no objects, so no listing shows them. Empty for other stores."""
        call = getattr(self.fs, "call_s3", None)
        if not callable(call) or not callable(getattr(self.fs, "abort_mpu", None)):
            return []
        bucket, _, prefix = self._key(name).partition("/")
        found: list[tuple[str, str]] = []
        markers: dict[str, str] = {}
        while True:  # 1,000 a page
            page = call("list_multipart_uploads", Bucket=bucket, Prefix=f"{prefix}/", **markers)
            found += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", []) or []]
            if not page.get("IsTruncated"):
                return found
            markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def _abort_uploads(self, name: str) -> None:
        """Abort the incomplete multipart uploads under checkpoint *name* (:meth:`_open_uploads`)."""
        bucket = self._key(name).partition("/")[0]
        for key, upload in self._open_uploads(name):
            with contextlib.suppress(FileNotFoundError):  # aborted meanwhile
                self.fs.abort_mpu(bucket, key, upload)

    def clean_leftovers(self) -> list[str]:
        """Delete the uncommitted checkpoints of dead processes of this host (see the module
        docstring), and abort their incomplete multipart uploads (S3); warn about the others.
        Return the names deleted. Call :meth:`checkpoints` first."""
        removed: list[str] = []
        for name in self.uncommitted:
            record: Any = None
            with contextlib.suppress(Exception):
                if self.fs.size(self._key(name, UPLOAD)) <= 4096:
                    record = json.loads(self.fs.cat_file(self._key(name, UPLOAD)))
            if (
                isinstance(record, dict)
                and record.get("host") == socket.gethostname()
                and _pid_dead(record.get("pid"))
            ):
                try:
                    self._abort_uploads(name)  # before the marker goes: it proves whose they are
                    self._remove_prefix(name)
                except Exception as error:
                    warnings.warn(
                        f"cannot delete {self.where(name)!r} (an unfinished upload): {_one_line(error)}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    continue
                removed.append(name)
                continue
            who = (
                f"pid {record.get('pid')} on host {record.get('host')!s:.80}"
                if isinstance(record, dict)
                else "an unknown writer (no upload marker)"
            )
            warnings.warn(
                f"{self.where(name)!r} has no manifest (an unfinished upload or deletion by {who}, "
                "perhaps still running): never read as a checkpoint, left in place (on S3 a bucket "
                "lifecycle rule AbortIncompleteMultipartUpload removes the parts of an upload that "
                "never finishes)",
                RuntimeWarning,
                stacklevel=2,
            )
        self.uncommitted = [n for n in self.uncommitted if n not in removed]
        return removed


def read_url(
    url: str,
    model_only: bool = False,
    options: Mapping[str, Any] | None = None,
    known: RemoteStore | None = None,
) -> ReadCheckpoint:
    """Read the checkpoint at *url*: a checkpoint, its manifest, ``latest``, or a store of them
    (its newest complete one). *known*, a store already open, is used when the URL is its own.
    """
    url = url.rstrip("/")
    parent, _, last = url.rpartition("/")

    def opened(where: str) -> RemoteStore:
        if known is not None and known.url == where.rstrip("/"):
            return known
        return RemoteStore(where, options)

    if last == MANIFEST:
        url = parent
        parent, _, last = url.rpartition("/")
    if last == POINTER:
        remote = opened(parent)
        name = remote.read_pointer()
        if name is None:
            raise CheckpointNotFoundError(f"{url!r} names no checkpoint (it must hold a checkpoint name)")
        return remote.read(name, model_only=model_only)
    if NAME_RE.match(last):
        return opened(parent).read(last, model_only=model_only)
    return opened(url).find_latest(model_only=model_only)[0]
