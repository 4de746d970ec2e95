"""A pytest plugin for plugin authors: run a small loop with your plugin and see every hook call.

Opt in from a test module or conftest.py::

    pytest_plugins = ["epochal.testing"]

    def test_my_plugin_stops(epochal_run):
        result = epochal_run({"guard": LossGuard(limit=0.0)}, max_epochs=3)
        assert result.log.status["finish_reason"].startswith("loss_guard")
        assert result.count("after_epoch") == 0
        assert result.calls[-1].hook == "after_training"

Fixtures: ``epochal_run`` (below), ``epochal_cli`` (runs ``python -m epochal ARGS`` in
``tmp_path`` with no ``EPOCHAL_*`` variable of the calling environment leaking in; annotate it
:data:`EpochalCli`; :func:`epochal_command` does the same in any directory) and
``no_epochal_env`` (removes those variables from the test process). :func:`digits_config`
writes a run configuration of the digits example for the plugins a test names.
:class:`StubModel` is a model without state whose steps return what you set, :class:`TrainRecords`
a plugin writing the train steps' outputs into the log (``train.<key>``), :func:`check_autoload_rule`
fails for a plugin that changes what is trained yet loads without being named, :class:`SaveAt` a plugin
keeping ``loop.state_dict()`` after a given epoch, and :class:`ResumeFrom` a plugin handing the
loop a saved ``loop.state_dict()`` (what a checkpoint plugin does), to test that your plugin's
state survives a resume::

    first = epochal_run({"mine": Mine()}, max_iterations=5)
    resumed = epochal_run({"mine": Mine(), "resume": ResumeFrom(first.loop.state_dict())})
    assert resumed.loop.resumed and resumed.calls_of("before_batch")[0].iteration == 5

:func:`counting_torch_ops` lists the torch operators run inside a block, to test that a plugin
does no work per batch on the device. :func:`unwrapped` joins what a command's output wrapped to
fit the terminal or a job log's 120 columns, to find a line's text whatever the width.

``epochal_run(plugins, **loop_options)`` takes plugin objects by name (in call order) or the
names of installed plugins (``epochal_run(["monitor"], options={"monitor": {...}})``), runs a
deterministic numpy regression (``epochal.examples.tiny``: :class:`TinyModel` on
:func:`tiny_data`, re-exported here; or your own ``model``
and ``data``) in a temporary run directory, and returns a :class:`RunResult` holding the loop
and every hook call in order (pytester-style).

A test module may import these helpers and opt in too: this module holds no assertions for
pytest to rewrite (PYTEST_DONT_REWRITE), so importing it first raises no warning.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from epochal._dispatch import HOOK_ARGS
from epochal._markers import hookimpl
from epochal.examples.tiny import TinyModel, tiny_data
from epochal.loop import Loop
from epochal.plugins import PluginSet, compose, load_plugins

RECORDER = "epochal.testing.recorder"

EpochalCli = Callable[..., subprocess.CompletedProcess[str]]
"""The type of the ``epochal_cli`` fixture, to annotate a test's argument."""


@dataclass
class HookCall:
    """One call of a hook: its name, the loop's counters then, and its other arguments."""

    hook: str
    epoch: int
    iteration: int
    kwargs: dict[str, Any] = field(default_factory=dict)


class _Recorder:
    """Implements every loop hook and records the call (registered last: it sees each call once)."""

    def __init__(self) -> None:
        self.calls: list[HookCall] = []


def _recording(hook: str) -> Callable[..., None]:
    args = [a for a in HOOK_ARGS[hook] if a != "loop"]

    def record(self: _Recorder, loop: Loop, **kwargs: Any) -> None:
        self.calls.append(HookCall(hook, loop.epoch, loop.iteration, kwargs))

    # pluggy reads the argument names from the signature: give each hook its own.
    params = ", ".join(["self", "loop", *args])
    passed = "".join(f", {a}={a}" for a in args)
    namespace: dict[str, Any] = {"_record": record}
    exec(f"def {hook}({params}):\n    _record(self, loop{passed})\n", namespace)
    return hookimpl(trylast=True)(namespace[hook])


for _hook, _args in HOOK_ARGS.items():
    if "loop" in _args and _hook != "resume_state":  # the loop's hooks (not the CLI's, launcher's)
        setattr(_Recorder, _hook, _recording(_hook))


#: what a :class:`StubModel` step returns: the same outputs every step, or a function of the batch.
Outputs = Mapping[str, Any] | Callable[[Any], Mapping[str, Any]]


class StubModel:
    """A model with no state whose steps return set outputs: for tests of plugins and of the
    loop, where what the model learns does not matter.

    :param train: what ``train_step`` returns (default ``{"loss": 0.0}``): a mapping, copied each
        step, or a function of the batch (``lambda batch: {"loss": float(batch)}``).
    :param evaluation: what ``eval_step`` returns (default ``{"loss": 0.0}``), likewise.

    Subclass it to add what a test needs (``distribute``, ``batch_size``...).
    """

    def __init__(self, train: Outputs | None = None, evaluation: Outputs | None = None) -> None:
        self.train: Outputs = {"loss": 0.0} if train is None else train
        self.evaluation: Outputs = {"loss": 0.0} if evaluation is None else evaluation

    @staticmethod
    def _outputs(outputs: Outputs, batch: Any) -> dict[str, Any]:
        return dict(outputs(batch) if callable(outputs) else outputs)

    def train_step(self, batch: Any) -> dict[str, Any]:
        """The *train* outputs for *batch*."""
        return self._outputs(self.train, batch)

    def eval_step(self, batch: Any) -> dict[str, Any]:
        """The *evaluation* outputs for *batch*."""
        return self._outputs(self.evaluation, batch)

    def state_dict(self) -> dict[str, Any]:
        """Empty: the model has no state."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Nothing to load: the model has no state."""


class TrainRecords:
    """A plugin writing every ``train_step`` output into the log's current row as
    ``train.<key>`` (as ``monitor`` does, without its means): for tests of plugins that read the
    log, without ``monitor``."""

    @hookimpl
    def after_batch(self, loop: Loop, outputs: Mapping[str, Any]) -> None:
        row = loop.log.current_row
        for key, value in outputs.items():
            row[f"train.{key}"] = value


class SaveAt:
    """A plugin keeping a copy of ``loop.state_dict()`` as it is after epoch *epoch* (what a
    checkpoint plugin would save there), in ``state``: resume from it with :class:`ResumeFrom`."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.state: dict[str, Any] | None = None

    @hookimpl
    def after_epoch(self, loop: Loop) -> None:
        if loop.epoch == self.epoch:
            self.state = copy.deepcopy(loop.state_dict())


class ResumeFrom:
    """A plugin handing the loop *state*, a saved ``loop.state_dict()``, to resume from."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state

    @hookimpl
    def resume_state(self) -> Mapping[str, Any]:
        return self.state


@dataclass
class RunResult:
    """What :func:`epochal_run` ran: the loop, its log, every hook call, and the error if any."""

    loop: Loop
    calls: list[HookCall]
    error: BaseException | None = None

    @property
    def log(self) -> Any:
        """The loop's training log."""
        return self.loop.log

    def hooks(self) -> list[str]:
        """The names of the hooks called, in order."""
        return [call.hook for call in self.calls]

    def count(self, hook: str) -> int:
        """How many times *hook* was called."""
        return sum(call.hook == hook for call in self.calls)

    def calls_of(self, hook: str) -> list[HookCall]:
        """Every call of *hook*, in order."""
        return [call for call in self.calls if call.hook == hook]


def run_loop(
    plugins: Mapping[str, object] | Sequence[str],
    *,
    model: Any = None,
    data: Mapping[str, Any] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    run_dir: str | Path | None = None,
    raises: bool = True,
    **loop_options: Any,
) -> RunResult:
    """Run a loop with *plugins* and record every hook call (see the module docstring)."""
    recorder = _Recorder()
    if isinstance(plugins, Mapping):
        plugin_set: PluginSet = compose({**plugins, RECORDER: recorder})
    else:
        plugin_set = load_plugins(
            order=[*plugins, RECORDER], autoload=False, options=options, extra={RECORDER: recorder}
        )
    loop_options.setdefault("max_epochs", 2)
    loop_options.setdefault("handle_signals", False)
    loop = Loop(
        model if model is not None else TinyModel(),
        data if data is not None else tiny_data(),
        plugins=plugin_set,
        run_dir=run_dir,
        **loop_options,
    )
    try:
        loop.run()
    except Exception as error:
        if raises:
            raise
        return RunResult(loop, recorder.calls, error)
    return RunResult(loop, recorder.calls)


def check_autoload_rule(plugin: object, name: str, **loop_options: Any) -> None:
    """Fail (``AssertionError``) when *plugin* breaks the autoload rule.

    A plugin that loads without being named (``autoload`` True, the default) runs in every run
    once installed, so it must not change what is trained: stop the run, change the learning
    rate or any other setting, load weights. Its declarations are checked (a phase ``adjust`` or
    ``decide`` needs ``autoload = False``), then a small deterministic run with *plugin* is
    compared with the same run without it: the model's final state, the batches trained and the
    reason training ended must be the same. A plugin that declares ``autoload = False`` may
    change them. Give *plugin* options that make it act (``LossGuard(limit=0.0)``); *name* is
    its plugin name; *loop_options* go to both runs (``max_epochs=3`` by default).
    """
    import tempfile

    import numpy as np

    from epochal.declarations import autoload_rule, read

    record = read(name, plugin)
    broken = autoload_rule(record)
    if broken is not None:
        raise AssertionError(broken)
    if not record.autoload:
        return
    loop_options.setdefault("max_epochs", 3)
    loop_options.setdefault("seed", 0)
    outcomes = []
    for plugins in ({}, {name: plugin}):
        with tempfile.TemporaryDirectory(prefix="epochal-autoload-rule-") as run_dir:
            loop = run_loop(plugins, run_dir=run_dir, **loop_options).loop
        state = {k: np.asarray(v).tobytes() for k, v in loop.model.state_dict().items()}
        outcomes.append((state, loop.iteration, loop.log.status.get("finish_reason")))
    (state, batches, reason), (state_with, batches_with, reason_with) = outcomes
    changed = [
        what
        for what, same in (
            (f"training ended: {reason_with!r} instead of {reason!r}", reason == reason_with),
            (f"{batches_with} batches trained instead of {batches}", batches == batches_with),
            ("the model's final state differs", state == state_with),
        )
        if not same
    ]
    if changed:
        raise AssertionError(
            f"plugin {name!r} changes what is trained ({'; '.join(changed)}) and autoloads: the autoload "
            "rule says a plugin that decides declares autoload = False (installed, it would run in "
            "every run of every configuration)"
        )


@pytest.fixture
def epochal_run(tmp_path: Path) -> Callable[..., RunResult]:
    """Run a small loop with the given plugins in ``tmp_path``; returns a :class:`RunResult`."""

    def run(plugins: Mapping[str, object] | Sequence[str], **kwargs: Any) -> RunResult:
        kwargs.setdefault("run_dir", tmp_path / "run")
        return run_loop(plugins, **kwargs)

    return run


def epochal_command(
    *args: str, cwd: str | Path, env: Mapping[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m epochal ARGS`` in *cwd*; ``EPOCHAL_*`` variables come only from *env*."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "epochal", *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def epochal_cli(tmp_path: Path) -> EpochalCli:
    """Run the ``epochal`` command in ``tmp_path``: ``epochal_cli("run", "run.toml", env={...})``."""

    def run(
        *args: str, env: Mapping[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return epochal_command(*args, cwd=tmp_path, env=env, timeout=timeout)

    return run


@contextlib.contextmanager
def counting_torch_ops() -> Iterator[list[str]]:
    """Collect the name of every torch operator run inside the block (``"add.Tensor"``,
    ``"stack.default"``...) into the list it yields: ``with counting_torch_ops() as ops: ...``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names: list[str] = []

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Counting():
        yield names


@pytest.fixture
def no_epochal_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every ``EPOCHAL_*`` environment variable for the test."""
    for name in list(os.environ):
        if name.startswith("EPOCHAL_"):
            monkeypatch.delenv(name)


def digits_config(
    path: str | Path,
    plugins: Sequence[str] = (),
    *,
    max_epochs: int = 2,
    run_dir: str | Path | None = None,
    batch_size: int = 64,
    hidden: int | None = None,
    extra: str = "",
) -> Path:
    """Write a run configuration of the digits example to *path* and return it.

    Only the named *plugins* run, in that order (``autoload = false``); *extra* is appended TOML
    (``[plugins.NAME]`` tables, say). The run directory defaults to ``run`` beside the file (a
    relative *run_dir* is relative to where the run starts). *hidden*: the MLP's hidden width
    (None: the example's default).
    """
    path = Path(path)
    run_dir = Path(run_dir) if run_dir is not None else path.parent / "run"
    model = f"hidden = {hidden}\n" if hidden is not None else ""
    path.write_text(
        f"""[loop]
max_epochs = {max_epochs}
seed = 0
run_dir = {json.dumps(str(run_dir))}

[model]
factory = "epochal.examples.digits:make_model"
{model}
[data]
factory = "epochal.examples.digits:make_data"
batch_size = {batch_size}

[plugins]
order = {json.dumps(list(plugins))}
autoload = false
"""
        + extra,
        encoding="utf-8",
    )
    return path


def unwrapped(text: str) -> str:
    """*text* (a command's output) with the lines the summary and notices wrapped joined again:
    a command's shell continuation (`` \\`` ending a line) and the indented rest of a wrapped
    line (four spaces or more) join the line before, with one space, as the line was before it
    was fitted to ``$COLUMNS`` or a job log's width."""
    return re.sub(r" \\\n +|\n {4,}(?=\S)", " ", text)
