"""PyTorch runs through the CLI on examples/digits_torch.toml: check-resume for every optimizer
and feature, --resume, the load plugin, export, and one clear error for each bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("epochal_checkpoint")  # installed with every plugin by tox
pytest.importorskip("epochal_schedule")

from safetensors.torch import load_file  # noqa: E402

from epochal.examples.digits_torch import DigitsCNN  # noqa: E402
from epochal.testing import epochal_command  # noqa: E402
from epochal.torch.describe import human  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits_torch.toml"
QUIET = ("--disable", "progress,timing,sqlite_log")


def run(tmp_path: Path, *args: str, timeout: float = 300):
    return epochal_command(*args, cwd=tmp_path, timeout=timeout)


@pytest.mark.parametrize(
    "settings",
    [
        # train.f1's state mid-epoch (one run with adam: each check-resume is five runs)
        ["model.optimizer=adam", "model.stream_metrics=true", "model.train_stream_metrics=true"],
        ["model.optimizer=adamw", "model.accumulate_grad_batches=3"],  # interrupted inside a window
        ["model.optimizer=sgd", "data.loader=true", "data.num_workers=2"],
        ["model.optimizer=adadelta", "model.precision=bf16-true"],
        ["model.optimizer=groups", "model.precision=16-mixed", "model.gradient_clip_algorithm=value"],
        ["model.precision=bf16-mixed", "data.loader=false", 'model.compile="aot_eager"'],
    ],
    ids=[
        "adam-train-stream-metrics", "adamw-accumulate", "sgd-loader-workers", "adadelta-bf16",
        "groups-16-mixed", "compile",
    ],
)  # fmt: skip
def test_check_resume_is_bitwise(tmp_path: Path, settings: list[str]) -> None:
    sets = [a for s in ["loop.max_epochs=2", "plugins.lr_scheduler.T_max=2", *settings] for a in ("--set", s)]
    result = run(tmp_path, "check-resume", str(EXAMPLE), "--at", "50", *sets, *QUIET)
    assert result.returncode == 0, result.stderr
    assert "ok: interrupted after batch 50 of 90 and resumed" in result.stdout


def test_check_resume_is_bitwise_on_two_processes_inside_an_accumulation_window_and_an_epoch(
    tmp_path: Path,
) -> None:
    """DDP on 2 gloo processes, AdamW's state, interrupted at batch 31 of windows of 3 (each
    rank's own gradients of the open window are saved) and inside an epoch whose train.f1 runs
    over the whole epoch (each rank's partial metric state is saved and continued): every rank's
    state matches bitwise, train.f1 included. (One run for both: a check-resume on two processes
    is five runs of two.)"""
    settings = [
        "loop.max_epochs=2",
        "plugins.lr_scheduler.T_max=2",
        "model.optimizer=adamw",
        "model.accumulate_grad_batches=3",
        "model.stream_metrics=true",
        "model.train_stream_metrics=true",
        "loop.uneven_shards=drop",  # 1,437 examples on 2 processes
    ]
    sets = [a for s in settings for a in ("--set", s)]
    result = run(tmp_path, "check-resume", str(EXAMPLE), "--nproc", "2", "--at", "31", *sets, *QUIET)
    assert result.returncode == 0, result.stderr
    assert "ok: interrupted after batch 31 of 46 and resumed" in result.stdout


def test_resume_continues_bitwise_and_the_load_plugin_starts_from_a_checkpoint(tmp_path: Path) -> None:
    common = ("--set", "plugins.checkpoint.export=last", *QUIET)
    straight = run(
        tmp_path, "run", str(EXAMPLE), "--set", "loop.max_epochs=2", "--set", "loop.run_dir=a", *common
    )
    assert straight.returncode == 0, straight.stderr
    params = sum(p.numel() for p in DigitsCNN().parameters())  # the model line, before training
    said = " ".join(straight.stderr.split())  # wrapped at $COLUMNS, or a job log's 120 (issue 47)
    assert f"epochal: model DigitsCNN: {human(params)} parameters ({human(params)} trainable), " in said
    assert "32-true on cpu" in said
    sets = ("--set", "loop.run_dir=b", "--set", "plugins.checkpoint.dir=b/ckpt", *common)
    first = run(tmp_path, "run", str(EXAMPLE), "--set", "loop.max_epochs=1", *sets)
    assert first.returncode == 0, first.stderr
    resumed = run(tmp_path, "run", str(EXAMPLE), "--set", "loop.max_epochs=2", "--resume", *sets)
    assert resumed.returncode == 0, resumed.stderr
    a = load_file(str(tmp_path / "a/version_0/checkpoints/last.safetensors"))
    b = load_file(str(tmp_path / "b/ckpt/last.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    start = "plugins.load.path=b/ckpt/ckpt-e0001-i000045"
    sets = ("--set", "loop.run_dir=c", "--set", "plugins.checkpoint.dir=c/ckpt", "--set", start, *common)
    loaded = run(tmp_path, "run", str(EXAMPLE), "--set", "loop.max_epochs=2", *sets)
    assert loaded.returncode == 0, loaded.stderr
    assert "finished after 2 epoch(s), 90 batch(es)" in loaded.stdout  # continued from epoch 1
    c = load_file(str(tmp_path / "c/ckpt/last.safetensors"))
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_a_model_that_has_not_stepped_saves_and_resumes(tmp_path: Path) -> None:
    sets = ("--set", "plugins.checkpoint.dir=ck", *QUIET)
    assert run(tmp_path, "run", str(EXAMPLE), "--set", "loop.max_epochs=0", *sets).returncode == 0
    assert (tmp_path / "ck" / "ckpt-e0000-i000000").is_dir()
    resumed = run(tmp_path, "run", str(EXAMPLE), "--set", "loop.max_epochs=1", "--resume", *sets)
    assert resumed.returncode == 0, resumed.stderr
    assert "finished after 1 epoch(s), 45 batch(es)" in resumed.stdout


def test_a_checkpoint_of_another_architecture_is_refused_naming_the_key(tmp_path: Path) -> None:
    sets = ("--set", "plugins.checkpoint.dir=ck", *QUIET)
    assert run(tmp_path, "run", str(EXAMPLE), "--set", "loop.max_epochs=1", *sets).returncode == 0
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    refused = run(tmp_path, "run", str(EXAMPLE), "--resume", "--set", "model.channels=8", *sets)
    assert refused.returncode == 2
    assert "does not fit the model" in refused.stderr
    assert "module.features.0.weight: shape [16, 1, 3, 3] != expected [8, 1, 3, 3]" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before  # nothing lost


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("model.precision=bf16-mix", "not str 'bf16-mix' (did you mean 'bf16-mixed'?)"),
        ("model.accumulate_grad_batches=0", "accumulate_grad_batches must be greater than or equal to 1"),
        ("model.gradient_clip_algorithm=l2", "'gradient_clip_algorithm' of 'make_model' must be 'norm' or"),
        ("plugins.lr_scheduler.name=CosineLR", "'CosineLR' is not a scheduler of torch.optim.lr_scheduler"),
        ("plugins.lr_scheduler.T_maximum=3", "'T_maximum' is not an argument of CosineAnnealingLR (did you"),
        ("plugins.lr_scheduler.last_epoch=5", "torch refused CosineAnnealingLR(T_max=15, last_epoch=5)"),
        ("model.optimizer=adamm", "optimizer 'adamm' is not one of adam, adamw, sgd, adadelta, groups"),
    ],
)  # fmt: skip
def test_bad_input_is_one_clear_error_before_training(tmp_path: Path, setting: str, message: str) -> None:
    result = run(
        tmp_path, "run", str(EXAMPLE), "--set", setting, "--set", "plugins.checkpoint.dir=ck", *QUIET
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert result.stderr.count("Error:") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").glob("ckpt-*"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_device_without_cuda_is_a_clear_error(tmp_path: Path) -> None:
    result = run(tmp_path, "run", str(EXAMPLE), "--set", "model.device=cuda", *QUIET)
    assert result.returncode == 2
    assert "device 'cuda': CUDA is not available on this machine" in result.stderr


def test_export_writes_weights_the_module_loads(tmp_path: Path) -> None:
    sets = ("--set", "loop.max_epochs=2", "--set", "plugins.checkpoint.dir=ck", *QUIET)
    assert run(tmp_path, "run", str(EXAMPLE), *sets).returncode == 0
    assert (tmp_path / "ck" / "best.safetensors").is_file()  # the example exports the best
    newest = run(tmp_path, "export", "ck", "-o", "newest.safetensors")
    assert newest.returncode == 0, newest.stderr
    assert "wrote 6 tensors of checkpoint" in newest.stdout
    module = DigitsCNN()
    assert not module.load_state_dict(load_file(str(tmp_path / "newest.safetensors"))).missing_keys
    best = run(tmp_path, "export", "ck", "--best", "-o", "best.safetensors")
    assert best.returncode == 0, best.stderr
    exported = load_file(str(tmp_path / "best.safetensors"))
    saved = load_file(str(tmp_path / "ck" / "best.safetensors"))
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    missing = run(tmp_path, "export", "nowhere")
    assert missing.returncode == 2 and "no checkpoint at 'nowhere'" in missing.stderr


def test_the_example_reaches_its_documented_accuracy(tmp_path: Path) -> None:
    result = run(tmp_path, "run", str(EXAMPLE), *QUIET)
    assert result.returncode == 0, result.stderr
    summary = next(line for line in result.stdout.splitlines() if line.startswith("epochal: last valid:"))
    metrics = dict(item.split("=") for item in summary.removeprefix("epochal: last valid: ").split(", "))
    assert float(metrics["accuracy"]) >= 0.97 and float(metrics["f1"]) >= 0.97
    assert (tmp_path / "runs" / "digits_torch" / "version_0" / "checkpoints" / "best.safetensors").is_file()


def test_model_line_counts_read_as_people_write_them() -> None:
    assert [human(n) for n in (7, 9_930, 1_234_567, 7e9)] == ["7", "9.93 K", "1.23 M", "7 B"]
    assert [human(n, "B") for n in (512, 39_720, 3e9)] == ["512 B", "39.7 KB", "3 GB"]


def test_sigterm_to_the_process_group_with_loader_workers_stops_and_saves(tmp_path: Path) -> None:
    """A scheduler's SIGTERM reaches the DataLoader's workers too (the process group): found by
    an outside-user pass, they died of it and the run failed with torch's "worker killed"."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    args = [
        "--set",
        "loop.max_epochs=200",
        "--set",
        "data.num_workers=2",
        "--set",
        "loop.run_dir=run",
        *QUIET,
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "epochal", "run", str(EXAMPLE), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a batch job's
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("run/version_0/checkpoints/ckpt-e0001-*")):  # an epoch trained
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "killed by signal" not in err and "Traceback" not in err
    assert "interrupted" in out
    resumed = run(tmp_path, "run", str(EXAMPLE), *args, "--set", "loop.max_epochs=2", "--resume")
    assert resumed.returncode == 0, resumed.stderr


def test_a_fine_tune_loads_the_weights_with_another_optimizer(tmp_path: Path) -> None:
    """`load` with `weights_only`: found by an outside-user pass, another optimizer class was
    refused ("unexpected keys optimizer.param_groups...") and the same class took the
    pretraining's learning rate and state."""
    common = ("--set", "plugins.checkpoint.export=last", "--set", "loop.max_epochs=1", *QUIET)
    pre = run(
        tmp_path, "run", str(EXAMPLE), "--set", "model.optimizer=sgd", "--set", "loop.run_dir=pre", *common
    )
    assert pre.returncode == 0, pre.stderr
    (saved,) = (tmp_path / "pre/version_0/checkpoints").glob("ckpt-e0001-*")
    sets = ("--set", f"plugins.load.path={saved}", "--set", "plugins.load.weights_only=true")
    tuned = run(
        tmp_path, "run", str(EXAMPLE), "--set", "model.optimizer=adamw", "--set", "loop.run_dir=ft",
        "--set", "loop.max_epochs=0", *sets, *QUIET,
    )  # fmt: skip
    assert tuned.returncode == 0, tuned.stderr
    weights = load_file(str(tmp_path / "pre/version_0/checkpoints/last.safetensors"))
    (final,) = (tmp_path / "ft/version_0/checkpoints").glob("ckpt-*")  # saved at the end, untrained
    from epochal_checkpoint.plugin import read_from

    state, _ = read_from(final)
    assert set(state["model"]["optimizer"]["param_groups"][0]) >= {"betas", "weight_decay"}  # AdamW's own
    assert state["model"]["steps"]["optimizer_steps"] == 0
    module = state["model"]["module"]
    assert all(torch.equal(torch.from_numpy(module[k].copy()), weights[k]) for k in weights)
