"""Hook tracing: for each hook call, the plugins called in order and how long each took.

Switched on with ``EPOCHAL_TRACE_PLUGINS=1`` (to stderr) or ``=PATH`` (JSON lines), or
``epochal run --trace-plugins[=PATH]``. Off by default, and free when off: the loop's hook
callers are compiled without any timing code unless tracing is on.
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any

ENV_TRACE = "EPOCHAL_TRACE_PLUGINS"


def trace_target_from_env() -> str | None:
    """``"-"`` (stderr), a file path, or None, from ``EPOCHAL_TRACE_PLUGINS``."""
    value = os.environ.get(ENV_TRACE, "").strip()
    if value.lower() in ("", "0", "false", "no"):
        return None
    return "-" if value.lower() in ("1", "true", "yes", "-", "stderr") else value


class HookTracer:
    """Writes one line per hook call: text to stderr, or JSON lines to a file."""

    def __init__(self, target: str) -> None:
        self.as_json = target != "-"
        self._out: IO[str] = open(target, "a", encoding="utf-8") if self.as_json else sys.stderr  # noqa: SIM115

    def __call__(self, hook: str, loop: Any, calls: tuple[tuple[str, float], ...]) -> None:
        epoch = getattr(loop, "epoch", None)
        iteration = getattr(loop, "iteration", None)
        if self.as_json:
            record = {
                "hook": hook,
                "epoch": epoch,
                "iteration": iteration,
                "calls": [{"plugin": name, "seconds": seconds} for name, seconds in calls],
            }
            self._out.write(json.dumps(record) + "\n")
        else:
            spans = " -> ".join(f"{name} {seconds * 1e6:.1f}us" for name, seconds in calls)
            self._out.write(f"[epochal trace] {hook} epoch={epoch} iteration={iteration}: {spans}\n")

    def close(self) -> None:
        """Flush, and close the file if the tracer opened one."""
        if self.as_json:
            self._out.close()
        else:
            self._out.flush()
