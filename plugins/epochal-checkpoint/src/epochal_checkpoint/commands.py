"""``epochal export``: a checkpoint's model weights as a ``.safetensors`` file."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from epochal_checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError
from epochal_checkpoint.export import export_weights
from epochal_checkpoint.storage import store
from epochal_checkpoint.storage.codec import is_finite_number
from epochal_checkpoint.storage.layout import CheckpointInfo, list_checkpoints
from epochal_checkpoint.storage.load import read_checkpoint
from epochal_checkpoint.storage.read import read_manifest


@click.command("export")
@click.argument("source")
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path, dir_okay=False),
    help="the file to write (default: <checkpoint name>.safetensors in the current directory)",
)
@click.option(
    "--best",
    is_flag=True,
    help="from a directory of checkpoints, the one with the best monitored value (else the newest)",
)
def export_command(source: str, output: Path | None, best: bool) -> None:
    """Write the model weights of checkpoint SOURCE as a safetensors file, and say which.

    SOURCE is a checkpoint, a directory of checkpoints (its newest complete one, or with
    --best the best by the monitor its manifests record) or its `latest` file; a local path or
    an fsspec URL (s3://bucket/run: endpoint and keys from the environment, as s3fs reads
    them). A TorchModel's weights keep the module's parameter names: `module.load_state_dict(
    safetensors.torch.load_file(FILE))` loads them.
    """
    from epochal_checkpoint.plugin import read_from

    remote = store.RemoteStore(source) if store.is_remote(source) else None
    if best:
        state, info = _read_best(
            _best(remote) if remote is not None else _best(store.local_path(source)), remote
        )
        where, manifest = info.path, info.manifest
    else:
        state, where = read_from(source, model_only=True, known=remote)
        manifest = read_manifest(where)
    output = output or Path(f"{where.name}.safetensors")
    meta = {
        "epochal.checkpoint": where.name,
        "epochal.run_id": manifest.get("run_id"),
        "epochal.epoch": manifest.get("epoch"),
        "epochal.iteration": manifest.get("iteration"),
    }
    export_weights(state["model"], output, meta)
    count = len(safe_names(output))
    shown = store.shown(where)
    click.echo(f"wrote {count} tensors of checkpoint {shown} ({_describe(manifest, best)}) to {output}")


def _describe(manifest: Mapping[str, Any], best: bool) -> str:
    """``epoch 10, best valid.loss=0.1234``: which state the exported weights are."""
    parts = [f"epoch {manifest.get('epoch')}", f"iteration {manifest.get('iteration')}"]
    monitor, metric = manifest.get("monitor"), manifest.get("metric")
    if isinstance(monitor, str) and metric is not None and is_finite_number(metric):
        parts.append(f"{'best ' if best else ''}{monitor}={float(metric):.6g}")
    return ", ".join(parts)


def _read_best(
    candidates: list[CheckpointInfo], remote: store.RemoteStore | None
) -> tuple[dict[str, Any], CheckpointInfo]:
    """The model state of the first of *candidates* (one save and its copies) that reads whole;
    a damaged one is passed over with a warning, as ``--resume`` passes over it."""
    import warnings

    errors: list[CorruptCheckpointError | UnsafeCheckpointError] = []
    for index, info in enumerate(candidates):
        try:
            if remote is not None:
                return remote.read(info.name, model_only=True).state, info
            return read_checkpoint(info.path, model_only=True)[0], info
        except (CorruptCheckpointError, UnsafeCheckpointError) as error:
            errors.append(error)
            if index + 1 < len(candidates):
                following = candidates[index + 1].name
                warnings.warn(f"{error}; trying its copy {following}", RuntimeWarning, stacklevel=2)
    if len(errors) == 1:
        raise errors[0]
    raise CorruptCheckpointError("; ".join(map(str, errors)))


def _best(directory: Path | store.RemoteStore) -> list[CheckpointInfo]:
    """The best checkpoint of *directory* by its manifests' monitored value, then the other
    checkpoints of the same save (``-v2``, written when a resume passed over a damaged one).

    :raises CheckpointNotFoundError: no checkpoint records a monitored value, or the newest
        manifest's record of the run's best save names a checkpoint that is no longer there.
    """
    if isinstance(directory, store.RemoteStore):
        infos, _ = directory.checkpoints()
        label = directory.url
    else:
        infos, _ = list_checkpoints(directory)
        label = str(directory)
    scored = [i for i in infos if is_finite_number(i.manifest.get("metric"))]
    if not scored:
        monitors = ", ".join(sorted({repr(str(m)) for i in infos if (m := i.manifest.get("monitor"))}))
        why = (
            f"a value of their monitor {monitors}: the run's log never had that record (is it one "
            "the run writes?)"
            if monitors
            else "a monitored value (set [plugins.checkpoint] monitor)"
        )
        raise CheckpointNotFoundError(f"--best: no checkpoint in {label!r} records {why}")
    mode = scored[-1].manifest.get("mode", "min")
    sign = -1.0 if mode == "max" else 1.0
    # ties: the older checkpoint, or the newer one where the run saved with greater_or_equal
    ties_newer = bool(scored[-1].manifest.get("greater_or_equal"))
    chosen = min(
        scored[::-1] if ties_newer else scored, key=lambda info: sign * float(info.manifest["metric"])
    )
    record = scored[-1].manifest.get("best")
    if isinstance(record, dict) and is_finite_number(record.get("metric")):
        at = (record.get("epoch"), record.get("iteration"))
        if not any((i.manifest.get("epoch"), i.manifest.get("iteration")) == at for i in scored):
            monitor = scored[-1].manifest.get("monitor")
            raise CheckpointNotFoundError(
                f"--best: the best checkpoint of the run in {label!r} (epoch {at[0]}, "
                f"iteration {at[1]}, {monitor}={float(record['metric']):.6g}) is gone; the best left "
                f"is {chosen.name} ({_describe(chosen.manifest, False)}): export it by its path"
            )
    key = (chosen.manifest.get("epoch"), chosen.manifest.get("iteration"), chosen.manifest["metric"])
    copies = [
        i
        for i in reversed(scored)
        if i is not chosen
        and (i.manifest.get("epoch"), i.manifest.get("iteration"), i.manifest["metric"]) == key
    ]
    return [chosen, *copies]


def safe_names(path: Path) -> list[str]:
    """The tensor names of the safetensors file *path* (its header only)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        return list(handle.keys())
