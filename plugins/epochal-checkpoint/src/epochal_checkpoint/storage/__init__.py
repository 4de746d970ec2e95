"""The on-disk checkpoint format (version 4): atomic writes, checksums, no pickle.

A checkpoint is a directory ``ckpt-e<epoch>-i<iteration>`` (``-v2``, ``-v3``... when the name is
taken) holding one data file and a manifest, plus the training log's segments:

``data.bin``
    every numpy array of the state, one ``.npy`` record after another (numpy's own format:
    header + raw buffer, written straight from the array's memory), then the rest of the state
    as JSON, with ``null`` where an array sits and an index giving each array's key path,
    offset, dtype, shape and CRC-32. A reader checks the state, then reads each array it wants
    (all, or only the model's) into one buffer allocated for them, checksumming each
    array on the way.
``log-<sequence>-i<first>-<last>.json``
    the training log's rows (``state["log"]["rows"]``), in segments: JSON ``{"<iteration>":
    {key: value}}``, read in the manifest's ``log_segments`` order, a later segment's row
    replacing an earlier one's (``{}``: the row was emptied). A segment is immutable: the next
    checkpoint of the run hard-links the previous one's segments (a copy when linking fails) and
    writes one new segment with only the rows new or changed since, so a save costs what
    changed, not the whole history; each checkpoint directory still holds every byte it needs.
    Rows that cannot be written as plain JSON (nested numpy values, huge ints) stay in the
    state, which is read last.
``manifest.json``
    format, run id, lineage, epoch, iteration, save sequence, time, plugin set, the monitored
    metric, the segment order, the checkpoints this run family wrote and keeps (``written``:
    rotation deletes only those), the size of every file and CRC-32 of the state and the
    segments, and last the commit record: the CRC-32 of every byte before its digits. Every
    byte that decides whether a checkpoint is complete and which one is newest is so covered: a
    checkpoint whose manifest does not verify is skipped (with a warning naming the file and
    why), never taken as the newest, and never pruned.
``latest`` (beside the checkpoints)
    a symbolic link holding the newest checkpoint's bare name.

Only format 4 is read: another version is one error naming the version found and the one
expected (formats 1-3 belonged to development versions before 0.1.0).

The concerns live in modules of their own, as Orbax's ``path``/``metadata`` and
``torch.distributed.checkpoint``'s planner/storage/filesystem split theirs:

- :mod:`~epochal_checkpoint.storage.codec`: flattening a state, ``data.bin``'s layout, the
  manifest's text and its seal (no file touched);
- :mod:`~epochal_checkpoint.storage.npy`: the ``.npy`` record headers, written and parsed;
- :mod:`~epochal_checkpoint.storage.read`: bounded reads, checksums, the manifest's check;
- :mod:`~epochal_checkpoint.storage.segments`: the log segments (encoding, merges, reading);
- :mod:`~epochal_checkpoint.storage.layout`: names, ``latest``, listing, deletion, leftovers;
- :mod:`~epochal_checkpoint.storage.write`: the atomic write and the concurrent fsyncs;
- :mod:`~epochal_checkpoint.storage.load`: a checkpoint's state read back, the newest that verifies;
- :mod:`~epochal_checkpoint.storage.sign`: the optional keyed signature (HMAC-SHA256,
  ``signature.json``) written and checked when ``EPOCHAL_CHECKPOINT_KEY`` is set.
- :mod:`~epochal_checkpoint.storage.store`: checkpoints on an fsspec URL (``s3://``...),
  uploaded file by file with the manifest (the commit record) last; imported on its own.

This package re-exports their public names (``storage.write_checkpoint``...).

CRC-32 is computed with zlib-ng (the same values as ``zlib.crc32``, SIMD: ~15x faster).
"""

from __future__ import annotations

from epochal_checkpoint.storage.codec import (
    BIG_INT_BITS,
    DATA,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    OWN,
    SEAL_RE,
    SEGMENTS,
    Snapshot,
    encode,
    flatten,
    is_finite_number,
    key_path,
    manifest_text,
    seal,
)
from epochal_checkpoint.storage.layout import (
    NAME_RE,
    POINTER,
    TMP_MARK,
    TMP_RE,
    CheckpointInfo,
    checkpoint_name,
    clean_temporaries,
    delete_checkpoint,
    finish_deletions,
    list_checkpoints,
    read_pointer,
    temp_name,
    unique_name,
)
from epochal_checkpoint.storage.load import (
    ReadCheckpoint,
    find_latest,
    load_latest,
    read_checkpoint,
    read_checkpoint_info,
    read_state_document,
    warn_damaged_segments,
)
from epochal_checkpoint.storage.read import (
    SEGMENT_RE,
    check_manifest,
    foreign_file_error,
    parse_json,
    read_manifest,
    read_regular,
)
from epochal_checkpoint.storage.segments import (
    LOG_FORMAT,
    SEGMENT_HEAD,
    LinkedSegment,
    MergedSegment,
    NewSegment,
    Segment,
    encode_segment,
    segment_name,
)
from epochal_checkpoint.storage.sign import KEY_ENV, SIGNATURE, UnsignedCheckpointError, signing_key
from epochal_checkpoint.storage.write import (
    Flushes,
    fsync_dir,
    make_directory,
    write_checkpoint,
    write_pointer,
)

__all__ = [
    "BIG_INT_BITS",
    "DATA",
    "FORMAT",
    "FORMAT_VERSION",
    "KEY_ENV",
    "LOG_FORMAT",
    "MANIFEST",
    "NAME_RE",
    "OWN",
    "POINTER",
    "SEAL_RE",
    "SEGMENTS",
    "SEGMENT_HEAD",
    "SEGMENT_RE",
    "SIGNATURE",
    "TMP_MARK",
    "TMP_RE",
    "CheckpointInfo",
    "Flushes",
    "LinkedSegment",
    "MergedSegment",
    "NewSegment",
    "ReadCheckpoint",
    "Segment",
    "Snapshot",
    "UnsignedCheckpointError",
    "check_manifest",
    "checkpoint_name",
    "clean_temporaries",
    "delete_checkpoint",
    "encode",
    "encode_segment",
    "find_latest",
    "finish_deletions",
    "flatten",
    "foreign_file_error",
    "fsync_dir",
    "is_finite_number",
    "key_path",
    "list_checkpoints",
    "load_latest",
    "make_directory",
    "manifest_text",
    "parse_json",
    "read_checkpoint",
    "read_checkpoint_info",
    "read_manifest",
    "read_pointer",
    "read_regular",
    "read_state_document",
    "seal",
    "segment_name",
    "signing_key",
    "temp_name",
    "unique_name",
    "warn_damaged_segments",
    "write_checkpoint",
    "write_pointer",
]
