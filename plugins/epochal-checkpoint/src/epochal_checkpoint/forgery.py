"""Checkpoints forged to run code in a reader that unpickles them: for the tests and the fuzz
campaign that check that no reader ever does.

Each payload, if unpickled by :func:`pickle.load` (as stock DCP reads ``.metadata``) or by
``torch.load(weights_only=False)`` (as DCP's default planner reads values), creates a marker
file ``PWNED-<kind>`` in a given directory: :func:`executed` lists those found. The forgeries
keep the manifest's CRC-32s in agreement (:func:`epochal_checkpoint.testing.resign`), as anyone
who can write the checkpoint directory can; only ``EPOCHAL_CHECKPOINT_KEY`` signatures tell them.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from epochal_checkpoint.storage.codec import MANIFEST
from epochal_checkpoint.testing import replace_state, resign

__all__ = [
    "METADATA_KINDS",
    "executed",
    "pickle_payload",
    "plant_dcp_location",
    "plant_metadata",
    "plant_value",
]

#: the kinds of pickle payload :func:`pickle_payload` makes.
METADATA_KINDS = ("os-system", "builtins-eval", "getattr-chain", "torch-global", "inside-metadata")
MARKER = "PWNED-"


def _text(value: str) -> bytes:
    if any(c in value for c in "\n\\"):
        raise ValueError(f"{value!r}: a payload argument holds no newline or backslash")
    return value.encode()


def _python(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


class _Call:
    """Pickles as a call of *function* with *args* (its ``__reduce__``)."""

    def __init__(self, function: Any, *args: Any) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.function, self.args


def pickle_payload(kind: str, directory: Path) -> bytes:
    """A pickle that creates ``directory/PWNED-<kind>`` when unpickled (*kind* in
    :data:`METADATA_KINDS`): ``os.system``, ``builtins.eval``, a ``getattr`` chain
    (``getattr(__import__('os'), 'system')(...)``), a torch global that runs code
    (``torch.fx.graph_module._exec_with_source``), and an ``eval`` inside DCP's own
    ``Metadata`` record (its ``planner_data``)."""
    marker = Path(directory).absolute() / f"{MARKER}{kind}"
    shell = _text(f"touch '{marker}'")
    code = _text(_python(marker))
    if kind == "os-system":
        return b"cos\nsystem\n(V" + shell + b"\ntR."
    if kind == "builtins-eval":
        return b"cbuiltins\neval\n(V" + code + b"\ntR."
    if kind == "getattr-chain":
        return b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vos\ntRVsystem\ntR(V" + shell + b"\ntR."
    if kind == "torch-global":
        return b"ctorch.fx.graph_module\n_exec_with_source\n(V" + code + b"\n(dtR."
    if kind == "inside-metadata":
        import pickle

        from torch.distributed.checkpoint.metadata import Metadata

        return pickle.dumps(Metadata(state_dict_metadata={}, planner_data=_Call(eval, code.decode())))
    raise ValueError(f"unknown payload kind {kind!r}")


def executed(directory: Path) -> list[str]:
    """The kinds of payload that ran: their marker files in *directory*."""
    return sorted(p.name.removeprefix(MARKER) for p in Path(directory).glob(f"{MARKER}*"))


def plant_metadata(checkpoint: Path, data: bytes) -> None:
    """Replace sharded *checkpoint*'s DCP ``.metadata`` with *data*; CRC-32s made to agree."""
    (Path(checkpoint) / ".metadata").write_bytes(data)
    resign(Path(checkpoint))


def plant_value(checkpoint: Path, directory: Path) -> None:
    """Rewrite one-process sharded *checkpoint*'s DCP files (stock DCP writes them) so that the
    optimizer's learning rate, a value that is not a tensor, is an object whose unpickling runs
    ``eval`` and creates ``directory/PWNED-distcp-value``; CRC-32s made to agree."""
    import torch.distributed.checkpoint as dcp

    from epochal.torch import dcp_io

    checkpoint = Path(checkpoint)
    state = dcp_io.consolidated(checkpoint)
    marker = Path(directory).absolute() / f"{MARKER}distcp-value"
    state["optim"]["param_groups"][0]["lr"] = _Call(eval, _python(marker))
    with tempfile.TemporaryDirectory() as tmp, dcp_io.quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True), no_dist=True)
        for name in (".metadata", "__0_0.distcp"):
            shutil.copyfile(Path(tmp) / name, checkpoint / name)
    resign(checkpoint)


def plant_dcp_location(checkpoint: Path, location: str) -> None:
    """Set single-format *checkpoint*'s model state to ``{"dcp": location, ...}`` (a directory
    or URL holding DCP files of anyone's making) although its manifest lists no DCP file;
    CRC-32s made to agree."""
    from epochal_checkpoint.storage import read_state_document

    checkpoint = Path(checkpoint)
    manifest = json.loads((checkpoint / MANIFEST).read_bytes())
    if manifest.get("sharded"):
        raise ValueError(f"{checkpoint} is sharded: plant a location in a single-format checkpoint")
    document = read_state_document(checkpoint)
    model = document["tree"]["model"]
    if not isinstance(model, dict):
        raise ValueError(f"{checkpoint}'s model state is not a table")
    # a sharded model state: its tensors elsewhere (a TorchModel's module and optimizer dropped)
    tensors = {"module", "optimizer"} & model.keys()
    document["tree"]["model"] = {**{k: v for k, v in model.items() if k not in tensors}, "dcp": str(location)}
    for key in ("arrays", "ints"):
        document[key] = [
            e for e in document.get(key, []) if e["path"][:2] not in (["model", t] for t in tensors)
        ]
    replace_state(checkpoint, document)
