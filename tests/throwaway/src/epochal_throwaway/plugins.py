"""Plugins that append every hook call to the JSON-lines file named by $EPOCHAL_TW_OUT."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from epochal import CompositePlugin, hookimpl


def _write(event: dict[str, Any]) -> None:
    path = os.environ.get("EPOCHAL_TW_OUT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(event) + "\n")


class Recorder:
    """Records hooks; raises in `fail_in`; sleeps `sleep` seconds per batch."""

    def __init__(self, fail_in: str = "", fail_on_error: bool = False, sleep: float = 0.0) -> None:
        self.fail_in = fail_in
        self.fail_on_error = fail_on_error
        self.sleep = sleep
        self.count = 0

    def _record(self, loop: Any, hook: str, **extra: Any) -> None:
        name = next(n for n, p in loop.plugins.items() if p is self)
        _write({"plugin": name, "hook": hook, "epoch": loop.epoch, "iteration": loop.iteration, **extra})
        if hook == self.fail_in:
            raise RuntimeError(f"{name} fails in {hook} as asked")

    @hookimpl
    def before_training(self, loop: Any) -> None:
        self._record(loop, "before_training")

    @hookimpl
    def before_epoch(self, loop: Any) -> None:
        self._record(loop, "before_epoch")

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        self.count += 1
        self._record(loop, "after_batch")
        if self.sleep:
            time.sleep(self.sleep)

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        self._record(loop, "after_epoch")

    @hookimpl
    def on_interrupt(self, loop: Any, signum: int) -> None:
        self._record(loop, "on_interrupt", signum=signum)

    @hookimpl
    def after_training(self, loop: Any) -> None:
        self._record(loop, "after_training", status=loop.log.status["status"])

    @hookimpl
    def on_error(self, loop: Any, error: BaseException) -> None:
        self._record(loop, "on_error", error=str(error), error_plugin=loop.error_plugin)
        if self.fail_on_error:
            raise RuntimeError("on_error fails as asked")

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


class First(Recorder):
    """A recorder that declares it must run before tw_alpha."""

    run_before = ("tw_alpha",)


class CycleA(Recorder):
    run_before = ("tw_cycle_b",)


class CycleB(Recorder):
    run_before = ("tw_cycle_a",)


class Needy(Recorder):
    """Needs tw_alpha in the same run."""

    requires = ("tw_alpha",)


class Rival(Recorder):
    """Cannot run together with tw_beta."""

    conflicts = ("tw_beta",)


class Shy(Recorder):
    """Loaded only when named: never autoloaded."""

    autoload = False


class Forgetful(Recorder):
    """Saves its state but does not restore it: a resumed run drifts from a straight one."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Bundle(CompositePlugin):
    """Two recorders ordered and configured as one unit."""

    def __init__(self, sleep: float = 0.0) -> None:
        super().__init__({"one": Recorder(sleep=sleep), "two": Recorder()})
