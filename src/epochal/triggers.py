"""Conditions that say when a plugin should act (Blocks' SimpleExtension triggers).

Each helper returns a predicate ``condition(loop) -> bool`` to test inside a hook::

    from epochal.triggers import every_n_batches

    class Snapshot:
        def __init__(self, every: int = 100):
            self.due = every_n_batches(every)

        @hookimpl
        def after_batch(self, loop):
            if self.due(loop):
                ...

Batch conditions read ``loop.iteration`` (training batches completed), epoch conditions
``loop.epoch`` (epochs completed), so they are meant for ``after_batch`` and ``after_epoch``
respectively and hold the same way after a resume. A value of 0 or None means "never".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

Condition = Callable[[Any], bool]


def _check(n: int | None, what: str) -> int:
    if n is None:
        return 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{what} must be a non-negative integer, not {n!r}")
    return n


def never(loop: Any) -> bool:
    """A condition that is never true."""
    return False


def every_n_batches(n: int | None) -> Condition:
    """True after every *n*-th training batch (``loop.iteration % n == 0``)."""
    n = _check(n, "every_n_batches")
    if not n:
        return never
    return lambda loop: loop.iteration > 0 and loop.iteration % n == 0


def every_n_epochs(n: int | None) -> Condition:
    """True after every *n*-th training epoch (``loop.epoch % n == 0``)."""
    n = _check(n, "every_n_epochs")
    if not n:
        return never
    return lambda loop: loop.epoch > 0 and loop.epoch % n == 0


def after_n_batches(n: int | None) -> Condition:
    """True once *n* training batches have completed (``loop.iteration >= n``)."""
    n = _check(n, "after_n_batches")
    if not n:
        return never
    return lambda loop: loop.iteration >= n


def after_n_epochs(n: int | None) -> Condition:
    """True once *n* training epochs have completed (``loop.epoch >= n``)."""
    n = _check(n, "after_n_epochs")
    if not n:
        return never
    return lambda loop: loop.epoch >= n


class every_n_seconds:  # noqa: N801 - used like the functions above
    """True when at least *seconds* of wall time passed since it was last true.

    It measures with ``time.monotonic``; the first call starts the clock and returns False.
    """

    def __init__(self, seconds: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        if seconds is not None and (isinstance(seconds, bool) or seconds < 0):
            raise ValueError(f"every_n_seconds must be a non-negative number, not {seconds!r}")
        self.seconds = seconds or 0
        self._clock = clock
        self._last: float | None = None

    def __call__(self, loop: Any = None) -> bool:
        if not self.seconds:
            return False
        now = self._clock()
        if self._last is None:
            self._last = now
            return False
        if now - self._last >= self.seconds:
            self._last = now
            return True
        return False
