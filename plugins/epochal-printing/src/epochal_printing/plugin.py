"""The ``printing`` plugin: one readable line per epoch with every stream's metrics.

Ancestor: Blocks' ``Printing``. Where ``progress`` draws bars on a terminal, ``printing`` writes
plain lines that read well in a CI log, a notebook or ``epochal run … > out.txt``; so it is on
when stdout is not a terminal and off on a terminal (``tty = true`` prints there too).

    epoch 3/20 (iteration 69): train loss=0.1790 accuracy=0.9570 | valid loss=0.1990 accuracy=0.9500

A line groups the epoch's log row by stream (``train.loss`` → ``train``, ``valid.accuracy`` →
``valid``), ``train`` first; keys without a stream appear last, under ``log`` (``lr``). Lines
fit ``$COLUMNS``, else the terminal, else 120 characters (a job log): a longer one gives each
stream a line of its own. The ``progress`` plugin's epoch block shows the same records.
``batches = N`` adds a line every N training batches with that batch's ``train_step`` outputs.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, TextIO

from epochal import hookimpl
from epochal.console import JOB_LOG_WIDTH, fit_groups, fit_lines, group_records, terminal_width
from epochal.protocol import Ge, Le, NonNegativeInt, Phase, Rank, checked_options


def _format(value: Any, digits: int) -> str | None:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        tiny_or_huge = abs(value) >= 1e4 or (value and abs(value) < 1e-3)
        return f"{value:.{digits}g}" if tiny_or_huge else f"{value:.{digits}f}"
    if isinstance(value, str):
        return value
    try:
        return _format(float(value), digits)  # numpy and torch scalars
    except (TypeError, ValueError):
        return None


def _best(value: Any, best: Any, digits: int) -> str:
    """`` (best)`` after a value that is the best so far, else `` (best 0.1234)`` ('' for none)."""
    shown = None if best is None else _format(best, digits)
    if shown is None:
        return ""
    return " (best)" if shown == _format(value, digits) else f" (best {shown})"


def metric_groups(
    row: Mapping[str, Any], digits: int = 4, exclude: Sequence[str] = ()
) -> list[tuple[str, list[str]]]:
    """A row's records as ``(stream, ["loss=0.18 (best)", ...])``: see :func:`format_metrics`."""
    groups = []
    for stream, metrics in group_records(row, exclude):
        items = []
        for metric, value, best in metrics:
            shown = _format(value, digits)
            if shown is not None:
                items.append(f"{metric}={shown}{_best(value, best, digits)}")
        if items:
            groups.append((stream, items))
    return groups


def format_metrics(row: Mapping[str, Any], digits: int = 4, exclude: Sequence[str] = ()) -> str:
    """``train loss=0.18 | valid loss=0.20 (best 0.19)``: a row's records grouped by stream.

    Within a stream the metrics come in :func:`epochal.console.metric_order` (losses first,
    then alphabetical: the same on 1 and N processes); early stopping's ``valid.loss.best``
    shows as ``(best)`` after the value it is the best of (or ``(best 0.19)``). Keys matching a
    pattern of *exclude* (``fnmatch``: ``"timing.*"``) and flags (``valid.loss.best_so_far =
    true``: booleans, not metrics) are left out (:func:`epochal.console.group_records`).
    """
    return " | ".join(f"{stream} {' '.join(items)}" for stream, items in metric_groups(row, digits, exclude))


@checked_options("printing")
class Printing:
    """Print one line per epoch (and every *batches* training batches) with every stream's metrics.

    :param batches: also print a line every n training batches with the batch's outputs (0: never).
    :param tty: print even when stdout is a terminal (there ``progress`` shows bars instead).
    :param digits: decimal places of the numbers shown.
    :param stream: where to print: ``stdout`` or ``stderr``.
    :param exclude: log keys not to show, as ``fnmatch`` patterns (default: ``timing``'s records,
        and the running records ``*.running``, monitor's per-step values, whose row can be an
        epoch's last: the line shows the epoch's means).
    """

    phase: ClassVar[Phase] = "report"  # the epoch's records and decisions are in the row
    #: on several processes rank 0 prints.
    rank: ClassVar[Rank] = "zero"

    def __init__(
        self,
        batches: NonNegativeInt = 0,
        tty: bool = False,
        digits: Annotated[int, Ge(0), Le(12)] = 4,
        stream: Literal["stdout", "stderr"] = "stdout",
        exclude: Sequence[str] = ("timing.*", "*.running"),
    ) -> None:
        self.batches, self.tty, self.digits, self.stream = batches, tty, digits, stream
        self.exclude = tuple(exclude)
        self.active = False
        #: printing no batch lines, it has nothing to do after a batch.
        self.idle_hooks = frozenset() if batches else frozenset({"after_batch"})

    def _out(self) -> TextIO:
        return sys.stdout if self.stream == "stdout" else sys.stderr

    def _width(self) -> int:
        # $COLUMNS when set, a terminal's width with tty = true, else a job log's
        return terminal_width(self._out(), JOB_LOG_WIDTH)

    def _print(self, line: str) -> None:
        print("\n".join(fit_lines(line, self._width())), file=self._out(), flush=True)

    def _print_groups(self, head: str, groups: list[tuple[str, list[str]]]) -> None:
        """*head* and the stream *groups*: one line, or a line per stream where that is too wide."""
        text = fit_groups(head, groups, self._width(), " | ", after_head=" ")
        print(text if groups else f"{head} (no metrics logged)", file=self._out(), flush=True)

    @staticmethod
    def _epoch(loop: Any, number: int) -> str:
        limit = f"/{loop.max_epochs}" if getattr(loop, "max_epochs", None) else ""
        return f"epoch {number}{limit}"

    @hookimpl
    def before_training(self, loop: Any) -> None:
        out = self._out()
        self.active = self.tty or not (hasattr(out, "isatty") and out.isatty())
        if not self.active:
            return
        resumed = f", resumed at epoch {loop.epoch}, iteration {loop.iteration}" if loop.resumed else ""
        self._print(f"training: run {loop.run_id}{resumed}")

    @hookimpl
    def after_evaluation(self, loop: Any, stream: str, metrics: Mapping[str, Any]) -> None:
        if not self.active:
            return
        groups = metric_groups({f"{stream}.{k}": v for k, v in metrics.items()}, self.digits)
        if loop.in_epoch:  # [loop] eval_every_n_batches: inside the epoch being run
            epoch = self._epoch(loop, loop.epoch + 1)
            self._print_groups(f"{epoch} batch {loop.batch_in_epoch} (iteration {loop.iteration}):", groups)
        elif stream in getattr(loop, "test_streams", ()):  # once, after training
            self._print_groups(f"after training, {loop.test_weights} weights:", groups)
        elif loop.epoch == 0:  # the evaluation before the first epoch
            self._print_groups("epoch 0:", groups)

    @hookimpl
    def after_batch(self, loop: Any, outputs: Mapping[str, Any]) -> None:
        if self.active and self.batches and loop.iteration % self.batches == 0:
            groups = metric_groups({f"train.{k}": v for k, v in outputs.items()}, self.digits)
            epoch = self._epoch(loop, loop.epoch + 1)
            self._print_groups(f"{epoch} batch {loop.batch_in_epoch} (iteration {loop.iteration}):", groups)

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        if self.active:
            groups = metric_groups(loop.log.current_row, self.digits, self.exclude)
            self._print_groups(f"{self._epoch(loop, loop.epoch)} (iteration {loop.iteration}):", groups)

    @hookimpl
    def after_training(self, loop: Any) -> None:
        if self.active:
            status = loop.log.status
            reason = status.get("finish_reason") or ""
            self._print(f"training {status.get('status', 'ended')}: {reason}".rstrip(": "))
