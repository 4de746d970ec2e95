"""What ``epochal run`` and its launcher ask the plugins about a run as a whole.

The CLI knows no plugin's files: before a fresh run it asks ``check_fresh_run`` whether one of
them refuses (an earlier run's checkpoints in the directory), and after a worker died the
launcher asks ``latest_checkpoint`` which checkpoint to resume from. Each implementation is
called on its own, so that an answer can name the plugin that gave it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pluggy

from epochal._dispatch import each_implementation
from epochal.errors import ConfigError, PluginError


def _run_dir(run_dir: str | Path | None) -> Path | None:
    return Path(run_dir).expanduser() if run_dir is not None else None


def refuse_fresh_run(pm: pluggy.PluginManager, run_dir: str | Path | None, command: Sequence[str]) -> None:
    """Ask every plugin whether a fresh run may start in *run_dir*.

    :raises ConfigError: with the first refusal's message (a plugin that keeps a run's files
        found an earlier run's there).
    """
    for name, call in each_implementation(
        pm, "check_fresh_run", run_dir=_run_dir(run_dir), command=list(command)
    ):
        message = call()
        if message is not None:
            if not isinstance(message, str):
                raise PluginError(f"plugin {name!r}: check_fresh_run must return a string or None")
            raise ConfigError(message)


def latest_checkpoint(pm: pluggy.PluginManager, run_dir: str | Path | None) -> str | None:
    """The newest complete checkpoint of the run in *run_dir*, as the plugins say (None: none).

    :raises PluginError: when two plugins name different checkpoints.
    """
    answers: dict[str, Any] = {}
    for name, call in each_implementation(pm, "latest_checkpoint", run_dir=_run_dir(run_dir)):
        answer = call()
        if answer is not None:
            answers[name] = str(answer)
    found = sorted(set(answers.values()))
    if len(found) > 1:
        named = "; ".join(f"plugin {name!r} says {path}" for name, path in answers.items())
        raise PluginError(f"the plugins disagree on the latest checkpoint: {named}")
    return found[0] if found else None
