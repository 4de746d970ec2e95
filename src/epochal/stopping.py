"""When training stops, and why: one object the loop owns and asks.

Every way a run ends early lands here: a plugin's ``loop.request_stop``, a signal (the first
SIGINT finishes the epoch, a second one or a SIGTERM finishes the batch, a third raises
``KeyboardInterrupt``), the iteration limit. While it trains the loop reads three things, and
nothing else: :attr:`Stop.halt` in its batch loop (one integer comparison per batch),
:attr:`Stop.done` between epochs ("stop now?", as Lightning's ``_FitLoop.done`` or Blocks'
``_check_finish_training``) and :attr:`Stop.finish_epoch` after one. When it ends,
:attr:`Stop.reason` and :attr:`Stop.by_signal` tell an interrupted run from one a signal cut
nothing short of.

On several processes :class:`epochal.distributed.agreement.AgreedStop` is used instead: the
same questions, answered only with what every rank agreed on.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from epochal.errors import ConfigError


def check_minimum(epochs: int, steps: int, limits: tuple[int | None, int | None], where: str) -> None:
    """Refuse ``min_epochs`` / ``min_steps`` above their limits (``max_epochs``, ``max_iterations``).

    :raises ConfigError: naming *where*, the minimum and its limit.
    """
    for low, high, value, limit in zip(
        ("min_epochs", "min_steps"), ("max_epochs", "max_iterations"), (epochs, steps), limits, strict=True
    ):
        if limit is not None and value > limit:
            raise ConfigError(f"{where}: {low} = {value} is more than {high} = {limit}")


class Stop:
    """The stop decision of a run on one process."""

    def __init__(self) -> None:
        #: why training stops (None: it goes on). Set by :meth:`decide`.
        self.reason: str | None = None
        #: the :attr:`reason` is a signal's (SIGTERM, a second SIGINT), not a limit or a plugin's.
        self.by_signal = False
        #: the first stop asked for on this process (on several processes: maybe not agreed yet).
        self.requested: str | None = None
        #: the batch loop ends once ``loop.iteration >= halt``: the iteration limit, -1 once stopping.
        self.halt = sys.maxsize
        #: the number of the last SIGINT/SIGTERM received on this process (None: none).
        self.signum: int | None = None
        #: a first SIGINT asked to finish the current epoch.
        self.finish_asked = False
        self._interrupts = 0
        #: ``[loop] min_epochs`` / ``min_steps``: a plugin's stop asked before both are reached
        #: is deferred until then (Lightning's); limits and signals are never deferred.
        self.min_epochs = 0
        self.min_steps = 0
        #: the reason of a stop deferred until the minimum (None: none).
        self.deferred: str | None = None
        self._signalled = False
        #: :attr:`requested` is a signal's.
        self.requested_by_signal = False
        #: (epochs completed, training batches completed), read when a stop may be deferred.
        self.progress: Callable[[], tuple[int, int]] = lambda: (0, 0)

    @property
    def done(self) -> bool:
        """Stop now: a reason was decided (agreed, on several processes)."""
        return self.reason is not None

    @property
    def finish_epoch(self) -> bool:
        """Training ends after the current epoch (a first SIGINT)."""
        return self.finish_asked

    @property
    def signal_received(self) -> int | None:
        """The signal that ends training (None: none)."""
        return self.signum

    def arm(self, limit: int) -> None:
        """At an epoch's start: the batch loop runs to *limit* unless a stop is decided (or to
        ``min_steps``, where a deferred stop takes effect, when that comes first)."""
        if self.reason is not None:
            self.halt = -1
        elif self.deferred is not None and self.progress()[0] >= self.min_epochs:
            self.halt = min(limit, self.min_steps)
        else:
            self.halt = limit

    def decide(self, reason: str, deferrable: bool = False, by_signal: bool = False) -> None:
        """Training stops after the current batch, for *reason* (the first reason stays).

        *deferrable* (a plugin's request): before ``min_epochs``/``min_steps`` the stop waits
        for them (:meth:`release` takes it then). *by_signal*: the reason is a signal's.
        """
        if deferrable and not self.minimum_reached():
            if self.deferred is None:
                self.deferred = reason
                epochs, _ = self.progress()
                if epochs >= self.min_epochs:  # only the steps are missing: stop at min_steps
                    self.halt = min(self.halt, self.min_steps)
            return
        if self.reason is None:
            self.reason = reason
            self.by_signal = by_signal
        self.halt = -1

    def minimum(self, epochs: int, steps: int, limits: tuple[int | None, int | None], where: str) -> None:
        """Defer plugins' stops until *epochs* epochs and *steps* batches are done.

        :raises ConfigError: naming *where* when a minimum is above its limit (``max_epochs``,
            ``max_iterations``: the two *limits*).
        """
        check_minimum(epochs, steps, limits, where)
        self.min_epochs, self.min_steps = epochs, steps

    def minimum_reached(self) -> bool:
        """Whether ``min_epochs`` epochs and ``min_steps`` batches are completed."""
        epochs, steps = self.progress()
        return epochs >= self.min_epochs and steps >= self.min_steps

    def release(self) -> bool:
        """Take a deferred stop once the minimum is reached; whether training stops now."""
        if self.deferred is not None and self.reason is None and self.minimum_reached():
            self.decide(
                f"{self.deferred} (deferred until min_epochs={self.min_epochs}, min_steps={self.min_steps})"
            )
        return self.reason is not None

    def request(self, reason: str, agreed: bool = False) -> None:
        """A stop asked for by a plugin or a signal; on one process it is decided at once
        (a plugin's, deferred until the minimum)."""
        self._ask(reason, agreed, by_signal=False)

    def _ask(self, reason: str, agreed: bool, by_signal: bool) -> None:
        """Note the request and decide it."""
        self._note(reason, by_signal)
        self.decide(reason, deferrable=not self._signalled, by_signal=by_signal)

    def stop_as_signal(self, signum: int, reason: str) -> None:
        """Stop after the current batch as *signum* (SIGTERM) would, for *reason*, without its
        notice: what ``check-resume`` does at its chosen batch. On several processes every rank
        must call it after the same batch (it is taken as agreed)."""
        self.signum = signum
        self._signalled = True
        self._ask(reason, agreed=True, by_signal=True)

    def _note(self, reason: str, by_signal: bool) -> None:
        """The first request stays :attr:`requested`."""
        if self.requested is None:
            self.requested, self.requested_by_signal = reason, by_signal

    def interrupt(self, signum: int) -> str | None:
        """Take signal *signum*; return the message to print (None: none).

        :raises KeyboardInterrupt: at the third SIGINT (stop at once, nothing saved).
        """
        self.signum = signum
        self._signalled = True
        self._interrupts += signum == signal.SIGINT
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self._interrupts == 1:
            self.finish_asked = True
            return (
                "epochal: SIGINT received, finishing the current epoch "
                "(Ctrl-C again to stop after the current batch)"
            )
        if signum == signal.SIGINT and self._interrupts > 2:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt("a third SIGINT: stopped at once, nothing saved at this point")
        self._ask(f"{name} received", agreed=False, by_signal=True)
        return f"epochal: {name} received, stopping after the current batch"

    def settle(self, loop: Any) -> int | None:
        """At the end of *loop*'s training: the signal that ended it (None: none)."""
        return self.signum

    def own_end(self, loop: Any) -> str | None:
        """Why *loop*'s training ended besides the signal it got: a limit reached, or a stop
        decided before the signal's (None: the signal ended it, a run to continue).

        A first SIGINT in the last epoch finishes that epoch, which ends the run all the same.
        """
        if loop.max_iterations is not None and loop.iteration >= loop.max_iterations:
            return f"max_iterations={loop.max_iterations} reached"
        if not loop.in_epoch and loop.max_epochs is not None and loop.epoch >= loop.max_epochs:
            return f"max_epochs={loop.max_epochs} reached"
        if self.reason is not None and not self.by_signal:
            return self.reason
        return None


class ProcessSignals:
    """SIGINT and SIGTERM for the whole life of an ``epochal run`` process, around the loop's own.

    Installed before the loop runs and never removed: :meth:`epochal.Loop.run` puts its own
    handler in place while it trains and gives this one back when training ends, so that a
    signal during the wind-down (the summary, leaving the process group, the interpreter's
    exit) no longer kills the process by the signal's default action, with no message. Before
    training a signal goes to the loop's stop object (training then stops before its first
    batch); once training ended it is only noted: a finished run stays finished (exit 0), an
    interrupted one keeps its own signal's status.
    """

    def __init__(self, stopping: Stop, say: Callable[[str], None] | None = None) -> None:
        #: the loop's stop object until training ends (it may hold the process group).
        self.stopping: Stop | None = stopping
        self.say = say
        #: training ended: later signals change nothing.
        self.ended = False
        #: training ended with an error.
        self.failed = False
        #: the last signal received after training ended (None: none).
        self.late: int | None = None

    def end(self, failed: bool = False) -> None:
        """Training ended (*failed*: with an error): from now on a signal is only noted (the
        stop object is let go)."""
        self.ended = True
        self.failed = failed
        self.stopping = None

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.ended and self.stopping is not None:
            message = self.stopping.interrupt(signum)
        else:
            self.late = signum
            name = signal.Signals(signum).name
            if self.failed:  # e.g. the agent stopping a rank that lost its peer
                message = f"epochal: {name} received while the failed run shuts down; its error stands"
            else:
                message = (
                    f"epochal: {name} received after training ended; "
                    "the run's outcome stands, finishing its summary and shutdown"
                )
        if message is not None and self.say is not None:
            self.say(message)


def install_handlers(handler: Callable[[int, Any], None]) -> dict[int, Any]:
    """Route SIGINT and SIGTERM to *handler*; return the handlers it replaced (none off the
    main thread, where Python allows no handler)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}


def restore_handlers(previous: Mapping[int, Any]) -> None:
    """Put back the handlers :func:`install_handlers` replaced."""
    for signum, handler in previous.items():
        signal.signal(signum, handler)
