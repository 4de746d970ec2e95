"""The ``progress`` plugin: a tqdm progress bar per training epoch and per evaluation stream.

Ancestor: Blocks' ``ProgressBar``; Keras' and Lightning's bars for what is shown. Each bar knows
its total when the stream has a ``len()`` and shows the rate and ETA; the epoch's bar shows the
running means of the train step's metrics over the epoch so far (not the last batch's values).
When the epoch ends its bar gives way to one block: the epoch, its wall time, the train means
and every eval stream's metrics, wrapped to the terminal's width so no metric name is cut.

Per-batch work is kept to a counter increment and a comparison: the clock is read only every
``stride`` batches, a stride that doubles while ``mininterval`` has not passed and shrinks after
each refresh, and the bar and its postfix are updated only when it is refreshed. While bars
are shown, ``logging`` output and warnings are written through ``tqdm.write`` so they do not
garble them.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
import warnings
from collections.abc import Mapping
from operator import itemgetter
from typing import Any, ClassVar, Literal

from epochal import hookimpl
from epochal.console import fit_groups, format_seconds, group_records, metric_order
from epochal.protocol import NonNegativeFloat, Phase, PositiveInt, Rank, checked_options


def _format(value: Any) -> str | None:
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):
        return None


#: records of the log row not shown in the epoch block (as the ``printing`` plugin's default).
_EXCLUDE = ("timing.*", "*.running")


def _best(text: str, best: Any) -> str:
    """`` (best)`` after a value *text* that is the best so far, else `` (best 0.1234)``."""
    shown = None if best is None else _format(best)
    if shown is None:
        return ""
    return " (best)" if shown == text else f" (best {shown})"


def _total(values: list[Any]) -> Any:
    """The sum of one metric's values over the batches of a fold.

    Numbers are added in C by ``sum``. Tensors (a loss left on the device, where reading it
    makes the host wait) are added in one stacked reduction: two kernels per fold instead of
    one addition kernel per batch, and the sum stays on the device until the bar shows it.
    """
    if type(values[0]).__module__.startswith("torch"):
        import torch

        with contextlib.suppress(RuntimeError, TypeError):  # shapes or devices that differ
            return torch.stack(values).sum(0)
    return sum(values)


def _length(stream: Any) -> int | None:
    """The number of batches of *stream* when it has a ``len()``, else None."""
    try:
        return len(stream) if hasattr(stream, "__len__") else None
    except TypeError:
        return None


def _columns(stream: Any) -> int:
    """The width of the terminal *stream* writes to (``$COLUMNS`` first, 80 if unknown)."""
    import os

    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return shutil.get_terminal_size((80, 24)).columns


#: the most batches between two clock reads, and so between two folds of the running means.
_FOLD_EVERY = 1024
#: the narrowest bar drawn beside the metrics (metrics that would need it narrower are left
#: out), and the width tqdm gives a bar when asked for no width.
_MIN_BAR, _DEFAULT_BAR, _SLACK = 10, 10, 3


class _Bar:
    """A tqdm bar plus the throttling state of its updates."""

    __slots__ = ("bar", "due", "next_refresh", "pending", "stride")

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.pending = 0
        self.stride = 1
        #: the value of ``pending`` at which ``_tick`` is called next.
        self.due = 1
        self.next_refresh = 0.0


@checked_options("progress")
class Progress:
    """Show tqdm progress bars for training epochs and evaluation streams.

    :param enabled: show bars at all.
    :param force: show bars even when stdout is not a terminal (logs, CI).
    :param metrics: the metric names shown (None: every numeric one): the running means of the
        train step's outputs while the epoch runs, then the train means and every eval stream's
        metrics of those names in the epoch's block.
    :param mininterval: the least number of seconds between two refreshes of a bar.
    :param eval_bars: show a bar for every evaluation stream as well.
    :param leave: keep each finished epoch's bar on screen above its block (eval bars are
        always removed).
    :param file: where bars are drawn: ``stderr`` or ``stdout``.
    :param ncols: the bars' width in characters (None: the terminal's width).
    """

    phase: ClassVar[Phase] = "report"  # the epoch's records and decisions are in the row
    #: on several processes one bar, drawn by rank 0.
    rank: ClassVar[Rank] = "zero"

    def __init__(
        self,
        enabled: bool = True,
        force: bool = False,
        metrics: list[str] | None = None,
        mininterval: NonNegativeFloat = 0.1,
        eval_bars: bool = True,
        leave: bool = False,
        file: Literal["stderr", "stdout"] = "stderr",
        ncols: PositiveInt | None = None,
    ) -> None:
        self.enabled = enabled
        self.force = force
        self.metrics = None if metrics is None else frozenset(metrics)
        self.mininterval = float(mininterval)
        self.eval_bars = eval_bars
        self.leave = leave
        self.file = file
        self.ncols = ncols
        #: whether bars are shown in the current run (decided in before_training).
        self.active = False
        self._epoch: _Bar | None = None
        self._eval: _Bar | None = None
        self._stack: contextlib.ExitStack | None = None
        self._clock = time.perf_counter
        self._tqdm: Any = None
        #: train output name → sum over the epoch's ``_count`` batches folded so far (every
        #: batch returned these keys); ``_irregular``: name → [sum, batches] once one did not.
        self._keys: tuple[str, ...] | None = None
        self._sums: dict[str, Any] = {}
        self._count = 0
        self._irregular: dict[str, list[Any]] = {}
        #: the outputs of the batches not folded into the sums yet (see _fold).
        self._buffer: list[Mapping[str, Any]] = []
        self._append = self._buffer.append
        self._eval_metrics: dict[str, dict[str, Any]] = {}
        self._epoch_started = 0.0

    # -- bars ---------------------------------------------------------------------------------

    def _stream(self) -> Any:
        return sys.stdout if self.file == "stdout" else sys.stderr

    def _open(self, desc: str, total: int | None, initial: int, leave: bool) -> _Bar:
        bar = self._tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="batch",
            leave=leave,
            file=self._stream(),
            ncols=self.ncols,
            dynamic_ncols=self.ncols is None,
            mininterval=0,  # throttled here, see _tick
            miniters=1,
            delay=self.mininterval,  # no first frame for a bar done within mininterval
        )
        state = _Bar(bar)
        state.next_refresh = self._clock() + self.mininterval
        return state

    def _tick(self, state: _Bar, outputs: Mapping[str, Any] | None) -> None:
        """Called every ``state.stride`` batches: refresh the bar if ``mininterval`` passed.

        Too early, the stride doubles up to :data:`_FOLD_EVERY` (the clock is read a logarithmic
        number of times while the interval runs); after a refresh it is cut to an eighth, about
        four clock reads per interval.
        """
        if outputs is not None:
            self._fold()
        if self._clock() < state.next_refresh:
            state.stride = min(state.stride * 2, _FOLD_EVERY)
            state.due = state.pending + state.stride
            return
        state.stride = max(1, state.stride // 8)
        self._flush(state, self._postfix_from_means() if outputs is not None else None)

    def _flush(self, state: _Bar, postfix: Mapping[str, str] | None) -> None:
        """Update *state*'s bar with its pending batches (and *postfix*) now."""
        if postfix:
            self._set_postfix(state.bar, postfix)
        pending, state.pending = state.pending, 0
        state.due = state.stride
        state.bar.update(pending)
        state.next_refresh = self._clock() + self.mininterval

    def _set_postfix(self, bar: Any, postfix: Mapping[str, str]) -> None:
        """Show as many of *postfix*'s ``name=value`` items as fit the bar's line whole.

        tqdm shrinks the bar to make room for a long postfix, then cuts the line at the
        terminal's edge (a bar one character wide, ``accuracy=0``); the items are chosen here
        instead, losses first, so the bar keeps :data:`_MIN_BAR` characters and no value is cut.
        """
        width = (self.ncols or _columns(self._stream())) - 1
        meter = bar.format_meter(**{**bar.format_dict, "ncols": None, "postfix": None})
        # measured before this refresh's batches are counted: _SLACK for the counts and the
        # rate growing by a digit or two
        room = width - (len(meter) - _DEFAULT_BAR) - _MIN_BAR - _SLACK
        items: list[str] = []
        for name in metric_order(postfix):
            item = f"{name}={postfix[name]}"
            if len(", ".join([*items, item])) + 2 > room:
                break
            items.append(item)
        bar.set_postfix_str(", ".join(items), refresh=False)

    def _shown(self, name: str) -> bool:
        return self.metrics is None or name in self.metrics

    def _means(self) -> dict[str, float]:
        self._fold()
        count = self._count
        means = {name: total / count for name, total in self._sums.items()} if count else {}
        for name, (total, n) in self._irregular.items():
            means[name] = total / n
        return means

    def _postfix_from_means(self) -> dict[str, str]:
        shown = {}
        for name, value in self._means().items():
            text = _format(value)
            if text is not None:
                shown[name] = text
        return shown

    def _fold(self) -> None:
        """Add the outputs of the batches since the last fold to the running means' sums.

        Per batch, ``after_batch`` only appends the outputs mapping to a list; the sums are made
        here, every ``stride`` batches (at most :data:`_FOLD_EVERY`), one sum per key in C (or
        one stacked reduction of tensors, :func:`_total`), so the means cost next to nothing per
        batch.
        """
        buffer = self._buffer
        if not buffer:
            return
        if self._keys is None:
            first = buffer[0]
            self._keys = tuple(
                name
                for name, value in first.items()
                if self._shown(name) and not isinstance(value, bool) and _format(value) is not None
            )
        if not self._irregular:
            try:
                totals = {name: _total(list(map(itemgetter(name), buffer))) for name in self._keys}
            except (KeyError, TypeError):  # a batch without a key, or with a non-number
                pass
            else:
                sums = self._sums
                for name, total in totals.items():
                    sums[name] = sums.get(name, 0) + total
                self._count += len(buffer)
                buffer.clear()
                return
            for name, total in self._sums.items():
                self._irregular[name] = [total, self._count]
            self._sums, self._count = {}, 0
        for outputs in buffer:
            for name, value in outputs.items():
                if isinstance(value, bool) or _format(value) is None or not self._shown(name):
                    continue
                cell = self._irregular.get(name)
                if cell is not None:
                    cell[0] += value
                    cell[1] += 1
                else:
                    self._irregular[name] = [value, 1]
        buffer.clear()

    def epoch_block(self, loop: Any, width: int) -> str:
        """The lines written when an epoch ends, each at most *width* characters wide.

        ``epoch 3/20 · 1.2s · train loss 0.4123 accuracy 0.9012 · valid loss ... · log lr 0.01``;
        when that is too wide every stream gets its own indented line, and a stream's metrics
        wrap in turn. The records are the ``printing`` plugin's (the epoch's log row, grouped by
        stream, ``(best)`` after a best-so-far value), with the running means of the train step
        where no plugin wrote the epoch's exact ones (``monitor``).
        """
        limit = f"/{loop.max_epochs}" if loop.max_epochs else ""
        head = f"epoch {loop.epoch}{limit} · {format_seconds(self._clock() - self._epoch_started)}"
        records: dict[str, Any] = {f"train.{k}": v for k, v in self._means().items()}
        for stream, metrics in self._eval_metrics.items():
            records.update({f"{stream}.{k}": v for k, v in metrics.items()})
        shown = ("train", *self._eval_metrics)
        for key, value in loop.log.current_row.items():
            stream, dot, name = key.partition(".")
            if not dot or stream not in shown or self._shown(name.removesuffix(".best")):
                records[key] = value  # the row's: monitor's exact means, lr, early stopping's best
        groups = []
        for stream, records_of in group_records(records, _EXCLUDE):
            items = []
            for name, value, best in records_of:
                text = _format(value)
                if text is not None and (stream not in shown or self._shown(name)):
                    items.append(f"{name} {text}{_best(text, best)}")
            if items:
                groups.append((stream, items))
        return fit_groups(head, groups, width, " · ")

    def _close(self, state: _Bar | None, postfix: Mapping[str, str] | None = None) -> None:
        if state is None:
            return
        bar = state.bar
        try:
            if state.pending or postfix:
                bar.n += state.pending  # drawn once, by close
                if postfix:
                    self._set_postfix(bar, postfix)
                state.pending = 0
            if bar.leave:
                bar.delay = 0  # a bar never drawn yet is drawn (once) when left on screen
        finally:
            bar.close()

    def _close_all(self) -> None:
        eval_bar, epoch_bar = self._eval, self._epoch
        self._eval = self._epoch = None
        try:
            self._close(eval_bar)
            self._close(epoch_bar)
        finally:
            if self._stack is not None:
                self._stack.close()
                self._stack = None

    def _open_epoch(self, loop: Any, initial: int) -> None:
        self._close(self._epoch)
        self._keys, self._sums, self._count, self._irregular = None, {}, 0, {}
        self._buffer.clear()
        self._eval_metrics = {}
        self._epoch_started = self._clock()
        total = _length(getattr(loop, "data", {}).get("train"))
        limit = f"/{loop.max_epochs}" if loop.max_epochs else ""
        self._epoch = self._open(f"epoch {loop.epoch + 1}{limit}", total, initial, self.leave)

    # -- hooks --------------------------------------------------------------------------------

    @hookimpl
    def before_training(self, loop: Any) -> None:
        """Decide whether bars are shown; route logging and warnings through ``tqdm.write``."""
        self.active = self.enabled and (self.force or sys.stdout.isatty())
        if not self.active:
            return
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._tqdm = tqdm
        stack = contextlib.ExitStack()
        stack.enter_context(logging_redirect_tqdm())
        previous = warnings.showwarning

        def show(
            message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
        ) -> None:
            text = warnings.formatwarning(message, category, filename, lineno, line)
            tqdm.write(text.rstrip("\n"), file=sys.stderr)

        warnings.showwarning = show

        def restore() -> None:
            warnings.showwarning = previous

        stack.callback(restore)
        self._stack = stack

    @hookimpl
    def on_resumption(self, loop: Any) -> None:
        """A run resumed in the middle of an epoch: its bar starts at ``loop.batch_in_epoch``."""
        if self.active and loop.in_epoch:
            self._open_epoch(loop, loop.batch_in_epoch)

    @hookimpl
    def before_epoch(self, loop: Any) -> None:
        """Open the epoch's bar."""
        if self.active:
            self._open_epoch(loop, 0)

    @hookimpl
    def after_batch(self, outputs: Mapping[str, Any]) -> None:
        """Count the batch, add its metrics to the epoch's means; refresh the bar when due."""
        state = self._epoch
        if state is None:
            return
        self._append(outputs)
        state.pending += 1
        if state.pending >= state.due:
            self._tick(state, outputs)

    @hookimpl
    def before_evaluation(self, loop: Any, stream: str) -> None:
        """Bring the epoch's bar up to date and open the stream's bar."""
        if not self.active:
            return
        if self._epoch is not None and self._epoch.pending:
            self._flush(self._epoch, None)
        if self.eval_bars:
            self._close(self._eval)
            total = _length(getattr(loop, "data", {}).get(stream))
            self._eval = self._open(stream, total, 0, False)

    @hookimpl
    def after_eval_batch(self) -> None:
        """Count an evaluation batch; refresh its bar when due."""
        state = self._eval
        if state is None:
            return
        state.pending += 1
        if state.pending >= state.due:
            self._tick(state, None)

    @hookimpl
    def after_evaluation(self, stream: str, metrics: Mapping[str, Any]) -> None:
        """Close the stream's bar; keep its metrics for the epoch's block."""
        state, self._eval = self._eval, None
        self._close(state)
        if self.active:
            self._eval_metrics[stream] = {k: v for k, v in metrics.items() if self._shown(k)}

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        """Close the epoch's bar and write the epoch's block under it."""
        state, self._epoch = self._epoch, None
        if state is None:
            return
        self._close(state, self._postfix_from_means())
        stream = self._stream()
        width = self.ncols or _columns(stream)
        self._tqdm.write(self.epoch_block(loop, max(20, width - 1)), file=stream)

    @hookimpl
    def on_interrupt(self) -> None:
        """Close every bar."""
        self._close_all()

    @hookimpl
    def after_training(self) -> None:
        """Close every bar and restore logging and warnings."""
        self._close_all()

    @hookimpl
    def on_error(self) -> None:
        """Close every bar and restore logging and warnings."""
        self._close_all()
