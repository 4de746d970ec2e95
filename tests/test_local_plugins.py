"""Plugins and factories from the user's own code, and the shared trigger keys, through the CLI."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from epochal.testing import epochal_command

# A user's project: run.toml beside mymodel.py and myplugins.py, run from another directory.
MODULE = '''
import json
from epochal import hookimpl
from epochal.examples.tiny import TinyModel, tiny_data


def make_model(seed=0):
    return TinyModel(seed=seed)


def make_data(examples=32, batch_size=8):
    return tiny_data(examples=examples, batch_size=batch_size)


class Recorder:
    """Appends one JSON line per hook call to a file."""

    def __init__(self, path: str, tag: str = "rec"):
        self.path, self.tag, self.calls = path, tag, 0

    def _write(self, hook, loop):
        with open(self.path, "a") as f:
            f.write(json.dumps({"tag": self.tag, "hook": hook, "epoch": loop.epoch,
                                "iteration": loop.iteration}) + "\\n")

    @hookimpl
    def before_training(self, loop):
        self._write("before_training", loop)

    @hookimpl
    def on_resumption(self, loop):
        self._write("on_resumption", loop)

    @hookimpl
    def before_batch(self, loop):
        self._write("before_batch", loop)

    @hookimpl
    def after_batch(self, loop):
        self.calls += 1
        self._write("after_batch", loop)

    @hookimpl
    def after_epoch(self, loop):
        self._write("after_epoch", loop)

    @hookimpl
    def after_training(self, loop):
        self._write("after_training", loop)

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def late(loop):
    return loop.epoch >= 2


class Flag:
    """Writes the true/false record `flag = True` into the rows of the given epochs only."""

    def __init__(self, epochs=()):
        self.epochs = set(epochs)

    @hookimpl
    def after_epoch(self, loop):
        if loop.epoch in self.epochs:
            loop.log.current_row["flag"] = True
'''

CONFIG = """
[loop]
max_epochs = 3
seed = 0

[model]
factory = "mymodel:make_model"

[data]
factory = "mymodel:make_data"

[plugins]
order = ["mine"]
autoload = false

[plugins.mine]
factory = "mymodel:Recorder"
path = "{events}"
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A directory with the user's module and a config beside it (not the current directory)."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "mymodel.py").write_text(textwrap.dedent(MODULE))
    return root


def write(project: Path, extra: str = "", **replace: str) -> Path:
    text = CONFIG.format(events=(project / "events.jsonl").as_posix()) + textwrap.dedent(extra)
    for old, new in replace.items():
        text = text.replace(old, new)
    path = project / "run.toml"
    path.write_text(text)
    return path


def events(project: Path) -> list[dict]:
    path = project / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def hooks(project: Path, hook: str) -> list[dict]:
    return [e for e in events(project) if e["hook"] == hook]


def run(cwd: Path, *args: str):
    return epochal_command(*args, cwd=cwd)


def test_factories_import_beside_the_config_without_pythonpath(project, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = write(project)
    result = run(elsewhere, "run", str(config))
    assert result.returncode == 0, result.stderr
    assert len(hooks(project, "after_batch")) == 12  # 3 epochs of 4 batches
    assert len(hooks(project, "after_training")) == 1


def test_local_plugin_is_listed_checked_and_ordered(project):
    config = write(project)
    listing = run(project, "plugins", "--json", "--config", str(config))
    assert listing.returncode == 0, listing.stderr
    mine = [p for p in json.loads(listing.stdout) if p["name"] == "mine"]
    assert mine and mine[0]["status"] == "loaded" and mine[0]["position"] == 0
    assert mine[0]["entry_point"] == "mymodel:Recorder"
    assert mine[0]["distribution"] == "(local)"
    assert "after_batch" in mine[0]["hooks"]
    checked = run(project, "plugins", "--check", str(config))
    assert checked.returncode == 0, checked.stderr
    assert "mine" in checked.stdout


def test_local_plugin_options_are_checked(project):
    config = write(project, 'pth = "x"\n')
    result = run(project, "run", str(config))
    assert result.returncode == 2
    assert "[plugins.mine]" in result.stderr and "'pth'" in result.stderr and "path" in result.stderr
    assert not events(project)


def test_local_plugin_state_is_saved_in_the_loop_state(project):
    from epochal.config import load_config
    from epochal.runner import build_loop

    config = load_config(write(project))
    loop = build_loop(config)
    loop.run()
    state = loop.state_dict()
    assert state["plugins"]["mine"]["state"] == {"calls": 12}
    assert state["plugins"]["mine"]["class"] == "mymodel.Recorder"


def test_a_factory_that_does_not_import_is_one_clear_error(project):
    config = write(project, replace_me="", **{'"mymodel:Recorder"': '"mymodle:Recorder"'})
    result = run(project, "run", str(config))
    assert result.returncode == 2
    assert "run.toml: [plugins.mine]" in result.stderr and "mymodle" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_local_name_clashing_with_an_installed_plugin_is_refused(project):
    config = write(project, **{"[plugins.mine]": "[plugins.monitor]", '["mine"]': '["monitor"]'})
    result = run(project, "run", str(config))
    assert result.returncode == 2
    assert "run.toml: [plugins.monitor] factory" in result.stderr
    assert "epochal-monitor" in result.stderr and "installed" in result.stderr
    assert not events(project)


HOOK_MODULE = """
import json
import os

from epochal import hookimpl


@hookimpl
def after_epoch(loop):
    with open(os.environ["HOOKS_OUT"], "a") as out:
        out.write(json.dumps({"hook": "after_epoch", "epoch": loop.epoch}) + "\\n")
"""


def test_a_module_of_hook_functions_is_a_local_plugin(project):
    (project / "myhooks.py").write_text(HOOK_MODULE)
    config = write(project, '\n[plugins.hooked]\nfactory = "myhooks"\n', **{'["mine"]': '["mine", "hooked"]'})
    out = project / "module-hooks.jsonl"
    result = epochal_command("run", str(config), cwd=project, env={"HOOKS_OUT": str(out)})
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["epoch"] for line in out.read_text().splitlines()] == [1, 2, 3]
    listing = run(project, "plugins", "--json", "--config", str(config))
    hooked = [p for p in json.loads(listing.stdout) if p["name"] == "hooked"]
    assert hooked and hooked[0]["status"] == "loaded" and hooked[0]["hooks"] == ["after_epoch"]
    assert (hooked[0]["distribution"], hooked[0]["entry_point"]) == ("(local)", "myhooks")


def test_a_module_plugin_takes_no_options(project):
    (project / "myhooks.py").write_text(HOOK_MODULE)
    config = write(project, '\n[plugins.hooked]\nfactory = "myhooks"\nevery = 2\n')
    result = run(project, "run", str(config))
    assert result.returncode == 2
    assert "[plugins.hooked]" in result.stderr
    assert "is a module and takes no options (got every)" in result.stderr
    assert "Traceback" not in result.stderr


# -- triggers --------------------------------------------------------------------------------


def test_every_n_batches_gates_the_batch_hooks(project):
    result = run(project, "run", str(write(project, "every_n_batches = 5\n")))
    assert result.returncode == 0, result.stderr
    assert [e["iteration"] for e in hooks(project, "after_batch")] == [5, 10]
    assert [e["iteration"] for e in hooks(project, "before_batch")] == [4, 9]  # the 5th and 10th
    assert len(hooks(project, "after_epoch")) == 3  # epoch hooks are not gated by batch keys


def test_epoch_triggers_and_switches(project):
    extra = "every_n_epochs = 2\nbefore_first_epoch = false\nafter_training = false\n"
    result = run(project, "run", str(write(project, extra)))
    assert result.returncode == 0, result.stderr
    assert [e["epoch"] for e in hooks(project, "after_epoch")] == [2]
    assert not hooks(project, "before_training") and not hooks(project, "after_training")
    assert len(hooks(project, "after_batch")) == 12


def test_after_n_batches_and_after_n_epochs(project):
    result = run(project, "run", str(write(project, "after_n_batches = 10\nafter_n_epochs = 2\n")))
    assert result.returncode == 0, result.stderr
    assert [e["iteration"] for e in hooks(project, "after_batch")] == [10, 11, 12]
    assert [e["epoch"] for e in hooks(project, "after_epoch")] == [2, 3]


def test_when_condition_on_the_log(project):
    # valid.loss is logged from the first evaluation on (after epoch 1)
    result = run(project, "run", str(write(project, 'when = "epoch >= 2 and valid.loss < 1e9"\n')))
    assert result.returncode == 0, result.stderr
    assert [e["epoch"] for e in hooks(project, "after_epoch")] == [2, 3]
    assert [e["iteration"] for e in hooks(project, "after_batch")] == [9, 10, 11, 12]


def test_a_when_key_never_logged_is_warned_about_once(project):
    # found by an outside-user pass: a misspelt key left the condition false for ever, unsaid
    result = run(project, "run", str(write(project, 'when = "valid.los < 1e9"\n')))
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if "'valid.los' is not in the log" in line]
    assert len(warned) == 1 and "(did you mean 'valid.loss'?)" in warned[0], result.stderr
    assert hooks(project, "after_epoch") == []  # the condition never held
    # a train.* key (no evaluation stream's) is due once an epoch ended
    result = run(project, "run", str(write(project, 'when = "train.los < 1e9"\n')))
    assert result.returncode == 0, result.stderr
    assert len([line for line in result.stderr.splitlines() if "'train.los' is not in the log" in line]) == 1


def test_when_predicate_from_a_module(project):
    result = run(project, "run", str(write(project, 'when = "mymodel:late"\n')))
    assert result.returncode == 0, result.stderr
    assert [e["epoch"] for e in hooks(project, "after_epoch")] == [2, 3]


@pytest.mark.parametrize(
    ("condition", "epochs", "batches"),
    [
        ("flag", [1, 3], []),  # no batch row holds the flag
        ("not flag", [2], [5, 6, 7, 8, 9, 10, 11, 12]),  # false until it is first logged
    ],
)
def test_a_true_false_record_is_read_from_its_own_row_only(project, condition, epochs, batches):
    # `flag` is written into the rows of epochs 1 and 3 only (4 batches an epoch)
    extra = f'when = "{condition}"\n\n[plugins.flag]\nfactory = "mymodel:Flag"\nepochs = [1, 3]\n'
    config = write(project, extra, **{'order = ["mine"]': 'order = ["flag", "mine"]'})
    result = run(project, "run", str(config))
    assert result.returncode == 0, result.stderr
    assert [e["epoch"] for e in hooks(project, "after_epoch")] == epochs
    assert [e["iteration"] for e in hooks(project, "after_batch")] == batches


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("every_n_batchs = 5\n", "unknown option 'every_n_batchs'"),
        ("every_n_batches = -1\n", "[plugins.mine] every_n_batches: must be a non-negative integer"),
        ('when = "valid.loss <"\n', "[plugins.mine] when: condition 'valid.loss <' does not parse"),
        ("when = \"__import__('os').system('x')\"\n", "[plugins.mine] when: condition"),
        ('when = "vaild.loss < 1"\n', "[plugins.mine] when: 'vaild.loss' names no logged key"),
        ('when = "mymodel:nope"\n', "[plugins.mine] when: factory 'mymodel:nope'"),
    ],
)
def test_bad_triggers_are_one_clear_error_before_the_first_batch(project, extra, message):
    result = run(project, "run", str(write(project, extra)))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "run.toml" in result.stderr
    assert "Traceback" not in result.stderr
    assert not hooks(project, "after_batch")


def test_per_stream_evaluation_schedule_and_epoch_size(project):
    extra = """
    [loop.eval_every_n_epochs]
    valid = 2
    """
    config = write(project, **{"seed = 0": "seed = 0\nepoch_size = 3"})
    config.write_text(config.read_text() + textwrap.dedent(extra))
    from epochal.config import load_config
    from epochal.runner import build_loop

    loop = build_loop(load_config(config))
    log = loop.run()
    assert loop.iteration == 9  # 3 epochs of 3 batches, over a stream of 4 batches
    evaluated = [row["epochs_done"] for _, row in log.rows() if "valid.loss" in row]
    assert evaluated == [2]
    bad = write(project, "\n[loop.eval_every_n_epochs]\nvalud = 2\n")
    result = run(project, "run", str(bad))
    assert result.returncode == 2
    assert "[loop] eval_every_n_epochs: no evaluation stream 'valud'" in result.stderr
    assert "did you mean 'valid'" in result.stderr
