"""``epochal run`` with sqlite_log, then ``epochal log runs|show|plot|compare`` (subprocesses)."""

from __future__ import annotations

import csv
import io
import json
import sqlite3
import subprocess
from pathlib import Path

import pytest

from epochal.testing import epochal_command

CONFIG = """
[loop]
max_epochs = 2
seed = 0

[model]
factory = "epochal.examples.digits:make_model"

[data]
factory = "epochal.examples.digits:make_data"
batch_size = 256
"""


ONLY_SQLITE_LOG = {"EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1", "EPOCHAL_PLUGINS": "sqlite_log"}


def epochal(
    cwd: Path, *args: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``epochal ARGS`` in *cwd* with only sqlite_log loaded, whatever else is installed."""
    return epochal_command(*args, cwd=cwd, env={**ONLY_SQLITE_LOG, **(extra_env or {})})


def run(cwd: Path, *sets: str) -> str:
    """``epochal run digits.toml`` pinned to sqlite_log; return the run id."""
    args = ["run", "digits.toml", "--plugins", "sqlite_log", "--set", "plugins.autoload=false"]
    for item in sets:
        args += ["--set", item]
    done = epochal(cwd, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[2]  # "epochal: run <id> finished ..."


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """A project directory with two finished runs of the digits example in runs/digits."""
    cwd = tmp_path_factory.mktemp("project")
    (cwd / "digits.toml").write_text(CONFIG)
    first = run(cwd)
    second = run(cwd, "model.lr=0.05")
    return cwd, first, second


def one_line_error(done: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_runs_lists_both_runs_from_the_default_database(project: tuple[Path, str, str]) -> None:
    cwd, first, second = project
    assert (cwd / "runs" / "epochal.sqlite").is_file()  # one per project, beside runs/digits
    done = epochal(cwd, "log", "runs")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["run_id", "status", "started"]
    assert [line.split()[:2] for line in lines[1:]] == [[first[:12], "finished"], [second[:12], "finished"]]
    listed = json.loads(epochal(cwd, "log", "runs", "--json").stdout)
    assert [r["run_id"] for r in listed] == [first, second]
    assert listed[1]["config"]["model"]["lr"] == 0.05 and listed[1]["plugins"] == {"sqlite_log": "0.1.0"}
    assert listed[0]["epochs_done"] == 2 and listed[0]["finish_reason"] == "max_epochs=2 reached"
    by_config = epochal(cwd, "log", "runs", "--config", "digits.toml", "--json")
    assert [r["run_id"] for r in json.loads(by_config.stdout)] == [first, second]


def test_show_text_csv_json_and_keys(project: tuple[Path, str, str]) -> None:
    cwd, first, second = project
    text = epochal(cwd, "log", "show", "latest")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"run {second} (finished)"
    assert lines[1].split() == ["iteration", "epochs_done", "valid.loss", "valid.accuracy"]  # losses first
    assert [line.split()[0] for line in lines[2:]] == ["6", "12"]  # 1438 examples / 256 = 6 batches

    table = list(csv.reader(io.StringIO(epochal(cwd, "log", "show", first[:6], "--csv").stdout)))
    assert table[0] == ["iteration", "run_id", "epochs_done", "valid.loss", "valid.accuracy"]
    assert [row[:2] for row in table[1:]] == [["6", first], ["12", first]]
    assert 0 < float(table[2][3]) < float(table[1][3])  # the validation loss went down

    payload = json.loads(epochal(cwd, "log", "show", first, "--json", "--keys", "valid.*").stdout)
    assert payload["run"]["run_id"] == first and payload["chain"] == [first]
    assert [row["iteration"] for row in payload["rows"]] == [6, 12]
    assert set(payload["rows"][0]["values"]) == {"valid.loss", "valid.accuracy"}

    none = epochal(cwd, "log", "show", first, "--keys", "nothing.*")
    one_line_error(none, "no key matches nothing.*")


def test_compare_shows_final_and_best_of_common_keys(project: tuple[Path, str, str]) -> None:
    cwd, first, second = project
    done = epochal(cwd, "log", "compare", first, second)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["key", "best", "is", f"{first[:8]}", "final", f"{second[:8]}", "final",
                                f"{first[:8]}", "best", f"{second[:8]}", "best"]  # fmt: skip
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert set(rows) == {"epochs_done", "valid.accuracy", "valid.loss"}
    assert rows["valid.accuracy"][0] == "max" and rows["valid.loss"][0] == "min"
    assert rows["epochs_done"][0] == "-" and len(rows["epochs_done"]) == 3  # a counter: no best
    data = json.loads(epochal(cwd, "log", "compare", first, second, "--json").stdout)
    loss = data["keys"]["valid.loss"]
    assert [entry["best"] for entry in loss] == [min(e["best"], e["final"]) for e in loss]
    assert [entry["best"] for entry in data["keys"]["epochs_done"]] == [None, None]
    usage = epochal(cwd, "log", "compare", first)  # a usage error: click's usage line, then the error
    assert usage.returncode == 2 and usage.stderr.strip().endswith("Error: compare needs at least two runs")


def test_plot_writes_a_png_that_opens(project: tuple[Path, str, str]) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    cwd, first, _ = project
    out = cwd / "plot.png"
    done = epochal(
        cwd, "log", "plot", first, "--key", "valid.loss", "--key", "valid.accuracy", "-o", str(out)
    )
    assert done.returncode == 0, done.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    image = imread(out)
    assert image.shape[0] > 200 and image.shape[1] > 400
    missing = epochal(cwd, "log", "plot", first, "--key", "train.loss", "-o", str(out))
    one_line_error(missing, "has no key 'train.loss'", "valid.loss")


def test_plot_without_matplotlib_says_how_to_install_it(
    project: tuple[Path, str, str], tmp_path: Path
) -> None:
    cwd, first, _ = project
    blocker = tmp_path / "blocker" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is blocked in this test')\n")
    done = epochal(
        cwd,
        "log", "plot", first, "--key", "valid.loss", "-o", str(tmp_path / "x.png"),
        extra_env={"PYTHONPATH": str(tmp_path / "blocker")},
    )  # fmt: skip
    one_line_error(done, "pip install matplotlib", "pip install './plugins/epochal-sqlite[plot]'")


def test_bad_input_is_one_clear_error_each(project: tuple[Path, str, str], tmp_path: Path) -> None:
    cwd, _, _ = project
    db = str(cwd / "runs" / "epochal.sqlite")
    one_line_error(
        epochal(tmp_path, "log", "runs", "--db", "nope.sqlite"), "no such database file: nope.sqlite"
    )
    one_line_error(epochal(tmp_path, "log", "runs"), "no epochal-sqlite database found", "--db")
    text = tmp_path / "notes.sqlite"
    text.write_text("this is not a database\n" * 200)
    one_line_error(
        epochal(tmp_path, "log", "runs", "--db", str(text)), "notes.sqlite is not a SQLite database"
    )
    foreign = tmp_path / "other.sqlite"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE log (t TEXT)")
    conn.commit()
    conn.close()
    one_line_error(
        epochal(tmp_path, "log", "show", "latest", "--db", str(foreign)),
        "other.sqlite is a SQLite database but not an epochal-sqlite log",
    )
    empty = tmp_path / "empty.sqlite"
    sqlite3.connect(empty).close()
    one_line_error(epochal(tmp_path, "log", "runs", "--db", str(empty)), "empty SQLite database")
    one_line_error(
        epochal(cwd, "log", "show", "0123abcd", "--db", db), "no run '0123abcd'", "epochal log runs"
    )
    one_line_error(epochal(cwd, "log", "show", "", "--db", db), "no run ''")
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "b").mkdir(parents=True)
    for name in ("a", "b"):
        (tmp_path / "runs" / name / "epochal.sqlite").write_bytes(Path(db).read_bytes())
    one_line_error(epochal(tmp_path, "log", "runs"), "2 databases found", "--db")
    newer = tmp_path / "newer.sqlite"
    newer.write_bytes(Path(db).read_bytes())
    conn = sqlite3.connect(newer)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    one_line_error(epochal(tmp_path, "log", "runs", "--db", str(newer)), "schema version 99", "upgrade")


def test_ambiguous_prefix_names_the_candidates(tmp_path: Path) -> None:
    from epochal_sqlite import store

    db = tmp_path / "log.sqlite"
    conn = store.connect(db, create=True)
    conn.execute(
        "INSERT INTO runs (run_id, started, status) VALUES ('abc1', 1, 'finished'), ('abc2', 2, 'finished')"
    )
    conn.close()
    one_line_error(epochal(tmp_path, "log", "show", "abc", "--db", str(db)), "ambiguous", "abc1", "abc2")
    done = epochal(tmp_path, "log", "show", "abc2", "--db", str(db))
    assert done.returncode == 0 and "no records" in done.stdout


def write_mixed_log(db: Path) -> None:
    """Two runs into *db*: A (3 epochs of 3 batches, flushing every 2 rows) saves its state after
    epoch 1; B resumes from it, so A's rows past iteration 3 are superseded. Records of every
    kind: floats, ints, ints beyond 2**53, booleans, text, lists, NaN and -inf."""
    import math
    from typing import Any

    from epochal_sqlite import SQLiteLog

    from epochal import Loop, hookimpl
    from epochal.testing import ResumeFrom

    class Model:
        def __init__(self) -> None:
            self.t = 0

        def train_step(self, batch: Any) -> dict[str, float]:
            self.t += 1
            return {"loss": 1.0 / self.t}

        def eval_step(self, batch: Any) -> dict[str, float]:
            return {"loss": 0.5}

        def state_dict(self) -> dict[str, Any]:
            return {"t": self.t}

        def load_state_dict(self, state: Any) -> None:
            self.t = int(state["t"])

    class Extra:
        @hookimpl
        def after_batch(self, loop: Loop) -> None:
            row = loop.log.current_row
            row["note"] = f"step {loop.iteration}"
            row["train.loss"] = 1.0 / loop.iteration
            row["int"] = loop.iteration * 10
            row["big"] = 2**60 + loop.iteration
            row["flag"] = loop.iteration % 2 == 0
            row["vec"] = [loop.iteration, 0.5]
            if loop.iteration % 3 == 0:
                row["nan"] = math.nan
                row["inf"] = -math.inf

    saved: dict[str, Any] = {}

    class Save:
        @hookimpl
        def after_epoch(self, loop: Loop) -> None:
            if loop.epoch == 1:
                saved["state"] = loop.state_dict()

    data = {"train": [[1], [2], [3]], "valid": [[1]]}
    plugins: dict[str, Any] = {
        "extra": Extra(),
        "save": Save(),
        "sqlite_log": SQLiteLog(path=str(db), flush_every=2),
    }
    Loop(Model(), data, plugins=plugins, max_epochs=3, handle_signals=False).run()
    plugins = {"resume": ResumeFrom(saved["state"]), "extra": Extra(), "sqlite_log": SQLiteLog(path=str(db))}
    Loop(Model(), data, plugins=plugins, max_epochs=4, handle_signals=False).run()


def test_show_one_key_as_csv_is_the_same_as_through_the_general_path(tmp_path: Path) -> None:
    """``log show --keys KEY --csv`` (one key: read as one series, lines formatted directly)
    prints exactly what the general path (a glob pattern: a timeline of dict rows) prints,
    for a resumed run's chain, without it, and for a key holding text and NaN."""
    db = tmp_path / "mixed.sqlite"
    write_mixed_log(db)  # a run and a resumed run
    done = epochal(tmp_path, "log", "runs", "--db", str(db), "--csv")
    resumed = list(csv.DictReader(io.StringIO(done.stdout)))[-1]["run_id"]
    for key in ("train.loss", "valid.loss", "note", "nan", "big"):
        pattern = f"{key[:-1]}[{key[-1]}]"  # the same key through a glob
        for chain in ("--chain", "--no-chain"):
            fast = epochal(tmp_path, "log", "show", resumed, "--db", str(db), "--keys", key, "--csv", chain)
            slow = epochal(
                tmp_path, "log", "show", resumed, "--db", str(db), "--keys", pattern, "--csv", chain
            )
            assert fast.returncode == slow.returncode == 0, fast.stderr + slow.stderr
            assert fast.stdout == slow.stdout
            lines = fast.stdout.splitlines()
            assert lines[0] == f"iteration,run_id,{key}"
            if key == "train.loss" and chain == "--chain":
                assert len(lines) == 1 + 12  # 3 iterations of the first run, 9 of the resumed one


@pytest.mark.parametrize(("sets", "plotted"), [((), True), (("loop.max_epochs=0",), False)])
def test_the_summarys_plot_command_works_and_is_left_out_when_nothing_was_logged(tmp_path, sets, plotted):
    (tmp_path / "digits.toml").write_text(CONFIG)
    args = ["run", "digits.toml", "--plugins", "sqlite_log", "--set", "plugins.autoload=false"]
    done = epochal(tmp_path, *args, *(a for s in sets for a in ("--set", s)))
    assert done.returncode == 0, done.stderr
    assert "epochal: log: " in done.stdout
    lines = [line for line in done.stdout.splitlines() if line.startswith("epochal: plot: ")]
    assert bool(lines) is plotted, done.stdout
    if plotted:  # the command as printed runs
        import shlex

        command = shlex.split(lines[0].removeprefix("epochal: plot: "))
        assert command[:3] == ["epochal", "log", "plot"] and "-o" in command
        drawn = epochal(tmp_path, *command[1:])
        assert drawn.returncode == 0, drawn.stderr
        assert (tmp_path / command[command.index("-o") + 1]).stat().st_size > 0


def test_a_branch_from_an_older_checkpoint_leaves_the_runs_own_history_whole(tmp_path):
    """``--resume PATH`` starts a run of its own from run A's epoch-1 checkpoint: A's epoch 2
    really happened (A's last checkpoint holds it), so A's rows past epoch 1 stay A's; a resume
    in A's own directory would supersede them."""
    (tmp_path / "digits.toml").write_text(CONFIG)
    both = {"EPOCHAL_PLUGINS": "sqlite_log,checkpoint"}
    args = ["run", "digits.toml", "--set", "plugins.autoload=false"]
    first = epochal(tmp_path, *args, extra_env=both)
    assert first.returncode == 0, first.stderr
    run_a = first.stdout.split()[2]
    (older,) = (tmp_path / "runs" / "digits" / "version_0" / "checkpoints").glob("ckpt-e0001-*")
    branch = epochal(tmp_path, *args, "--resume", str(older), "--set", "loop.max_epochs=3", extra_env=both)
    assert branch.returncode == 0, branch.stderr
    shown = epochal(tmp_path, "log", "show", run_a, "--no-chain", "--json", "--keys", "epochs_done")
    assert shown.returncode == 0, shown.stderr
    rows = json.loads(shown.stdout)["rows"]
    assert [row["values"]["epochs_done"] for row in rows if "epochs_done" in row["values"]] == [1, 2]
