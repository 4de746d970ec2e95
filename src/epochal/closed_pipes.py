"""A run goes on when the reader of its output goes away (``epochal run ... | head``, a dead ``tee``).

The listing commands (``epochal plugins | head``) end quietly on a closed pipe, as ``ls`` does:
``SIGPIPE`` keeps its default action there. A command that trains must not: a closed pipe
would kill it between two batches, with no interrupt checkpoint and its log marked "killed".
:func:`keep_running_on_closed_pipes` ignores ``SIGPIPE`` and guards ``sys.stdout`` and
``sys.stderr``: the first write that finds its pipe closed points that descriptor at the null
device, and everything written there afterwards (by any library, through any handle on it) is
dropped while training goes on.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, TextIO

__all__ = ["keep_running_on_closed_pipes"]


class _Guarded:
    """*stream* whose writes and flushes survive its pipe being closed (see the module)."""

    def __init__(self, stream: TextIO, name: str) -> None:
        self._stream = stream
        self._name = name

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        """Point the stream's descriptor at the null device; say so on the other stream."""
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)
        other = sys.stderr if self._name == "stdout" else None
        if other is not None:
            try:
                other.write(f"epochal: {self._name} was closed by its reader; the run goes on without it\n")
                other.flush()
            except (OSError, ValueError):
                pass

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno, buffer, ...
        return getattr(self._stream, name)


def keep_running_on_closed_pipes() -> None:
    """Let this process outlive the readers of its standard output and error (see the module).

    Call it once, before anything keeps a reference to ``sys.stdout`` or ``sys.stderr``.
    Streams without a descriptor (a test runner's capture) are left as they are.
    """
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a closed pipe: EPIPE, not death
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, _Guarded):
            continue
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        setattr(sys, name, _Guarded(stream, name))
