"""Decisions every rank takes together: when training stops, and why.

A stop request (``loop.request_stop`` from any plugin, early stopping, ``finish_after``), a
signal (SIGTERM, a first or second SIGINT) or a wish to finish the epoch arrives on *one*
process. Acted on locally it leaves the other ranks waiting in their next collective for a peer
that is gone. So on several processes the loop acts only on what the ranks agree:

* after every n-th training batch each rank starts an asynchronous MAX all-reduce of its few
  local flags over the gloo control group and reads the previous agreement's result (already
  there, as a rule): with n = 1 a request made on any rank during batch *k* stops every rank
  after batch *k + 1*; with n > 1 within 2n batches, on every rank at the same one;
* n is ``[distributed] agree_every_n_batches``; ``"auto"`` (the default) agrees after every batch
  during the run's first :data:`CALIBRATION_BATCHES` batches, then times a few blocking
  all-reduces and picks the smallest n (1 … :data:`MAX_EVERY`) for which one round trip per n
  steps costs at most :data:`BUDGET` (1%) of those n steps; the ranks adopt the largest n any of
  them proposed (one more all-reduce, once per run), so they agree at the same batches;
* at every epoch end a blocking all-reduce agrees on the flags raised during the epoch's last
  batch and its evaluation (so early stopping on an evaluated metric stops at that epoch's end,
  as on one process) and checks that every rank ran the same number of batches;
* the reason is agreed once, when a stop is decided (every rank's own reason is gathered and the
  lowest rank's wins), and the signal that ends the run is agreed when training ends.

:class:`AgreedStop` is the loop's stop object on several processes (one process uses
:class:`epochal.stopping.Stop`, and pays nothing for the agreement). It takes part in
``after_batch`` and ``after_epoch`` as the last implementation (registered as
``epochal.agreement``), and reads only the loop's public counters.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING, Any

from epochal._markers import hookimpl
from epochal.errors import EpochalError
from epochal.stopping import Stop

if TYPE_CHECKING:
    from epochal.distributed.world import World

#: the loop, as the agreement reads it (its public counters only).
Loop = Any

#: what a reduction is for: a rank that reduces for another purpose is out of step.
_BATCH, _EPOCH_END, _END = 0, 1, 2
_WHERE = {_BATCH: "after a training batch", _EPOCH_END: "at an epoch end", _END: "at the end of training"}

#: with ``agree_every_n_batches = "auto"``: batches agreed one by one while the steps are timed.
CALIBRATION_BATCHES = 16
#: blocking all-reduces timed at the end of the calibration (their median is the round trip).
ROUND_TRIPS = 5
#: the share of the steps' time one agreement may cost.
BUDGET = 0.01
#: the largest n "auto" picks: a local stop request waits at most 2n batches.
MAX_EVERY = 128

#: the clock the calibration reads (tests replace it with a scripted one).
_clock = time.perf_counter


def choose_every(round_trip: float, step: float) -> int:
    """The smallest n in 1 … MAX_EVERY such that *round_trip* ≤ BUDGET × n × *step* (seconds)."""
    if round_trip <= 0:
        return 1
    if step <= 0:
        return MAX_EVERY
    # a relative 1e-6 off the ratio: 10.000000000000002 (float noise of timed seconds) is 10
    return max(1, min(MAX_EVERY, math.ceil(round_trip / (BUDGET * step) * (1 - 1e-6))))


class RanksOutOfStepError(EpochalError):
    """The ranks ran different numbers of batches (their streams are not sharded evenly)."""


class AgreedStop(Stop):
    """The stop decision of one rank among several: it acts only on what every rank agreed."""

    def __init__(self, world: World) -> None:
        super().__init__()
        self.world = world
        every = getattr(world, "agree_every_n_batches", 1)
        #: agree after every n-th batch (1 during the calibration of ``"auto"``).
        self.every = 1 if every == "auto" else max(1, int(every))
        #: ``"auto"``: the batches still to time before n is chosen (0: chosen, or fixed).
        self._calibrating = CALIBRATION_BATCHES if every == "auto" else 0
        #: the calibration's measures: seconds between this hook's calls, less its own time.
        self._steps: list[float] = []
        self._left: float | None = None
        #: what the calibration measured and chose (None before it ends): for reports and tests.
        self.calibration: dict[str, float] | None = None
        self._pending: Any = None
        self._pending_kind = _BATCH
        #: every rank agreed to finish the epoch.
        self._finish_agreed = False
        #: the signal that ended training, agreed by every rank (None: none).
        self.agreed_signum: int | None = None

    @property
    def finish_epoch(self) -> bool:
        """Training ends after the current epoch: some rank got a first SIGINT, all agreed."""
        return self._finish_agreed

    @property
    def signal_received(self) -> int | None:
        """The agreed signal once training ended (a signal to any rank counts), else this rank's."""
        return self.agreed_signum if self.agreed_signum is not None else self.signum

    def interrupt(self, signum: int) -> str | None:
        """Take signal *signum*; only rank 0 says so (the others' messages would repeat it)."""
        message = super().interrupt(signum)
        return message if self.world.is_zero else None

    def _ask(self, reason: str, agreed: bool, by_signal: bool) -> None:
        """A local request waits for the agreement; *agreed* (every rank asks at this same
        point, e.g. from the counters) stops here, as on one process."""
        self._note(reason, by_signal)
        if agreed:
            self.decide(reason, deferrable=not self._signalled, by_signal=by_signal)

    def _flags(self, loop: Loop, kind: int) -> list[float]:
        count = loop.batch_in_epoch
        return [
            self.requested is not None,
            self.finish_asked,
            self.signum or 0,
            kind,
            -kind,
            count,
            -count,
        ]

    def _check(self, loop: Loop, values: list[float], kind: int) -> None:
        high, low = int(values[3]), -int(values[4])
        if high != low:
            raise RanksOutOfStepError(
                f"the ranks are out of step in epoch {loop.epoch + 1}: some reduced {_WHERE[low]} while "
                f"others reduced {_WHERE[high]}: they ran different numbers of training batches. "
                "Every rank must get the same number of batches per epoch (shard the train stream "
                "evenly: a world size that divides the number of batches, or drop_last)"
            )
        most, least = int(values[5]), -int(values[6])
        if kind == _EPOCH_END and most != least:
            raise RanksOutOfStepError(
                f"the ranks ran different numbers of training batches in epoch {loop.epoch} "
                f"({least} to {most}); every rank must get the same number of batches per epoch "
                "(shard the train stream evenly: a world size that divides the number of batches, "
                "or drop_last)"
            )

    def _decide(self, loop: Loop, values: list[float]) -> None:
        """Adopt the agreed flags: a stop (with its agreed reason), finishing the epoch."""
        if values[0] and self.reason is None and self.deferred is None:
            reasons = self.world.all_gather_object((self.requested, self.requested_by_signal))
            asked = [(rank, reason) for rank, reason in enumerate(reasons) if reason[0] is not None]
            reason, by_signal = asked[0][1]
            if len(asked) < len(reasons):  # a local event: say where it happened
                ranks = ", ".join(str(r) for r, _ in asked)
                reason = f"{reason} (on rank{'s' if len(asked) > 1 else ''} {ranks})"
            # a signal is never deferred
            self.decide(reason, deferrable=not values[2], by_signal=by_signal)
        if values[1]:
            self._finish_agreed = True
        if values[2]:
            self.agreed_signum = int(values[2])

    def _settle_pending(self, loop: Loop) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            values = pending.wait()
            self._check(loop, values, self._pending_kind)

    @hookimpl(trylast=True)
    def after_batch(self, loop: Loop) -> None:
        """Read the previous batch's agreement (stop now if any rank asked), start this one's.

        With ``agree_every_n_batches = n`` only after every n-th batch of the run: the
        previous agreement is then n batches old. With ``"auto"``, the calibration's last batch
        chooses n (:meth:`_calibrate`).
        """
        if self._calibrating:
            self._time_step(loop)
            return
        if self.every > 1 and loop.iteration % self.every:
            return
        self._agree_now(loop)

    def _agree_now(self, loop: Loop) -> None:
        """Read the pending agreement (stop if any rank asked), start the next one."""
        pending, self._pending = self._pending, None
        if pending is not None:
            values = pending.wait()
            self._check(loop, values, _BATCH)
            if values[0]:
                self._decide(loop, values)
        if self.reason is None:
            self._pending = self.world.all_reduce_async(self._flags(loop, _BATCH), "max")
            self._pending_kind = _BATCH

    def _time_step(self, loop: Loop) -> None:
        """A calibration batch: agree as with n = 1, and time the step this hook ends."""
        entered = _clock()
        if self._left is not None:
            self._steps.append(entered - self._left)
        self._calibrating -= 1
        if self._calibrating:
            self._agree_now(loop)
        else:
            self._calibrate(loop)
        self._left = _clock()

    def _calibrate(self, loop: Loop) -> None:
        """Time a few round trips; every rank adopts the largest n any rank proposes.

        Blocking, at the same batch on every rank; the last all-reduce carries this batch's
        flags too, so no agreement is skipped.
        """
        self._settle_pending(loop)
        times = []
        for _ in range(ROUND_TRIPS):
            started = _clock()
            self.world.all_reduce([0.0], "max")
            times.append(_clock() - started)
        round_trip = statistics.median(times)
        step = statistics.median(self._steps) if self._steps else 0.0
        proposed = choose_every(round_trip, step)
        values = self.world.all_reduce([*self._flags(loop, _BATCH), proposed], "max")
        self._check(loop, values, _BATCH)
        self.every = int(values[-1])
        self.calibration = {"round_trip": round_trip, "step": step, "proposed": proposed, "every": self.every}
        if values[0]:
            self._decide(loop, values)

    @hookimpl(trylast=True)
    def after_epoch(self, loop: Loop) -> None:
        """Agree on the flags raised during the epoch's end; check the ranks ran alike."""
        self._settle_pending(loop)
        values = self.world.all_reduce(self._flags(loop, _EPOCH_END), "max")
        self._check(loop, values, _EPOCH_END)
        self._decide(loop, values)

    def settle(self, loop: Loop) -> int | None:
        """At the end of training: drain the reduction in flight, agree on the ending signal."""
        self._settle_pending(loop)
        values = self.world.all_reduce(self._flags(loop, _END), "max")
        self._check(loop, values, _END)
        if values[2]:
            self.agreed_signum = int(values[2])
        return self.agreed_signum
