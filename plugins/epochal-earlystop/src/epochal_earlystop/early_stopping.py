"""The ``early_stopping`` plugin: stop when a log record stops improving; track the best value.

Ancestors: Blocks' ``TrackTheBest`` and ``FinishIfNoImprovementAfter``, Keras'/Lightning's
``EarlyStopping``, Ignite's ``EarlyStopping``. After every epoch whose log row holds the
monitored record (``valid.loss`` by default, written by the core's evaluation or by another
plugin such as ``monitor``), the value is compared with the best so far; ``patience`` such
checks in a row without an improvement of more than ``min_delta`` end training through
``loop.request_stop`` with a reason. With ``[loop] eval_every_n_batches`` the check runs after
each evaluation inside an epoch whose stream holds the record instead (as Lightning checks after
each validation); a row is never checked twice. The peers' options are here under their names: Keras'
``mode = "auto"`` and ``baseline``, Lightning's ``stopping_threshold`` and
``divergence_threshold``, torch's ``threshold_mode`` and Ignite's ``cumulative_delta``.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from epochal import PluginError, hookimpl
from epochal.errors import option_error
from epochal.protocol import NonEmptyStr, NonNegativeFloat, NonNegativeInt, Phase, Rank, checked_options

#: words of a record's name that say which way is better, for ``mode = "auto"`` (Keras decides
#: by the name too: "loss" is minimized, "acc"/"auc"/F-measure-like names maximized).
LOWER_IS_BETTER = frozenset(
    {"loss", "nll", "error", "err", "mse", "mae", "rmse", "mape", "perplexity", "ppl", "cer", "wer"}
)
HIGHER_IS_BETTER = frozenset(
    {"acc", "accuracy", "auc", "auroc", "roc", "f1", "fmeasure", "fbeta", "precision", "recall",
     "iou", "miou", "dice", "r2", "bleu", "map"}
)  # fmt: skip


def _when(loop: Any) -> str:
    """Where a check took place, for a stop's reason: ``after epoch 3``, or inside an epoch (an
    in-epoch evaluation's check) ``in epoch 4 (after batch 250)``."""
    if loop.in_epoch:
        return f"in epoch {loop.epoch + 1} (after batch {loop.iteration})"
    return f"after epoch {loop.epoch}"


class EarlyStoppingWarning(UserWarning):
    """The monitored record is missing, or the best model state cannot be restored."""


def _option_error(option: str, message: str) -> PluginError:
    return option_error("early_stopping", option, message)


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def direction_of(monitor: str) -> Literal["min", "max"] | None:
    """``min`` or ``max`` as a record's name says (``valid.loss``, ``valid.top1_accuracy``), or None.

    The words of the name after its stream (split at ``.``, ``_``, ``-``, ...) are looked
    up in :data:`LOWER_IS_BETTER` and :data:`HIGHER_IS_BETTER` (``accuracy``-like prefixes such as
    ``acc`` count); a name with words of both kinds, or of neither, says nothing.
    """
    _, dot, metric = monitor.partition(".")
    words = {w for w in re.split(r"[^a-z0-9]+", (metric if dot else monitor).lower()) if w}
    lower = bool(words & LOWER_IS_BETTER) or any(w.endswith("loss") for w in words)
    higher = bool(words & HIGHER_IS_BETTER) or any(w.startswith("acc") for w in words)
    if lower == higher:
        return None
    return "min" if lower else "max"


def _optional_number(option: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _option_error(option, f"must be a finite number or unset, not {value!r}")
    return float(value)


@checked_options("early_stopping")
class EarlyStopping:
    """Stop training when the monitored record has not improved for ``patience`` checks.

    :param monitor: the log record to watch (``valid.loss``, ``valid.accuracy``, ``train.loss``).
    :param mode: ``min`` (lower is better), ``max`` (higher is better) or ``auto`` (as the
        record's name says: :func:`direction_of`; a name that says nothing is an error).
    :param patience: checks (epochs in whose row the record appears) without improvement
        before stopping; 0 stops at the first check that does not improve.
    :param min_delta: an improvement must beat the best value by more than this.
    :param threshold_mode: ``abs``: ``min_delta`` is a difference; ``rel``: a fraction of the
        best value's magnitude (torch's ``threshold_mode``).
    :param cumulative_delta: True: a value better than the best by ``min_delta`` or less is no
        new best (the deltas add up since the last improvement); False: it is the new best but
        counts as no improvement (Ignite's default).
    :param baseline: a value to beat: checks that improve on the best but not on the baseline
        count against ``patience`` (Keras).
    :param stopping_threshold: stop as soon as the value is better than this (Lightning).
    :param divergence_threshold: stop as soon as the value is worse than this (Lightning).
    :param stop_on_nan: stop as soon as the record is NaN or infinite.
    :param restore_best: keep a copy of the model state of the best check in memory (and in the
        plugin's state, for a resumed run) and load it into the model when training ends.
    """

    #: it decides when training ends: it runs only when a run names it (a table, order, --plugins).
    autoload = False
    phase: ClassVar[Phase] = "decide"  # after the records, before the save
    #: every rank decides on the same reduced metrics; the loop agrees on the stop anyway.
    rank: ClassVar[Rank] = "all"

    def __init__(
        self,
        monitor: NonEmptyStr = "valid.loss",
        mode: Literal["min", "max", "auto"] = "min",
        patience: NonNegativeInt = 5,
        min_delta: NonNegativeFloat = 0.0,
        stop_on_nan: bool = True,
        restore_best: bool = False,
        baseline: float | None = None,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        threshold_mode: Literal["abs", "rel"] = "abs",
        cumulative_delta: bool = True,
    ) -> None:
        named = direction_of(monitor)
        if mode == "auto":
            if named is None:
                raise _option_error(
                    "mode",
                    f"'auto' cannot tell whether {monitor!r} should decrease or increase (its name "
                    "has no word such as loss, error, accuracy, auc, f1, or words of both kinds): "
                    "set mode = 'min' or 'max'",
                )
            mode = named
        self.monitor = monitor
        self.mode: Literal["min", "max"] = mode
        self.patience = patience
        self.min_delta = float(min_delta)
        self.threshold_mode = threshold_mode
        self.cumulative_delta = bool(cumulative_delta)
        self.stop_on_nan = stop_on_nan
        self.restore_best = restore_best
        self.baseline = _optional_number("baseline", baseline)
        self.stopping_threshold = _optional_number("stopping_threshold", stopping_threshold)
        self.divergence_threshold = _optional_number("divergence_threshold", divergence_threshold)
        self._check_thresholds(named)
        self._reset()

    def _check_thresholds(self, named: Literal["min", "max"] | None) -> None:
        """Refuse thresholds that contradict the mode, the record's name or each other."""
        lower, sign = self.mode == "min", "<" if self.mode == "min" else ">"
        thresholds = [
            (option, value)
            for option, value in (
                ("stopping_threshold", self.stopping_threshold),
                ("divergence_threshold", self.divergence_threshold),
            )
            if value is not None
        ]
        if thresholds and named is not None and named != self.mode:
            option, value = thresholds[0]
            which = "lower" if named == "min" else "higher"
            raise _option_error(
                option,
                f"with mode = '{self.mode}' a value {sign} {value:g} is better, but {self.monitor!r} "
                f"is a {which}-is-better name: set mode = '{named}' (or 'auto')",
            )
        stop, diverge, base = self.stopping_threshold, self.divergence_threshold, self.baseline
        if stop is not None and diverge is not None and not (stop < diverge if lower else stop > diverge):
            raise _option_error(
                "stopping_threshold",
                f"{stop:g} must be better than divergence_threshold = {diverge:g} with mode = "
                f"'{self.mode}' (a value {sign} {stop:g} stops as good enough; one worse than "
                f"{diverge:g} as diverged)",
            )
        if base is not None and stop is not None and (stop > base if lower else stop < base):
            raise _option_error(
                "stopping_threshold",
                f"{stop:g} is worse than baseline = {base:g} with mode = '{self.mode}': it would "
                "stop as good enough a run that has not beaten its baseline",
            )
        if base is not None and diverge is not None and (diverge < base if lower else diverge > base):
            raise _option_error(
                "divergence_threshold",
                f"{diverge:g} is better than baseline = {base:g} with mode = '{self.mode}': every "
                "value that beats the baseline would count as diverged",
            )

    def _reset(self) -> None:
        """Forget every check: the state of a plugin that has seen no run."""
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.best_iteration: int | None = None
        #: where the best was checked, for the reason of a stop: ``in epoch 2 (after batch 7)``.
        self.best_where: str | None = None
        self.wait = 0
        self.checks = 0
        self.best_state: Any = None
        self._seen = False
        self._evaluated = False
        self._warned = False
        #: the iteration whose row an in-epoch evaluation's check read last (after an epoch's
        #: last batch, that row is not checked again at the epoch's end).
        self.checked_at: int | None = None
        #: set by load_state_dict: the next run, if it is a resumed one, continues this state.
        self._restored = False

    def beats(self, value: float, reference: float) -> bool:
        """Whether *value* is better than *reference* by more than ``min_delta`` (absolute, or
        relative to ``abs(reference)`` with ``threshold_mode = "rel"``)."""
        delta = self.min_delta if self.threshold_mode == "abs" else abs(reference) * self.min_delta
        if self.mode == "min":
            return value < reference - delta
        return value > reference + delta

    def improves(self, value: float) -> bool:
        """Whether *value* beats the best so far by more than ``min_delta``."""
        return self.best is None or self.beats(value, self.best)

    def _better(self, value: float, reference: float) -> bool:
        return value < reference if self.mode == "min" else value > reference

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
    def before_training(self, loop: Any) -> None:
        """A fresh run starts from no best (Keras resets on every ``fit``); a resumed one goes on."""
        if not (self._restored and loop.resumed):
            self._reset()
        self._restored = False

    @hookimpl
    def after_evaluation(self, loop: Any, stream: str) -> None:
        """Note that an evaluation took place (the missing-record warning waits for one); inside
        an epoch (``[loop] eval_every_n_batches``), check the monitored record of *stream*."""
        self._evaluated = True
        ours = self.monitor.partition(".")[0] == stream
        if ours and loop.in_epoch and self.monitor in loop.log.current_row:
            # the evaluation's records are reduced across the ranks by the loop: every rank
            # decides alike here, so the stop is agreed and lands on this batch on every run
            # (not on the next agreement of the ranks, whose interval depends on timing)
            self._check(loop, agreed=True)

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        """Compare the epoch's value with the best; request a stop when patience runs out."""
        row = loop.log.current_row
        if self.monitor not in row:
            self._missing(loop, row)
            return
        if self.checked_at != loop.iteration:
            self._check(loop)

    def _check(self, loop: Any, agreed: bool = False) -> None:
        """Check the row's monitored value; *agreed*: every rank checks the same value now."""
        row = loop.log.current_row
        self._seen = True
        if loop.in_epoch:
            self.checked_at = loop.iteration
        value = _number(row[self.monitor])
        if value is None:
            raise PluginError(
                f"[plugins.early_stopping] monitor: record {self.monitor!r} is "
                f"{type(row[self.monitor]).__name__} {row[self.monitor]!r}, not a number"
            )
        self.checks += 1
        finite = math.isfinite(value)
        if not finite and self.stop_on_nan:
            loop.request_stop(
                f"early_stopping: {self.monitor} is {value!r} {_when(loop)} (stop_on_nan)",
                agreed=agreed,
            )
            self._write(row, False)
            return
        improved = finite and self.improves(value)
        # Ignite's cumulative_delta = False: a smaller step than min_delta is the new best too
        # (so the next improvement is measured from it), without resetting the patience.
        new_best = improved or (
            finite and not self.cumulative_delta and self.best is not None and self._better(value, self.best)
        )
        if new_best:
            self.best, self.best_epoch, self.best_iteration = value, loop.epoch, loop.iteration
            self.best_where = _when(loop)
            if self.restore_best:
                self.best_state = copy.deepcopy(loop.model.state_dict())
        # Keras' baseline: the patience restarts only on a value that beats the baseline too.
        if improved and (self.baseline is None or self.beats(value, self.baseline)):
            self.wait = 0
        else:
            self.wait += 1
        self._write(row, new_best)
        if finite and self._threshold_stop(loop, value, agreed):
            return
        if self.wait and self.wait >= self.patience:
            better = "decrease" if self.mode == "min" else "increase"
            delta = f" by more than {self.min_delta:g}" if self.min_delta else ""
            if self.threshold_mode == "rel" and self.min_delta:
                delta += " (relative)"
            if self.baseline is not None and (self.best is None or not self.beats(self.best, self.baseline)):
                below = "below" if self.mode == "min" else "above"
                delta += f" {below} the baseline {self.baseline:g}"
            loop.request_stop(
                f"early_stopping: {self.monitor} did not {better}{delta} for {self.wait} "
                f"check(s) (patience={self.patience}); best {self.best:.4g} "
                f"{self.best_where or f'after epoch {self.best_epoch}'}",
                agreed=agreed,
            )

    def _threshold_stop(self, loop: Any, value: float, agreed: bool) -> bool:
        """Request a stop when *value* passed ``stopping_threshold`` or ``divergence_threshold``."""
        sign, worse = ("<", ">") if self.mode == "min" else (">", "<")
        stop, diverge = self.stopping_threshold, self.divergence_threshold
        if stop is not None and self._better(value, stop):
            loop.request_stop(
                f"early_stopping: {self.monitor} = {value!r} {sign} stopping_threshold {stop:g} "
                f"{_when(loop)}",
                agreed=agreed,
            )
            return True
        if diverge is not None and self._better(diverge, value):
            loop.request_stop(
                f"early_stopping: {self.monitor} = {value!r} {worse} divergence_threshold {diverge:g} "
                f"{_when(loop)} (diverged)",
                agreed=agreed,
            )
            return True
        return False

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
        # with an in-epoch interval and eval_every_n_epochs = 0, evaluations count batches over the run
        no_eval = not loop.eval_streams or not (
            loop.eval_every_n_epochs or getattr(loop, "eval_interval", None)
        )
        if not (self._evaluated or no_eval):
            return  # the record may come with the first evaluation
        self._warned = True
        records = sorted(k for k in row if k != "epochs_done")
        import difflib  # only for this warning: not when the plugin is listed

        match = difflib.get_close_matches(self.monitor, records, n=1, cutoff=0.5)
        hint = f" (did you mean {match[0]!r}?)" if match else ""
        stream = self.monitor.partition(".")[0]
        shown = [k for k in records if k.startswith(f"{stream}.")] or records  # its stream's, if any
        warnings.warn(
            f"early_stopping: the monitored record {self.monitor!r} is not in the log after epoch "
            f"{loop.epoch}{hint}; records written: {', '.join(shown) or 'none'}. Early stopping "
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
            "best_where": self.best_where,
            "wait": self.wait,
            "checks": self.checks,
            "seen": self._seen,
            "warned": self._warned,
            "checked_at": self.checked_at,
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
        where = state.get("best_where")
        self.best_where = where if isinstance(where, str) else None
        self.wait = int(state.get("wait", 0))
        self.checks = int(state.get("checks", 0))
        self._seen = bool(state.get("seen", False))
        self._warned = bool(state.get("warned", False))
        checked = state.get("checked_at")
        self.checked_at = None if checked is None else int(checked)
        self.best_state = state.get("best_state")
        self._restored = True
