"""Model weights as a ``.safetensors`` file that other tools read.

A checkpoint holds the whole loop state in epochal's own format. Users also want the weights
alone in the format the ecosystem reads (Hugging Face, ``safetensors.torch.load_file``):
:func:`export_weights` writes the model's tensors of a state — a ``TorchModel``'s
``module`` state under the module's own parameter names, so that
``module.load_state_dict(safetensors.torch.load_file(path))`` restores them; any other model's
arrays under their dotted key paths. The file is written next to its final name and renamed
into place (atomic, fsynced).

Tensors of dtypes numpy lacks (bfloat16, float8) need torch to be written; plain numpy states
are written through ``safetensors.numpy`` without torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from epochal_checkpoint.errors import CheckpointWriteError, UnsupportedStateError
from epochal_checkpoint.storage.write import fsync_dir

__all__ = ["export_weights", "exported_metric", "model_tensors"]

_RECORD = "__tensor__"  # epochal.torch.state's tag for a tensor numpy has no dtype for


def _is_torch_state(model_state: Any) -> bool:
    return (
        isinstance(model_state, Mapping)
        and isinstance(model_state.get("module"), Mapping)
        and "optimizer" in model_state
    )


def _is_sharded_state(model_state: Any) -> bool:
    return isinstance(model_state, Mapping) and isinstance(model_state.get("dcp"), str)


def _consolidated(path: str) -> dict[str, Any]:
    """The model tensors of the sharded checkpoint *path*, read whole by this one process
    (no process group, no code from its files: :mod:`epochal.torch.dcp_io`); the optimizer's
    state is not read."""
    try:
        from epochal.torch import dcp_io
    except ImportError:
        raise UnsupportedStateError(
            f"checkpoint {path!r} is sharded (torch.distributed.checkpoint): reading it needs torch "
            "(pip install 'epochal[torch]')"
        ) from None
    # no_dist inside: this process reads alone, also inside a run on several processes (rank 0
    # exports while the others wait), where DCP's public loaders would start a collective
    return dict(dcp_io.consolidated(path, keys={"model"})["model"])


def model_tensors(model_state: Any) -> dict[str, Any]:
    """The arrays (and tensor records) of a model state, by the names a loader expects.

    A ``TorchModel`` state (``{"module", "optimizer", ...}``) gives its module's state dict; a
    sharded checkpoint's (``{"dcp": path, ...}``) its module's tensors, consolidated; any other
    state gives every array leaf under its dotted key path.
    """
    if _is_sharded_state(model_state):
        return _consolidated(model_state["dcp"])
    if _is_torch_state(model_state):
        return dict(model_state["module"])
    import numpy as np  # here: listing plugins (epochal plugins, every CLI start) does not pay for it

    found: dict[str, Any] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, np.ndarray) or (isinstance(value, Mapping) and _RECORD in value):
            found[path] = value
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else str(key))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{path}.{i}" if path else str(i))

    walk(model_state, "")
    return found


def export_weights(model_state: Any, path: str | Path, metadata: Mapping[str, Any] | None = None) -> Path:
    """Write the model tensors of *model_state* to the safetensors file *path*.

    :param metadata: strings stored in the file's header (run id, epoch, ...).
    :raises UnsupportedStateError: the state holds no array, or tensors of a dtype that needs
        torch when torch is not installed.
    :raises CheckpointWriteError: the file cannot be written.
    """
    tensors = model_tensors(model_state)
    sharded = _is_sharded_state(model_state)
    framework = "pt" if sharded or _is_torch_state(model_state) else "np"
    if not tensors:
        raise UnsupportedStateError("the model state holds no arrays to export")
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if sharded:
            from safetensors.torch import save_file as save_tensors

            save_tensors({k: v.contiguous() for k, v in tensors.items()}, str(tmp), {"format": "pt", **meta})
        elif any(isinstance(v, Mapping) for v in tensors.values()):
            _save_torch(tensors, tmp, {"format": framework, **meta})
        else:
            import numpy as np
            from safetensors.numpy import save_file

            arrays = {k: np.ascontiguousarray(v, dtype=v.dtype.newbyteorder("<")) for k, v in tensors.items()}
            save_file(arrays, str(tmp), metadata={"format": framework, **meta})
        # safetensors creates its file 0600: an export is for others to read, as a file the
        # process writes with open() is (0666 less the umask)
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise CheckpointWriteError(f"cannot write {str(path)!r}: {error.strerror or error}") from None
    return path


def _umask() -> int:
    """This process's umask (read from /proc where it can be: setting it to read it back would
    race with the threads that save in the background)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _save_torch(tensors: Mapping[str, Any], path: Path, meta: dict[str, str]) -> None:
    try:
        from safetensors.torch import save_file

        from epochal.torch.state import plain_to_tensor
    except ImportError:
        raise UnsupportedStateError(
            "the model holds tensors of a dtype numpy lacks (bfloat16, float8): exporting them "
            "needs torch (pip install 'epochal[torch]')"
        ) from None
    save_file({k: plain_to_tensor(v) for k, v in tensors.items()}, str(path), metadata=meta)


def exported_metric(path: Path) -> float | None:
    """The ``monitor`` value recorded in an exported weights file (None: none or unreadable)."""
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as handle:
            value = (handle.metadata() or {}).get("epochal.metric")
        return float(value) if value is not None else None
    except Exception:  # a damaged or foreign file: the next best save replaces it
        return None
