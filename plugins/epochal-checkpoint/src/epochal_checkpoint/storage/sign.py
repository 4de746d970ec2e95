"""Keyed signatures of a checkpoint's files: HMAC-SHA256 with a key from the environment.

CRC-32 finds damage, not forgery: anyone who can write a checkpoint can recompute its CRC-32s
(``epochal_checkpoint.testing.resign`` does). When ``EPOCHAL_CHECKPOINT_KEY`` is set (non-empty),
every checkpoint written carries ``signature.json`` beside its manifest: one HMAC-SHA256 per
file (the manifest, ``data.bin``, each log segment, a sharded checkpoint's DCP files: each rank
signs its own), over the file's name and bytes. Every
checkpoint read then needs a signature that verifies under that key: the manifest's bytes are
checked before it is parsed, ``data.bin``'s before any byte of it is parsed, and a log segment's
before its rows are used (a segment that fails costs only its rows, as a damaged one does).
Without the variable nothing is signed and signatures are not looked at.

The key is the variable's text, UTF-8 encoded. Standard library only (:mod:`hmac`,
:mod:`hashlib`); digests are compared with :func:`hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from epochal_checkpoint.errors import CorruptCheckpointError, UnsignedCheckpointError
from epochal_checkpoint.storage.read import READ_CHUNK, corrupt, parse_json, read_regular

__all__ = [
    "KEY_ENV",
    "SIGNATURE",
    "UnsignedCheckpointError",
    "check_file",
    "check_stream",
    "compare",
    "file_mac",
    "new_mac",
    "read_signature",
    "signature_text",
    "signing_key",
]

#: the environment variable holding the signing key.
KEY_ENV = "EPOCHAL_CHECKPOINT_KEY"
#: the signature file beside the manifest.
SIGNATURE = "signature.json"
ALGORITHM = "hmac-sha256"
_MAX_SIGNATURE_BYTES = 1 << 20
_HEX_LENGTH = 64


def signing_key() -> bytes | None:
    """The key of ``EPOCHAL_CHECKPOINT_KEY`` (None when unset or empty)."""
    text = os.environ.get(KEY_ENV, "")
    return text.encode("utf-8", "surrogateescape") if text else None


def new_mac(key: bytes, name: str) -> Any:
    """An HMAC-SHA256 of file *name* to feed its bytes (``update``), for files read in pieces."""
    # the file's name is part of what is signed: a signed data.bin cannot pass as a segment
    return hmac.new(key, b"epochal-checkpoint\0" + name.encode("ascii") + b"\0", hashlib.sha256)


def file_mac(key: bytes, name: str, pieces: Iterable[bytes | bytearray | memoryview]) -> str:
    """The HMAC-SHA256 (hex) of file *name* made of *pieces*."""
    mac = new_mac(key, name)
    for piece in pieces:
        mac.update(piece)
    return mac.hexdigest()


def signature_text(macs: dict[str, str]) -> bytes:
    """The content of ``signature.json`` for the files' MACs *macs*."""
    import json

    return (
        json.dumps({"algorithm": ALGORITHM, "files": macs}, indent=1, sort_keys=True).encode("ascii") + b"\n"
    )


def _unsigned(path: Path, why: str) -> UnsignedCheckpointError:
    return UnsignedCheckpointError(
        f"checkpoint {str(path)!r}: {why} ({KEY_ENV} is set: only checkpoints signed with that key are read)"
    )


def read_signature(path: Path) -> dict[str, str]:
    """The MACs of ``<path>/signature.json`` (file name → hex).

    :raises UnsignedCheckpointError: the file is missing, not a regular file, or malformed.
    """
    try:
        os.lstat(path / SIGNATURE)
    except FileNotFoundError:
        raise _unsigned(path, f"has no {SIGNATURE} (it was written without a key)") from None
    except OSError:
        pass  # read_regular names the problem
    try:
        document = parse_json(path, SIGNATURE, read_regular(path, SIGNATURE, _MAX_SIGNATURE_BYTES), depth=3)
    except UnsignedCheckpointError:
        raise
    except CorruptCheckpointError as error:
        raise _unsigned(path, str(error).split(": ", 1)[-1]) from None
    files = document.get("files") if isinstance(document, dict) else None
    if (
        not isinstance(document, dict)
        or document.get("algorithm") != ALGORITHM
        or not isinstance(files, dict)
        or not all(
            isinstance(v, str) and len(v) == _HEX_LENGTH and all(c in "0123456789abcdef" for c in v)
            for v in files.values()
        )
    ):
        raise _unsigned(
            path, f"{SIGNATURE} is not {{algorithm: {ALGORITHM}, files: {{name: 64 hex digits}}}}"
        )
    return files


def compare(path: Path, name: str, signature: dict[str, str], found: str) -> None:
    """Check file *name*'s MAC *found* (hex) against *signature*.

    :raises UnsignedCheckpointError: naming the checkpoint and the file.
    """
    expected = signature.get(name)
    if expected is None:
        raise _unsigned(path, f"{SIGNATURE} does not sign {name}")
    if not hmac.compare_digest(expected, found):
        raise _unsigned(path, f"{name} does not match its signature (forged, or signed with another key)")


def check_file(
    path: Path, name: str, data: bytes | bytearray | memoryview, key: bytes, signature: dict[str, str]
) -> None:
    """Check file *name*'s bytes *data* against *signature*.

    :raises UnsignedCheckpointError: naming the checkpoint and the file.
    """
    compare(path, name, signature, file_mac(key, name, [data]))


def check_stream(path: Path, name: str, fd: int, size: int, key: bytes, signature: dict[str, str]) -> None:
    """Check the *size* bytes of open file *name* (*fd*) against *signature*, read in pieces
    (nothing of it is parsed, and memory stays bounded).

    :raises UnsignedCheckpointError: naming the checkpoint and the file.
    :raises CorruptCheckpointError: the file cannot be read or changed size.
    """
    mac = new_mac(key, name)
    buffer = bytearray(min(size, 16 * READ_CHUNK))
    view, got = memoryview(buffer), 0
    try:
        while got < size:
            n = os.preadv(fd, [view[: min(len(buffer), size - got)]], got)
            if n == 0:
                raise corrupt(path, name, "changed size while it was read")
            mac.update(view[:n])
            got += n
    except OSError as error:
        raise corrupt(path, name, f"cannot be read: {error.strerror or error}") from None
    compare(path, name, signature, mac.hexdigest())
