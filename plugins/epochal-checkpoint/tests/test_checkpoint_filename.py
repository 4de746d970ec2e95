"""The ``filename`` template (metrics in checkpoint names) and ``greater_or_equal`` (issue 30).

Through the CLI on the digits example: the names carry the formatted values of the log at each
save and stay parseable (listing, ``latest``, resume, pruning); a template that cannot work is
refused with one line, exit 2; ties choose the older or the newer checkpoint as best.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from epochal_checkpoint import list_checkpoints

from epochal.testing import digits_config, epochal_command

pytestmark = pytest.mark.slow

#: the run of every test: three epochs of a small MLP, a relative run directory.
DIGITS = {"max_epochs": 3, "run_dir": "run", "batch_size": 256, "hidden": 16}


def _write(tmp_path: Path, checkpoint: str) -> None:
    """run.toml: the digits example, 3 epochs, the checkpoint plugin alone with these options."""
    table = "[plugins.checkpoint]\n" + checkpoint
    digits_config(tmp_path / "run.toml", ["checkpoint"], **DIGITS, extra=table)


def _run(tmp_path: Path, *args: str, extra: str = "") -> tuple[int, str]:
    _write(tmp_path, 'keep_last = "none"\n' + extra)
    done = epochal_command("run", "run.toml", *args, cwd=tmp_path)
    return done.returncode, done.stderr


TEMPLATE = 'filename = "{epoch}-{valid.loss:.3f}-acc={valid.accuracy:.2f}"\n'


def test_names_carry_the_formatted_metrics_and_resume_reads_them(tmp_path: Path) -> None:
    code, err = _run(tmp_path, extra=TEMPLATE)
    assert code == 0, err
    directory = tmp_path / "run" / "version_0" / "checkpoints"
    infos = list_checkpoints(directory)[0]
    assert [info.manifest["epoch"] for info in infos] == [1, 2, 3]  # all listed, in save order
    losses = []
    for info in infos:
        epoch, iteration = info.manifest["epoch"], info.manifest["iteration"]
        found = re.fullmatch(
            rf"ckpt-e{epoch:04d}-i{iteration:06d}_{epoch}-(\d\.\d{{3}})-acc=(0\.\d\d)", info.name
        )
        assert found, info.name
        losses.append(float(found.group(1)))
    assert losses == sorted(losses, reverse=True)  # the loss falls epoch after epoch
    assert (directory / "latest").readlink().name == infos[-1].name

    code, err = _run(tmp_path, "--resume", "--set", "loop.max_epochs=4", extra=TEMPLATE)
    assert code == 0, err
    resumed = list_checkpoints(directory)[0]
    assert resumed[-1].manifest["epoch"] == 4 and resumed[-1].manifest["resumed_from"] is not None
    assert resumed[-1].name.startswith("ckpt-e0004-i000024_4-")


def test_the_name_holds_the_monitored_value_the_manifest_records(tmp_path: Path) -> None:
    code, err = _run(tmp_path, extra='monitor = "valid.loss"\nfilename = "loss={valid.loss:.6f}"\n')
    assert code == 0, err
    for info in list_checkpoints(tmp_path / "run" / "version_0" / "checkpoints")[0]:
        assert info.name.endswith(f"_loss={info.manifest['metric']:.6f}")


def test_a_save_before_the_first_evaluation_says_none(tmp_path: Path) -> None:
    code, err = _run(
        tmp_path, "--set", "loop.max_epochs=1", extra='every_n_batches = 4\nfilename = "{valid.loss:.2f}"\n'
    )
    assert code == 0, err
    names = [info.name for info in list_checkpoints(tmp_path / "run" / "version_0" / "checkpoints")[0]]
    assert names[0] == "ckpt-e0000-i000004_none"
    assert re.fullmatch(r"ckpt-e0001-i000006_\d\.\d\d", names[-1])


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{valid.loss:.3q}", "'.3q' is not a format spec of a number (valid.loss)"),
        ("run/{epoch}", "'/' cannot be part of a checkpoint name"),
        ("{epoch", "expected '}' before end of string"),
        ("{0}", "not a position"),
        ("{valid.loss!r}", "no conversion"),
    ],
)
def test_a_template_that_cannot_work_is_refused_before_the_first_batch(
    tmp_path: Path, template: str, says: str
) -> None:
    code, err = _run(tmp_path, extra=f"filename = '{template}'\n")  # a TOML literal string
    assert code == 2, err
    assert says in err and "[plugins.checkpoint] filename" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "run" / "version_0" / "checkpoints").exists() or not list(
        (tmp_path / "run" / "version_0" / "checkpoints").glob("ckpt-*")
    )


def test_a_key_never_logged_is_refused_at_the_first_save(tmp_path: Path) -> None:
    code, err = _run(tmp_path, extra='filename = "{valid.los:.3f}"\n')
    assert code == 2, err
    assert "'valid.los' is not in the training log at the save after epoch 1" in err
    assert "did you mean 'valid.loss'?" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not list((tmp_path / "run" / "version_0" / "checkpoints").glob("ckpt-*"))


# lr = 1e-300: the weights never change, so every epoch's valid.loss ties with the first one's
TIES = 'monitor = "valid.loss"\nkeep_last = 0\n'


@pytest.mark.parametrize(("greater_or_equal", "best_epoch"), [(False, 1), (True, 3)])
def test_greater_or_equal_chooses_the_newer_of_tied_checkpoints(
    tmp_path: Path, greater_or_equal: bool, best_epoch: int
) -> None:
    config = TIES + f"greater_or_equal = {str(greater_or_equal).lower()}\n"
    _write(tmp_path, config)
    done = epochal_command("run", "run.toml", "--set", "model.lr=1e-300", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    infos = list_checkpoints(tmp_path / "run" / "version_0" / "checkpoints")[0]
    metrics = {info.manifest["metric"] for info in infos}
    assert len(metrics) == 1  # a tie indeed
    assert infos[-1].manifest["best"]["epoch"] == best_epoch
    # kept: the newest (epoch 3) and the best
    assert sorted({info.manifest["epoch"] for info in infos}) == sorted({best_epoch, 3})
    exported = epochal_command(
        "export", "run/version_0/checkpoints", "--best", "-o", "b.safetensors", cwd=tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    assert f"(epoch {best_epoch}," in exported.stdout
