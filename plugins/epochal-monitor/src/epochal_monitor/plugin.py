"""The ``monitor`` plugin: per-epoch aggregates of the train step's metrics as log records.

Ancestors: Blocks' ``TrainingDataMonitoring`` and ``DataStreamMonitoring``. The core already
evaluates the eval streams (``<stream>.<metric>`` records); this plugin aggregates what
``train_step`` returns over each epoch into ``train.<metric>`` records, writes running aggregates
(``train.<metric>.running``) every *n* batches (by default every 50, as Lightning logs a step
every 50; 0 = never), sets the loop's evaluation schedule when asked, and reports non-finite
values once per metric.

Sums are kept in float64 and added in batch order; the accumulators of an unfinished epoch are part
of :meth:`Monitor.state_dict`, so a run resumed in the middle of an epoch writes bitwise the same
``train.*`` records as an uninterrupted one.

On several processes the epoch records are reduced across the ranks at the epoch end (one
collective per epoch); the running records are each rank's own, so that logging every step adds
no collective to a step (``reduce = "step"`` reduces each running record too, as before).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from epochal import hookimpl
from epochal.protocol import NonEmptyStr, NonNegativeInt, Phase, Rank, checked_options
from epochal.triggers import every_n_batches as _every_n_batches

Aggregation = Literal["mean", "sum", "min", "max", "last"]
#: which records are reduced across the ranks: the epoch's only, or the running ones too.
Reduce = Literal["epoch", "step"]
AGGREGATIONS: tuple[str, ...] = ("mean", "sum", "min", "max", "last")
_MEAN, _SUM, _MIN, _MAX, _LAST = range(5)
#: aggregations that need no comparison, so device scalars are summed without being read.
_LAZY = frozenset({_MEAN, _SUM, _LAST})
_NAN = float("nan")
#: a running record every 50 training batches by default: Lightning's ``log_every_n_steps``.
DEFAULT_EVERY_N_BATCHES = 50


class NonFiniteMetricWarning(RuntimeWarning):
    """A train or eval metric was NaN or infinite (reported once per metric)."""


def _encode(value: float) -> float | str:
    """A float as JSON-able data: finite floats as themselves, others as "nan"/"inf"/"-inf"."""
    return value if math.isfinite(value) else repr(value)


def _on_device(value: Any) -> bool:
    """Whether *value* lives on an accelerator (a CUDA tensor): reading it makes the host wait."""
    device = getattr(value, "device", None)
    return device is not None and getattr(device, "type", "cpu") != "cpu"


def _read_all(values: list[Any]) -> list[float]:
    """Device scalars as floats, read in one copy (torch tensors) or one by one.

    Tensors are stacked as they are (no op per value: a detach and a reshape each cost more than
    the stack of a 50-batch window) and copied to the host once; scalars of shapes that differ
    are reshaped one by one first. Floating values come back as ``float()`` reads each; integers
    and booleans are converted on the host (an MPS device has no float64 to widen them to).
    """
    if values and type(values[0]).__module__.startswith("torch"):
        import torch

        with torch.no_grad():
            try:
                stacked = torch.stack(values)
            except RuntimeError:  # shapes that differ, e.g. () and (1,)
                stacked = torch.stack([v.reshape(()) for v in values])
            read = stacked.reshape(len(values)).tolist()
        return read if stacked.is_floating_point() else [float(v) for v in read]
    return [float(v) for v in values]


def _decode(value: Any) -> float:
    return float(value)


@checked_options("monitor")
class Monitor:
    """Aggregate the train step's outputs per epoch into ``train.<metric>`` log records.

    :param every_n_epochs: set the loop's ``eval_every_n_epochs`` (evaluate every eval stream
        after every n-th epoch; 0 = never). None keeps the loop's own setting.
    :param at_start: set the loop's ``eval_at_start`` (evaluate before the first epoch, epoch 0).
        None keeps the loop's own setting.
    :param every_n_batches: also write ``train.<metric>.running`` every n training batches: the
        aggregate of the batches since the previous running record. Default 50, as Lightning's
        ``log_every_n_steps``; 0 (or None) = never.
    :param aggregation: per-metric aggregation, ``{loss = "mean", grad_norm = "max"}``; one of
        mean (weighted by batch size), sum, min, max, last.
    :param default_aggregation: the aggregation of metrics not named in *aggregation*.
    :param prefix: the prefix of the records (``train`` gives ``train.loss``).
    :param reduce: on several processes, which records are reduced across the ranks: ``"epoch"``
        (``train.<metric>`` at the epoch end, one collective per epoch; the running records are
        each rank's own, rank 0's in the log) or ``"step"`` (the running records too, one
        collective per running record: with ``every_n_batches = 1``, one per step).
    """

    phase: ClassVar[Phase] = "measure"  # its records come first
    #: on several processes every rank accumulates its own batches; the epoch records are reduced
    #: across the ranks at the epoch end, so all ranks log them alike (see *reduce*).
    rank: ClassVar[Rank] = "all"

    def __init__(
        self,
        every_n_epochs: NonNegativeInt | None = None,
        at_start: bool | None = None,
        every_n_batches: NonNegativeInt | None = DEFAULT_EVERY_N_BATCHES,
        aggregation: dict[str, Aggregation] | None = None,
        default_aggregation: Aggregation = "mean",
        prefix: NonEmptyStr = "train",
        reduce: Reduce = "epoch",
    ) -> None:
        self.every_n_epochs = every_n_epochs
        self.at_start = at_start
        self.every_n_batches = every_n_batches or 0
        self.aggregation: dict[str, str] = dict(aggregation or {})
        self.default_aggregation = default_aggregation
        self.prefix = prefix
        self.reduce = reduce
        self._running_due = _every_n_batches(self.every_n_batches)
        self._reset()
        self._batch_size: Any = None
        #: the run's world when it has several processes (records are reduced across them).
        self._world: Any = None
        #: the running records are reduced across the ranks (several processes, reduce="step").
        self._reduce_steps = False

    def _reset(self) -> None:
        """Forget every accumulator and report: the state of a plugin that has seen no run."""
        #: metric → [kind, a, b] for the epoch in progress (see _update).
        self._epoch: dict[str, list[Any]] = {}
        #: metric → (its accumulator in _epoch, and: None without running records, its running
        #: record's name with one every batch, its accumulator in _window with one every n > 1
        #: batches), for the metrics not skipped: what the hot paths of after_batch look up.
        #: Reset with _epoch.
        self._hot: dict[str, tuple[list[Any], Any]] = {}
        #: the same since the last running record (only with every_n_batches). With running
        #: records a device scalar is kept in its window's accumulator alone, and added to the
        #: epoch's when the window is read (_fold_window): each value is read from the device once.
        self._window: dict[str, list[Any]] = {}
        #: metric → its window accumulator, for the metrics whose values were device scalars:
        #: what the hot path of n > 1 appends the next device scalar to.
        self._lazy: dict[str, list[Any]] = {}
        self._skip: set[str] = set()
        self._warned: set[str] = set()
        #: set by load_state_dict: the next run, if it is a resumed one, continues this state.
        self._restored = False

    # -- accumulation -------------------------------------------------------------------------

    def _kind(self, metric: str) -> int:
        return AGGREGATIONS.index(self.aggregation.get(metric, self.default_aggregation))

    @staticmethod
    def _start(kind: int) -> list[Any]:
        if kind == _MEAN:
            return [kind, 0.0, 0]
        if kind == _SUM:
            return [kind, 0.0, 0]
        return [kind, None, 0]

    @staticmethod
    def _update(acc: list[Any], value: float, size: int) -> None:
        kind = acc[0]
        if kind == _MEAN:
            acc[1] += value * size
            acc[2] += size
        elif kind == _SUM:
            acc[1] += value
            acc[2] += 1
        elif kind == _LAST:
            acc[1] = value
            acc[2] += 1
        else:
            current = acc[1]
            # the first value, a NaN (NaN is sticky), or a better value than a non-NaN current
            first_or_nan = current is None or value != value
            if first_or_nan or (
                current == current and (value < current if kind == _MIN else value > current)
            ):
                acc[1] = value
            acc[2] += 1

    @classmethod
    def _settle(cls, acc: list[Any]) -> None:
        """Fold the device scalars kept in *acc* (beyond its three fields) into it, in order."""
        if len(acc) <= 3:
            return
        pending = acc[3:]
        del acc[3:]
        values = _read_all([value for value, _ in pending])
        for value, (_, size) in zip(values, pending):
            cls._update(acc, value, size)

    @classmethod
    def _result(cls, acc: list[Any]) -> float:
        cls._settle(acc)
        kind, a, b = acc
        if kind == _MEAN:
            return float(a / b) if b else _NAN
        return float(a) if a is not None else _NAN

    def _results(self, accs: dict[str, list[Any]], across: bool = True) -> dict[str, float]:
        """The records of *accs*; on several processes (and *across*), of every rank's together.

        One all-gather per record; every rank combines the same values in rank order, so every
        rank writes bitwise the same records: mean = the sums over the ranks' summed sizes, sum,
        min and max over every rank's batches, last = the mean of the ranks' last values.
        """
        if self._world is None or not across:
            return {key: self._result(acc) for key, acc in accs.items()}
        for acc in accs.values():
            self._settle(acc)
        every = self._world.all_gather_object({key: tuple(acc) for key, acc in accs.items()})
        keys = sorted({key for accs_of_rank in every for key in accs_of_rank})
        out: dict[str, float] = {}
        for key in keys:
            parts = [rank[key] for rank in every if key in rank and rank[key][2]]
            if not parts:
                out[key] = _NAN
                continue
            kind = parts[0][0]
            if kind in (_MEAN, _SUM):
                total = [kind, 0.0, 0]
                for _, a, b in parts:
                    total[1] += a
                    total[2] += b
                out[key] = self._result(total)
            elif kind == _LAST:
                out[key] = float(sum(a for _, a, _ in parts) / len(parts))
            else:
                acc = self._start(kind)
                for _, a, _ in parts:
                    self._update(acc, a, 1)
                out[key] = self._result(acc)
        return out

    # -- hooks --------------------------------------------------------------------------------

    @hookimpl
    def before_training(self, loop: Any) -> None:
        """Apply ``every_n_epochs``/``at_start`` to the loop's evaluation schedule.

        A fresh run starts with no accumulator and no metric reported; a resumed run continues
        the state it loaded.
        """
        if not (self._restored and loop.resumed):
            self._reset()
        self._restored = False
        if self.every_n_epochs is not None:
            loop.eval_every_n_epochs = self.every_n_epochs
        if self.at_start is not None:
            loop.eval_at_start = self.at_start
        from epochal.data import batch_size  # imports numpy: only when a run starts

        self._batch_size = batch_size
        world = getattr(loop, "world", None)
        self._world = world if world is not None and world.distributed else None
        self._reduce_steps = self._world is not None and self.reduce == "step"

    @hookimpl
    def before_epoch(self) -> None:
        """Start the epoch's accumulators afresh."""
        self._epoch, self._hot = {}, {}

    @hookimpl
    def after_batch(self, loop: Any, batch: Any, outputs: Mapping[str, Any]) -> None:
        """Add the batch's metrics to the accumulators (and write running records when due)."""
        every = self.every_n_batches
        if self._reduce_steps:
            self._after_batch(loop, batch, outputs)
            return
        if every > 1:
            # A running record every n batches (the default, n = 50), inline: a metric seen
            # already this epoch whose value is a float costs one lookup (_hot: its epoch
            # and window accumulators) before its arithmetic, and the batch one counter check.
            # Any other value goes through _accumulate alone (device scalars kept lazily, a
            # first value, a non-number).
            hot = self._hot
            size = -1
            lazy = self._lazy
            for key, raw in outputs.items():
                entry = hot.get(key)
                if entry is None or type(raw) is not float:
                    window = lazy.get(key)
                    if window is not None and _on_device(raw):  # kept, read with the window
                        if size < 0:
                            size = self._batch_size(batch)
                        window.append((raw, size))
                        continue
                    self._accumulate(loop, batch, {key: raw})
                    if entry is None and key not in self._skip and key in self._epoch and key in self._window:
                        hot[key] = (self._epoch[key], self._window[key])
                    continue
                if raw - raw != 0.0:  # NaN or infinite
                    self._non_finite(f"{self.prefix}.{key}", raw, loop)
                if size < 0:
                    size = self._batch_size(batch)
                total, window = entry
                if total[0] == _MEAN:
                    total[1] += raw * size
                    total[2] += size
                    window[1] += raw * size
                    window[2] += size
                else:
                    self._update(total, raw, size)
                    self._update(window, raw, size)
            if loop.iteration % every == 0:
                self._write_running(loop)
            return
        if every == 0:
            # Epoch records only, on one process (the default), inline: a metric seen already this
            # epoch whose value is a float costs one lookup before its arithmetic; any other goes
            # through _after_batch alone (device scalars kept lazily, a first value, a non-number).
            hot = self._hot
            size = -1
            for key, raw in outputs.items():
                entry = hot.get(key)
                if entry is None or type(raw) is not float:
                    self._after_batch(loop, batch, {key: raw})
                    if entry is None and key not in self._skip and key in self._epoch:
                        hot[key] = (self._epoch[key], None)
                    continue
                if raw - raw != 0.0:  # NaN or infinite
                    self._non_finite(f"{self.prefix}.{key}", raw, loop)
                if size < 0:
                    size = self._batch_size(batch)
                mean = entry[0]
                if mean[0] == _MEAN:
                    mean[1] += raw * size
                    mean[2] += size
                else:
                    self._update(mean, raw, size)
            return
        # A running record every batch on one process (the per-step hot path, inline): the
        # window is this batch alone, so its record is computed from the value directly (the
        # same float operations as _update then _result on a fresh accumulator), with no window
        # kept. A metric seen already this epoch whose value is a float costs one lookup (_hot:
        # its accumulator and record name) before its arithmetic.
        hot = self._hot
        size = -1
        row = None
        for key, raw in outputs.items():
            entry = hot.get(key)
            if entry is not None and type(raw) is float:
                value = raw
            else:
                if key in self._skip:
                    continue
                try:
                    value = float(raw)
                except (TypeError, ValueError):
                    self._skip.add(key)  # not a number: not aggregated
                    hot.pop(key, None)
                    continue
            if value - value != 0.0:  # NaN or infinite
                self._non_finite(f"{self.prefix}.{key}", value, loop)
            if size < 0:
                size = self._batch_size(batch)
            if entry is None:  # the metric's first value this epoch (in the order of before)
                acc = self._epoch.get(key)
                if acc is None:
                    acc = self._epoch[key] = self._start(self._kind(key))
                entry = hot[key] = (acc, f"{self.prefix}.{key}.running")
            acc, name = entry
            kind = acc[0]
            if kind == _MEAN:
                acc[1] += value * size
                acc[2] += size
                running = (0.0 + value * size) / size if size else _NAN
            else:
                self._update(acc, value, size)
                running = 0.0 + value if kind == _SUM else value
            if row is None:
                row = loop.log.current_row
            row[name] = running

    def _after_batch(self, loop: Any, batch: Any, outputs: Mapping[str, Any]) -> None:
        """``after_batch`` in general: device scalars kept lazily, a window of running records."""
        self._accumulate(loop, batch, outputs)
        if self.every_n_batches and self._running_due(loop):
            self._write_running(loop)

    def _write_running(self, loop: Any) -> None:
        """Write the window's ``<prefix>.<metric>.running`` records and start a new window.

        The window's accumulators are started afresh in place (the hot path of n > 1 holds
        them); a metric with no value in this window (a count of 0) gets no record.
        """
        row = loop.log.current_row
        prefix = self.prefix
        self._fold_window()
        window = self._window
        seen = {key: acc for key, acc in window.items() if acc[2] or len(acc) > 3}
        for key, value in self._results(seen, self._reduce_steps).items():
            row[f"{prefix}.{key}.running"] = value
        for acc in window.values():
            acc[:] = self._start(acc[0])

    def _accumulate(self, loop: Any, batch: Any, outputs: Mapping[str, Any]) -> None:
        """Add *outputs* to the epoch's accumulators and, with running records, the window's."""
        size = -1
        epoch, window = self._epoch, self._window
        running = self.every_n_batches
        for key, raw in outputs.items():
            if key in self._skip:
                continue
            if type(raw) is float:  # the usual case: a host number, read as it is
                value = raw
            else:
                if _on_device(raw) and self._kind(key) in _LAZY:
                    # Kept as it is: reading it now would make the host wait for the device. The
                    # epoch's device scalars are read together, in one copy, when a record is due.
                    if size < 0:
                        size = self._batch_size(batch)
                    accs = window if running else epoch  # running: added to the epoch's when read
                    acc = accs.get(key)
                    if acc is None:
                        acc = accs[key] = self._start(self._kind(key))
                    acc.append((raw, size))
                    if running:
                        self._lazy[key] = acc
                    continue
                try:
                    value = float(raw)
                except (TypeError, ValueError):
                    self._skip.add(key)  # not a number: not aggregated
                    self._hot.pop(key, None)
                    continue
            if value - value != 0.0:  # NaN or infinite
                self._non_finite(f"{self.prefix}.{key}", value, loop)
            if size < 0:
                size = self._batch_size(batch)
            acc = epoch.get(key)
            if acc is None:
                acc = epoch[key] = self._start(self._kind(key))
            if acc[0] == _MEAN:  # _update's first case, without its call
                acc[1] += value * size
                acc[2] += size
            else:
                self._update(acc, value, size)
            if running:
                acc = window.get(key)
                if acc is None:
                    acc = window[key] = self._start(self._kind(key))
                self._update(acc, value, size)

    def _fold_window(self) -> None:
        """Read the device scalars kept in the window's accumulators (one copy per metric) and
        add them, in batch order, to the window's and to the epoch's accumulators."""
        epoch = self._epoch
        for key, acc in self._window.items():
            if len(acc) <= 3:
                continue
            pending = acc[3:]
            del acc[3:]
            total = epoch.get(key)
            if total is None:
                total = epoch[key] = self._start(acc[0])
            for value, (_, size) in zip(_read_all([value for value, _ in pending]), pending):
                self._update(acc, value, size)
                self._update(total, value, size)

    @hookimpl
    def after_evaluation(self, loop: Any, stream: str, metrics: Mapping[str, float]) -> None:
        """Report a non-finite evaluation metric once."""
        for key, value in metrics.items():
            try:
                if not math.isfinite(value):
                    self._non_finite(f"{stream}.{key}", value, loop)
            except TypeError:
                continue

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        """Write ``train.<metric>`` for the epoch that just ended."""
        row = loop.log.current_row
        prefix = self.prefix
        self._fold_window()
        for key, value in self._results(self._epoch).items():
            row[f"{prefix}.{key}"] = value
            if value - value != 0.0 and key not in self._skip:  # NaN or infinite, summed lazily
                self._non_finite(f"{prefix}.{key}", value, loop)
        self._epoch, self._hot = {}, {}

    def _non_finite(self, record: str, value: float, loop: Any) -> None:
        if record in self._warned:
            return
        self._warned.add(record)
        warnings.warn(
            f"monitor: {record} is {value!r} in epoch {loop.epoch + 1} at iteration {loop.iteration}; "
            "it is recorded as such (reported once per metric)",
            NonFiniteMetricWarning,
            stacklevel=2,
        )

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The accumulators of the unfinished epoch and window, and the metrics already reported."""

        def dump(accs: dict[str, list[Any]]) -> dict[str, Any]:
            for acc in accs.values():
                self._settle(acc)
            return {
                key: [AGGREGATIONS[kind], None if a is None else _encode(a), b]
                for key, (kind, a, b) in accs.items()
            }

        self._fold_window()
        return {"epoch": dump(self._epoch), "window": dump(self._window), "warned": sorted(self._warned)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s accumulators (a run resumed mid-epoch continues them)."""

        def load(accs: Mapping[str, Any]) -> dict[str, list[Any]]:
            return {
                key: [AGGREGATIONS.index(kind), None if a is None else _decode(a), b]
                for key, (kind, a, b) in accs.items()
            }

        self._epoch, self._hot, self._skip = load(state.get("epoch", {})), {}, set()
        self._window, self._lazy = load(state.get("window", {})), {}
        self._warned = set(state.get("warned", []))
        self._restored = True
