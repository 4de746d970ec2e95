"""The ``early_stopping`` plugin: stop when a log record stops improving; track the best value.

Ancestors: Blocks' ``TrackTheBest`` and ``FinishIfNoImprovementAfter``, Keras'/Lightning's
``EarlyStopping``. After every epoch whose log row holds the monitored record (``valid.loss`` by
default, written by the core's evaluation or by another plugin such as ``monitor``), the value is
compared with the best so far; ``patience`` such checks in a row without an improvement of more
than ``min_delta`` end training through ``loop.request_stop`` with a reason.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from epochal import PluginError, hookimpl


class EarlyStoppingWarning(UserWarning):
    """The monitored record is missing, or the best model state cannot be restored."""


def _option_error(option: str, message: str) -> PluginError:
    return PluginError(f"[plugins.early_stopping] {option}: {message}")


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class EarlyStopping:
    """Stop training when the monitored record has not improved for ``patience`` checks.

    :param monitor: the log record to watch (``valid.loss``, ``valid.accuracy``, ``train.loss``).
    :param mode: ``min`` (lower is better) or ``max`` (higher is better).
    :param patience: checks (epochs in whose row the record appears) without improvement
        before stopping; 0 stops at the first check that does not improve.
    :param min_delta: an improvement must beat the best value by more than this.
    :param stop_on_nan: stop as soon as the record is NaN or infinite.
    :param restore_best: keep a copy of the model state of the best check in memory (and in the
        plugin's state, for a resumed run) and load it into the model when training ends.
    """

    #: it decides when training ends: it runs only when a run names it (a table, order, --plugins).
    autoload = False
    run_after = ("monitor",)
    run_before = ("checkpoint",)
    #: every rank decides on the same reduced metrics; the loop agrees on the stop anyway.
    rank = "all"

    def __init__(
        self,
        monitor: str = "valid.loss",
        mode: Literal["min", "max"] = "min",
        patience: int = 5,
        min_delta: float = 0.0,
        stop_on_nan: bool = True,
        restore_best: bool = False,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise _option_error("monitor", f"must be a log record name such as 'valid.loss', not {monitor!r}")
        if mode not in ("min", "max"):
            raise _option_error("mode", f"must be 'min' or 'max', not {mode!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise _option_error("patience", f"must be a non-negative integer, not {patience!r}")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or not min_delta >= 0:
            raise _option_error("min_delta", f"must be a non-negative number, not {min_delta!r}")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = float(min_delta)
        self.stop_on_nan = stop_on_nan
        self.restore_best = restore_best
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.best_iteration: int | None = None
        self.wait = 0
        self.checks = 0
        self.best_state: Any = None
        self._seen = False
        self._evaluated = False
        self._warned = False

    def improves(self, value: float) -> bool:
        """Whether *value* beats the best so far by more than ``min_delta``."""
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    @property
    def record_best(self) -> str:
        """The record holding the best value so far: ``<monitor>.best``."""
        return f"{self.monitor}.best"

    @property
    def record_flag(self) -> str:
        """The record set to True in rows where the value is a new best: ``<monitor>.best_so_far``."""
        return f"{self.monitor}.best_so_far"

    # -- hooks --------------------------------------------------------------------------------

    @hookimpl
    def after_evaluation(self) -> None:
        """Note that an evaluation took place (the missing-record warning waits for one)."""
        self._evaluated = True

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        """Compare the epoch's value with the best; request a stop when patience runs out."""
        row = loop.log.current_row
        if self.monitor not in row:
            self._missing(loop, row)
            return
        self._seen = True
        value = _number(row[self.monitor])
        if value is None:
            raise PluginError(
                f"[plugins.early_stopping] monitor: record {self.monitor!r} is "
                f"{type(row[self.monitor]).__name__} {row[self.monitor]!r}, not a number"
            )
        self.checks += 1
        if not math.isfinite(value):
            if self.stop_on_nan:
                loop.request_stop(
                    f"early_stopping: {self.monitor} is {value!r} after epoch {loop.epoch} (stop_on_nan)"
                )
                self._write(row, False)
                return
            improved = False
        else:
            improved = self.improves(value)
        if improved:
            self.best, self.best_epoch, self.best_iteration = value, loop.epoch, loop.iteration
            self.wait = 0
            if self.restore_best:
                self.best_state = copy.deepcopy(loop.model.state_dict())
        else:
            self.wait += 1
        self._write(row, improved)
        if not improved and self.wait >= self.patience:
            better = "decrease" if self.mode == "min" else "increase"
            delta = f" by more than {self.min_delta:g}" if self.min_delta else ""
            loop.request_stop(
                f"early_stopping: {self.monitor} did not {better}{delta} for {self.wait} check(s) "
                f"(patience={self.patience}); best {self.best!r} after epoch {self.best_epoch}"
            )

    @hookimpl
    def after_training(self, loop: Any) -> None:
        """Load the best model state (``restore_best``) and record the best in ``log.status``."""
        if self.best is not None:
            loop.log.status["early_stopping"] = {
                "monitor": self.monitor,
                "best": self.best,
                "best_epoch": self.best_epoch,
                "best_iteration": self.best_iteration,
                "wait": self.wait,
            }
        if not self.restore_best or self.best is None:
            return
        if self.best_state is None:
            warnings.warn(
                f"early_stopping: restore_best is set but no model state of the best epoch "
                f"({self.best_epoch}) is available; the model keeps its last state",
                EarlyStoppingWarning,
                stacklevel=2,
            )
            return
        loop.model.load_state_dict(self.best_state)
        loop.log.status["early_stopping"]["restored_epoch"] = self.best_epoch

    # -- helpers ------------------------------------------------------------------------------

    def _write(self, row: dict[str, Any], improved: bool) -> None:
        if self.best is not None:
            row[self.record_best] = self.best
        if improved:
            row[self.record_flag] = True

    def _missing(self, loop: Any, row: Mapping[str, Any]) -> None:
        if self._seen or self._warned:
            return
        no_eval = not loop.eval_streams or not loop.eval_every_n_epochs
        if not (self._evaluated or no_eval):
            return  # the record may come with the first evaluation
        self._warned = True
        records = sorted(k for k in row if k != "epochs_done")
        import difflib  # only for this warning: not when the plugin is listed

        match = difflib.get_close_matches(self.monitor, records, n=1, cutoff=0.5)
        hint = f" (did you mean {match[0]!r}?)" if match else ""
        warnings.warn(
            f"early_stopping: the monitored record {self.monitor!r} is not in the log after epoch "
            f"{loop.epoch}{hint}; records written: {', '.join(records) or 'none'}. Early stopping "
            "does nothing until it appears; set [plugins.early_stopping] monitor",
            EarlyStoppingWarning,
            stacklevel=2,
        )

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Best value, its epoch, the checks without improvement (and the best model state)."""
        state: dict[str, Any] = {
            "monitor": self.monitor,
            "best": self.best if self.best is None or math.isfinite(self.best) else repr(self.best),
            "best_epoch": self.best_epoch,
            "best_iteration": self.best_iteration,
            "wait": self.wait,
            "checks": self.checks,
            "seen": self._seen,
            "warned": self._warned,
        }
        if self.restore_best and self.best_state is not None:
            state["best_state"] = self.best_state
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (ignored if it watched a different record)."""
        if state.get("monitor") != self.monitor:
            warnings.warn(
                f"early_stopping: the saved state tracked {state.get('monitor')!r}, this run "
                f"monitors {self.monitor!r}; starting its tracking afresh",
                EarlyStoppingWarning,
                stacklevel=2,
            )
            return
        best = state.get("best")
        self.best = None if best is None else float(best)
        self.best_epoch = state.get("best_epoch")
        self.best_iteration = state.get("best_iteration")
        self.wait = int(state.get("wait", 0))
        self.checks = int(state.get("checks", 0))
        self._seen = bool(state.get("seen", False))
        self._warned = bool(state.get("warned", False))
        self.best_state = state.get("best_state")
