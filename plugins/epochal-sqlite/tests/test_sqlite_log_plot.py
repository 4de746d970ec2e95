"""``epochal log plot``: runs overlaid with their resume chains, streams together, smoothing, HTML."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from epochal_sqlite import Reader
from epochal_sqlite.plot import read_series, smooth

from epochal.testing import digits_config, epochal_command

pytest.importorskip("matplotlib")

ENV = {"EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}


def epochal(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``epochal ARGS``; ``epochal log`` with sqlite_log loaded, whatever else is installed."""
    extra = {"EPOCHAL_PLUGINS": "sqlite_log"} if args[0] == "log" else {}
    return epochal_command(*args, cwd=cwd, env={**ENV, **extra})


def run(cwd: Path, *args: str) -> str:
    db = f"plugins.sqlite_log.path={cwd / 'run' / 'epochal.sqlite'}"  # every run in one database
    done = epochal(cwd, "run", "digits.toml", "--set", db, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[2]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str, str]:
    """Run A (2 epochs), run B resuming A to 3 epochs, run C with another learning rate."""
    cwd = tmp_path_factory.mktemp("plots")
    digits_config(cwd / "digits.toml", ["monitor", "checkpoint", "sqlite_log"], max_epochs=2, batch_size=128)
    first = run(cwd)
    resumed = run(cwd, "--resume", "--set", "loop.max_epochs=3")
    other = run(cwd, "--set", "model.lr=0.05", "--set", f"loop.run_dir={cwd / 'other'}",
                "--set", f"plugins.sqlite_log.path={cwd / 'run' / 'epochal.sqlite'}")  # fmt: skip
    return cwd, first, resumed, other


def test_smoothing_is_tensorboards_debiased_moving_average() -> None:
    assert smooth([1.0, 0.0, 0.0], 0.0) == [1.0, 0.0, 0.0]
    assert smooth([1.0, 0.0, 0.0], 0.5) == pytest.approx([1.0, 1 / 3, 1 / 7])
    assert smooth([2.0] * 5, 0.9) == pytest.approx([2.0] * 5)


def test_a_resume_chain_is_one_series(project: tuple[Path, str, str, str]) -> None:
    cwd, _, resumed, _ = project
    with Reader(cwd / "run" / "epochal.sqlite") as reader:
        chain = read_series(reader, [reader.resolve(resumed)], ["valid.loss"], chain=True)
        alone = read_series(reader, [reader.resolve(resumed)], ["valid.loss"], chain=False)
        start = reader.resolve(resumed).start_iteration
    (series,) = chain
    assert len(series.xs) == 3 and series.xs == sorted(series.xs) and series.resumes == [start]
    assert alone[0].xs == [x for x in series.xs if x > start]  # the restored row belongs to A


def test_two_runs_overlaid_train_and_valid_in_one_panel_svg(project: tuple[Path, str, str, str]) -> None:
    cwd, _, resumed, other = project
    out = cwd / "overlay.svg"
    db = str(cwd / "run" / "epochal.sqlite")
    done = epochal(cwd, "log", "plot", resumed, other, "--key", "*.loss", "--key", "*.accuracy",
                   "--smooth", "0.6", "-o", str(out), "--db", db)  # fmt: skip
    assert done.returncode == 0, done.stderr
    svg = out.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    texts = set(re.findall(r">([^<>]+)</text>", svg))
    for run_id in (resumed, other):
        for key in ("train.loss", "valid.loss", "train.accuracy", "valid.accuracy"):
            assert f"{run_id[:8]} {key}" in texts, (run_id, key)
    assert {"iteration", "loss", "accuracy", "loss (smoothing 0.6)"} <= texts


def test_html_report_is_one_self_contained_file(project: tuple[Path, str, str, str]) -> None:
    cwd, _, resumed, _ = project
    out = cwd / "report.html"
    done = epochal(cwd, "log", "plot", resumed, "-o", str(out), "--db", str(cwd / "run" / "epochal.sqlite"))
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert not re.search(r"(src|href)=\"(http|//|[^\"#]+\.(js|css|png))", page)
    assert resumed in page and "&quot;max_epochs&quot;: 3" in page


def test_a_missing_key_is_one_clear_error(project: tuple[Path, str, str, str]) -> None:
    cwd, first, _, _ = project
    done = epochal(cwd, "log", "plot", first, "--key", "nope", "-o", str(cwd / "x.png"),
                   "--db", str(cwd / "run" / "epochal.sqlite"))  # fmt: skip
    assert done.returncode == 2 and "has no key 'nope'" in done.stderr
