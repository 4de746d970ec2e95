"""A plugin that ends its process as ``kill -9`` does after batch ``$PORTS_KILL_AT`` (unset: never)."""

from __future__ import annotations

import os
import signal
from typing import Any

from epochal import hookimpl


class KillAt:
    @hookimpl
    def after_batch(self, loop: Any) -> None:
        at = os.environ.get("PORTS_KILL_AT")
        if at is not None and loop.iteration == int(at):
            os.kill(os.getpid(), signal.SIGKILL)
