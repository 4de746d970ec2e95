"""A damaged log file, a full disk, read-only media: one line and exit status 2 from the CLI
(``epochal run`` and ``epochal log``), nothing already written lost; readers read read-only media.

The full disk is a small tmpfs and the read-only media a read-only bind mount, each made in a
mount namespace of its own (``unshare --mount``: root, or the capability to mount). Where that
is not possible, the read-only tests fall back to ``chmod`` (which stops a user, not root) and
the full disk test is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from epochal.testing import epochal_command

pytestmark = pytest.mark.slow

CONFIG = """
[loop]
max_epochs = 2
seed = 0

[model]
factory = "epochal.examples.digits:make_model"

[data]
factory = "epochal.examples.digits:make_data"
batch_size = 256

[plugins]
order = ["sqlite_log"]
autoload = false
"""

ONLY_SQLITE_LOG = {"EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1", "EPOCHAL_PLUGINS": "sqlite_log"}


def epochal(cwd: Path, *args: str, db: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``epochal ARGS`` in *cwd* with only sqlite_log loaded, logging into *db* if given."""
    env = {**ONLY_SQLITE_LOG, **({"EPOCHAL_SQLITE_DB": str(db)} if db else {})}
    return epochal_command(*args, cwd=cwd, env=env)


def one_line_error(done: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, object]]]:
    """A project holding ``runs/epochal.sqlite`` with two finished runs, and their ``log runs --json``."""
    cwd = tmp_path_factory.mktemp("project")
    (cwd / "digits.toml").write_text(CONFIG)
    for _ in range(2):
        done = epochal(cwd, "run", "digits.toml")
        assert done.returncode == 0, done.stderr
    listed = epochal(cwd, "log", "runs", "--json")
    assert listed.returncode == 0, listed.stderr
    return cwd, json.loads(listed.stdout)


def copy_of(log: tuple[Path, list[dict[str, object]]], into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    (into / "digits.toml").write_text(CONFIG)
    return Path(shutil.copy(log[0] / "runs" / "epochal.sqlite", into / "epochal.sqlite"))


# -- damaged pages ------------------------------------------------------------------------------


def damage(db: Path, table: str) -> None:
    """Overwrite the root page of *table*: a page in the middle of the file, not its header (whose
    damage is found when the file is opened), and one SQLite reads before it writes there."""
    conn = sqlite3.connect(db)
    (page_size,) = conn.execute("PRAGMA page_size").fetchone()
    (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()
    conn.close()
    assert root > 1
    with open(db, "r+b") as file:
        file.seek((root - 1) * page_size)
        file.write(b"\xa5" * page_size)


def test_damaged_runs_table_is_one_line_for_every_reader_and_for_a_new_run(
    log: tuple[Path, list[dict[str, object]]], tmp_path: Path
) -> None:
    db = copy_of(log, tmp_path)
    damage(db, "runs")
    damaged = db.read_bytes()
    for command in (["runs"], ["show", "latest"], ["compare", "latest", "latest"]):
        done = epochal(tmp_path, "log", *command, "--db", str(db))
        one_line_error(done, f"cannot read the training log {db}", "the file is damaged", ".recover")
    done = epochal(tmp_path, "run", "digits.toml", db=db)
    one_line_error(done, str(db), "the file is damaged", "nothing more was written into it")
    assert db.read_bytes() == damaged  # nothing written into a damaged file


def test_damaged_records_stop_a_run_at_its_first_write_and_its_run_is_kept(
    log: tuple[Path, list[dict[str, object]]], tmp_path: Path
) -> None:
    db = copy_of(log, tmp_path)
    damage(db, "chunks")
    done = epochal(tmp_path, "run", "digits.toml", db=db)
    one_line_error(done, f"cannot write the training log {db}", "the file is damaged", ".recover")
    show = epochal(tmp_path, "log", "show", str(log[1][0]["run_id"]), "--db", str(db))
    one_line_error(show, f"cannot read the training log {db}", "the file is damaged")
    # the runs table was not damaged: the earlier runs, and the new one, which no longer runs
    listed = epochal(tmp_path, "log", "runs", "--db", str(db), "--json")
    assert listed.returncode == 0, listed.stderr
    runs = json.loads(listed.stdout)
    assert runs[:2] == log[1]
    assert len(runs) == 3 and runs[2]["status"] == "killed"


# -- a full disk --------------------------------------------------------------------------------


def can_mount(tmp_path: Path) -> bool:
    """Whether this process may mount a tmpfs in a mount namespace of its own."""
    if shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"],
        capture_output=True,
    )
    return done.returncode == 0


FULL = """
set -e
mount -t tmpfs -o size=$SIZE tmpfs "$DISK"
cp "$LOG" "$DISK/epochal.sqlite"
set +e
"$@" > "$OUT/stdout" 2> "$OUT/stderr"
echo $? > "$OUT/rc"
cp -a "$DISK/." "$OUT/disk/"
"""


def test_a_full_disk_stops_the_run_with_one_line_and_keeps_every_committed_write(
    log: tuple[Path, list[dict[str, object]]], tmp_path: Path
) -> None:
    if not can_mount(tmp_path):
        pytest.skip("cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN and unshare)")
    db = copy_of(log, tmp_path / "project")
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    (out / "disk").mkdir(parents=True)
    # room for the -shm file and a few flushes, not for 60 epochs of them
    size = db.stat().st_size + 96 * 1024
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env.update(ONLY_SQLITE_LOG, SIZE=str(size), DISK=str(disk), LOG=str(db), OUT=str(out))
    env["EPOCHAL_SQLITE_DB"] = str(disk / "epochal.sqlite")
    run = [sys.executable, "-m", "epochal", "run", "digits.toml", "--set", "loop.max_epochs=60"]
    subprocess.run(
        ["unshare", "--mount", "sh", "-c", FULL, "sh", *run], cwd=db.parent, env=env, check=True, timeout=300
    )
    done = subprocess.CompletedProcess(
        run, int((out / "rc").read_text()), (out / "stdout").read_text(), (out / "stderr").read_text()
    )
    line = one_line_error(
        done, f"cannot write the training log {disk / 'epochal.sqlite'}", "the disk is full", "are kept"
    )
    kept = int(line.rsplit("up to iteration ", 1)[1])  # what the message says was kept
    assert kept > 0

    after = out / "disk" / "epochal.sqlite"  # the file as the failed run left it on the full disk
    conn = sqlite3.connect(after)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    listed = epochal(tmp_path, "log", "runs", "--db", str(after), "--json")
    assert listed.returncode == 0, listed.stderr
    runs = json.loads(listed.stdout)
    assert runs[:2] == log[1]  # the earlier runs, untouched
    assert len(runs) == 3 and runs[2]["iterations_done"] == kept and runs[2]["status"] == "killed"
    shown = epochal(tmp_path, "log", "show", runs[2]["run_id"], "--db", str(after), "--csv")
    assert shown.returncode == 0, shown.stderr
    iterations = [int(line.split(",")[0]) for line in shown.stdout.splitlines()[1:]]
    assert iterations == list(range(6, kept + 1, 6))  # every epoch's row up to there


# -- read-only media ----------------------------------------------------------------------------


def read_only(directory: Path, command: list[str]) -> subprocess.CompletedProcess[str]:
    """Run *command* (``epochal ...``) with *directory* read-only: a read-only bind mount in a
    mount namespace where this process may mount (root, which ``chmod`` does not stop), else
    ``chmod``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env.update(ONLY_SQLITE_LOG)
    args = [sys.executable, "-m", "epochal", *command]
    if os.geteuid() != 0:
        files = [directory, *directory.iterdir()]
        modes = {path: path.stat().st_mode for path in files}
        for path in files:
            path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            return subprocess.run(args, cwd=directory.parent, env=env, capture_output=True, text=True)
        finally:
            for path, mode in modes.items():
                path.chmod(mode)
    script = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" && exec "$@"'
    return subprocess.run(
        ["unshare", "--mount", "sh", "-c", script, str(directory), *args],
        cwd=directory.parent,
        env=env,
        capture_output=True,
        text=True,
    )


def test_a_log_on_read_only_media_is_read_and_a_run_into_it_is_one_line(
    log: tuple[Path, list[dict[str, object]]], tmp_path: Path
) -> None:
    if os.geteuid() == 0 and not can_mount(tmp_path):
        pytest.skip("root, and no read-only bind mount possible here: nothing stops a write")
    media = tmp_path / "media"
    db = copy_of(log, media)
    before = sorted(p.name for p in media.iterdir())
    first, second = (str(run["run_id"]) for run in log[1])

    listed = read_only(media, ["log", "runs", "--db", str(db), "--json"])
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == log[1]
    shown = read_only(media, ["log", "show", first, "--db", str(db), "--csv"])
    assert shown.returncode == 0, shown.stderr
    assert [line.split(",")[:2] for line in shown.stdout.splitlines()[1:]] == [["6", first], ["12", first]]
    compared = read_only(media, ["log", "compare", first, second, "--db", str(db), "--json"])
    assert compared.returncode == 0, compared.stderr
    assert set(json.loads(compared.stdout)["keys"]) == {"epochs_done", "valid.accuracy", "valid.loss"}
    if _has_matplotlib():
        plotted = read_only(media, ["log", "plot", first, "--db", str(db), "-o", str(tmp_path / "p.svg")])
        assert plotted.returncode == 0, plotted.stderr
        assert (tmp_path / "p.svg").read_bytes().startswith(b"<?xml")

    done = read_only(media, ["run", str(media / "digits.toml"), "--set", f"plugins.sqlite_log.path={db}"])
    one_line_error(done, str(db), "read-only")
    assert sorted(p.name for p in media.iterdir()) == before  # no -wal, -shm or lock left


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
