"""The background side of the ``mlflow`` plugin: one thread owns the MLflow client.

The training loop only appends records to a bounded buffer (a deque under a lock) and returns;
this thread creates or finds the MLflow run, sends the buffered metrics with ``log_batch`` (up
to 1000 per call), logs the artifacts and ends the run. So a slow or unreachable tracker never
stalls training:

- tracker down (a connection error, a server error): one warning naming the plugin, the record
  and the tracker; the records stay buffered and the thread retries every ``retry_seconds``.
  When the buffer holds ``max_buffered`` records the oldest are dropped (counted; one warning).
  At the end of the run the thread gets ``close_timeout`` seconds to send what is left; what it
  could not send is reported in one warning.
- a record the tracker refuses (an invalid metric name, a too-long param): the failing batch is
  halved until the culprit is found; one warning names it, that key is skipped from then on,
  and the rest of the batch is sent.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: MLflow's limits per ``log_batch`` call.
METRICS_PER_CALL = 1000
PARAMS_PER_CALL = 100


@dataclass
class RunSpec:
    """What the thread needs to create, or find and continue, the MLflow run."""

    tracking_uri: str
    experiment: str
    artifact_location: str | None
    run_id: str
    resumed_from: str | None
    restored_iteration: int
    known_mlflow_run: str | None
    run_name: str | None
    params: dict[str, str] = field(default_factory=dict)


def refused(error: BaseException) -> bool:
    """True when *error* is MLflow refusing the data, not the tracker failing or unreachable."""
    return getattr(error, "error_code", None) in ("INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS")


class Tracker(threading.Thread):
    """Sends one epochal run's params, metrics and artifacts to MLflow from a daemon thread."""

    def __init__(
        self,
        spec: RunSpec,
        *,
        max_buffered: int,
        retry_seconds: float,
        warn: Callable[[str], None],
    ) -> None:
        super().__init__(name=f"epochal-mlflow-{spec.run_id[:8]}", daemon=True)
        self.spec = spec
        self.max_buffered = max_buffered
        self.retry_seconds = retry_seconds
        self.warn = warn
        self.mlflow_run_id: str | None = None
        self.forked_from: str | None = None
        #: counters for tests and benchmarks.
        self.sent = 0
        self.dropped = 0
        self._buffer: collections.deque[Any] = collections.deque()
        self._condition = threading.Condition()
        self._stopping = False
        self._end: tuple[str, list[tuple[Path, str]], dict[str, Any] | None] | None = None
        self._deadline = float("inf")
        self._skip: set[str] = set()
        self._down_warned = False
        self._drop_warned = False
        self._client: Any = None

    # -- the loop's side -------------------------------------------------------------------------

    def put(self, records: Iterable[tuple[int, str, float]]) -> None:
        """Buffer ``(step, key, value)`` records; drop the oldest past ``max_buffered``."""
        stamp = int(time.time() * 1000)
        with self._condition:
            buffer = self._buffer
            buffer.extend((step, key, value, stamp) for step, key, value in records)
            excess = len(buffer) - self.max_buffered
            if excess > 0:
                for _ in range(excess):
                    buffer.popleft()
                self.dropped += excess
                if not self._drop_warned:
                    self._drop_warned = True
                    self.warn(
                        f"{self.max_buffered} records are waiting for the tracker at "
                        f"{self.spec.tracking_uri}; dropping the oldest from now on"
                    )
            self._condition.notify()

    @property
    def buffered(self) -> int:
        with self._condition:
            return len(self._buffer)

    def finish(
        self,
        status: str,
        artifacts: list[tuple[Path, str]],
        config: dict[str, Any] | None,
        timeout: float,
    ) -> None:
        """Send what is buffered, log *artifacts* and *config*, end the run; wait *timeout* s."""
        with self._condition:
            self._end = (status, artifacts, config)
            self._stopping = True
            self._deadline = time.monotonic() + timeout
            self._condition.notify()
        self.join(timeout + 1)
        left = self.buffered
        if self.is_alive() or left:
            self.warn(
                f"the tracker at {self.spec.tracking_uri} did not take the run's last records in "
                f"{timeout:g} s: {left} record(s) not sent"
                + (f", {self.dropped} dropped" if self.dropped else "")
            )

    # -- the thread ------------------------------------------------------------------------------

    def run(self) -> None:
        while True:
            with self._condition:
                while not self._buffer and not self._stopping and self.mlflow_run_id is not None:
                    self._condition.wait()
                stopping = self._stopping
            if time.monotonic() > self._deadline:
                return
            try:
                if self.mlflow_run_id is None:
                    self._start()
                self._send()
                if stopping and not self.buffered:
                    self._end_run()
                    return
            except Exception as error:
                self._tracker_down(error)
                self._pause()

    def _pause(self) -> None:
        end = min(time.monotonic() + self.retry_seconds, self._deadline)
        with self._condition:
            while time.monotonic() < end:
                self._condition.wait(end - time.monotonic())
                if self._stopping and self._deadline < float("inf"):
                    end = min(end, self._deadline)
                    if time.monotonic() >= end:
                        break

    def _tracker_down(self, error: BaseException) -> None:
        if self._down_warned:
            return
        self._down_warned = True
        with self._condition:
            first = self._buffer[0] if self._buffer else None
        record = f"record {first[1]!r} at step {first[0]}" if first else "the run's start"
        self.warn(
            f"cannot send {record} to the tracker at {self.spec.tracking_uri}: "
            f"{_short(error)}; training goes on, records are kept (up to {self.max_buffered}) "
            f"and sent again every {self.retry_seconds:g} s"
        )

    def _start(self) -> None:
        import os

        # MLflow prints "View run ... at URL" on stdout when a run ends; epochal's stdout is its own.
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        from mlflow import MlflowClient

        spec = self.spec
        client = self._client or MlflowClient(tracking_uri=spec.tracking_uri)
        self._client = client
        experiment = client.get_experiment_by_name(spec.experiment)
        if experiment is None:
            experiment_id = client.create_experiment(
                spec.experiment, artifact_location=spec.artifact_location
            )
        else:
            experiment_id = experiment.experiment_id
        earlier = self._find_earlier(client, experiment_id) if spec.resumed_from else None
        tags = {"epochal.run_id": spec.run_id}
        if spec.resumed_from:
            tags["epochal.resumed_from"] = spec.resumed_from
        if earlier is not None and not self._superseded(client, earlier):
            run_id = earlier.info.run_id
            client.update_run(run_id, status="RUNNING")
            runs = earlier.data.tags.get("epochal.runs", earlier.data.tags.get("epochal.run_id", ""))
            tags["epochal.runs"] = f"{runs} {spec.run_id}".strip()
            params = {k: v for k, v in spec.params.items() if k not in earlier.data.params}
        else:
            if earlier is not None:
                tags["epochal.continues"] = earlier.info.run_id
            run = client.create_run(experiment_id, tags=tags, run_name=spec.run_name)
            run_id = run.info.run_id
            tags["epochal.runs"] = spec.run_id
            params = dict(spec.params)
            if earlier is not None:
                self._copy_history(client, earlier, run_id)
                params = {**earlier.data.params, **params}
                self.forked_from = earlier.info.run_id
        self._log_tags(client, run_id, tags)
        self._log_params(client, run_id, params)
        self.mlflow_run_id = run_id

    def _find_earlier(self, client: Any, experiment_id: str) -> Any:
        """The MLflow run the resumed epochal run wrote to (state first, then by tag)."""
        spec = self.spec
        if spec.known_mlflow_run:
            try:
                return client.get_run(spec.known_mlflow_run)
            except Exception as error:
                if not refused(error) and getattr(error, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                    raise
        found = client.search_runs(
            [experiment_id], filter_string=f"tags.`epochal.run_id` = '{spec.resumed_from}'", max_results=1
        )
        return found[0] if found else None

    def _superseded(self, client: Any, earlier: Any) -> bool:
        """Whether *earlier* holds metric steps after the restored iteration."""
        restored = self.spec.restored_iteration
        for key in earlier.data.metrics:
            if any(m.step > restored for m in client.get_metric_history(earlier.info.run_id, key)):
                return True
        return False

    def _copy_history(self, client: Any, earlier: Any, run_id: str) -> None:
        """Copy the metric history of *earlier* up to the restored iteration into *run_id*."""
        from mlflow.entities import Metric

        restored = self.spec.restored_iteration
        kept: list[Any] = []
        for key in earlier.data.metrics:
            kept.extend(
                Metric(m.key, m.value, m.timestamp, m.step)
                for m in client.get_metric_history(earlier.info.run_id, key)
                if m.step <= restored
            )
        for start in range(0, len(kept), METRICS_PER_CALL):
            client.log_batch(run_id, metrics=kept[start : start + METRICS_PER_CALL])
        client.set_tag(earlier.info.run_id, "epochal.superseded_after", str(restored))

    def _log_tags(self, client: Any, run_id: str, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def _log_params(self, client: Any, run_id: str, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), PARAMS_PER_CALL):
            self._batch(client, run_id, items[start : start + PARAMS_PER_CALL], "params", "param")

    def _batch(self, client: Any, run_id: str, items: list[Any], kind: str, what: str) -> None:
        """``log_batch`` *items*; on a refusal halve until the refused item is found and skipped."""
        if not items:
            return
        try:
            client.log_batch(run_id, **{kind: items})
        except Exception as error:
            if not refused(error):
                raise
            if len(items) == 1:
                item = items[0]
                self._skip.add(item.key)
                step = f" at step {item.step}" if hasattr(item, "step") else ""
                self.warn(
                    f"the tracker at {self.spec.tracking_uri} refused {what} {item.key!r}{step}: "
                    f"{_short(error)}; that {what} is left out of the MLflow run (the run goes on)"
                )
                return
            middle = len(items) // 2
            self._batch(client, run_id, items[:middle], kind, what)
            self._batch(client, run_id, [i for i in items[middle:] if i.key not in self._skip], kind, what)

    def _send(self) -> None:
        """Send the buffered metrics, a call of up to 1000 at a time."""
        from mlflow.entities import Metric

        while True:
            with self._condition:
                chunk = [self._buffer[i] for i in range(min(METRICS_PER_CALL, len(self._buffer)))]
            if not chunk:
                return
            metrics = [
                Metric(key, value, stamp, step) for step, key, value, stamp in chunk if key not in self._skip
            ]
            assert self.mlflow_run_id is not None
            self._batch(self._client, self.mlflow_run_id, metrics, "metrics", "metric")
            with self._condition:
                for _ in range(min(len(chunk), len(self._buffer))):
                    self._buffer.popleft()
            self.sent += len(metrics)
            self._down_warned = False

    def _end_run(self) -> None:
        assert self._end is not None
        status, artifacts, config = self._end
        client, run_id = self._client, self.mlflow_run_id
        if config is not None:
            client.log_text(run_id, json.dumps(config, indent=2, default=str), "epochal/config.json")
        for path, where in artifacts:
            try:
                if path.is_dir():
                    client.log_artifacts(run_id, str(path), where)
                else:
                    client.log_artifact(run_id, str(path), where)
            except OSError as error:
                self.warn(f"cannot log artifact {path}: {error}")
        client.set_terminated(run_id, status=status)


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def warn(message: str) -> None:
    """One warning from the plugin (the prefix names it)."""
    warnings.warn(f"mlflow: {message}", RuntimeWarning, stacklevel=2)
