"""``epochal export``: a checkpoint's model weights as a ``.safetensors`` file."""

from __future__ import annotations

from pathlib import Path

import click

from epochal_checkpoint.errors import CheckpointNotFoundError
from epochal_checkpoint.export import export_weights, model_tensors
from epochal_checkpoint.storage.codec import is_finite_number
from epochal_checkpoint.storage.layout import CheckpointInfo, list_checkpoints
from epochal_checkpoint.storage.load import read_checkpoint
from epochal_checkpoint.storage.read import read_manifest


@click.command("export")
@click.argument("source", type=click.Path(path_type=Path))
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
def export_command(source: Path, output: Path | None, best: bool) -> None:
    """Write the model weights of checkpoint SOURCE as a safetensors file.

    SOURCE is a checkpoint, a directory of checkpoints (its newest complete one, or with
    --best the best by the monitor its manifests record) or its `latest` file. A TorchModel's
    weights keep the module's parameter names: `module.load_state_dict(
    safetensors.torch.load_file(FILE))` loads them.
    """
    from epochal_checkpoint.plugin import read_from

    if best:
        info = _best(source)
        state, _ = read_checkpoint(info.path, model_only=True)
        where, manifest = info.path, info.manifest
    else:
        state, where = read_from(source, model_only=True)
        manifest = read_manifest(where)
    output = output or Path(f"{where.name}.safetensors")
    meta = {
        "epochal.checkpoint": where.name,
        "epochal.run_id": manifest.get("run_id"),
        "epochal.epoch": manifest.get("epoch"),
        "epochal.iteration": manifest.get("iteration"),
    }
    export_weights(state["model"], output, meta)
    count = len(model_tensors(state["model"]))
    click.echo(f"wrote {count} tensors of checkpoint {where} to {output}")


def _best(directory: Path) -> CheckpointInfo:
    infos, _ = list_checkpoints(directory)
    scored = [i for i in infos if is_finite_number(i.manifest.get("metric"))]
    if not scored:
        raise CheckpointNotFoundError(
            f"--best: no checkpoint in {str(directory)!r} records a monitored value "
            "(set [plugins.checkpoint] monitor)"
        )
    mode = scored[-1].manifest.get("mode", "min")
    sign = -1.0 if mode == "max" else 1.0
    return min(scored, key=lambda info: sign * float(info.manifest["metric"]))
