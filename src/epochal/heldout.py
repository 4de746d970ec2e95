"""Held-out streams, evaluated once when training ends (``[loop] test_streams``).

Lightning's ``trainer.test(ckpt_path="best")`` after ``fit`` and Ignite's ``Checkpoint`` with a
``COMPLETED`` handler, as a configuration choice. The streams named are not evaluated during
training. When training ends by a limit or a plugin's stop (not by a signal or an error), each
is evaluated and logged as ``STREAM.KEY`` in the last row, before the ``after_training`` hooks,
so the final checkpoint and the training log hold the results. With ``test_weights = "best"``
the model first loads the best saved state, which a plugin gives through the
``best_model_state`` hook (the core reads no checkpoint), and gets its last weights back after.
A run interrupted before it resumes and evaluates them then; resuming a run that ended
evaluates them again, with the same result.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from epochal._dispatch import each_implementation
from epochal.errors import ConfigError, PluginError, did_you_mean


def check_streams(streams: Sequence[str], data: Mapping[str, Any], where: str) -> list[str]:
    """The ``test_streams`` as a list, each a stream of *data* other than ``train``.

    :raises ConfigError: naming *where* and the stream.
    """
    held = list(streams)
    others = [name for name in data if name != "train"]
    for stream in held:
        if stream == "train" or stream not in data:
            raise ConfigError(
                f"{where}: test_streams names {stream!r}, which is not an evaluation stream"
                f"{did_you_mean(stream, others)}; streams: {', '.join(others) or 'none'}"
            )
        if held.count(stream) > 1:
            raise ConfigError(f"{where}: test_streams names {stream!r} twice (it would be evaluated twice)")
    return held


def ask_best(loop: Any, read: bool) -> Any:
    """What the plugins answer to ``best_model_state`` (None: none answered).

    :raises PluginError: when more than one plugin answers.
    """
    answers = {
        name: answer
        for name, call in each_implementation(loop.plugin_set.pm, "best_model_state", loop=loop, read=read)
        if (answer := call()) is not None
    }
    if len(answers) > 1:
        raise PluginError(f"plugins {', '.join(map(repr, answers))} each give a best model state; keep one")
    return next(iter(answers.values()), None)


def check_best(loop: Any, where: str) -> str | None:
    """With ``test_weights = "best"``, which state a plugin will give (before the first batch).

    :raises ConfigError: naming *where* when no plugin tracks a best.
    """
    if not loop.test_streams or loop.test_weights != "best":
        return None
    described = ask_best(loop, read=False)
    if described is None:
        saver = loop.plugin_set.provider("checkpoint")  # the standard one, or its replacement
        if saver is None:
            how = 'add a checkpoint plugin that tracks one ([plugins.checkpoint] monitor = "valid.loss")'
        elif "monitor" in loop.plugin_set.records[saver].options:
            how = f'set a monitored record for checkpoints ([plugins.{saver}] monitor = "valid.loss")'
        else:
            how = f"plugin {saver!r} saves this run's checkpoints and tracks none: make it track one"
        raise ConfigError(
            f'{where}: test_weights = "best" needs a plugin that tracks the best saved state, and '
            f'none does: {how}, or use test_weights = "last"'
        )
    return str(described)


def evaluate_after_training(loop: Any) -> bool:
    """Evaluate ``loop.test_streams`` unless a signal came (see the module's docs); return
    False when a signal left them for a resumed run."""
    if not loop.test_streams:
        return True
    if loop.stopping.signal_received is not None:
        return False
    last = None
    if loop.test_weights == "best":
        answer = ask_best(loop, read=True)
        if answer is None:
            warnings.warn(
                f'test_weights = "best": no best state was saved ({loop.best_source}); the test '
                f"streams {', '.join(loop.test_streams)} are not evaluated",
                RuntimeWarning,
                stacklevel=2,
            )
            return True
        state, source = answer
        last = copy.deepcopy(loop.model.state_dict())
        loop.model.load_state_dict(state)
        loop.log.status["test_weights"] = f"best: {source}"
    else:
        loop.log.status["test_weights"] = "last"
    try:
        for stream in loop.test_streams:
            loop.evaluate(stream)
    finally:
        if last is not None:
            loop.model.load_state_dict(last)
    return True
