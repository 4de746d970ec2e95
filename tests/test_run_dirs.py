"""A directory per fresh run (issue 29): ``<[loop] run_dir>/version_N``, through the CLI.

A config run twice makes two directories and both exit 0; ``--resume`` continues the newest
run, ``--resume auto`` starts one when there is none; the summary names the directory and its
resume command trains on; concurrent fresh runs never share a directory.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from epochal.resume_hint import continuing_command, launcher_command
from epochal.run_dirs import make_fresh, versions
from epochal.testing import digits_config, epochal_command


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return epochal_command("run", "run.toml", *args, cwd=tmp_path)


def summary(done: subprocess.CompletedProcess[str], what: str) -> str:
    """The value of the summary line ``epochal: WHAT: ...``."""
    prefix = f"epochal: {what}: "
    found = [line.removeprefix(prefix) for line in done.stdout.splitlines() if line.startswith(prefix)]
    assert len(found) == 1, done.stdout
    return found[0]


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt-*"))


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return digits_config(tmp_path / "run.toml", ["checkpoint", "sqlite_log"], run_dir="runs/digits")


def test_a_config_run_twice_makes_two_directories_and_both_exit_0(tmp_path: Path, config: Path) -> None:
    first = run(tmp_path)
    assert first.returncode == 0, first.stderr
    assert summary(first, "directory") == str(Path("runs/digits/version_0"))
    assert summary(first, "checkpoints") == str(Path("runs/digits/version_0/checkpoints"))
    kept = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs/digits/version_0").rglob("*")}
    second = run(tmp_path, "--set", "loop.max_epochs=1")
    assert second.returncode == 0, second.stderr
    assert summary(second, "directory") == str(Path("runs/digits/version_1"))
    root = tmp_path / "runs" / "digits"
    assert [p.name for p in versions(root)] == ["version_0", "version_1"]
    assert checkpoints(root / "version_0") == ["ckpt-e0001-i000023", "ckpt-e0002-i000046"]
    assert checkpoints(root / "version_1") == ["ckpt-e0001-i000023"]
    # the second run wrote nothing into the first one's directory
    assert {p: p.stat().st_mtime_ns for p in (root / "version_0").rglob("*")} == kept
    # one log for both, each run with its directory
    listed = epochal_command("log", "runs", "--csv", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split(",") for line in listed.stdout.splitlines()[1:]]
    assert [row[7] for row in rows] == [
        str(Path("runs/digits/version_0")),
        str(Path("runs/digits/version_1")),
    ]


def test_resume_continues_the_newest_run_in_its_directory(tmp_path: Path, config: Path) -> None:
    assert run(tmp_path).returncode == 0
    newest = run(tmp_path, "--set", "loop.max_epochs=1")
    assert newest.returncode == 0
    # its hint drops the --set the run reached: the config's own max_epochs = 2 trains on
    assert summary(newest, "resume") == "epochal run run.toml --resume"
    resumed = run(tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    version_1 = Path("runs/digits/version_1")
    assert f"resumed from checkpoint {version_1 / 'checkpoints' / 'ckpt-e0001-i000023'}" in resumed.stderr
    assert summary(resumed, "directory") == str(version_1)
    assert "finished after 2 epoch(s)" in resumed.stdout
    root = tmp_path / "runs" / "digits"
    assert len(versions(root)) == 2  # no new directory
    assert checkpoints(root / "version_1") == ["ckpt-e0001-i000023", "ckpt-e0002-i000046"]


def test_resume_auto_with_no_run_starts_fresh_and_resume_alone_is_refused(
    tmp_path: Path, config: Path
) -> None:
    refused = run(tmp_path, "--resume")
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "no run of this configuration under 'runs/digits' yet" in errors[0]
    assert "Traceback" not in refused.stderr and not (tmp_path / "runs" / "digits").exists()
    auto = run(tmp_path, "--resume", "auto")
    assert auto.returncode == 0, auto.stderr
    assert "starting a fresh run" in auto.stderr
    assert summary(auto, "directory") == str(Path("runs/digits/version_0"))
    again = run(tmp_path, "--resume", "auto")  # a requeued job: continues it, nothing left
    assert again.returncode == 0
    assert "nothing left to train" in again.stderr and "resumed from checkpoint" in again.stderr
    assert len(versions(tmp_path / "runs" / "digits")) == 1


def test_the_resume_hint_of_a_run_that_reached_its_limit_trains_on(tmp_path: Path, config: Path) -> None:
    done = run(tmp_path)
    # max_epochs = 2 is the config's own: resuming with it would finish at once
    hint = summary(done, "resume")
    assert hint == "epochal run run.toml --set loop.max_epochs=4 --resume"
    resumed = run(tmp_path, *hint.split()[3:])
    assert resumed.returncode == 0, resumed.stderr
    assert "finished after 4 epoch(s)" in resumed.stdout and "nothing left" not in resumed.stderr
    assert summary(resumed, "resume") == "epochal run run.toml --set loop.max_epochs=6 --resume"


def test_resume_path_starts_a_new_directory_from_that_checkpoint(tmp_path: Path, config: Path) -> None:
    assert run(tmp_path).returncode == 0
    path = tmp_path / "runs/digits/version_0/checkpoints/ckpt-e0001-i000023"
    resumed = run(tmp_path, "--resume", str(path))
    assert resumed.returncode == 0, resumed.stderr
    assert summary(resumed, "directory") == str(Path("runs/digits/version_1"))
    assert checkpoints(tmp_path / "runs/digits/version_0") == ["ckpt-e0001-i000023", "ckpt-e0002-i000046"]
    assert checkpoints(tmp_path / "runs/digits/version_1") == ["ckpt-e0002-i000046"]


def test_an_explicit_checkpoint_dir_shared_by_two_fresh_runs_is_refused_with_a_fitting_hint(
    tmp_path: Path, config: Path
) -> None:
    assert run(tmp_path, "--set", "plugins.checkpoint.dir=shared").returncode == 0
    second = run(tmp_path, "--set", "plugins.checkpoint.dir=shared")
    assert second.returncode == 2
    errors = [line for line in second.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, second.stderr
    assert "checkpoint directory 'shared' already holds 2 checkpoint(s)" in errors[0]
    assert "--set plugins.checkpoint.dir=DIR, or leave [plugins.checkpoint] dir unset" in errors[0]
    assert "--set loop.run_dir" not in errors[0]
    # the refused run left no directory behind
    assert [p.name for p in versions(tmp_path / "runs" / "digits")] == ["version_0"]


def test_two_fresh_runs_started_together_get_two_directories(tmp_path: Path, config: Path) -> None:
    command = [sys.executable, "-m", "epochal", "run", "run.toml", "--set", "loop.max_epochs=1"]
    started = [
        subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=300) for process in started]
    assert [process.returncode for process in started] == [0, 0], outputs
    directories = sorted(
        line for out, _ in outputs for line in out.splitlines() if "epochal: directory:" in line
    )
    assert len(set(directories)) == 2
    assert [p.name for p in versions(tmp_path / "runs" / "digits")] == ["version_0", "version_1"]


def test_make_fresh_never_gives_one_directory_twice(tmp_path: Path) -> None:
    made: list[Path] = []
    threads = [threading.Thread(target=lambda: made.append(make_fresh(tmp_path / "root"))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(p.name for p in made) == sorted(f"version_{n}" for n in range(8))
    (tmp_path / "root" / "version_10").mkdir()
    (tmp_path / "root" / "version_x").mkdir()  # not a run directory
    assert make_fresh(tmp_path / "root").name == "version_11"


class Ended:
    """What continuing_command reads of a loop."""

    def __init__(
        self, command: list[str], epoch: int, max_epochs: int | None, config_file: str | None
    ) -> None:
        self.command, self.epoch, self.max_epochs, self.config_file = command, epoch, max_epochs, config_file
        self.iteration, self.max_iterations = 10 * epoch, None


def test_the_continuing_command_keeps_a_limit_not_reached_and_raises_one_reached(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[loop]\nmax_epochs = 3\n")
    base = ["epochal", "run", str(config)]
    interrupted = Ended([*base, "--set", "loop.max_epochs=4"], epoch=2, max_epochs=4, config_file=str(config))
    assert continuing_command(interrupted) == [*base, "--set", "loop.max_epochs=4"]
    # reached on the command line, and the file's own 3 lies no further: as many epochs again
    reached = Ended([*base, "--set=loop.max_epochs=4"], epoch=4, max_epochs=4, config_file=str(config))
    assert continuing_command(reached) == [*base, "--set", "loop.max_epochs=8"]
    assert continuing_command(reached, started=(3, 30)) == [*base, "--set", "loop.max_epochs=5"]
    # reached on the command line, the file's own 3 trains on: the --set goes
    short = Ended([*base, "--set", "loop.max_epochs=1", "--disable", "x"], 1, 1, str(config))
    assert continuing_command(short) == [*base, "--disable", "x"]
    # max_iterations reached in the middle of an epoch: as many batches again
    mid = Ended([*base, "--set", "loop.max_iterations=3"], epoch=0, max_epochs=None, config_file=str(config))
    mid.iteration, mid.max_iterations = 3, 3
    assert continuing_command(mid) == [*base, "--set", "loop.max_iterations=6"]


def test_the_command_under_torchrun_is_torchruns() -> None:
    def without_resume(args: list[str]) -> list[str]:
        return [a for a in args if a not in ("--resume", "auto")]

    parent = [
        "/venv/bin/python",
        "/venv/bin/torchrun",
        "--nproc-per-node",
        "2",
        "-m",
        "epochal",
        "run",
        "r.toml",
    ]
    assert launcher_command([*parent, "--resume", "auto"], without_resume) == ["torchrun", *parent[2:]]
    module = ["python3", "-m", "torch.distributed.run", "--standalone", "-m", "epochal", "run", "r.toml"]
    assert launcher_command(module, without_resume) == ["torchrun", *module[3:]]
    assert launcher_command(["/usr/bin/python", "-m", "epochal", "run", "r.toml"], without_resume) is None
