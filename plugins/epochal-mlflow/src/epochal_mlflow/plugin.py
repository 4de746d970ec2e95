"""The ``mlflow`` plugin: each epochal run as an MLflow run (params, metrics, artifacts).

Every numeric record of the training log becomes an MLflow metric with the record's iteration
as its step (the key unchanged: ``train.loss``, ``valid.accuracy``); the run configuration,
flattened to ``section.key``, becomes the run's params; the epochal run id and ``resumed_from``
are tags. At the end the run's configuration (``epochal/config.json``) and the final weights are
logged as artifacts: the newest ``*.safetensors`` export in the checkpoint directory, else the
latest checkpoint directory.

Records are collected with ``sqlite_log``'s cursor rule (every ``flush_every`` iterations, at
each epoch end, on an interrupt, at the end) and handed to a background thread
(:mod:`epochal_mlflow.tracker`) that owns the MLflow client, so training never waits for the
tracker; see there for what happens when it is down or refuses a record.

Resume: the MLflow run id is part of the plugin's saved state (and the run carries the tag
``epochal.run_id``), so a resumed epochal run continues the same MLflow run. MLflow cannot
delete metric values, so when that run already holds steps after the restored iteration (the
earlier run went on past the checkpoint), continuing it would duplicate those steps; then a new
MLflow run is started instead, tagged ``epochal.continues = <earlier MLflow run id>``, with the
earlier run's params and its metric history up to the restored iteration copied in, and the
earlier run is tagged ``epochal.superseded_after = <iteration>`` (``sqlite_log``'s superseded
rule).
"""

from __future__ import annotations

import fnmatch
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from epochal import hookimpl
from epochal.protocol import (
    NonNegativeFloat,
    NonNegativeInt,
    Phase,
    PositiveFloat,
    PositiveInt,
    Rank,
    checked_options,
)
from epochal.records import Cursor, flat_config
from epochal_mlflow.tracker import RunSpec, Tracker, warn

if TYPE_CHECKING:
    from epochal.loop import Loop

#: MLflow's limit on a param value's length.
PARAM_LENGTH = 6000


@checked_options("mlflow")
class MLflow:
    """Log the run to MLflow: params from the config, metrics by step, weights and config as artifacts.

    :param tracking_uri: the tracking server (``http://host:5000``) or store URI; default a
        SQLite store ``<[loop] run_dir>/mlflow.db`` with artifacts in ``<[loop] run_dir>/mlartifacts``,
        shared by the runs of the config (each run's files are in its ``version_N``).
    :param experiment: the MLflow experiment (created when missing).
    :param run_name: the MLflow run's name (default: MLflow's generated one).
    :param flush_every: hand the new records to the sending thread every this many iterations
        (also at every epoch end and when training ends); 0: only then.
    :param max_buffered: records kept while the tracker is down; past it the oldest are dropped.
    :param retry_seconds: how often the thread tries again while the tracker is down.
    :param request_timeout: seconds one request to the tracker may wait (to connect, for an
        answer) before the tracker counts as down; MLflow's own retries are off for the
        plugin's requests (its default, 7 retries and 120 s, is minutes per request).
    :param close_timeout: seconds the end of the run waits for the last records to be sent.
    :param log_weights: log the final weights (safetensors export or latest checkpoint).
    :param exclude: log keys not sent, as ``fnmatch`` patterns (default: the ``timing`` plugin's
        profiling records, which would outnumber the metrics, as the ``tensorboard`` plugin's
        default; ``[]`` sends them).
    """

    #: write after monitor, early stopping and checkpoint have logged the epoch's records.
    phase: ClassVar[Phase] = "report"  # the epoch's records and decisions are in the row
    #: on several processes only rank 0 writes (the records it logs are reduced across ranks).
    rank: ClassVar[Rank] = "zero"
    #: loaded only when named (``[plugins] order``, ``--plugins``): installing every plugin
    #: distribution must not mean an MLflow store in every run directory, or traffic to a tracking server.
    autoload = False

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "epochal",
        run_name: str | None = None,
        flush_every: NonNegativeInt = 100,
        max_buffered: PositiveInt = 100_000,
        retry_seconds: PositiveFloat = 10.0,
        close_timeout: NonNegativeFloat = 30.0,
        log_weights: bool = True,
        request_timeout: PositiveFloat = 10.0,
        exclude: Sequence[str] = ("timing.*",),
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.flush_every = flush_every
        #: handing records over only at epoch ends: nothing to do after a batch.
        self.idle_hooks = frozenset() if flush_every else frozenset({"after_batch"})
        self.max_buffered = max_buffered
        self.retry_seconds = float(retry_seconds)
        self.close_timeout = float(close_timeout)
        self.request_timeout = float(request_timeout)
        self.log_weights = log_weights
        self.exclude = tuple(exclude)
        self._excluded: dict[str, bool] = {}
        self.tracker: Tracker | None = None
        #: the tracker of the last run that ended (its ``sent``/``dropped`` counters, the MLflow run).
        self.finished: Tracker | None = None
        self._cursor = Cursor()
        self._restored_mlflow_run: str | None = None

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The MLflow run this epochal run writes to (so that a resumed run continues it)."""
        tracker = self.tracker
        run_id = tracker.mlflow_run_id if tracker is not None else None
        return {"mlflow_run_id": run_id or self._restored_mlflow_run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restored_mlflow_run = state.get("mlflow_run_id")

    # -- hooks -------------------------------------------------------------------------------

    @hookimpl
    def before_training(self, loop: Loop) -> None:
        """Start the sending thread; it creates (or finds and continues) the MLflow run."""
        self._close_quietly()
        uri, artifacts, local_store = self.tracking_uri, None, None
        if uri is None:
            root = loop.run_root  # one store for a config's runs, as MLflow's own mlruns
            base = Path(root) if root is not None else Path()
            local_store = str((base / "mlflow.db").resolve())
            uri = f"sqlite:///{local_store}"
            artifacts = (base / "mlartifacts").resolve().as_uri()
            try:
                base.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                warn(f"cannot create the local MLflow store in {base}: {error}; no MLflow run for this run")
                return
        params = {k: _param(v) for k, v in flat_config(loop.config).items()}
        spec = RunSpec(
            tracking_uri=uri,
            experiment=self.experiment,
            artifact_location=artifacts,
            run_id=loop.run_id,
            resumed_from=loop.resumed_from,
            restored_iteration=loop.iteration,
            known_mlflow_run=self._restored_mlflow_run if loop.resumed_from else None,
            run_name=self.run_name,
            params=params,
            local_store=local_store,
        )
        self._cursor.start(loop.log, loop.iteration)
        self.tracker = Tracker(
            spec,
            max_buffered=self.max_buffered,
            retry_seconds=self.retry_seconds,
            request_timeout=self.request_timeout,
            warn=warn,
        )
        self.tracker.start()

    @hookimpl
    def after_batch(self, loop: Loop) -> None:
        """Hand the new records to the sending thread every ``flush_every`` iterations."""
        if self.flush_every and loop.iteration - self._cursor.iteration >= self.flush_every:
            self.collect(loop)

    @hookimpl
    def after_epoch(self, loop: Loop) -> None:
        """Hand over the epoch's records (evaluation included)."""
        self.collect(loop)

    @hookimpl
    def on_interrupt(self, loop: Loop) -> None:
        """Hand over what was logged before the interrupt."""
        self.collect(loop)

    @hookimpl
    def after_training(self, loop: Loop) -> None:
        """Send the last records, log the config and weights, end the MLflow run."""
        self.collect(loop)
        status = "KILLED" if loop.log.status.get("status") == "interrupted" else "FINISHED"
        self._finish(loop, status)

    @hookimpl
    def on_error(self, loop: Loop) -> None:
        """Send what was logged; end the MLflow run as killed (Ctrl-C) or failed."""
        self.collect(loop)
        self._finish(loop, "KILLED" if loop.log.status.get("status") == "interrupted" else "FAILED")

    @hookimpl
    def run_summary(self) -> list[str]:
        """The MLflow run and its store, with the command that shows a local store."""
        tracker = self.finished
        if tracker is None or tracker.store_refused:
            return []
        uri = tracker.spec.tracking_uri
        if tracker.mlflow_run_id is None:
            return [f"mlflow: no run was made in {uri} (see the warning above)"]
        where = f"mlflow: run {tracker.mlflow_run_id} (experiment {tracker.spec.experiment!r}) in {uri}"
        if tracker.spec.local_store is None:
            return [where]
        return [where, f"mlflow ui: mlflow ui --backend-store-uri {shlex.quote(uri)}"]

    # -- helpers -----------------------------------------------------------------------------

    def collect(self, loop: Loop) -> None:
        """Buffer the numeric records new since the last collection."""
        if self.tracker is not None:
            records = self._cursor.collect(loop.log, loop.iteration)
            self.tracker.put([r for r in records if not self._skip(r[1])] if self.exclude else records)

    def _skip(self, key: str) -> bool:
        skip = self._excluded.get(key)
        if skip is None:
            skip = self._excluded[key] = any(fnmatch.fnmatchcase(key, p) for p in self.exclude)
        return skip

    def _finish(self, loop: Loop, status: str) -> None:
        tracker, self.tracker = self.tracker, None
        if tracker is None:
            return
        self._restored_mlflow_run = tracker.mlflow_run_id
        artifacts = weights(loop) if self.log_weights else []
        tracker.finish(status, artifacts, dict(loop.config), self.close_timeout)
        self.finished = tracker

    def _close_quietly(self) -> None:
        if self.tracker is not None:
            self.tracker.finish("KILLED", [], None, 0)
            self.tracker = None


def weights(loop: Loop) -> list[tuple[Path, str]]:
    """The final weights to log: the newest ``*.safetensors`` in the checkpoint directory, else the
    latest checkpoint directory; ``(path, artifact folder)``, or nothing without checkpoints."""
    plugin = loop.plugins.get("checkpoint")
    directory: Path | None = None
    directory_of = getattr(plugin, "directory", None)
    if callable(directory_of):
        try:
            directory = Path(directory_of(loop))
        except Exception:
            directory = None
    if directory is None and loop.run_dir is not None:
        directory = Path(loop.run_dir) / "checkpoints"
    if directory is None or not directory.is_dir():
        return []
    exports = sorted(directory.rglob("*.safetensors"), key=lambda p: p.stat().st_mtime)
    if exports:
        return [(exports[-1], "weights")]
    pointer = directory / "latest"
    if pointer.is_symlink():  # epochal-checkpoint format 4: a link holding the name
        name = os.readlink(pointer)
    else:  # formats 1-3: a text file holding it
        name = pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else ""
    latest = directory / name if name else None
    if latest is None or not latest.is_dir():
        candidates = sorted((p for p in directory.iterdir() if p.is_dir()), key=lambda p: p.name)
        latest = candidates[-1] if candidates else None
    return [(latest, f"checkpoint/{latest.name}")] if latest is not None else []


def _param(value: Any) -> str:
    text = str(value)
    return text if len(text) <= PARAM_LENGTH else text[: PARAM_LENGTH - 3] + "..."
