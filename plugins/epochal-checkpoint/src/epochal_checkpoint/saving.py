"""Taking a save: when it is due, its state and manifest, writing it (now or in the background),
and pruning the older checkpoints (the save machinery of the ``checkpoint`` plugin).

:class:`Saving` is a part of :class:`epochal_checkpoint.plugin.Checkpoint` (which holds the
hooks and the options); the writer thread and its back-pressure are in
:mod:`epochal_checkpoint.background`, the file format in :mod:`epochal_checkpoint.storage`.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epochal.errors import ConfigError
from epochal_checkpoint import incremental, naming, storage
from epochal_checkpoint import sharded as shards
from epochal_checkpoint.background import BackgroundWrites
from epochal_checkpoint.export import export_weights
from epochal_checkpoint.storage import store

if TYPE_CHECKING:
    from epochal.loop import Loop

__all__ = ["BEST_WEIGHTS", "LAST_WEIGHTS", "Saving", "collector_paused"]

#: the weights files ``export`` writes into the checkpoint directory.
LAST_WEIGHTS, BEST_WEIGHTS = "last.safetensors", "best.safetensors"


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block (where it was enabled).

    A save makes a few containers per tensor (its record, its view, its index entry), thousands
    for a model of thousands of tensors, and drops them when it ends. Collected while they live,
    they are promoted to the oldest generation, whose growth triggers full collections, each a
    walk of every object of the process (~340,000 with torch imported: 150-180 ms on the bench
    machine). Paused, they are freed by reference counting at the block's end and promote
    nothing; the collector runs again as before afterwards.
    """
    if not gc.isenabled():  # the program's own choice: left as it is
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Saving(BackgroundWrites):
    """How the checkpoint plugin saves (a mixin of :class:`epochal_checkpoint.plugin.Checkpoint`,
    whose ``__init__`` sets these attributes)."""

    _name: str
    _template: naming.Template | None
    _directory: Path | None
    _remote: store.RemoteStore | None
    _last_key: tuple[int, int] | None
    _sequence: int
    _base: incremental.LogBase | None
    _spare: list[Any]
    _best: dict[str, Any] | None
    #: this run's save warned that ``monitor`` is not logged (once per run)
    _monitor_warned: bool
    _best_exported: float | None
    _lineage: list[str]
    _own: list[str]
    _known: list[storage.CheckpointInfo]
    _damaged: set[str]
    _plugin_set: dict[str, dict[str, Any]]
    dir: str | None
    monitor: str | None
    mode: str
    greater_or_equal: bool
    export: str
    keep_last: int | None
    keep_best: int
    last_saved: Path | None
    _store: Callable[[], store.RemoteStore | None]

    def _warn_unlogged_monitor(self, loop: Any) -> None:
        """Warn once when ``monitor`` names a record the log does not have at a save although it
        should by now (its stream was evaluated, or it is no evaluation stream's and an epoch
        ended): a typo would otherwise leave no best checkpoint, without a word."""
        if self._monitor_warned:
            return
        stream = str(self.monitor).partition(".")[0]
        due = stream in loop.last_metrics if stream in loop.eval_streams else loop.epoch > 0
        if not due:
            return
        self._monitor_warned = True
        import difflib  # only for this warning

        records = sorted(k for k in loop.log.current_row if k != "epochs_done")
        match = difflib.get_close_matches(str(self.monitor), records, n=1, cutoff=0.5)
        hint = f" (did you mean {match[0]!r}?)" if match else ""
        shown = [k for k in records if k.startswith(f"{stream}.")] or records  # its stream's, if any
        warnings.warn(
            f"checkpoint: the monitored record {self.monitor!r} is not in the log{hint}; records "
            f"written: {', '.join(shown) or 'none'}. No checkpoint is ranked (best, keep_best, "
            'export, test_weights = "best") until it appears; set [plugins.checkpoint] monitor',
            UserWarning,
            stacklevel=2,
        )

    def _save(
        self, loop: Loop, reason: str, error: BaseException | None = None, periodic: bool = False
    ) -> None:
        """Take a save now (or defer a periodic one while the last write runs), with the cyclic
        garbage collector paused (:func:`collector_paused`)."""
        with collector_paused():
            self._take_save(loop, reason, error, periodic)

    def _take_save(self, loop: Loop, reason: str, error: BaseException | None, periodic: bool) -> None:
        key = (loop.epoch, loop.iteration)
        if key == self._last_key:
            self._pending = None
            return
        if periodic and self._inexact(loop):
            self._defer_to_window(loop, reason)
            return
        # back-pressure: a periodic save never waits for the disk, but an epoch end's: deferred,
        # it would become a mid-epoch checkpoint, which only the same number of processes resumes
        if periodic and reason != "epoch" and self._busy(loop):
            self._defer(loop, reason)
            return
        self._pending = None
        background = self.sharded and self.async_save  # every rank writes in its own thread
        if background:
            self._meet(loop)  # every rank's previous write done; a failure raised on every rank
        name = self._checkpoint_name(loop)
        # on several machines writing to a URL, every rank uploads its own files (its store)
        spread = self._store() if self.sharded and loop.world.several_nodes else None
        if self._directory is None:
            if not self._writer:  # another rank: its part of the state goes to rank 0, which writes
                if background:  # its own tensors it writes itself
                    _, (tmp, staged), name = self._stage_shards(loop, None, name, spread)
                    self._start(self._shards.write, loop.world, tmp, staged, None, name, spread)
                elif self.sharded:
                    shards.save_part(loop, None, name, spread)
                else:
                    loop.state_dict(log_rows=False)
                self._last_key = key
            return
        self.wait()
        self._sequence += 1
        prepared = None
        later: tuple[Path, dict[str, Any]] | None = None  # the staged tensors a thread writes
        if background:
            state, later, name = self._stage_shards(loop, self._directory, name, spread)
        elif self.sharded:
            state, prepared, name = shards.save_part(loop, self._directory, name, spread)
        else:
            state = loop.state_dict(log_rows=False)  # the rows go into segments: only what changed
        # plan() updates the base in place: until this write completes there is none, so a save
        # that fails (or never starts) makes the next one write every row
        base, self._base = self._base, None
        log_save = incremental.plan(loop.log, base, self._sequence)
        state["log"]["rows"] = log_save.inline
        snapshot = storage.flatten(state, copy_arrays=self.async_save, reuse=self._spare)
        metric = None
        if self.monitor:
            value = loop.log.last(self.monitor)
            metric = float(value) if storage.is_finite_number(value) else None
            if value is None:
                self._warn_unlogged_monitor(loop)
        if metric is not None and (self._best is None or self._better(metric, self._best["metric"])):
            self._best = {"epoch": loop.epoch, "iteration": loop.iteration, "metric": metric}
        manifest = {
            "sequence": self._sequence,
            "run_id": loop.run_id,
            "resumed_from": loop.resumed_from,
            "lineage": list(self._lineage),
            "epoch": loop.epoch,
            "iteration": loop.iteration,
            "batch_in_epoch": loop.batch_in_epoch,
            "reason": reason,
            "monitor": self.monitor,
            "mode": self.mode,
            "greater_or_equal": self.greater_or_equal,
            "metric": metric,
            "best": self._best,  # the run family's best save: `epochal export --best` checks it is kept
            "plugins": self._plugin_set,
            "deferred_saves": self.deferred,
        }
        best: dict[str, Any] | None = None  # the metadata of best.safetensors, when this save is it
        if self.export in ("best", "both") and metric is not None and self._improves(metric):
            best = {**self._metadata(loop), "epochal.monitor": self.monitor, "epochal.metric": repr(metric)}
            if later is None:  # sharded in the background: exported once the thread wrote the files
                weights = (
                    {"dcp": str(prepared[0])} if self.sharded and prepared is not None else state["model"]
                )
                self._export_best(weights, best)
            self._best_exported = metric
        if error is not None:  # --resume says so: plugins after this one had not seen the batch
            manifest["error_plugin"] = getattr(error, "epochal_plugin", None)
            manifest["error_hook"] = getattr(error, "epochal_hook", None)
        self._last_key = key
        if self.async_save:
            self._spare = snapshot.arrays  # reused by the next save, once this write is done
            if later is not None:
                shards_later = (loop.world, *later, best, spread)
                self._start(
                    self._write_later, self._directory, name, snapshot, manifest, log_save, shards_later
                )
            else:
                self._start(self._write, self._directory, name, snapshot, manifest, log_save)
        else:
            self._write(self._directory, name, snapshot, manifest, log_save, prepared, spread is not None)

    def _checkpoint_name(self, loop: Loop) -> str:
        """This save's name: the counters and the formatted ``filename`` template.

        On several processes rank 0 formats it from its log (plugins that run on rank 0 only
        log there only) and every rank takes rank 0's name, or its error (one collective).

        :raises ConfigError: a key of the template that is not logged (see :mod:`.naming`).
        """
        if self._template is None:
            return storage.checkpoint_name(loop.epoch, loop.iteration)
        tag, error = "", None
        if loop.world.is_zero:
            log = loop.log

            def logged() -> list[str]:
                return sorted({key for _, row in log.rows() for key in row})

            evaluated = {stream: stream in loop.last_metrics for stream in loop.eval_streams}
            counters = {"epoch": loop.epoch, "iteration": loop.iteration}
            try:
                tag = self._template.format(counters, log.last, evaluated, logged)
            except ConfigError as refused:
                error = str(refused)
        if loop.world.distributed:
            tag, error = loop.world.all_gather_object((tag, error))[0]
        if error is not None:
            raise ConfigError(error)
        return storage.checkpoint_name(loop.epoch, loop.iteration, tag)

    def _check_sharded(self, loop: Loop) -> None:
        """Refuse a model that cannot give its tensors to DCP; with ``async_save``, make the
        writers' group."""
        where = f"[plugins.{self._name}]"
        shards.check_model(loop.model, where)
        shards.check_keys(loop.world, where)  # every rank signs its own files: the same key
        if self.async_save:
            self._shards.open(loop.world)  # every rank, here: a collective

    def _improves(self, metric: float) -> bool:
        best = self._best_exported
        return best is None or self._better(metric, best)

    def _better(self, metric: float, than: float) -> bool:
        if self.greater_or_equal:
            return metric <= than if self.mode == "min" else metric >= than
        return metric < than if self.mode == "min" else metric > than

    @staticmethod
    def _metadata(loop: Loop) -> dict[str, Any]:
        return {
            "epochal.run_id": loop.run_id,
            "epochal.epoch": loop.epoch,
            "epochal.iteration": loop.iteration,
        }

    def _stage_shards(
        self, loop: Loop, directory: Path | None, name: str, spread: store.RemoteStore | None
    ) -> tuple[dict[str, Any], tuple[Path, dict[str, Any]], str]:
        """Every rank, on the training thread: the plain state, the temporary directory (made
        by rank 0) and this rank's tensors copied to host memory, for its writer thread."""
        model: Any = loop.model  # checked by check_model: it has the methods of a sharded save
        state = loop.state_dict(log_rows=False, model=False)
        state["model"] = model.rest_state_dict()
        tmp, name = shards.temporary(loop.world, directory, name, spread)
        self._unmet = True  # every rank starts its thread now: they meet before the next save
        return state, (tmp, self._shards.stage(model.sharded_state_dict())), name

    def _write_later(
        self,
        directory: Path,
        name: str,
        snapshot: storage.Snapshot,
        manifest: dict[str, Any],
        log_save: incremental.LogSave,
        shards_later: tuple[Any, Path, dict[str, Any], dict[str, Any] | None, store.RemoteStore | None],
    ) -> None:
        """Rank 0's writer thread of a sharded save: every rank's files, then the rest and the
        manifest (the commit) once the gather said every rank's files are durable."""
        world, tmp, staged, best, spread = shards_later
        files = self._shards.write(world, tmp, staged, directory, name, spread)
        del staged, shards_later  # the staging buffers stay with the stager, for the next save
        if best is not None:
            self._export_best({"dcp": str(tmp)}, best)
        self._write(directory, name, snapshot, manifest, log_save, (tmp, files), spread is not None)

    def _export_best(self, weights: Any, meta: dict[str, Any]) -> None:
        assert self._directory is not None
        best = export_weights(weights, self._directory / BEST_WEIGHTS, meta)
        if self._remote is not None:
            self._remote.put_extra(best)

    def _write(
        self,
        directory: Path,
        name: str,
        snapshot: storage.Snapshot,
        manifest: dict[str, Any],
        log_save: incremental.LogSave,
        prepared: tuple[Path, dict[str, dict[str, Any]]] | None = None,
        uploaded: bool = False,
    ) -> None:
        """Write checkpoint *name* (and upload it to the store); *uploaded*: the DCP files of
        *prepared* are in the store already, under *name*, which :func:`shards.temporary`
        settled there."""
        # the name is settled by write_checkpoint (-vN when taken): record the own list after it
        manifest[storage.OWN] = list(self._own)
        sources = log_save.sources()
        remote = self._remote
        if remote is not None and not uploaded:  # free in the store too (an unfinished upload may hold it)
            name = remote.free_name(name)
        info = storage.write_checkpoint(
            directory, name, snapshot, manifest, segments=sources, prepared=prepared
        )
        if remote is not None:  # committed by its manifest, uploaded last
            linked = {s.segment.name: s.where.name for s in sources if isinstance(s, storage.LinkedSegment)}
            remote.upload(info, linked, uploaded=set(prepared[1]) if uploaded and prepared else ())
        self._own.append(info.name)
        log_save.base.path, log_save.base.segments = info.path, list(info.segments or [])
        self._base = log_save.base
        self.last_saved = info.path
        self._known.append(info)
        self._prune(directory)

    def _prune(self, directory: Path) -> None:
        """Delete old checkpoints of this run family beyond keep_last/keep_best.

        With ``monitor`` set the best checkpoint (by the manifests' ``metric``) is always kept,
        even with ``keep_best = 0``.

        Only checkpoints this run family wrote (recorded in the manifests' ``written`` list),
        still under the name they were written with, whose manifest verified, are candidates;
        the order is the verified save sequence, and checkpoints found damaged are not counted
        (so a damaged newer checkpoint never costs a valid older one).
        """
        lineage, own = set(self._lineage), set(self._own)
        mine = [
            info
            for info in self._known
            if info.name in own
            and not info.renamed
            and info.name not in self._damaged
            and info.manifest.get("run_id") in lineage
        ]
        if self.keep_last is None or not mine:
            return
        keep = {mine[-1].name}  # the newest is what --resume continues from
        if self.keep_last:
            keep.update(info.name for info in mine[-self.keep_last :])
        # whenever a best is tracked the best checkpoint stays, whatever keep_best says: it is
        # what `epochal export --best` and a person looking for the best epoch want (issue 29)
        best = max(self.keep_best, 1) if self.monitor else 0
        if best:
            scored = [info for info in mine if storage.is_finite_number(info.manifest.get("metric"))]
            if self.greater_or_equal:  # ties: the newer first (the stable sort keeps this order)
                scored.reverse()
            scored.sort(key=lambda info: float(info.manifest["metric"]), reverse=self.mode == "max")
            keep.update(info.name for info in scored[:best])
        doomed = [info for info in mine if info.name not in keep]
        storage.finish_deletions(keep=4)  # deletions slower than saves: bound the backlog
        for info in doomed:
            try:
                if self._remote is not None:
                    self._remote.delete(info.name)
                else:
                    storage.delete_checkpoint(info.path, wait=False)
            except FileNotFoundError:
                pass
            except OSError as error:
                warnings.warn(
                    f"cannot delete old checkpoint {store.shown(info.path)!r}: {error.strerror or error}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            self._known.remove(info)
            self._own.remove(info.name)
        # No directory fsync for the deletions: one lost to a power cut brings back an older
        # checkpoint of this run family, listed as its own in the newest manifest (``written``,
        # saved before this prune), so the next run prunes it again. The next save's fsync of
        # the directory makes them durable anyway.
