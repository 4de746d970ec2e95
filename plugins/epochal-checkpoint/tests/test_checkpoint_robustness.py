"""Checkpoints against bit-rot and hostile files; the directory lock; ``--resume auto|PATH``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
from epochal_checkpoint import Checkpoint, CheckpointError, Load, list_checkpoints, load_latest, storage
from epochal_checkpoint.errors import CheckpointLockedError, CorruptCheckpointError
from epochal_checkpoint.fuzz import make_pristine
from epochal_checkpoint.lock import DirectoryLock
from epochal_checkpoint.plugin import read_from
from epochal_checkpoint.storage import write
from epochal_checkpoint.testing import TORTURE_CONFIG, make_data, make_model, replace_state, resign
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epochal import Loop, hookimpl
from epochal.testing import epochal_command


def make_loop(run_dir: Path, *plugins: tuple[str, object], **options: Any) -> Loop:
    options.setdefault("max_epochs", 2)
    return Loop(
        make_model(1000),
        make_data(),
        plugins=dict(plugins),
        seed=0,
        run_dir=run_dir,
        handle_signals=False,
        **options,
    )


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt-*"))


def three_epochs(tmp_path: Path) -> list[storage.CheckpointInfo]:
    make_loop(tmp_path, ("checkpoint", Checkpoint(keep_last=3)), max_epochs=3).run()
    return list_checkpoints(tmp_path / "checkpoints")[0]


def test_a_flipped_manifest_byte_is_skipped_and_rotation_keeps_the_good_ones(tmp_path: Path) -> None:
    first, _, third = three_epochs(tmp_path)
    manifest = first.path / "manifest.json"
    text = manifest.read_bytes()
    assert b'"sequence": 1,' in text
    manifest.write_bytes(text.replace(b'"sequence": 1,', b'"sequence": 9,'))  # one bit: 1 -> 9
    with pytest.warns(RuntimeWarning) as warned:
        state, info = load_latest(tmp_path / "checkpoints")
    assert info.name == third.name and state["epoch"] == 3
    messages = [str(w.message) for w in warned]
    assert (
        len(messages) == 1 and first.name in messages[0] and "manifest.json fails its checksum" in messages[0]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        make_loop(tmp_path, ("checkpoint", Checkpoint(keep_last=3)), max_epochs=5, resume=True).run()
    # the damaged checkpoint is neither taken as the newest nor pruned; the valid ones rotate by
    # their verified order
    assert checkpoints(tmp_path) == [first.name, third.name, "ckpt-e0004-i000064", "ckpt-e0005-i000080"]


def test_rotation_never_deletes_a_users_copy_of_a_checkpoint(tmp_path: Path) -> None:
    *_, third = three_epochs(tmp_path)
    backup = third.path.parent / f"{third.name}-v9"
    shutil.copytree(third.path, backup)  # cp -a: the run's own id, a checkpoint-like name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        make_loop(tmp_path, ("checkpoint", Checkpoint(keep_last=1)), max_epochs=5, resume=True).run()
    assert backup.is_dir() and storage.read_checkpoint(backup)[0]["epoch"] == 3
    assert checkpoints(tmp_path) == [backup.name, "ckpt-e0005-i000080"]


def test_latest_never_leads_out_of_the_checkpoint_directory(tmp_path: Path) -> None:
    three_epochs(tmp_path / "a")
    elsewhere = tmp_path / "elsewhere"
    make_loop(elsewhere, ("checkpoint", Checkpoint()), max_epochs=1).run()
    pointer = tmp_path / "a" / "checkpoints" / "latest"
    for target in ("../../elsewhere/checkpoints/ckpt-e0001-i000016", "/etc", "ckpt-e0001-i000016/.."):
        pointer.unlink()  # a pointer file of formats 1-3
        pointer.write_text(target + "\n")
        with pytest.raises(CheckpointError, match="names no checkpoint of its directory"):
            read_from(pointer)
        pointer.unlink()  # a pointer link (format 4) to anything but a bare name of the directory
        pointer.symlink_to(target)
        with pytest.raises(CheckpointError, match="names no checkpoint of its directory"):
            read_from(pointer)
    pointer.unlink()
    pointer.symlink_to(elsewhere / "checkpoints" / "latest")
    with pytest.raises(CheckpointError, match="names no checkpoint"):
        read_from(pointer)
    # a checkpoint entry that is a link to another directory is not a checkpoint of this one
    (tmp_path / "a" / "checkpoints" / "ckpt-e0009-i000999").symlink_to(
        elsewhere / "checkpoints" / "ckpt-e0001-i000016"
    )
    with pytest.warns(RuntimeWarning, match="ckpt-e0009-i000999.*symbolic link"):
        assert load_latest(tmp_path / "a" / "checkpoints")[1].name == "ckpt-e0003-i000048"
    # the user's own explicit path is followed
    assert read_from(elsewhere / "checkpoints" / "ckpt-e0001-i000016")[0]["epoch"] == 1


@pytest.mark.parametrize("hostile", ["fifo", "dev-zero", "huge-npy-shape", "deep-json", "wrong-types"])
def test_a_hostile_newest_checkpoint_is_skipped_by_resume_and_by_a_fresh_run(
    tmp_path: Path, hostile: str
) -> None:
    *_, third = three_epochs(tmp_path)
    newest = third.path.parent / "ckpt-e0004-i000064"
    shutil.copytree(third.path, newest)
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest.update(name=newest.name, sequence=99)
    if hostile == "fifo":
        (newest / "data.bin").unlink()
        os.mkfifo(newest / "data.bin")
    elif hostile == "dev-zero":
        (newest / "data.bin").unlink()
        (newest / "data.bin").symlink_to("/dev/zero")
    elif hostile == "huge-npy-shape":
        data = (newest / "data.bin").read_bytes()
        (newest / "data.bin").write_bytes(data.replace(b"'shape': (250,)", b"'shape': (10**12,)", 1))
    elif hostile == "deep-json":
        at = manifest["files"]["data.bin"]["state"]
        data = (newest / "data.bin").read_bytes()[:at]
        (newest / "data.bin").write_bytes(data + b"[" * 200_000 + b"]" * 200_000)
    else:
        manifest.update(epoch="3a", iteration=10**20)
    resign(newest, manifest)
    with pytest.warns(RuntimeWarning, match=newest.name):
        assert load_latest(tmp_path / "checkpoints")[1].name == third.name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        resumed = make_loop(tmp_path, ("checkpoint", Checkpoint()), max_epochs=4, resume=True)
        resumed.run()
        assert resumed.resumed and resumed.epoch == 4
        make_loop(tmp_path / "fresh", ("checkpoint", Checkpoint(dir=str(tmp_path / "checkpoints")))).run()


def test_wrong_types_are_a_corrupt_checkpoint_error_naming_file_and_key(tmp_path: Path) -> None:
    *_, third = three_epochs(tmp_path)
    manifest = json.loads((third.path / "manifest.json").read_text())
    for key, value, fragment in [
        ("sequence", "3a", "manifest.json key sequence"),
        ("files", {**manifest["files"], "data.bin": 5}, "manifest.json key files.data.bin"),
        ("lineage", 7, "manifest.json key lineage"),
    ]:
        data = json.dumps({**manifest, key: value}).encode()
        (third.path / "manifest.json").write_bytes(storage.seal(data))
        with pytest.raises(CorruptCheckpointError, match=fragment):
            storage.read_checkpoint(third.path)
    resign(third.path, manifest)
    state = storage.read_state_document(third.path)
    state["arrays"][0]["offset"] = 10**20
    replace_state(third.path, state)
    with pytest.raises(CorruptCheckpointError, match=r"data.bin key arrays\[0\]"):
        storage.read_checkpoint(third.path)


# -- the lock ------------------------------------------------------------------------------------

HOLD = """
import sys, time
from pathlib import Path
from epochal_checkpoint.lock import DirectoryLock
lock = DirectoryLock(Path(sys.argv[1]), "holder-run")
lock.acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_run_into_a_locked_directory_names_the_holder_and_a_dead_holder_is_taken_over(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointLockedError) as caught:
            make_loop(tmp_path, ("checkpoint", Checkpoint()), max_epochs=1).run()
        message = str(caught.value)
        for fragment in (str(directory), "run holder-run", f"pid {holder.pid}", "on host", "since 20"):
            assert fragment in message, message
        assert list(directory.glob("ckpt-*")) == []
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: the OS drops the lock
        holder.wait()
    with pytest.warns(RuntimeWarning, match="taking over the stale lock.*holder-run"):
        loop = make_loop(tmp_path, ("checkpoint", Checkpoint()), max_epochs=1)
        loop.run()
    assert checkpoints(tmp_path) == ["ckpt-e0001-i000016"]
    lock = DirectoryLock(directory, "next")  # released at the end of the run
    lock.acquire()
    lock.release()


def test_cli_second_run_is_one_line_exit_2(tmp_path: Path) -> None:
    """A resume of the run a live process holds (a fresh run would get a directory of its own)."""
    (tmp_path / "run.toml").write_text(TORTURE_CONFIG.format(size=1000, every=0, async_save="false"))
    directory = tmp_path / "run" / "version_0" / "checkpoints"
    directory.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        result = epochal_command(
            "run", "run.toml", "--resume", "auto", "--set", "loop.max_iterations=3", cwd=tmp_path
        )
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "is in use by run holder-run" in errors[0], result.stderr


# -- --resume auto | PATH, exit statuses -----------------------------------------------------------


def test_cli_resume_auto_starts_fresh_then_resumes(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(TORTURE_CONFIG.format(size=1000, every=0, async_save="false"))
    first = epochal_command(
        "run", "run.toml", "--resume", "auto", "--set", "loop.max_iterations=3", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr
    assert "--resume auto: no complete checkpoint" in first.stderr and "starting a fresh run" in first.stderr
    again = epochal_command(
        "run", "run.toml", "--resume", "auto", "--set", "loop.max_iterations=5", cwd=tmp_path
    )
    assert again.returncode == 0, again.stderr
    assert "starting a fresh run" not in again.stderr
    state, info = load_latest(tmp_path / "run" / "version_0" / "checkpoints")
    assert state["iteration"] == 5 and info.manifest["resumed_from"] is not None
    plain = epochal_command("run", "run.toml", "--resume", "--set", "loop.max_iterations=6", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr


def test_cli_resume_path_takes_that_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(TORTURE_CONFIG.format(size=1000, every=0, async_save="false"))
    other = tmp_path / "other.toml"
    other.write_text((tmp_path / "run.toml").read_text().replace('run_dir = "run"', 'run_dir = "other"'))
    assert 'run_dir = "other"' in other.read_text()
    done = epochal_command("run", "other.toml", "--set", "loop.max_iterations=4", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    source = list_checkpoints(tmp_path / "other" / "version_0" / "checkpoints")[0][-1]
    result = epochal_command(
        "run", "run.toml", "--resume", str(source.path), "--set", "loop.max_iterations=6", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    state, info = load_latest(tmp_path / "run" / "version_0" / "checkpoints")
    assert state["iteration"] == 6 and info.manifest["resumed_from"] == source.manifest["run_id"]
    assert source.path.is_dir()  # another directory's checkpoint is never pruned
    missing = epochal_command("run", "run.toml", "--resume", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert missing.returncode == 2 and "nowhere" in missing.stderr


class Interrupt:
    """Raises KeyboardInterrupt in after_batch (a third Ctrl-C landing in this plugin)."""

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if loop.iteration == 5:
            raise KeyboardInterrupt


def test_a_keyboard_interrupt_inside_a_plugin_saves_nothing(tmp_path: Path) -> None:
    plugin = Checkpoint(every_n_batches=4, every_n_epochs=0)
    loop = make_loop(tmp_path, ("interrupt", Interrupt()), ("checkpoint", plugin))
    with pytest.raises(KeyboardInterrupt):
        loop.run()
    assert checkpoints(tmp_path) == ["ckpt-e0000-i000004"]


def test_an_error_checkpoint_is_named_when_resumed(tmp_path: Path) -> None:
    class Raise:
        @hookimpl
        def after_batch(self, loop: Any) -> None:
            if loop.iteration == 6:
                raise RuntimeError("plugin failure")

    loop = make_loop(
        tmp_path, ("raise", Raise()), ("checkpoint", Checkpoint(every_n_batches=4, every_n_epochs=0))
    )
    with pytest.raises(RuntimeError):
        loop.run()
    manifest = load_latest(tmp_path / "checkpoints")[1].manifest
    assert (manifest["reason"], manifest["error_plugin"], manifest["error_hook"]) == (
        "error",
        "raise",
        "after_batch",
    )
    with pytest.warns(RuntimeWarning, match="saved when plugin 'raise' raised in 'after_batch'"):
        make_loop(tmp_path, ("checkpoint", Checkpoint()), resume=True).run()


SLOW_MODEL = """
import time
from epochal_checkpoint.testing import SyntheticModel


class SlowModel(SyntheticModel):
    def train_step(self, batch):
        time.sleep(0.5)  # the three signals land inside one step
        return super().train_step(batch)


def make(size=1000):
    return SlowModel(size)
"""


def test_cli_third_ctrl_c_exits_130_and_saves_nothing(tmp_path: Path) -> None:
    (tmp_path / "slow_model.py").write_text(SLOW_MODEL)
    config = TORTURE_CONFIG.format(size=1000, every=1, async_save="false")
    (tmp_path / "run.toml").write_text(
        config.replace("epochal_checkpoint.testing:make_model", "slow_model:make")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-c", "from epochal.cli import main; main()", "run", "run.toml"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    directory = tmp_path / "run" / "version_0" / "checkpoints"
    deadline = time.monotonic() + 60
    while not list(directory.glob("ckpt-*")) and time.monotonic() < deadline:
        time.sleep(0.01)  # the first checkpoint: the loop runs, its signal handlers are in place
    time.sleep(0.1)
    for _ in range(3):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "stopped at once by a third SIGINT" in err and "nothing was saved" in err
    assert "Traceback" not in err
    saved = [info.manifest["reason"] for info in list_checkpoints(directory)[0]]
    assert "error" not in saved and "interrupt" not in saved, saved


def test_load_refuses_a_latest_pointer_out_of_the_directory_even_through_the_plugin(tmp_path: Path) -> None:
    three_epochs(tmp_path / "a")
    pointer = tmp_path / "a" / "checkpoints" / "latest"
    pointer.unlink()
    pointer.write_text("../../b\n")
    loop = make_loop(tmp_path / "c", ("load", Load(path=str(pointer))), max_epochs=1)
    with pytest.raises(CheckpointError, match="names no checkpoint of its directory"):
        loop.run()


def test_new_checkpoint_directories_are_fsynced_in_their_parents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []
    real = write.fsync_dir
    monkeypatch.setattr(write, "fsync_dir", lambda path: (synced.append(Path(path)), real(path))[1])
    make_loop(tmp_path / "new" / "run", ("checkpoint", Checkpoint()), max_epochs=1).run()
    # run_dir/ and run_dir/checkpoints/ were made: each parent synced after its mkdir
    for made in (tmp_path / "new", tmp_path / "new" / "run", tmp_path / "new" / "run" / "checkpoints"):
        assert made.parent in synced[:3], synced


# -- property-based: any JSON document in place of a checkpoint's JSON files ---------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pristine(tmp_path_factory.mktemp("pristine") / "checkpoints")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    target=st.sampled_from(["manifest.json", "data.bin", "segment"]),
    path=st.lists(
        st.sampled_from(["files", "arrays", "tree", "rows", "log", 0, "sequence", "path", "shape"]),
        max_size=3,
    ),
    value=JSON,
)
def test_any_json_value_anywhere_is_a_clean_error_or_a_clean_load(
    pristine: Path, tmp_path_factory: pytest.TempPathFactory, target: str, path: list[Any], value: Any
) -> None:
    """Replace one value (or the whole document) of a JSON file of the newest checkpoint,
    checksums re-signed: reading it is a CheckpointError or a load, and load_latest falls back."""
    case = tmp_path_factory.mktemp("case") / "checkpoints"
    shutil.copytree(pristine, case)
    newest = list_checkpoints(case)[0][-1].path
    name = target if target != "segment" else sorted(p.name for p in newest.glob("log-*"))[-1]
    if name == "data.bin":
        document = storage.read_state_document(newest)
    else:
        document = json.loads((newest / name).read_text())
    node = document
    for key in path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            break
    try:
        if path:
            node[path[-1]] = value
        else:
            document = value
    except (IndexError, TypeError):
        document = value
    if name == "manifest.json":
        (newest / name).write_bytes(storage.seal(json.dumps(document).encode()))
    elif name == "data.bin":
        replace_state(newest, document)
    else:
        (newest / name).write_text(json.dumps(document))
        manifest = json.loads((newest / "manifest.json").read_text())
        data = (newest / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
        resign(newest, manifest)
    with contextlib.suppress(CheckpointError):
        storage.read_checkpoint(newest)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert load_latest(case)[1].name in {p.name for p in case.glob("ckpt-*")}
