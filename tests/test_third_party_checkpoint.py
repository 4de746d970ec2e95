"""A third party's checkpoint plugin gets everything the standard one gets from the core.

``tests/npycheckpoint`` is a checkpoint plugin over ``numpy.save`` written only from
docs/writing-plugins.md ("Replacing a standard plugin"), pip-installed as a distribution. Run
through the ``epochal`` CLI without the standard ``checkpoint`` plugin, it gets the summary's
lines, the fresh-run refusal, ``--resume``/``--resume auto``/``--resume PATH``,
``epochal check-resume`` and, on 2 processes, the launcher's message after ``kill -9`` of a rank.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes import wait_for, worker_pids

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def npy_site(tmp_path_factory: pytest.TempPathFactory, pip_install_target: Any) -> Path:
    root = tmp_path_factory.mktemp("npycheckpoint")
    shutil.copytree(HERE / "npycheckpoint", root / "src")
    pip_install_target(root / "src", root / "site")
    assert list((root / "site").glob("epochal_npycheckpoint-0.3.0.dist-info/entry_points.txt"))
    return root / "site"


def write_run(tmp_path: Path, *, max_epochs: int = 2, distributed: bool = False) -> Path:
    shutil.copy(HERE / "ddp_tiny.py", tmp_path / "ddp_tiny.py")
    config = tmp_path / "run.toml"
    config.write_text(
        f"""[loop]
max_epochs = {max_epochs}
seed = 0
run_dir = "run"
{"[distributed]" + chr(10) + 'backend = "gloo"' + chr(10) + "timeout = 60" if distributed else ""}

[model]
factory = "ddp_tiny:make_model"

[data]
factory = "ddp_tiny:make_data"

[plugins]
order = ["npy_checkpoint"]
autoload = false
""",
        encoding="utf-8",
    )
    return config


def environment(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def epochal(site: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "epochal", *args],
        cwd=tmp_path,
        env=environment(site),
        capture_output=True,
        text=True,
        timeout=300,
    )


def saved(tmp_path: Path, run: str = "version_0", where: str = "npy") -> list[str]:
    return sorted(p.name for p in (tmp_path / "run" / run / where).glob("npy-*.npy"))


def test_the_summary_has_its_lines_a_second_run_its_own_directory_a_shared_dir_is_refused(npy_site, tmp_path):
    write_run(tmp_path)
    first = epochal(npy_site, tmp_path, "run", "run.toml", "--set", "loop.seed=0")
    assert first.returncode == 0, first.stderr
    assert "epochal: checkpoints: run/version_0/npy" in first.stdout.splitlines()
    # max_epochs = 2 was reached: the resume command asks for as many again
    assert (
        "epochal: resume: epochal run run.toml --set loop.seed=0 --set loop.max_epochs=4 --resume"
        in first.stdout
    )
    assert saved(tmp_path) == ["npy-00000016.npy", "npy-00000032.npy"]
    again = epochal(npy_site, tmp_path, "run", "run.toml")
    assert again.returncode == 0, again.stderr
    assert saved(tmp_path, "version_1") == ["npy-00000016.npy", "npy-00000032.npy"]
    # a directory the config shares between its runs: the plugin's check_fresh_run refuses
    shared = ("--set", "plugins.npy_checkpoint.directory=shared")
    assert epochal(npy_site, tmp_path, "run", "run.toml", *shared).returncode == 0
    refused = epochal(npy_site, tmp_path, "run", "run.toml", *shared)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1, refused.stderr  # one line
    assert "npy_checkpoint: shared holds 2 checkpoint(s)" in refused.stderr
    assert "epochal run run.toml --set plugins.npy_checkpoint.directory=shared --resume" in refused.stderr
    assert saved(tmp_path, "..", "shared") == ["npy-00000016.npy", "npy-00000032.npy"]  # nothing written


def test_resume_latest_auto_and_path(npy_site, tmp_path):
    write_run(tmp_path)
    missing = epochal(npy_site, tmp_path, "run", "run.toml", "--resume")
    assert missing.returncode == 2 and "no run of this configuration under 'run' yet" in missing.stderr
    fresh = epochal(npy_site, tmp_path, "run", "run.toml", "--resume", "auto")
    assert fresh.returncode == 0, fresh.stderr
    assert "resumed from" not in fresh.stderr and saved(tmp_path)[-1] == "npy-00000032.npy"
    longer = epochal(npy_site, tmp_path, "run", "run.toml", "--resume", "--set", "loop.max_epochs=3")
    assert longer.returncode == 0, longer.stderr
    assert "epochal: resumed from checkpoint run/version_0/npy/npy-00000032.npy of run" in longer.stderr
    assert "at epoch 2, iteration 32" in longer.stderr and "after 3 epoch(s)" in longer.stdout
    auto = epochal(npy_site, tmp_path, "run", "run.toml", "--resume", "auto", "--set", "loop.max_epochs=4")
    assert auto.returncode == 0 and "npy-00000048.npy of run" in auto.stderr
    path = str(tmp_path / "run" / "version_0" / "npy" / "npy-00000016.npy")
    chosen = epochal(npy_site, tmp_path, "run", "run.toml", "--resume", path)
    assert chosen.returncode == 0, chosen.stderr
    assert f"resumed from checkpoint {path}" in chosen.stderr and "at epoch 1, iteration 16" in chosen.stderr
    assert saved(tmp_path, "version_1") == ["npy-00000032.npy"]  # a new directory


def test_check_resume_passes(npy_site, tmp_path):
    write_run(tmp_path, max_epochs=2)
    done = epochal(npy_site, tmp_path, "check-resume", "run.toml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "check-resume: 5/5" in done.stdout + done.stderr
    assert "ok: interrupted after batch" in done.stdout
    assert "as kill -9 ends it and resumed from its latest complete checkpoint" in done.stdout


@pytest.mark.distributed
def test_a_rank_killed_on_two_processes_names_its_last_checkpoint(npy_site, tmp_path):
    write_run(tmp_path, max_epochs=6, distributed=True)
    run = subprocess.Popen(
        [sys.executable, "-m", "epochal", "run", "run.toml", "--nproc", "2", "--set", "model.delay=0.08"],
        cwd=tmp_path,
        env=environment(npy_site),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: saved(tmp_path), process=run)
    workers = worker_pids(run.pid)
    assert sorted(workers) == [0, 1]
    os.kill(workers[1], signal.SIGKILL)
    started = time.monotonic()
    _, err = run.communicate(timeout=120)
    assert time.monotonic() - started < 90
    assert run.returncode == 1
    last = [line for line in err.splitlines() if line.startswith("Error: rank 1")]
    assert len(last) == 1, err
    kept = saved(tmp_path)
    assert f"the last complete checkpoint is run/version_0/npy/{kept[-1]}" in last[0], last[0]
    assert "resume: epochal run run.toml --nproc 2 --set model.delay=0.08 --resume" in last[0]


def test_check_resume_moves_the_option_it_declares_and_touches_no_real_directory(npy_site, tmp_path):
    """Its option is ``directory`` (not ``dir`` or ``path``): check-resume moves it because the
    plugin declares ``writes_to = ("directory",)``, and the user's directory stays empty."""
    config = write_run(tmp_path, max_epochs=2)
    config.write_text(config.read_text() + '\n[plugins.npy_checkpoint]\ndirectory = "real"\n')
    done = epochal(npy_site, tmp_path, "check-resume", "run.toml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok: ") == 2, done.stdout
    assert not (tmp_path / "real").exists()  # nothing written where the real runs write
    assert not (tmp_path / "run").exists()


def test_check_resume_refuses_a_saver_that_does_not_say_where_it_writes(npy_site, tmp_path):
    (tmp_path / "mine.py").write_text(
        "from epochal_npycheckpoint import NpyCheckpoint\n\n\n"
        "class Undeclared(NpyCheckpoint):\n    writes_to = None\n"
    )
    config = write_run(tmp_path, max_epochs=2)
    text = config.read_text().replace('order = ["npy_checkpoint"]', 'order = ["mine"]')
    config.write_text(text + '\n[plugins.mine]\nfactory = "mine:Undeclared"\ndirectory = "real"\n')
    refused = epochal(npy_site, tmp_path, "check-resume", "run.toml")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert (
        "check-resume cannot isolate plugin 'mine': it saves checkpoints but does not declare"
        in refused.stderr
    )
    assert "ok:" not in refused.stdout and not (tmp_path / "real").exists()


def test_installed_beside_the_standard_one_it_replaces_it_by_declaration(npy_site, tmp_path):
    """``provides = "checkpoint"``: with both savers installed and autoloading, only it runs, so
    ``--resume`` finds one latest checkpoint (two savers made the plugins disagree)."""
    pytest.importorskip("epochal_checkpoint")
    config = write_run(tmp_path)
    config.write_text(
        config.read_text()
        .replace('order = ["npy_checkpoint"]', "disable = ['progress', 'printing', 'sqlite_log', 'timing']")
        .replace("autoload = false", "autoload = true")
    )
    listing = epochal(npy_site, tmp_path, "plugins", "--config", "run.toml", "--json")
    statuses = {p["name"]: (p["status"], p["error"]) for p in json.loads(listing.stdout)}
    assert statuses["npy_checkpoint"][0] == "loaded"
    assert statuses["checkpoint"] == (
        "replaced",
        "replaced by plugin 'npy_checkpoint', which provides 'checkpoint'",
    )
    first = epochal(npy_site, tmp_path, "run", "run.toml")
    assert first.returncode == 0, first.stderr
    assert saved(tmp_path) == ["npy-00000016.npy", "npy-00000032.npy"]
    assert not (tmp_path / "run" / "version_0" / "checkpoints").exists()  # the standard one did not run
    resumed = epochal(npy_site, tmp_path, "run", "run.toml", "--resume", "--set", "loop.max_epochs=3")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from checkpoint run/version_0/npy/npy-00000032.npy" in resumed.stderr
    named = epochal(npy_site, tmp_path, "run", "run.toml", "--plugins", "checkpoint,npy_checkpoint")
    assert named.returncode == 2 and "each provide 'checkpoint'" in named.stderr, named.stderr


def test_a_checkpoint_of_another_model_is_one_line_naming_the_plugin_and_the_checkpoint(npy_site, tmp_path):
    """Issue 44, item 9: the plugin knows nothing of the core's checks; the core checks the state
    it returns (``Loop.check_state``) and says one line, exit 2, not a traceback."""
    write_run(tmp_path)
    assert epochal(npy_site, tmp_path, "run", "run.toml").returncode == 0
    path = str(tmp_path / "run" / "version_0" / "npy" / "npy-00000032.npy")
    other = ("--set", "model.factory=epochal.examples.tiny:TinyModel", "--set", "model.features=5")
    done = epochal(npy_site, tmp_path, "run", "run.toml", *other, "--resume", path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, done.stderr
    assert f"cannot resume from checkpoint {path} (given by plugin 'npy_checkpoint')" in errors[0]
    assert "model.w: shape (3,) != expected (5,)" in errors[0]
