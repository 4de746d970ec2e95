"""The ``checkpoint`` and ``load`` plugins.

``checkpoint`` saves ``loop.state_dict()`` on triggers (every n epochs/batches/seconds, at the
end, on interrupt, on an error raised at a batch boundary), keeps the last and the best ones, and
resumes a run from its newest complete checkpoint (``epochal run CONFIG --resume``).
``load`` (:mod:`epochal_checkpoint.load`, re-exported here with :func:`read_from`, and the checks
of :mod:`epochal_checkpoint.fit`) starts a run from a given checkpoint: the full state, or the
model's arrays only.

The format and the crash-safe write are in :mod:`epochal_checkpoint.storage`.
"""

from __future__ import annotations

import shlex
import sys
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from epochal import hookimpl, triggers
from epochal.errors import ConfigError
from epochal.protocol import NonNegativeFloat, NonNegativeInt, Phase, Rank, checked_options
from epochal_checkpoint import incremental, naming, storage
from epochal_checkpoint import sharded as shards
from epochal_checkpoint.background import AsyncShards
from epochal_checkpoint.errors import (
    CheckpointNotFoundError,
    CheckpointWriteError,
)
from epochal_checkpoint.export import export_weights, exported_metric
from epochal_checkpoint.fit import check_fits, check_model, structure_mismatches
from epochal_checkpoint.load import Load, load_destinations, read_from
from epochal_checkpoint.lock import DirectoryLock, live_holder
from epochal_checkpoint.nodes import refuse_node_local
from epochal_checkpoint.saving import BEST_WEIGHTS, LAST_WEIGHTS, Saving
from epochal_checkpoint.storage import store

if TYPE_CHECKING:
    from epochal.loop import Loop

# Load, read_from and the fit checks live in their own modules; their old import path stays.
__all__ = [
    "BEST_WEIGHTS",
    "BOUNDARY_HOOKS",
    "LAST_WEIGHTS",
    "Checkpoint",
    "Load",
    "check_fits",
    "check_model",
    "exported_metric",
    "load_destinations",
    "read_from",
    "structure_mismatches",
]

#: the hooks that raise at a batch boundary: an error from another plugin's implementation of
#: one of them leaves the model, the streams and the counters consistent, so it can be saved.
BOUNDARY_HOOKS = frozenset({"after_batch", "after_epoch", "on_interrupt", "after_training"})


def _plugin_name(loop: Loop, plugin: object, default: str) -> str:
    return next((name for name, p in loop.plugins.items() if p is plugin), default)


@checked_options("checkpoint")
class Checkpoint(Saving):
    """Save the loop's state atomically on triggers, keep the last/best, resume the newest.

    :param dir: the checkpoint directory (default ``<[loop] run_dir>/checkpoints``), or any
        fsspec URL (``s3://bucket/prefix``, ``gs://...``, ``memory://...``): see
        :mod:`epochal_checkpoint.storage.store`.
    :param storage_options: keyword arguments of the URL's filesystem (``fsspec.url_to_fs``):
        endpoint, credentials...; also used for a URL given to ``--resume``.
    :param every_n_epochs: save after every n-th epoch (0: never).
    :param every_n_batches: save after every n-th training batch (0: never).
    :param every_n_seconds: save after a batch when this much wall time passed since the last
        such save (0: never).
    :param save_at_end: save when training ends (unless that state was just saved).
    :param save_on_interrupt: save when SIGINT/SIGTERM stopped training.
    :param save_on_error: save when another plugin's ``after_batch``, ``after_epoch``,
        ``on_interrupt`` or ``after_training`` raised (the state is at a batch boundary then);
        never when the model or the data raised (mid-step).
    :param keep_last: keep this many newest checkpoints of this run (None: keep all).
    :param keep_best: also keep this many best checkpoints by ``monitor`` (with ``monitor``
        set the best one is kept in any case).
    :param monitor: the log key ranking checkpoints for ``keep_best`` (e.g. ``valid.loss``).
    :param mode: ``min`` or ``max``: which values of ``monitor`` are best.
    :param async_save: copy the state in memory and write it in a background thread. A
        periodic save (every n epochs/batches/seconds) that comes due while the previous write
        is still running is deferred, not waited for: it is taken at the first batch or epoch
        end after that write finished (several due meanwhile make one save). So the loop never
        waits longer than one in-memory copy; a warning says so once per run and
        :attr:`deferred` (and each manifest's ``deferred_saves``) counts them. Saves at the end,
        on interrupt and on error wait for the write in flight and are always written. Sharded
        saves too: every rank writes its own part in its own thread, committed by rank 0 once
        every rank's files are durable (:mod:`epochal_checkpoint.background`).
    :param export: also write the model's weights as a ``.safetensors`` file in the checkpoint
        directory: ``"last"`` (``last.safetensors`` when training ends), ``"best"``
        (``best.safetensors`` whenever a save has the best ``monitor`` value so far), ``"both"``
        or ``"none"``. ``safetensors.torch.load_file`` reads them into the same module.
    :param format: ``"single"``: rank 0 writes the whole state (gathered); ``"sharded"``: every
        rank writes its own tensors in parallel through ``torch.distributed.checkpoint``
        (:mod:`epochal_checkpoint.sharded`); ``"auto"``: sharded when the model says
        ``sharded`` is True (an FSDP-sharded TorchModel), single otherwise.
    :param filename: a template of metrics appended to each checkpoint's name, e.g.
        ``"{epoch}-{valid.loss:.3f}"`` (``ckpt-e0003-i000069_3-0.412``): see
        :mod:`epochal_checkpoint.naming`. None: the bare ``ckpt-e<epoch>-i<iteration>``.
    :param greater_or_equal: a ``monitor`` value equal to the best counts as the new best (the
        newer checkpoint wins ties, Ignite's ``greater_or_equal``); false: the older one stays best.
    """

    phase: ClassVar[Phase] = "save"  # after every decision: a resumed run holds them
    #: where it writes (epochal check-resume moves it): unset, under the run directory.
    writes_to = ("dir",)
    #: on several processes it runs on every rank: ``loop.state_dict()`` is a collective, and the
    #: triggers are agreed, so every rank snapshots at the same point; only rank 0 writes (the
    #: directory, its lock, pruning, exports): see ``_writer``.
    rank: ClassVar[Rank] = "all"

    def __init__(
        self,
        dir: str | None = None,
        every_n_epochs: NonNegativeInt = 1,
        every_n_batches: NonNegativeInt = 0,
        every_n_seconds: NonNegativeFloat = 0.0,
        save_at_end: bool = True,
        save_on_interrupt: bool = True,
        save_on_error: bool = True,
        keep_last: NonNegativeInt | None = 3,
        keep_best: NonNegativeInt = 0,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        async_save: bool = False,
        export: Literal["none", "last", "best", "both"] = "none",
        storage_options: dict[str, Any] | None = None,
        format: Literal["auto", "single", "sharded"] = "auto",
        filename: str | None = None,
        greater_or_equal: bool = False,
    ) -> None:
        where = "[plugins.checkpoint]"
        #: the parsed ``filename`` template (None: bare names); checked here, before any batch.
        self._template = naming.Template(filename, where) if filename else None
        self.filename, self.greater_or_equal = filename, greater_or_equal
        if export in ("best", "both") and not monitor:
            raise ConfigError(f'{where} export = "{export}" needs monitor = "<log key>" (e.g. valid.loss)')
        if keep_best and not monitor:
            raise ConfigError(
                f'{where} keep_best = {keep_best} needs monitor = "<log key>" (e.g. valid.loss)'
            )
        self._epoch_due = triggers.every_n_epochs(every_n_epochs)
        self._batch_due = triggers.every_n_batches(every_n_batches)
        self._seconds_due = triggers.every_n_seconds(every_n_seconds)
        self.dir = dir
        self.storage_options = storage_options
        #: the store of a ``dir`` that is an fsspec URL (None: a local directory).
        self._remote: store.RemoteStore | None = None
        self.every_n_epochs, self.every_n_batches, self.every_n_seconds = (
            every_n_epochs,
            every_n_batches,
            every_n_seconds,
        )
        self.save_at_end, self.save_on_interrupt, self.save_on_error = (
            save_at_end,
            save_on_interrupt,
            save_on_error,
        )
        self.keep_last, self.keep_best, self.monitor, self.mode = keep_last, keep_best, monitor, mode
        self.async_save = async_save
        self.export = export
        self.format = format
        #: whether this run's saves are sharded (``format``, resolved when training starts).
        self.sharded = False
        #: hooks the loop need not call (see epochal's writing-plugins guide): without a batch or
        #: time trigger, and with synchronous saves (nothing deferred), no save comes due after a
        #: batch.
        self.idle_hooks = (
            frozenset() if every_n_batches or every_n_seconds or async_save else frozenset({"after_batch"})
        )
        #: the idle hooks its options make (a save deferred to a batch end listens meanwhile).
        self._quiet = self.idle_hooks
        #: the best ``monitor`` value exported to best.safetensors so far (None: none yet).
        self._best_exported: float | None = None
        #: the run family's best save so far (epoch, iteration, metric), recorded in each manifest.
        self._best: dict[str, Any] | None = None
        self._monitor_warned = False
        #: run ids of this run and the runs it resumed from (from the resumed checkpoint's
        #: manifest): only their checkpoints are pruned.
        self._lineage: list[str] = []
        self._directory: Path | None = None
        self._known: list[storage.CheckpointInfo] = []
        self._sequence = 0
        self._last_key: tuple[int, int] | None = None
        self._plugin_set: dict[str, dict[str, Any]] = {}
        self._name = "checkpoint"
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._shards = AsyncShards()
        self._unmet = False
        self._spare: list[Any] = []
        #: the log as the newest complete checkpoint of this run holds it (None: save it whole).
        self._base: incremental.LogBase | None = None
        self._resumed: tuple[storage.CheckpointInfo, dict[str, Any]] | None = None
        #: the path of the newest checkpoint written by this run (None before the first).
        self.last_saved: Path | None = None
        #: names of the checkpoints this run family wrote and keeps (recorded in each manifest):
        #: rotation deletes only these, never anything that merely looks like a checkpoint.
        self._own: list[str] = []
        #: checkpoints that failed verification when resuming: never counted, never pruned.
        self._damaged: set[str] = set()
        self._lock: DirectoryLock | None = None
        #: the checkpoint this run resumed from (None for a fresh run).
        self.resumed_path: Path | None = None
        #: whether this process writes checkpoints (on several processes: rank 0 only).
        self._writer = True
        #: periodic saves deferred because the previous asynchronous write was still running.
        self.deferred = 0
        #: the reason of a deferred save still to take (None: none).
        self._pending: str | None = None
        self._window_warned = False

    # -- hooks ------------------------------------------------------------------------------------

    @hookimpl
    def resume_state(self, loop: Loop, resume: bool) -> dict[str, Any] | None:
        """With ``--resume``: the state of the newest complete checkpoint that verifies.

        ``--resume auto`` starts afresh (with a notice) when the directory holds no checkpoint
        directory at all, and refuses like ``--resume`` when it holds only damaged ones;
        ``--resume PATH`` reads that checkpoint (or directory of checkpoints).
        """
        if not resume:
            return None
        self._check_shared(loop.run_dir)
        directory = self.directory(loop)
        remote = self._store()
        mode = loop.resume if isinstance(loop.resume, str) else "latest"
        if directory.is_dir() and remote is None:
            self._claim(directory, loop)
            storage.clean_temporaries(directory)
        into = load_destinations(loop)
        if mode not in ("latest", "auto"):
            state, where = read_from(mode, storage_options=self.storage_options, known=remote, into=into)
            manifest = storage.read_manifest(where)
            check_fits(loop, state, where)
            shards.read_from_store(loop.world, state, self.storage_options)
            self._adopt(loop, directory, storage.CheckpointInfo(where, manifest), state, [])
            return state
        try:
            read, failures = remote.find_latest() if remote else storage.find_latest(directory, into=into)
        except CheckpointNotFoundError as error:
            # a fresh start only where no checkpoint directory exists at all: damaged ones
            # (a manifest that does not verify) are refused as by --resume, never started over
            listing = remote.checkpoints if remote else lambda: storage.list_checkpoints(directory)
            damaged = listing()[1] if mode == "auto" else []
            if mode == "auto" and damaged:
                raise CheckpointNotFoundError(
                    f"cannot resume: {error} (--resume auto starts a fresh run only where no "
                    "checkpoint exists; repair or move away the damaged ones)"
                ) from None
            if mode == "auto":
                print(
                    "epochal: --resume auto: no complete checkpoint in "  # as every line of a run
                    f"{store.shown(directory)!r} yet; starting a fresh run",
                    file=sys.stderr,
                    flush=True,
                )
                return None
            raise CheckpointNotFoundError(f"cannot resume: {error}") from None
        state = read.state
        check_fits(loop, state, read.path)
        shards.read_from_store(loop.world, state, self.storage_options)
        info = storage.CheckpointInfo(read.path, read.manifest, read.segments, read.inline_rows)
        self._adopt(loop, directory, info, state, failures)
        return state

    def _adopt(
        self,
        loop: Loop,
        directory: Path,
        info: storage.CheckpointInfo,
        state: dict[str, Any],
        failures: list[tuple[Path, str]],
    ) -> None:
        """Take over the bookkeeping of the run family that wrote checkpoint *info*."""
        manifest = info.manifest
        if manifest.get("reason") == "error":
            warnings.warn(
                f"resuming from checkpoint {str(info.path)!r}, saved when plugin "
                f"{manifest.get('error_plugin')!r} raised in {manifest.get('error_hook')!r}: plugins "
                "ordered after it had not seen that batch, so this resume may not match a straight run",
                RuntimeWarning,
                stacklevel=3,
            )
        # The lineage is bookkeeping of the runs, not training state: it comes from the manifest
        # of the checkpoint resumed from, so the loop's state stays identical to a straight run's.
        self._lineage = [str(run_id) for run_id in manifest.get("lineage", [])]
        best = manifest.get("best")
        self._best = best if isinstance(best, dict) and storage.is_finite_number(best.get("metric")) else None
        same_directory = _same_dir(info.path.parent, directory)
        own = [*manifest.get(storage.OWN, []), info.path.name] if not info.renamed else []
        self._own = own if same_directory else []
        self._damaged = {path.name for path, _ in failures if _same_dir(path.parent, directory)}
        self._resumed = (info, state["log"]["rows"])
        self.resumed_path = info.path
        loop.resumed_source = f"checkpoint {store.shown(info.path)}"

    def _claim(self, directory: Path, loop: Loop) -> None:
        if self._lock is None or self._lock.directory != directory:
            self._release()
            self._name = _plugin_name(loop, self, "checkpoint")  # resume_state comes first
            self._lock = DirectoryLock(directory, loop.run_id, self._name)
        self._lock.acquire()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    @hookimpl
    def before_training(self, loop: Loop) -> None:
        """Lock and prepare the directory, clean leftovers, note the checkpoints already there."""
        self._name = _plugin_name(loop, self, "checkpoint")
        self._check_shared(loop.run_dir)  # on every rank: they all fail alike, before any save
        self.sharded, self._unmet = shards.wanted(self.format, loop.model), False
        if self.sharded:
            self._check_sharded(loop)
        # The one place where the rank matters: on several processes every rank takes part in
        # the saves (the state is a collective) and only rank 0 touches the directory.
        self._writer = loop.world.is_zero
        if not self._writer:
            self._directory = None
            self._last_key = (loop.epoch, loop.iteration) if loop.resumed else None
            return
        directory = self.directory(loop)
        remote = self._store()
        if remote is not None:  # unreachable, no bucket, no right to write: one line, nothing written
            remote.probe()
        try:
            storage.make_directory(directory)
        except OSError as error:
            raise CheckpointWriteError(
                f"cannot create checkpoint directory {str(directory)!r}: {error.strerror or error}"
            ) from None
        self._claim(directory, loop)
        if remote is not None:  # a local directory's leftovers go in the listing below (one listing)
            storage.clean_temporaries(directory)
        self._directory = directory
        self._known, _ignored = (
            remote.checkpoints() if remote else storage.list_checkpoints(directory, clean=True)
        )
        if remote is not None:
            remote.clean_leftovers()
            if loop.resumed:
                remote.get_extra(BEST_WEIGHTS, directory)
        self._sequence = max((info.order[0] for info in self._known), default=0)
        if not loop.resumed:
            self._lineage, self._own, self._damaged, self._best = [], [], set(), None
            if self._known:
                warnings.warn(
                    f"checkpoint directory {store.shown(directory)!r} already holds {len(self._known)} "
                    f"checkpoint(s) of earlier runs (newest: {self._known[-1].name}); this fresh run "
                    "keeps them and does not prune them (`epochal run --resume` continues the newest)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self._lineage = [*(r for r in self._lineage if r != loop.run_id), loop.run_id]
        self._last_key = (loop.epoch, loop.iteration) if loop.resumed else None
        self.deferred, self._pending = 0, None
        resumed, self._resumed = self._resumed, None
        self._base = None
        if loop.resumed and resumed is not None:  # its segments are linked by the next save
            self._base = incremental.resumed_base(loop.log, *resumed)
        self._best_exported = exported_metric(directory / BEST_WEIGHTS) if loop.resumed else None
        self._monitor_warned = False
        self._plugin_set = {
            info.name: {"distribution": info.distribution, "version": info.version}
            for info in loop.plugin_set.infos
            if info.status == "loaded"
        }

    @hookimpl
    def after_batch(self, loop: Loop) -> None:
        """Save every n batches / every n seconds (or a save deferred until the writer is idle)."""
        due = self._batch_due(loop)
        if self.every_n_seconds:
            seconds = self._seconds_due(loop)
            if loop.world.distributed:  # clocks differ: rank 0's decides, for every rank
                seconds = loop.world.all_reduce([seconds and loop.world.is_zero], "max")[0] > 0
            due = seconds or due
        if due:
            self._save(loop, "batch", periodic=True)
        elif self._pending is not None and not self._inexact(loop) and not self._busy(loop):
            self._save(loop, self._pending, periodic=True)
            self._listen(loop, batches=False)

    @hookimpl
    def after_epoch(self, loop: Loop) -> None:
        """Save every n epochs (or a save deferred until the writer is idle)."""
        if self._epoch_due(loop):
            self._save(loop, "epoch", periodic=True)
        elif self._pending is not None and not self._inexact(loop) and not self._busy(loop):
            self._save(loop, self._pending, periodic=True)
        elif self._unmet and not self._busy(loop):  # sharded writes done: their failure said now
            self._meet(loop)

    @hookimpl
    def on_interrupt(self, loop: Loop) -> None:
        """Save the state a signal stopped at; wait for the write."""
        if self.save_on_interrupt:
            self._save(loop, "interrupt")
        self._meet(loop)
        storage.finish_deletions()

    @hookimpl
    def after_training(self, loop: Loop) -> None:
        """Save the final state (unless just saved); wait for any write in flight."""
        try:
            # a sharded run's last weights are read back from its final checkpoint: save it
            exports_last = self.export in ("last", "both")
            if self.save_at_end or self._pending is not None or (self.sharded and exports_last):
                self._save(loop, "end" if self.save_at_end else self._pending or "end")
            self._meet(loop)
            if exports_last and self._directory is not None:
                model_state = (
                    {"dcp": str(self.last_saved)}
                    if self.sharded and self.last_saved is not None
                    else loop.model.state_dict()
                )
                last = export_weights(model_state, self._directory / LAST_WEIGHTS, self._metadata(loop))
                if self._remote is not None:
                    self._remote.put_extra(last)
        finally:
            self._spare = []
            self._shards.close()
            storage.finish_deletions()
            self._release()
            if self._remote is not None:
                self._remote.close()

    @hookimpl
    def on_error(self, loop: Loop, error: BaseException) -> None:
        """Save if another plugin raised at a batch boundary; always wait for the write."""
        try:
            if self.save_on_error and self._directory is not None and self._at_boundary(loop, error):
                self._save(loop, "error", error)
        finally:
            failed = self.wait(raise_error=False)  # this rank's: its peers may not be here
            self._shards.close()
            storage.finish_deletions()
            self._release()
            if self._remote is not None:
                self._remote.close()
            if failed is not None:
                warnings.warn(f"epochal-checkpoint: {failed}", RuntimeWarning, stacklevel=2)

    # -- saving -----------------------------------------------------------------------------------

    def directory(self, loop: Loop) -> Path:
        """The checkpoint directory of *loop*'s run."""
        return self._directory_for(loop.run_dir)

    def _store(self) -> store.RemoteStore | None:
        """The store of ``dir`` when it is an fsspec URL (None: a local directory)."""
        if self._remote is None and store.is_remote(self.dir):
            self._remote = store.RemoteStore(str(self.dir), self.storage_options)
        return self._remote

    def _check_shared(self, run_dir: str | Path | None) -> None:
        """On several machines, refuse a directory relative to each one's working directory."""
        if self.dir:
            refuse_node_local(str(self.dir), f"[plugins.{self._name}] dir")
        elif run_dir is not None:
            refuse_node_local(str(Path(run_dir) / "checkpoints"), "[loop] run_dir")

    def _directory_for(self, run_dir: str | Path | None) -> Path:
        """The checkpoint directory of a run whose ``[loop] run_dir`` is *run_dir* (for a
        URL: the local staging directory of its store)."""
        if self.dir:
            remote = self._store()
            return remote.staging if remote is not None else store.local_path(self.dir)
        if run_dir is None:
            raise ConfigError(
                "plugin 'checkpoint' has no directory: set [plugins.checkpoint] dir or [loop] run_dir "
                "(or disable the plugin)"
            )
        return Path(run_dir) / "checkpoints"

    def _at_boundary(self, loop: Loop, error: BaseException) -> bool:
        if not isinstance(error, Exception):  # a third Ctrl-C (KeyboardInterrupt) lands anywhere
            return False
        if loop.world.distributed:  # one rank's error is no boundary the other ranks agreed on
            return False
        plugin = loop.error_plugin
        hook = getattr(error, "epochal_hook", None)
        return plugin is not None and plugin != self._name and hook in BOUNDARY_HOOKS

    @staticmethod
    @hookimpl
    def register_commands(cli: Any) -> None:
        """Add ``epochal export``: a checkpoint's model weights as a safetensors file."""
        from epochal_checkpoint.commands import export_command

        cli.add_command(export_command)

    @hookimpl
    def run_summary(self, loop: Loop) -> list[str]:
        """Where the checkpoints and the exported weights are, and the command that resumes the run."""
        if store.is_remote(self.dir):
            lines = [f"checkpoints: {self.dir}"]
        else:
            try:
                directory = self.directory(loop)
            except ConfigError:  # no directory configured: nothing to point at
                return []
            lines = [f"checkpoints: {directory}"]
            exported = [Path(directory) / name for name in (BEST_WEIGHTS, LAST_WEIGHTS)]
            if any(path.is_file() for path in exported):
                lines.append(f"weights: {', '.join(str(path) for path in exported if path.is_file())}")
        if loop.command:
            lines.append(f"resume: {shlex.join([*loop.command, '--resume'])}")
        return lines

    @hookimpl
    def best_model_state(self, loop: Loop, read: bool) -> Any:
        """The model state of the saved checkpoint with the best ``monitor`` value, for
        ``[loop] test_weights = "best"`` (None without a ``monitor``, or before such a save)."""
        if not self.monitor:
            return None
        if not read:
            return f"the checkpoint with the {'lowest' if self.mode == 'min' else 'highest'} {self.monitor}"
        from epochal_checkpoint.commands import _best, _describe, _read_best

        self.wait()
        try:
            candidates = _best(self.directory(loop))
        except CheckpointNotFoundError:
            return None
        state, info = _read_best(candidates, None)
        return state["model"], f"checkpoint {info.path} ({_describe(info.manifest, True)})"

    @hookimpl
    def latest_checkpoint(self, run_dir: Path | None) -> str | None:
        """The newest complete checkpoint in this run's directory (for the launcher's message)."""
        try:
            remote = self._store()
            infos, _ = (
                remote.checkpoints() if remote else storage.list_checkpoints(self._directory_for(run_dir))
            )
        except Exception:  # no directory, or none readable: nothing to name
            return None
        if not infos:
            return None
        return remote.where(infos[-1].name) if remote else str(infos[-1].path)

    @hookimpl
    def check_fresh_run(self, run_dir: Path | None, command: Sequence[str]) -> str | None:
        """Refuse a fresh run into a directory a live run holds, or that holds an earlier run's
        checkpoints.

        A live run (the directory's lock is held) is named (run, pid, host, since) and no
        ``--resume`` is advised: resuming would fail the same way while it runs.

        Mixing two runs' checkpoints in one directory makes ``--resume`` pick whichever is
        newest; the user says which they want: continue (``--resume``) or another directory.
        """
        self._check_shared(run_dir)
        # `epochal run` gives each fresh run a new run_dir, so only a `dir` set explicitly (shared
        # by the config's runs) can hold another run's checkpoints here
        elsewhere = (
            "--set plugins.checkpoint.dir=DIR, or leave [plugins.checkpoint] dir unset: each run "
            "then keeps its checkpoints in its own directory under [loop] run_dir"
            if self.dir
            else "--set loop.run_dir=DIR"
        )
        remote = self._store()
        if remote is not None:  # no lock on an object store; an unreachable one fails here, one line
            committed = [info.name for info in remote.checkpoints()[0]]
            return naming.fresh_run_refusal(remote.url, committed, command, elsewhere)
        try:
            directory = self._directory_for(run_dir)
        except ConfigError:
            return None  # no directory configured: the plugin says so when training starts
        holder = live_holder(directory) if directory.is_dir() else None
        if holder is not None:
            return (
                f"checkpoint directory {str(directory)!r} is in use by {holder}, which is running now. "
                "Two runs must not write one directory: wait for it to end (or stop it), or choose "
                f"another directory ({elsewhere})."
            )
        found = sorted(p.name for p in directory.glob("ckpt-*") if p.is_dir()) if directory.is_dir() else []
        return naming.fresh_run_refusal(str(directory), found, command, elsewhere)


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False
