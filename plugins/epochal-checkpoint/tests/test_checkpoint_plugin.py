"""The `checkpoint` and `load` plugins: triggers, retention, async writes, failures, loading, CLI errors."""

from __future__ import annotations

import errno
import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from epochal_checkpoint import (
    Checkpoint,
    CheckpointWriteError,
    Load,
    StateMismatchError,
    list_checkpoints,
    load_latest,
    read_checkpoint,
    storage,
)
from epochal_checkpoint.storage import write
from epochal_checkpoint.testing import TORTURE_CONFIG, make_data, make_model, resign

from epochal import ConfigError, Loop, PluginError, hookimpl, load_plugins
from epochal.testing import epochal_command

BATCHES = 16  # make_data(): 256 examples in batches of 16


def make_loop(run_dir: Path, *plugins: tuple[str, object], size: int = 1000, **options: Any) -> Loop:
    options.setdefault("max_epochs", 2)
    return Loop(
        make_model(size),
        make_data(),
        plugins=dict(plugins),
        seed=0,
        run_dir=run_dir,
        handle_signals=False,
        **options,
    )


def names(run_dir: Path) -> list[str]:
    return [info.name for info in list_checkpoints(run_dir / "checkpoints")[0]]


class WriteMetric:
    """Writes a made-up metric into the row of every batch (ordered before checkpoint)."""

    def __init__(self, values: dict[int, float]) -> None:
        self.values = values

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if loop.iteration in self.values:
            loop.log.current_row["score"] = self.values[loop.iteration]


class Raise:
    """Raises in after_batch at the given iteration."""

    def __init__(self, at: int) -> None:
        self.at = at

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if loop.iteration == self.at:
            raise RuntimeError("plugin failure")


def test_triggers_manifest_pointer_and_keep_last(tmp_path: Path) -> None:
    loop = make_loop(tmp_path, ("checkpoint", Checkpoint(every_n_batches=5, keep_last=2)))
    loop.run()
    # saved: batches 5,10,15, epoch 1 (i16), 20,25,30, epoch 2 (i32); the end state equals the last
    assert names(tmp_path) == ["ckpt-e0001-i000030", "ckpt-e0002-i000032"]
    state, info = load_latest(tmp_path / "checkpoints")
    assert storage.read_pointer(tmp_path / "checkpoints") == info.name
    manifest = info.manifest
    assert (manifest["epoch"], manifest["iteration"], manifest["reason"]) == (2, 32, "epoch")
    assert manifest["run_id"] == loop.run_id == state["run_id"] and manifest["sequence"] == 8
    assert manifest["plugins"] == {"checkpoint": {"distribution": None, "version": None}}
    assert state["model"]["p0"].tobytes() == loop.model.params["p0"].tobytes()


def test_keep_best_by_monitor_keeps_best_and_newest(tmp_path: Path) -> None:
    scores = {2: 0.5, 4: 0.1, 6: 0.9, 8: 0.3, 10: 0.7}
    plugin = Checkpoint(
        every_n_batches=2, every_n_epochs=0, keep_last=1, keep_best=2, monitor="score", mode="min"
    )
    make_loop(tmp_path, ("metric", WriteMetric(scores)), ("checkpoint", plugin), max_iterations=10).run()
    assert names(tmp_path) == ["ckpt-e0000-i000004", "ckpt-e0000-i000008", "ckpt-e0000-i000010"]
    for path in (tmp_path / "checkpoints").glob("ckpt-*"):
        if path.name != "latest":
            assert json.loads((path / "manifest.json").read_text())["metric"] == scores[int(path.name[-2:])]
    best_max = tmp_path / "max"
    plugin = Checkpoint(
        every_n_batches=2, every_n_epochs=0, keep_last=0, keep_best=1, monitor="score", mode="max"
    )
    make_loop(best_max, ("metric", WriteMetric(scores)), ("checkpoint", plugin), max_iterations=10).run()
    assert names(best_max) == ["ckpt-e0000-i000006", "ckpt-e0000-i000010"]


def test_bad_options_are_one_error_each() -> None:
    with pytest.raises(ConfigError, match="keep_best = 2 needs monitor"):
        Checkpoint(keep_best=2)  # two options that contradict each other: the plugin says so

    def options(**table: Any) -> None:
        load_plugins(order=["checkpoint"], autoload=False, options={"checkpoint": table})

    with pytest.raises(PluginError, match="'every_n_batches' of plugin 'checkpoint' must be greater than or"):
        options(every_n_batches=-1)
    with pytest.raises(PluginError, match="'mode' of plugin 'checkpoint' must be 'min' or 'max'"):
        options(mode="best")
    with pytest.raises(PluginError, match="'keep_last' of plugin 'checkpoint' must be greater than or"):
        options(keep_last=-1)


def test_no_directory_is_a_config_error() -> None:
    loop = Loop(make_model(10), make_data(), plugins={"checkpoint": Checkpoint()}, handle_signals=False)
    with pytest.raises(ConfigError, match=r"set \[plugins.checkpoint\] dir or \[loop\] run_dir"):
        loop.run()


def test_fresh_run_keeps_other_runs_checkpoints_and_warns(tmp_path: Path) -> None:
    make_loop(tmp_path, ("checkpoint", Checkpoint(keep_last=1))).run()
    before = names(tmp_path)
    with pytest.warns(RuntimeWarning, match="already holds 1 checkpoint"):
        make_loop(tmp_path, ("checkpoint", Checkpoint(keep_last=1))).run()
    assert names(tmp_path) == [*before, "ckpt-e0002-i000032-v2"]


def test_async_saves_match_sync_saves_and_nothing_is_left_in_flight(tmp_path: Path) -> None:
    # the reference saves after every batch and epoch: a superset of what the async run saves
    # (a save due while a write is in flight is deferred to a later batch, see back-pressure)
    for mode, every in (("sync", 1), ("async", 3)):
        plugin = Checkpoint(every_n_batches=every, keep_last=None, async_save=mode == "async")
        make_loop(tmp_path / mode, ("checkpoint", plugin), size=200_000).run()
        assert not any(t.name == "epochal-checkpoint-writer" for t in threading.enumerate())
    assert set(names(tmp_path / "async")) <= set(names(tmp_path / "sync"))
    assert names(tmp_path / "async")[-1] == names(tmp_path / "sync")[-1] == "ckpt-e0002-i000032"
    for name in names(tmp_path / "async"):
        a, _ = read_checkpoint(tmp_path / "sync" / "checkpoints" / name)
        b, _ = read_checkpoint(tmp_path / "async" / "checkpoints" / name)
        assert all(a["model"][k].tobytes() == b["model"][k].tobytes() for k in ("p0", "p1", "p2", "p3"))
        assert repr(a["log"]["rows"]) == repr(b["log"]["rows"])


def fail_writes_after(monkeypatch: pytest.MonkeyPatch, good: int) -> None:
    """Make every file write after the first *good* ones fail with ENOSPC."""
    real, calls = write.writev_all, [0]

    def write_all(fd: int, data: Any) -> None:
        calls[0] += 1
        if calls[0] > good:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(write, "writev_all", write_all)


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_is_a_clear_error_and_earlier_checkpoints_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    make_loop(tmp_path, ("checkpoint", Checkpoint(every_n_batches=1, keep_last=2)), max_iterations=3).run()
    before = names(tmp_path)
    fail_writes_after(monkeypatch, 0)
    loop = make_loop(
        tmp_path,
        ("checkpoint", Checkpoint(every_n_batches=1, keep_last=2, async_save=async_save)),
        max_iterations=6,
        resume=True,
    )
    with pytest.raises(
        CheckpointWriteError, match=r"No space left on device.*earlier checkpoints are kept"
    ) as info:
        loop.run()
    assert str(tmp_path / "checkpoints" / "ckpt-e0000-i00000") in str(info.value)
    assert names(tmp_path) == before
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if storage.TMP_RE.search(p.name)]
    assert all(read_checkpoint(tmp_path / "checkpoints" / n) for n in before)


def test_error_from_a_plugin_at_a_batch_boundary_is_saved_and_resumable(tmp_path: Path) -> None:
    plugin = Checkpoint(every_n_batches=4, every_n_epochs=0)
    loop = make_loop(tmp_path, ("raise", Raise(at=6)), ("checkpoint", plugin))
    with pytest.raises(RuntimeError, match="plugin failure"):
        loop.run()
    state, info = load_latest(tmp_path / "checkpoints")
    assert (info.manifest["reason"], state["iteration"]) == ("error", 6)
    resumed = make_loop(tmp_path, ("checkpoint", Checkpoint()), resume=True)
    with pytest.warns(RuntimeWarning, match="saved when plugin 'raise' raised in 'after_batch'"):
        resumed.run()
    assert resumed.resumed and resumed.iteration == 2 * BATCHES


def test_error_from_the_model_mid_step_is_not_saved(tmp_path: Path) -> None:
    loop = make_loop(tmp_path, ("checkpoint", Checkpoint(every_n_batches=4, every_n_epochs=0)))
    step, calls = loop.model.train_step, [0]

    def failing_step(batch: Any) -> dict[str, float]:
        calls[0] += 1
        if calls[0] == 7:
            raise FloatingPointError("model blew up")
        return step(batch)

    loop.model.train_step = failing_step  # type: ignore[method-assign]
    with pytest.raises(FloatingPointError):
        loop.run()
    assert names(tmp_path) == ["ckpt-e0000-i000004"]


def test_load_full_state_and_weights_only(tmp_path: Path) -> None:
    source = make_loop(
        tmp_path / "a", ("checkpoint", Checkpoint(every_n_epochs=0, every_n_batches=5)), max_iterations=10
    )
    source.run()
    checkpoint = tmp_path / "a" / "checkpoints" / "ckpt-e0000-i000005"
    full = make_loop(tmp_path / "b", ("load", Load(path=str(checkpoint))), max_iterations=12)
    full.run()
    assert full.resumed and full.resumed_from == source.run_id and full.iteration == 12
    weights = make_loop(
        tmp_path / "c", ("load", Load(path=str(tmp_path / "a" / "checkpoints"), weights_only=True))
    )
    weights.max_iterations = 0
    weights.run()
    assert not weights.resumed and weights.iteration == 0
    newest, _ = load_latest(tmp_path / "a" / "checkpoints")
    assert all(
        weights.model.params[k].tobytes() == newest["model"][k].tobytes() for k in weights.model.params
    )
    assert weights.plugins["load"].loaded == tmp_path / "a" / "checkpoints" / "ckpt-e0000-i000010"  # type: ignore[attr-defined]


def test_load_into_a_different_model_lists_the_mismatches(tmp_path: Path) -> None:
    make_loop(tmp_path / "a", ("checkpoint", Checkpoint()), max_iterations=2).run()
    loop = Loop(
        make_model(size=40, chunks=2),
        make_data(),
        plugins={"load": Load(path=str(tmp_path / "a" / "checkpoints"), weights_only=True)},
        handle_signals=False,
    )
    with pytest.raises(StateMismatchError) as info:
        loop.run()
    message = str(info.value)
    assert "ckpt-e0000-i000002' does not fit the model" in message
    assert (
        "unexpected keys model.p2, model.p3" in message
        and "model.p0: shape (250,) != expected (20,)" in message
    )


def test_resume_takes_precedence_over_load(tmp_path: Path) -> None:
    make_loop(tmp_path / "a", ("checkpoint", Checkpoint()), max_iterations=3).run()
    make_loop(tmp_path / "b", ("checkpoint", Checkpoint()), max_iterations=7).run()
    loop = make_loop(
        tmp_path / "b",
        ("load", Load(path=str(tmp_path / "a" / "checkpoints"))),
        ("checkpoint", Checkpoint()),
        max_iterations=9,
        resume=True,
    )
    loop.run()
    assert loop.plugins["load"].loaded is None  # type: ignore[attr-defined]
    assert names(tmp_path / "b")[-1] == "ckpt-e0000-i000009"


# -- the command line: one clear line, exit status 2 -------------------------------------------


def assert_clear_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(error_lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in error_lines[0], result.stderr


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "run.toml").write_text(TORTURE_CONFIG.format(size=1000, every=0, async_save="false"))
    return tmp_path


def test_cli_resume_without_checkpoints_names_the_directory(project: Path) -> None:
    assert_clear_error(
        epochal_command("run", "run.toml", "--resume", cwd=project), "--resume: no run", "under 'run'"
    )
    (project / "run" / "version_0").mkdir(parents=True)  # a run that saved nothing
    assert_clear_error(
        epochal_command("run", "run.toml", "--resume", cwd=project),
        "cannot resume",
        str(Path("run/version_0/checkpoints")),
    )


def test_cli_resume_into_another_model_names_the_checkpoint_and_mismatches(project: Path) -> None:
    done = epochal_command("run", "run.toml", "--set", "loop.max_iterations=3", cwd=project)
    assert done.returncode == 0, done.stderr
    assert_clear_error(
        epochal_command("run", "run.toml", "--resume", "--set", "model.size=2000", cwd=project),
        "ckpt-e0000-i000003' does not fit the model",
        "model.p0: shape (250,) != expected (500,)",
    )


def test_cli_resume_refuses_a_pickle_payload(project: Path) -> None:
    done = epochal_command("run", "run.toml", "--set", "loop.max_iterations=3", cwd=project)
    assert done.returncode == 0, done.stderr
    path = project / "run" / "version_0" / "checkpoints" / "ckpt-e0000-i000003"
    state = storage.read_state_document(path)
    state["arrays"][0].update(dtype="|O", shape=[1], offset=0)
    with open(path / "data.bin", "wb") as file:  # an object array: np.save pickles it
        np.save(file, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
        file.write(json.dumps(state).encode())
    resign(path)
    assert_clear_error(
        epochal_command("run", "run.toml", "--resume", cwd=project), "ckpt-e0000-i000003", "pickle payload"
    )


def test_cli_unwritable_directory_is_a_clear_error(project: Path) -> None:
    (project / "afile").write_text("not a directory")
    assert_clear_error(
        epochal_command("run", "run.toml", "--set", "plugins.checkpoint.dir=afile/checkpoints", cwd=project),
        "cannot create checkpoint directory 'afile/checkpoints'",
    )


def test_cli_corrupt_latest_warns_and_resumes_from_the_previous(project: Path) -> None:
    done = epochal_command(
        "run",
        "run.toml",
        "--set",
        "loop.max_iterations=20",
        "--set",
        "plugins.checkpoint.every_n_batches=5",
        cwd=project,
    )
    assert done.returncode == 0, done.stderr
    directory = project / "run" / "version_0" / "checkpoints"
    newest = directory / storage.read_pointer(directory)  # type: ignore[operator]
    with open(newest / "data.bin", "r+b") as file:
        file.truncate(10)
    resumed = epochal_command("run", "run.toml", "--resume", "--set", "loop.max_iterations=22", cwd=project)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{newest.name}" in resumed.stderr and "truncated" in resumed.stderr
    assert "22 batch(es)" in resumed.stdout
    assert np.isfinite(load_latest(directory)[0]["model"]["p0"]).all()
