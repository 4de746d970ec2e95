"""``epochal check-resume``: does a run interrupted at batch N and resumed match a straight run?

Three runs of the same configuration, each in its own temporary run directory: a straight run;
a run stopped right after batch N the way SIGTERM from a scheduler stops it (the loop takes the
path its signal handler starts, without a signal being sent or announced: the batch finishes,
``on_interrupt`` and ``after_training`` run and the checkpoint plugin saves); and a run started
with ``--resume`` from what that run saved. The final model state,
the training-log rows, the counters, the RNG states and every plugin's state of the straight and
the resumed run must be bitwise equal; the first difference is reported with its key path.

Plugins whose class says ``deterministic = False`` (wall-clock timings, say) cannot match and are
left out of all three runs; they are named in the report.
"""

from __future__ import annotations

import copy
import math
import signal
import struct
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epochal._markers import hookimpl
from epochal.errors import ConfigError
from epochal.loop import Loop
from epochal.runner import build_loop


@dataclass
class ResumeReport:
    """The outcome of a resume check."""

    at: int
    iterations: int
    difference: str | None
    left_out: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the resumed run matched the straight run bitwise."""
        return self.difference is None


class _InterruptAt:
    """Stops the run right after training batch *at* as the loop's SIGTERM handler would."""

    def __init__(self, at: int) -> None:
        self.at = at

    @hookimpl
    def after_batch(self, loop: Loop) -> None:
        if loop.iteration == self.at:
            # What Loop._on_signal does for SIGTERM, minus its "SIGTERM received" notice: the
            # user sent no signal, and check-resume says what it is doing in its own words.
            loop._signum = signal.SIGTERM
            loop.request_stop(f"check-resume: stopped after batch {self.at} as SIGTERM would")


def _config_in(config: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    """A copy of *config* whose run directory, and every plugin `dir`/`path` option, is in *run_dir*."""
    copied: dict[str, Any] = copy.deepcopy(dict(config))
    copied.setdefault("loop", {})["run_dir"] = str(run_dir)
    for name, options in copied.get("plugins", {}).items():
        if isinstance(options, dict):
            for key in ("dir", "path"):
                if key in options:
                    options[key] = str(run_dir / name.replace("/", "_") / Path(str(options[key])).name)
    return copied


def _nondeterministic(loop: Loop) -> list[str]:
    return [name for name, plugin in loop.plugins.items() if getattr(plugin, "deterministic", True) is False]


def _comparable(loop: Loop) -> dict[str, Any]:
    state = loop.state_dict()
    return {
        "epoch": state["epoch"],
        "iteration": state["iteration"],
        "model": state["model"],
        "log rows": state["log"]["rows"],
        "rng": state["rng"],
        "data": state["data"],
        "plugins": {name: entry["state"] for name, entry in state["plugins"].items()},
    }


def check_resume(
    config: Mapping[str, Any],
    at: int | None = None,
    order: list[str] | None = None,
    disable: list[str] | None = None,
    say: Callable[[str], None] | None = None,
) -> ResumeReport:
    """Run *config* straight, interrupted at batch *at* and resumed; compare bitwise.

    *say* is told, in a line each, which of the three runs starts.
    """
    disable = list(disable or [])
    say = say or (lambda line: None)
    with tempfile.TemporaryDirectory(prefix="epochal-check-resume-") as tmp:
        probe = build_loop(_config_in(config, Path(tmp) / "probe"), order, disable)
        left_out = _nondeterministic(probe)
        if not probe.plugin_set.implements("resume_state"):
            raise ConfigError(
                "check-resume needs a plugin that saves and restores checkpoints (resume_state), "
                "and none is loaded (from a clone of epochal: pip install plugins/epochal-checkpoint)"
            )
        disable += left_out
        straight = build_loop(_config_in(config, Path(tmp) / "straight"), order, disable)
        say("check-resume: 1/3 straight run (in a temporary directory)")
        straight.run()
        total = straight.iteration
        at = total // 2 if at is None else at
        if not 0 < at < total:
            raise ConfigError(
                f"--at must be between 1 and {total - 1} (the straight run has {total} batches)"
            )
        stopped = build_loop(_config_in(config, Path(tmp) / "resumed"), order, disable)
        stopped.plugin_set.pm.register(_InterruptAt(at), name="epochal.check-resume")
        stopped.hooks.rebuild()
        say(
            f"check-resume: 2/3 the same run, stopped after batch {at} as SIGTERM stops it "
            "(no signal is sent)"
        )
        stopped.run()
        if stopped.iteration != at or stopped.log.status["status"] != "interrupted":
            raise ConfigError(
                f"the interrupted run did not stop at batch {at} (it stopped at {stopped.iteration}: "
                f"{stopped.log.status['finish_reason']}); is another plugin stopping it earlier?"
            )
        resumed = build_loop(_config_in(config, Path(tmp) / "resumed"), order, disable, resume=True)
        say(f"check-resume: 3/3 resuming it from its checkpoint at batch {at}, to the end")
        resumed.run()
        difference = first_difference(_comparable(straight), _comparable(resumed))
    return ResumeReport(at=at, iterations=total, difference=difference, left_out=left_out)


def first_difference(expected: Any, found: Any, path: str = "") -> str | None:
    """The key path and values of the first place where *found* is not bitwise *expected*."""
    for where, a, b in _walk(expected, found, path):
        return f"{where or '(top)'}: straight run has {_show(a)}, resumed run has {_show(b)}"
    return None


def _walk(a: Any, b: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                yield f"{path}.{key}".lstrip("."), a.get(key, "<missing>"), b.get(key, "<missing>")
                return
            yield from _walk(a[key], b[key], f"{path}.{key}".lstrip("."))
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            yield path, f"{len(a)} items", f"{len(b)} items"
            return
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _walk(x, y, f"{path}[{i}]")
        return
    if hasattr(a, "dtype") or hasattr(b, "dtype"):
        import numpy as np

        x, y = np.asarray(a), np.asarray(b)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            yield path, x, y
        return
    if isinstance(a, float) and isinstance(b, float):
        if struct.pack("<d", a) != struct.pack("<d", b) and not (math.isnan(a) and math.isnan(b)):
            yield path, a, b
        return
    if type(a) is not type(b) or a != b:
        yield path, a, b


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
