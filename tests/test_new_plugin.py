"""`epochal new-plugin`: the scaffold installs, passes its own tests and is listed at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run(args, cwd, env=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    full_env.update(env or {})
    return subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=300)


def test_scaffold_installs_tests_and_lists(tmp_path):
    made = run([sys.executable, "-m", "epochal", "new-plugin", "batch_count", "--dir", "out"], tmp_path)
    assert made.returncode == 0, made.stderr
    root = tmp_path / "out" / "epochal-batch-count"
    assert (root / "src" / "epochal_batch_count" / "plugin.py").exists()
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    installed = run([*pip, "--disable-pip-version-check", "--target", str(site), str(root)], tmp_path)
    assert installed.returncode == 0, installed.stderr
    env = {"PYTHONPATH": str(site)}
    tests = run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "tests")], tmp_path, env
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "4 passed" in tests.stdout
    listing = run([sys.executable, "-m", "epochal", "plugins", "--json"], tmp_path, env)
    plugins = {p["name"]: p for p in json.loads(listing.stdout)}
    assert plugins["batch_count"]["distribution"] == "epochal-batch-count"
    assert plugins["batch_count"]["hooks"] == ["after_batch", "after_epoch", "before_epoch"]


def test_scaffold_refuses_bad_names_and_existing_folders(tmp_path):
    bad = run([sys.executable, "-m", "epochal", "new-plugin", "Bad-Name"], tmp_path)
    assert bad.returncode == 2 and "'Bad-Name'" in bad.stderr and "Traceback" not in bad.stderr
    assert run([sys.executable, "-m", "epochal", "new-plugin", "twice"], tmp_path).returncode == 0
    again = run([sys.executable, "-m", "epochal", "new-plugin", "twice"], tmp_path)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_scaffold_refuses_a_name_that_would_replace_an_installed_plugin(tmp_path):
    # found by an outside plugin author: new-plugin checkpoint wrote epochal-checkpoint, whose
    # install would replace the standard distribution
    for name, taken in (
        (
            "checkpoint",
            "the distribution 'epochal-checkpoint' is installed already, and the new package would",
        ),
        (
            "early_stopping",
            "the plugin 'early_stopping' (from epochal-earlystop) is installed already: the two",
        ),
    ):
        made = run([sys.executable, "-m", "epochal", "new-plugin", name], tmp_path)
        assert made.returncode == 2 and taken in made.stderr, made.stderr
        assert not (tmp_path / f"epochal-{name.replace('_', '-')}").exists()


def test_the_scaffolds_plugin_records_with_the_measurements(tmp_path):
    assert (
        run([sys.executable, "-m", "epochal", "new-plugin", "guard", "--dir", "out"], tmp_path).returncode
        == 0
    )
    source = (tmp_path / "out" / "epochal-guard" / "src" / "epochal_guard" / "plugin.py").read_text()
    assert '\n    phase = "measure"\n' in source  # before checkpoint: a save holds the epoch's record


@pytest.mark.slow
def test_the_writing_plugins_guide_runs_as_written(tmp_path):
    """docs/writing-plugins.md §0 → §4: the scaffold, §1's guard as its plugin.py, §3's tests as
    its test file, installed, listed (loaded only when named: the autoload rule) and run with
    §4's command line."""
    import re
    import shlex
    from pathlib import Path

    guide = (Path(__file__).resolve().parent.parent / "docs" / "writing-plugins.md").read_text()
    blocks = re.findall(r"```python\n(.*?)\n```", guide, re.S)
    plugin = next(b for b in blocks if b.startswith("# src/epochal_loss_guard/plugin.py"))
    tests = next(b for b in blocks if b.startswith("# tests/test_loss_guard.py"))
    try_it = next(line for line in guide.splitlines() if line.startswith("epochal run example.toml"))

    made = run([sys.executable, "-m", "epochal", "new-plugin", "loss_guard"], tmp_path)
    assert made.returncode == 0, made.stderr
    root = tmp_path / "epochal-loss-guard"
    (root / "src" / "epochal_loss_guard" / "plugin.py").write_text(plugin + "\n")
    (root / "tests" / "test_loss_guard.py").write_text(tests + "\n")
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    installed = run([*pip, "--disable-pip-version-check", "--target", str(site), str(root)], tmp_path)
    assert installed.returncode == 0, installed.stderr
    env = {"PYTHONPATH": str(site)}
    tested = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], root, env)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "3 passed" in tested.stdout
    listing = run([sys.executable, "-m", "epochal", "plugins", "--json"], root, env)
    guard = next(p for p in json.loads(listing.stdout) if p["name"] == "loss_guard")
    assert (guard["distribution"], guard["autoload"], guard["status"]) == (
        "epochal-loss-guard",
        False,
        "available",
    )
    command = shlex.split(try_it.partition("#")[0])
    ran = run([sys.executable, "-m", *command], root, env)
    assert ran.returncode == 0, ran.stderr
    assert "finished after" in ran.stdout and "Traceback" not in ran.stderr
