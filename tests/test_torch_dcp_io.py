"""``epochal.torch.dcp_io``: DCP checkpoints read without running code, DCP's errors in one line.

Stock DCP unpickles ``.metadata`` and reads values with ``torch.load(weights_only=False)``; the
payloads here run code under stock pickle (checked first, so that a test that sees no marker
file means something), and none runs through ``dcp_io``. The files stay DCP's own: stock DCP
and ``dcp_io`` read the same tensors from them.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402
from epochal_checkpoint.forgery import METADATA_KINDS, executed, pickle_payload  # noqa: E402
from torch.distributed.checkpoint import metadata as md  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

from epochal.torch import dcp_io  # noqa: E402


def model_and_optimizer(width: int = 3) -> tuple[Any, Any]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(width, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.randn(5, width)).sum().backward()
    optimizer.step()
    return module, optimizer


def state_of(module: Any, optimizer: Any) -> dict[str, Any]:
    model, optim = get_state_dict(module, optimizer)
    return {"model": model, "optim": optim}


def save(state: dict[str, Any], where: Path) -> Path:
    with dcp_io.quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(where, single_file_per_rank=True), no_dist=True)
    return where


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A stock DCP checkpoint (one process) of a module and its AdamW state."""
    return save(state_of(*model_and_optimizer()), tmp_path / "ckpt")


def sizes(where: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in where.glob("*.distcp")}


def test_the_metadata_of_stock_dcp_reads_as_stock_pickle_reads_it(checkpoint: Path) -> None:
    data = (checkpoint / ".metadata").read_bytes()
    ours, theirs = dcp_io.parse_metadata(data, sizes(checkpoint)), pickle.loads(data)
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data and ours.planner_data == theirs.planner_data


def test_dcp_io_and_stock_dcp_read_the_same_tensors(checkpoint: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with dcp_io.quiet():
        stock = _load_state_dict_from_keys(checkpoint_id=str(checkpoint))
    ours = dcp_io.consolidated(checkpoint)
    assert ours["model"].keys() == stock["model"].keys()
    for key, value in stock["model"].items():
        assert torch.equal(ours["model"][key], value), key
    assert ours["optim"]["param_groups"] == stock["optim"]["param_groups"]
    # and a model loads them in place
    module, optimizer = model_and_optimizer()
    torch.nn.init.zeros_(module[0].weight)
    target = state_of(module, optimizer)
    dcp_io.load(target, checkpoint, no_dist=True)
    assert torch.equal(target["model"]["0.weight"], stock["model"]["0.weight"])


@pytest.mark.parametrize("kind", METADATA_KINDS)
def test_a_metadata_payload_runs_under_pickle_and_never_through_dcp_io(
    kind: str,
    checkpoint: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    payload = pickle_payload(kind, tmp_path / "stock")
    (tmp_path / "stock").mkdir()
    with contextlib.suppress(Exception):  # the payload is real: stock unpickling runs it
        pickle.loads(payload)
    assert executed(tmp_path / "stock") == [kind]

    marks = tmp_path / "marks"
    marks.mkdir()
    forged = pickle_payload(kind, marks)
    with pytest.raises(ValueError, match="not DCP metadata"):
        dcp_io.parse_metadata(forged)
    (checkpoint / ".metadata").write_bytes(forged)
    module, optimizer = model_and_optimizer()
    with pytest.raises(dcp_io.DamagedShardsError, match=r"is damaged: \.metadata is not DCP metadata"):
        dcp_io.load(state_of(module, optimizer), checkpoint, no_dist=True)
    with pytest.raises(dcp_io.DamagedShardsError):
        dcp_io.consolidated(checkpoint)
    assert executed(marks) == []
    # DCP logs "Global metadata is not found" with a traceback on the root logger: kept quiet
    # (its own dcp_logger has a NullHandler and does not propagate)
    assert not [r for r in caplog.records if r.name == "root"], caplog.records
    assert capfd.readouterr().err == ""


def test_setting_attributes_of_a_class_or_an_enum_member_is_refused() -> None:
    doc = md.Metadata.__doc__
    on_class = b"ctorch.distributed.checkpoint.metadata\nMetadata\n(N(dV__doc__\nVhacked\nstb."
    with pytest.raises(ValueError, match=r"sets the attributes of a (ABCMeta|type)"):
        dcp_io.parse_metadata(on_class)
    assert md.Metadata.__doc__ == doc
    member = b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n(I0\ntR(dV_value_\nI7\nsb."
    with pytest.raises(ValueError, match="sets the attributes of a _MEM_FORMAT_ENCODING"):
        dcp_io.parse_metadata(member)
    assert md._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT.value == 0


def forged_records(checkpoint: Path, change: Any) -> bytes:
    """The checkpoint's metadata with every file record changed by *change*."""
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        change(info)
    return pickle.dumps(metadata)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda info: setattr(info, "relative_path", "../../outside.distcp"),
            "not a file of this checkpoint",
        ),
        (lambda info: setattr(info, "relative_path", "__5_0.distcp"), "which the checkpoint does not list"),
        (lambda info: setattr(info, "offset", info.offset + 10**9), "ends after the end of"),
        (lambda info: setattr(info, "transform_descriptors", ["zstd"]), "asks for storage transforms"),
        (lambda info: setattr(info, "length", 1), "larger than its record"),
    ],
    ids=["outside", "unlisted", "past-the-end", "transforms", "short-record"],
)
def test_records_outside_the_checkpoints_files_are_refused(
    checkpoint: Path, change: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        dcp_io.parse_metadata(forged_records(checkpoint, change), sizes(checkpoint))


@pytest.mark.parametrize("field", ["offset", "relative_path", "length"])
def test_a_record_without_one_of_its_fields_is_not_dcp_metadata(checkpoint: Path, field: str) -> None:
    """Found by the fuzz campaign: a bit flip in a field's name left a record without it
    (AttributeError), and one that named no field set an attribute of another name."""
    data = (checkpoint / ".metadata").read_bytes()
    renamed = field[:-1] + field[-1].upper()  # the same length: a flip of one bit
    forged = data.replace(field.encode(), renamed.encode())
    assert forged != data
    with pytest.raises(ValueError, match=rf"sets \w+\.{renamed}\w*, which is no field of it"):
        dcp_io.parse_metadata(forged, sizes(checkpoint))


def test_a_huge_tensor_size_is_refused_before_anything_is_allocated(checkpoint: Path) -> None:
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    entry = metadata.state_dict_metadata["model.0.weight"]
    entry.size = torch.Size([10**6, 10**6])
    with pytest.raises(ValueError, match="not covered by its chunks"):
        dcp_io.parse_metadata(pickle.dumps(metadata))


class Run:
    """Pickles as ``eval(code)``."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return eval, (self.code,)


def test_a_value_payload_in_a_distcp_file_never_runs(tmp_path: Path) -> None:
    module, optimizer = model_and_optimizer()
    state = state_of(module, optimizer)
    marker = tmp_path / "PWNED-value"
    state["optim"]["param_groups"][0]["lr"] = Run(f"open({str(marker)!r}, 'w').close()")
    where = save(state, tmp_path / "forged")
    metadata = dcp_io.parse_metadata((where / ".metadata").read_bytes(), sizes(where))
    with pytest.raises(
        dcp_io.RecordError, match=r"'optim\.param_groups\.0\.lr' does not read without code"
    ) as caught:
        dcp_io.check_values(metadata, where)
    assert caught.value.file == "__0_0.distcp"
    with pytest.raises(dcp_io.DamagedShardsError, match=r"__0_0\.distcp does not read"):
        dcp_io.load(state_of(*model_and_optimizer()), where, no_dist=True)
    assert not marker.exists()
    # stock DCP runs it: the forgery is real
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with dcp_io.quiet():
        _load_state_dict_from_keys(checkpoint_id=str(where))
    assert marker.exists()


def test_a_checkpoint_that_does_not_fit_is_one_error_not_a_base_exception(
    checkpoint: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    wider = model_and_optimizer(width=5)  # 0.weight is 4 x 5, saved 4 x 3
    with pytest.raises(dcp_io.ShardsMismatchError, match=r"does not fit the model: .*0\.weight") as caught:
        dcp_io.load(state_of(*wider), checkpoint, no_dist=True)
    assert "Traceback" not in str(caught.value) and "\n" not in str(caught.value)
    module, optimizer = model_and_optimizer()
    state = state_of(module, optimizer)
    state["model"]["extra.weight"] = torch.zeros(2)
    with pytest.raises(dcp_io.ShardsMismatchError, match=r"extra\.weight"):
        dcp_io.load(state, checkpoint, no_dist=True)
    assert capfd.readouterr().err == ""


def test_a_missing_or_truncated_file_is_damage_not_a_mismatch(checkpoint: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(dcp_io.DamagedShardsError, match=r"cannot be read: \.metadata cannot be read"):
        dcp_io.load(state_of(*model_and_optimizer()), empty, no_dist=True)
    copy = Path(shutil.copytree(checkpoint, tmp_path / "copy"))
    shard = copy / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(dcp_io.DamagedShardsError, match=r"__0_0\.distcp does not read"):
        dcp_io.load(state_of(*model_and_optimizer()), copy, no_dist=True)


def test_quiet_leaves_the_root_logger_as_it_was() -> None:
    root = logging.getLogger()
    before = list(root.filters)
    with dcp_io.quiet(), dcp_io.quiet():
        assert len(root.filters) == len(before) + 1
    assert root.filters == before


def test_a_failed_dcp_save_is_one_line_from_every_rank(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """DCP raises a CheckpointException (a BaseException) when a rank's write fails: the
    checkpoint plugin's writer reports it as one line, it does not escape as a traceback."""
    from types import SimpleNamespace

    from epochal_checkpoint import sharded

    world = SimpleNamespace(rank=0, is_zero=True)
    said = sharded.write_part(world, tmp_path, {"weight": torch.zeros(2), "value": lambda: 0})
    assert isinstance(said, str) and said.startswith("rank 0: ") and "pickle" in said, said
    assert "\n" not in said and "Traceback" not in said
    assert capfd.readouterr().err == ""
