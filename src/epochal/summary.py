"""What ``epochal run`` tells a person: the line about a resumed state and the closing summary.

:class:`RunSummary` is registered by the CLI beside the run's plugins (it is not a plugin a
configuration names). It reads each epoch's log row once, in ``after_epoch``, so it costs nothing
per batch, and after training :meth:`RunSummary.lines` says, TTY or not: how the run ended and
the last and best value of every metric, then the lines every plugin adds through the
``run_summary`` hook (where the checkpoints and the log are, the commands that resume the run
and plot its log). The summary knows no plugin: each one speaks for itself.
"""

from __future__ import annotations

import fnmatch
import math
import sys
import warnings
from typing import Any

from epochal._dispatch import each_implementation
from epochal._markers import hookimpl
from epochal.console import JOB_LOG_WIDTH, fit_lines, fit_summary, metric_order, terminal_width

#: metrics where higher is better (glob patterns on the metric's name); lower wins otherwise.
MAXIMIZE = ("*acc*", "*accuracy*", "*auc*", "*f1*", "*precision*", "*recall*", "*score*", "*iou*")
#: records of a row that are not a stream's metric.
_NOT_METRICS = (".best", ".best_so_far", ".running")


def higher_is_better(key: str) -> bool:
    """Whether a larger value of metric *key* (``valid.accuracy``) is the better one."""
    name = key.rpartition(".")[2].lower()
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in MAXIMIZE)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def format_metrics(metrics: dict[str, float], epochs: dict[str, int] | None = None) -> str:
    """``loss=0.1234, accuracy=0.9611`` (with ``(epoch N)`` after each when *epochs* is given),
    in :func:`~epochal.console.metric_order` (losses first, then alphabetical)."""
    parts = []
    for name in metric_order(metrics):
        value = metrics[name]
        where = f" (epoch {epochs[name]})" if epochs and name in epochs else ""
        parts.append(f"{name}={value:.4g}{where}")
    return ", ".join(parts)


def resume_line(loop: Any) -> str:
    """One line naming what *loop* resumed from: the source its plugin named, run, counters."""
    source = loop.resumed_source
    where = str(source) if source is not None else "a saved state"
    run = f" of run {loop.resumed_from}" if loop.resumed_from else ""
    middle = f", batch {loop.batch_in_epoch} of epoch {loop.epoch + 1}" if loop.in_epoch else ""
    return (
        f"epochal: resumed from {where}{run} at epoch {loop.epoch}, iteration {loop.iteration}"
        f"{middle} (this run: {loop.run_id})"
    )


def say(line: str, ids: tuple[str | None, ...] = ()) -> None:
    """*line* on stderr, wrapped at spaces to ``$COLUMNS`` or the terminal (one line in a job
    log: a notice is what one greps for); where it is too wide, the run *ids* in it are cut to
    12 characters first (as the summary's)."""
    width = terminal_width(sys.stderr)
    for run_id in ids:
        if run_id and len(line) > width:
            line = line.replace(run_id, run_id[:12])
    print("\n".join(fit_lines(line, width)), file=sys.stderr, flush=True)


def nothing_left(loop: Any) -> str | None:
    """The notice for a resumed run that has nothing left to train (None: it has)."""
    for limit, count, option in (
        (loop.max_epochs, loop.epoch, "max_epochs"),
        (loop.max_iterations, loop.iteration, "max_iterations"),
    ):
        if limit is not None and count >= limit and not loop.in_epoch:
            return (
                f"epochal: nothing left to train: the state resumed is at {option} = {limit} already "
                f"({count} done); to train on, raise it (--set loop.{option}=N)"
            )
    return None


class RunSummary:
    """Collects the metrics of every epoch and writes the closing summary of ``epochal run``."""

    def __init__(self) -> None:
        #: stream → metric → last value.
        self.last: dict[str, dict[str, float]] = {}
        #: stream → metric → (best value, epoch).
        self.best: dict[str, dict[str, tuple[float, int]]] = {}
        #: (epoch, iteration) where this run started: a resumed run's restored counters.
        self.started = (0, 0)

    @hookimpl(tryfirst=True)
    def before_training(self, loop: Any) -> None:
        """Say what trains (the model's optional ``summary()`` line), before any progress bar."""
        summary = getattr(loop.model, "summary", None)
        if callable(summary):
            say(f"epochal: model {summary()}")

    @hookimpl(tryfirst=True)
    def on_resumption(self, loop: Any) -> None:
        """Say what the run resumed from, before any progress bar is drawn; note its earlier epochs."""
        self.started = (loop.epoch, loop.iteration)
        say(resume_line(loop), (loop.resumed_from, loop.run_id))
        done = nothing_left(loop)
        if done is not None:
            say(done)
        for _, row in loop.log.rows():
            epoch = row.get("epochs_done")
            if isinstance(epoch, int):
                self._note(loop, row, epoch)

    @hookimpl(trylast=True)
    def after_epoch(self, loop: Any) -> None:
        """Note the epoch's train and eval metrics (the other plugins have written their records)."""
        self._note(loop, loop.log.current_row, loop.epoch)

    def _note(self, loop: Any, row: Any, epoch: int) -> None:
        streams = ("train", *loop.eval_streams)
        for key, value in row.items():
            stream, _, metric = key.partition(".")
            if stream not in streams or not metric or key.endswith(_NOT_METRICS):
                continue
            number = _number(value)
            if number is None:
                continue
            self.last.setdefault(stream, {})[metric] = number
            best = self.best.setdefault(stream, {})
            previous = best.get(metric)
            better = higher_is_better(key)
            if previous is None or (number > previous[0] if better else number < previous[0]):
                best[metric] = (number, epoch)

    # -- the summary --------------------------------------------------------------------------

    def lines(self, loop: Any, elapsed: float | None = None, width: int | None = None) -> list[str]:
        """The closing summary of *loop*'s run, one ``epochal: ...`` line per fact.

        Fitted to *width* (default: ``$COLUMNS``, else the terminal's, else a job log's 120
        characters; see :func:`~epochal.console.fit_summary`).
        """
        status = loop.log.status
        took = f" ({elapsed:.3g} s)" if elapsed is not None else ""
        lines = [
            f"epochal: run {loop.run_id} {status['status']} after {loop.epoch} epoch(s), "
            f"{loop.iteration} batch(es): {status['finish_reason']}{took}"
        ]
        if loop.run_dir is not None:
            lines.append(f"epochal: directory: {loop.run_dir}")
        last = {
            stream: dict(metrics)
            for stream, metrics in sorted(self.last.items(), key=lambda i: i[0] != "train")
        }
        for stream, metrics in loop.last_metrics.items():  # evaluations after the last epoch too
            last.setdefault(stream, {}).update(
                {k: n for k, v in metrics.items() if (n := _number(v)) is not None}
            )
        for stream, metrics in last.items():
            label = "train (epoch)" if stream == "train" else stream  # means, or whole-epoch metric objects
            lines.append(f"epochal: last {label}: {format_metrics(metrics)}")
        for stream, best in self.best.items():
            if stream == "train" or loop.epoch < 2:
                continue
            values = {metric: value for metric, (value, _) in best.items()}
            epochs = {metric: epoch for metric, (_, epoch) in best.items()}
            lines.append(f"epochal: best {stream}: {format_metrics(values, epochs)}")
        lines.extend(f"epochal: {line}" for line in plugin_lines(loop))
        return fit_summary(
            lines, loop.run_id, terminal_width(default=JOB_LOG_WIDTH) if width is None else width
        )


def plugin_lines(loop: Any) -> list[str]:
    """Every plugin's ``run_summary`` lines, in call order.

    A plugin whose implementation raises or returns anything but strings is left out with one
    warning naming it; the other plugins' lines are kept.
    """
    lines: list[str] = []
    pm = loop.plugin_set.pm
    for name, call in each_implementation(pm, "run_summary", loop=loop):
        try:
            answer = call()
        except Exception as error:  # one plugin's failure must not hide the others' lines
            warnings.warn(
                f"plugin {name!r} raised in run_summary: {type(error).__name__}: {error}",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        if answer is None:
            continue
        if isinstance(answer, str) or not all(isinstance(line, str) for line in answer):
            warnings.warn(
                f"plugin {name!r}: run_summary must return a list of strings, not {answer!r:.80}",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        lines.extend(answer)
    return lines
