"""The ``finish_after`` plugin: end training after a number of epochs, batches or seconds.

Ancestor: Blocks' ``FinishAfter``. Each limit requests a stop with a reason naming it, so the
run's ``finish_reason`` says which limit ended it. Epochs and batches are the loop's own counters
(restored on resume); seconds count the training time of every run that continued the same
training, kept in the plugin's state across resume.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, ClassVar

from epochal import PluginError, hookimpl
from epochal.protocol import Phase, PositiveFloat, PositiveInt, Rank, checked_options


@checked_options("finish_after")
class FinishAfter:
    """Request a stop once ``epochs`` epochs, ``batches`` batches or ``seconds`` seconds are done.

    :param epochs: stop after this many training epochs (``loop.epoch``, counted across resume).
    :param batches: stop after this many training batches (``loop.iteration``).
    :param seconds: stop after this much training wall time, summed over resumed runs.

    At least one is required. ``finish_after`` is never autoloaded (``autoload = False``): a run
    loads it only when it names it, in ``[plugins] order``, ``--plugins`` or a
    ``[plugins.finish_after]`` table.
    """

    autoload = False
    #: every rank counts the same epochs and batches (their stops are ``agreed``); seconds are
    #: each rank's own clock, agreed by the loop a batch later.
    rank: ClassVar[Rank] = "all"
    phase: ClassVar[Phase] = "decide"  # after the records, before the save

    def __init__(
        self,
        epochs: PositiveInt | None = None,
        batches: PositiveInt | None = None,
        seconds: PositiveFloat | None = None,
    ):
        if epochs is None and batches is None and seconds is None:
            raise PluginError(
                "[plugins.finish_after]: set at least one of the options epochs, batches, seconds "
                "(e.g. epochs = 10)"
            )
        self.epochs = epochs
        self.batches = batches
        self.seconds = float(seconds) if seconds is not None else None
        #: training seconds of the runs before this one (from a resumed state).
        self.elapsed_before = 0.0
        self._clock = time.monotonic
        self._started: float | None = None
        self._stopped: float | None = None
        #: set by load_state_dict: the next run, if it is a resumed one, continues the count.
        self._restored = False

    @property
    def elapsed(self) -> float:
        """Training seconds so far, including those of the runs this one resumed."""
        if self._started is None:
            return self.elapsed_before
        end = self._stopped if self._stopped is not None else self._clock()
        return self.elapsed_before + (end - self._started)

    # -- hooks --------------------------------------------------------------------------------

    @hookimpl(tryfirst=True)
    def before_training(self, loop: Any) -> None:
        """Start the clock (a fresh run from 0 s); stop at once if a limit is already met."""
        if not (self._restored and loop.resumed):
            self.elapsed_before = 0.0
        self._restored = False
        self._started, self._stopped = self._clock(), None
        self._check_epochs(loop)
        self._check_batches(loop)
        self._check_seconds(loop)

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        """Check the batch and time limits."""
        if self.batches is not None:
            self._check_batches(loop)
        if self.seconds is not None:
            self._check_seconds(loop)

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        """Check the epoch and time limits."""
        if self.epochs is not None:
            self._check_epochs(loop)
        if self.seconds is not None:
            self._check_seconds(loop)

    @hookimpl
    def after_training(self) -> None:
        """Stop the clock."""
        self._stopped = self._clock()

    @hookimpl
    def on_error(self) -> None:
        """Stop the clock."""
        self._stopped = self._clock()

    def _check_epochs(self, loop: Any) -> None:
        if self.epochs is not None and loop.epoch >= self.epochs:
            loop.request_stop(f"finish_after: epochs={self.epochs} reached", agreed=True)

    def _check_batches(self, loop: Any) -> None:
        if self.batches is not None and loop.iteration >= self.batches:
            loop.request_stop(f"finish_after: batches={self.batches} reached", agreed=True)

    def _check_seconds(self, loop: Any) -> None:
        if self.seconds is not None:
            elapsed = self.elapsed
            if elapsed >= self.seconds:
                loop.request_stop(
                    f"finish_after: seconds={self.seconds:g} reached ({elapsed:.1f} s of training)"
                )

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The training seconds so far (epochs and batches are the loop's own counters)."""
        return {"elapsed": self.elapsed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue counting seconds from a saved :meth:`state_dict`."""
        self.elapsed_before = float(state.get("elapsed", 0.0))
        self._started = self._stopped = None
        self._restored = True
