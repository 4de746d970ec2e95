"""The ``tensorboard`` plugin: the training log as TensorBoard event files.

Every numeric record of the training log (``train.loss``, ``valid.accuracy``, a plugin's
``lr``) becomes a scalar whose step is the record's iteration; the tag is the key with its first
``.`` made a ``/`` (``train/loss``, ``valid/loss``), so TensorBoard groups the cards by stream.
The run configuration is written as hyperparameters (the HParams dashboard) with the last value
of each scalar, and the model's parameters as histograms every ``histogram_every`` epochs.

Records are collected with the same cursor rule as ``sqlite_log`` (every ``flush_every``
iterations, at each epoch end, on an interrupt and at the end) and written with
``torch.utils.tensorboard.SummaryWriter`` (one event per row holding a scalar per record),
which writes through tensorboard's own event file
writer in a background thread.

Resume: a resumed run writes into the same directory with ``purge_step`` set to the restored
iteration + 1, so TensorBoard's reader discards the steps the earlier run wrote after the state
that was restored — the same rule as ``sqlite_log``'s ``superseded`` rows: no duplicated steps.

Nothing here stops training: a directory that cannot be written, or a write that fails, gives
one warning naming the plugin and what failed, and the plugin stops writing for that run.
"""

from __future__ import annotations

import fnmatch
import shlex
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from epochal import hookimpl
from epochal.protocol import NonNegativeInt, Phase, Rank, checked_options
from epochal.records import Cursor, flat_config

if TYPE_CHECKING:
    from epochal.loop import Loop


@checked_options("tensorboard")
class TensorBoard:
    """Write the run's numeric records, hyperparameters and parameter histograms for TensorBoard.

    :param dir: the directory of the event files; default ``<run_dir>/tensorboard``
        (``./tensorboard`` without a run directory). Point TensorBoard's ``--logdir`` at it, or
        at a parent holding the directories of several runs.
    :param flush_every: collect the new records after this many training iterations (they are
        also collected at every epoch end and when training ends).
    :param histogram_every: write a histogram of every model parameter every this many epochs
        (0: never).
    :param hparams: write the run configuration as hyperparameters at the end of the run.
    :param exclude: log keys not written, as ``fnmatch`` patterns (default: the ``timing``
        plugin's profiling records, which would outnumber the metrics' cards; ``[]`` writes them).
    """

    #: write after monitor, early stopping and checkpoint have logged the epoch's records.
    phase: ClassVar[Phase] = "report"  # the epoch's records and decisions are in the row
    #: on several processes only rank 0 writes (the records it logs are reduced across ranks).
    rank: ClassVar[Rank] = "zero"
    #: loaded only when named (``[plugins] order``, ``--plugins``): installing every plugin
    #: distribution must not mean event files in every run directory.
    autoload = False
    writes_to = ("dir",)  # its event files (epochal check-resume moves them)

    def __init__(
        self,
        dir: str | None = None,
        flush_every: NonNegativeInt = 100,
        histogram_every: NonNegativeInt = 0,
        hparams: bool = True,
        exclude: Sequence[str] = ("timing.*",),
    ) -> None:
        self.dir = dir
        self.flush_every = flush_every
        #: writing only at epoch ends (``flush_every = 0``): nothing to do after a batch.
        self.idle_hooks = frozenset() if flush_every else frozenset({"after_batch"})
        self.histogram_every = histogram_every
        self.hparams = hparams
        self.exclude = tuple(exclude)
        self._excluded: dict[str, bool] = {}
        self.log_dir: Path | None = None
        self._writer: Any = None
        self._cursor = Cursor()
        self._last: dict[str, float] = {}
        #: the number of scalars written by this run (for tests and benchmarks).
        self.scalars_written = 0

    # -- hooks --------------------------------------------------------------------------------

    @hookimpl
    def before_training(self, loop: Loop) -> None:
        """Open the event file writer; a resumed run purges the steps after the restored one."""
        self.close()
        if self.dir is not None:
            log_dir = Path(self.dir)
        elif loop.run_dir is not None:
            log_dir = Path(loop.run_dir) / "tensorboard"
        else:
            log_dir = Path("tensorboard")
        self.log_dir = log_dir
        self._cursor.start(loop.log, loop.iteration)
        self._last = {}
        self.scalars_written = 0
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            _warn(f"cannot write event files: torch.utils.tensorboard is not importable ({error})")
            return
        purge = loop.iteration + 1 if loop.resumed_from is not None else None
        try:
            self._writer = SummaryWriter(
                log_dir=str(log_dir), purge_step=purge, filename_suffix=f".{loop.run_id[:12]}"
            )
        except Exception as error:  # an unwritable directory, a full disk: training goes on
            _warn(f"cannot write event files in {log_dir}: {error}; no TensorBoard log for this run")
            self._writer = None

    @hookimpl
    def after_batch(self, loop: Loop) -> None:
        """Write the new records every ``flush_every`` iterations."""
        if self.flush_every and loop.iteration - self._cursor.iteration >= self.flush_every:
            self.write(loop)

    @hookimpl
    def after_epoch(self, loop: Loop) -> None:
        """Write the epoch's records (evaluation included) and, when due, the histograms."""
        self.write(loop)
        if self.histogram_every and loop.epoch % self.histogram_every == 0:
            self.write_histograms(loop)

    @hookimpl
    def on_interrupt(self, loop: Loop) -> None:
        """Write what was logged before the interrupt."""
        self.write(loop)

    @hookimpl
    def after_training(self, loop: Loop) -> None:
        """Write the last records and the hyperparameters; close the event file."""
        try:
            self.write(loop)
            if self.hparams:
                self.write_hparams(loop)
        finally:
            self.close()

    @hookimpl
    def run_summary(self) -> list[str]:
        """Where the event files are, as the command that shows them."""
        if self.log_dir is None or not self.log_dir.is_dir():
            return []
        return [f"tensorboard: tensorboard --logdir {shlex.quote(str(self.log_dir))}"]

    @hookimpl
    def on_error(self, loop: Loop) -> None:
        """Write what was logged before the failure and close the event file."""
        try:
            self.write(loop)
        finally:
            self.close()

    # -- writing ------------------------------------------------------------------------------

    def write(self, loop: Loop) -> int:
        """Write the numeric records new since the last write; return their count."""
        records = [r for r in self._cursor.collect(loop.log, loop.iteration) if not self._skip(r[1])]
        writer = self._writer
        if writer is None or not records:
            return 0
        from tensorboard.compat.proto.summary_pb2 import Summary

        # One event per row with a value per record (what add_scalar writes, one event each).
        key = ""
        try:
            file_writer = writer._get_file_writer()
            values: list[Any] = []
            step = records[0][0]
            for iteration, key, value in records:
                if iteration != step:
                    file_writer.add_summary(Summary(value=values), global_step=step)
                    values, step = [], iteration
                values.append(Summary.Value(tag=tag(key), simple_value=value))
                self._last[key] = value
            file_writer.add_summary(Summary(value=values), global_step=step)
        except Exception as error:
            self._fail(f"cannot write record {key!r}: {error}")
            return 0
        self.scalars_written += len(records)
        return len(records)

    def _skip(self, key: str) -> bool:
        skip = self._excluded.get(key)
        if skip is None:
            skip = self._excluded[key] = any(fnmatch.fnmatchcase(key, p) for p in self.exclude)
        return skip

    def write_histograms(self, loop: Loop) -> None:
        """A histogram of every parameter of the model, at the current iteration."""
        if self._writer is None:
            return
        name = ""
        try:
            for name, values in parameters(loop.model):
                self._writer.add_histogram(f"parameters/{name}", values, global_step=loop.iteration)
        except Exception as error:
            self._fail(f"cannot write the histogram of parameter {name!r}: {error}")

    def write_hparams(self, loop: Loop) -> None:
        """The run configuration as hyperparameters, with the last value of every scalar."""
        if self._writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        params = flat_config(loop.config)
        metrics = {tag(key): value for key, value in self._last.items()}
        try:
            writer = self._writer._get_file_writer()
            for summary in hparams(params, metrics):
                writer.add_summary(summary)
        except Exception as error:
            self._fail(f"cannot write the hyperparameters: {error}")

    def _fail(self, message: str) -> None:
        _warn(f"{message}; no more TensorBoard records for this run (the run goes on)")
        self.close()

    def close(self) -> None:
        """Flush and close the event file."""
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception as error:
                _warn(f"cannot close the event file in {self.log_dir}: {error}")


def tag(key: str) -> str:
    """The TensorBoard tag of a log key: its first ``.`` made a ``/`` (``valid.loss`` → ``valid/loss``)."""
    return key.replace(".", "/", 1)


def parameters(model: Any) -> list[tuple[str, Any]]:
    """``(name, numpy array)`` of the model's parameters (torch ``named_parameters`` or ``state_dict``)."""
    import numpy as np

    named = getattr(model, "named_parameters", None)
    if callable(named):
        return [(name, p.detach().cpu().numpy()) for name, p in named()]
    state = getattr(model, "state_dict", None)
    if not callable(state):
        return []
    found = []
    for name, value in state().items():
        array = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
        if array.dtype.kind in "fiu" and array.size:
            found.append((str(name), array))
    return found


def _warn(message: str) -> None:
    warnings.warn(f"tensorboard: {message}", RuntimeWarning, stacklevel=3)
