"""The background side of the ``mlflow`` plugin: one thread owns the MLflow client.

The training loop only appends records to a bounded buffer (a deque under a lock) and returns;
this thread creates or finds the MLflow run, sends the buffered metrics with ``log_batch``
(MLflow's limit of 1000 per call; to a tracking server up to ``PARALLEL_REQUESTS`` calls in
flight at once when a backlog waits), logs the artifacts and ends the run. So a slow or
unreachable tracker never stalls training:

- every request of the plugin waits at most ``request_timeout`` seconds and is not retried by
  MLflow (:mod:`epochal_mlflow.http`: MLflow's own default is 7 retries with backoff and a 120 s
  timeout, minutes per request); the thread retries on its own schedule instead.
- tracker down (a connection error, a timeout, a server error): a failed request is tried once
  more after ``GRACE_SECONDS``; if that fails too, one warning names the plugin, the record and
  the tracker, the records stay buffered and the thread retries every ``retry_seconds``. When
  the tracker answers again, what was buffered is sent (a later outage warns again). When the
  buffer holds ``max_buffered`` records the oldest are dropped (counted; one warning).
- the end of the run: the thread gets ``close_timeout`` seconds *without progress* to send what
  is left, log the artifacts and end the MLflow run with the epochal run's status (``FINISHED``,
  ``KILLED``, ``FAILED``): each call the tracker takes gives it ``close_timeout`` more, so a busy
  machine or a long backlog loses nothing, and a local store (the default SQLite one) is waited
  for until it is made and the run opened (there is no network to wait for: on a busy machine
  importing MLflow and creating its tables can take longer than ``close_timeout``). A tracker
  that is down at the end (two failed requests in a row) is given up at once, not after the
  whole ``close_timeout``. Past the deadline it stops sending and makes one last attempt to end
  the run (tagged ``epochal.records_not_sent``), so the MLflow run is not left ``RUNNING`` while
  the tracker answers; one warning says what was not sent and whether the run could be ended.
- a record the tracker refuses (an invalid metric name, a too-long param): the failing batch is
  halved until the culprit is found; one warning names it, that key is skipped from then on,
  and the rest of the batch is sent.
"""

from __future__ import annotations

import collections
import json
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epochal_mlflow.http import is_http, policy, post_metrics

#: MLflow's limits per ``log_batch`` call.
METRICS_PER_CALL = 1000
PARAMS_PER_CALL = 100
#: ``log_batch`` calls in flight at once while a backlog is sent to a tracking server.
PARALLEL_REQUESTS = 4
#: the first retry after a failed request comes this soon (a blip is not an outage).
GRACE_SECONDS = 1.0

#: ``(step, key, value, timestamp in ms)`` for a metric, ``(None, key, value)`` for a param.
Item = tuple[Any, ...]


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
    #: the default SQLite store's file, made whole before first use (None: a store of the user's).
    local_store: str | None = None


def make_store_whole(database: Path) -> None:
    """Create MLflow's SQLite store *database* whole, if it does not exist yet.

    MLflow creates a store by running its schema migrations in place, and they are not atomic: a
    process killed in those ~2 s left a store every later run failed on (``table ... already
    exists``). The store is made under a temporary name beside it and linked into place once
    complete and synced (a link, not a rename: a store another run made meanwhile stays).
    """
    if database.exists():
        return
    from mlflow import MlflowClient

    made = database.with_name(f".{database.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments(max_results=1)
        with open(made, "rb+") as file:
            os.fsync(file.fileno())
        try:
            os.link(made, database)
        except FileExistsError:
            return  # another run made the store first: that one is the store
        directory = os.open(database.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    finally:
        made.unlink(missing_ok=True)


def quiet_store_logs() -> None:
    """MLflow's ``INFO ... Creating initial MLflow database tables`` lines kept out of the console
    (a run's console is epochal's), unless the user set that logger's level."""
    import logging

    logger = logging.getLogger("mlflow.store.db.utils")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


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
        request_timeout: float,
        warn: Callable[[str], None],
        parallel: int = PARALLEL_REQUESTS,
    ) -> None:
        super().__init__(name=f"epochal-mlflow-{spec.run_id[:8]}", daemon=True)
        self.spec = spec
        self.max_buffered = max_buffered
        self.retry_seconds = retry_seconds
        self.request_timeout = request_timeout
        #: a tracking server: metrics go to its REST endpoint, several calls at once.
        self.rest = is_http(spec.tracking_uri)
        #: a store on this machine (a SQLite file, the default): no network to wait for.
        self.local = spec.local_store is not None or spec.tracking_uri.startswith(("sqlite:", "file:", "/"))
        self.parallel = parallel if self.rest else 1
        self.warn = warn
        self.mlflow_run_id: str | None = None
        self.forked_from: str | None = None
        #: counters for tests and benchmarks; ``ended``: the MLflow run got its final status.
        self.sent = 0
        self.dropped = 0
        self.ended = False
        #: the store refused the run's URI or settings for good (a bad scheme, a refused store):
        #: nothing is buffered or sent any more.
        self.store_refused = False
        self._buffer: collections.deque[Item] = collections.deque()
        self._inflight = 0
        self._condition = threading.Condition()
        self._stopping = False
        self._end: tuple[str, list[tuple[Path, str]], dict[str, Any] | None] | None = None
        self._deadline = float("inf")
        self._timeout = 0.0
        self._skip: set[str] = set()
        self._skip_lock = threading.Lock()
        self._failures = 0
        self._down_warned = False
        self._drop_warned = False
        self._client: Any = None
        self._opening: tuple[str, dict[str, str], dict[str, str], Any] | None = None
        self._pool: ThreadPoolExecutor | None = None

    # -- the loop's side -------------------------------------------------------------------------

    def put(self, records: Iterable[tuple[int, str, float]]) -> None:
        """Buffer ``(step, key, value)`` records; drop the oldest past ``max_buffered``."""
        if self.store_refused:
            return
        stamp = int(time.time() * 1000)
        with self._condition:
            self._buffer.extend((step, key, value, stamp) for step, key, value in records)
            self._trim()
            self._condition.notify()

    def _trim(self) -> None:
        """Drop the oldest buffered records past ``max_buffered`` (the condition's lock held)."""
        excess = len(self._buffer) + self._inflight - self.max_buffered
        if excess <= 0:
            return
        for _ in range(min(excess, len(self._buffer))):
            self._buffer.popleft()
            self.dropped += 1
        if not self._drop_warned:
            self._drop_warned = True
            self.warn(
                f"{self.max_buffered} records are waiting for the tracker at "
                f"{self.spec.tracking_uri}; dropping the oldest from now on"
            )

    @property
    def buffered(self) -> int:
        """Records not sent yet (in flight included)."""
        with self._condition:
            return len(self._buffer) + self._inflight

    def finish(
        self,
        status: str,
        artifacts: list[tuple[Path, str]],
        config: dict[str, Any] | None,
        timeout: float,
    ) -> None:
        """Send what is buffered, log *artifacts* and *config*, end the run as *status*.

        Waits *timeout* s for that, then for the request in flight and one last attempt to end
        the run (each at most ``request_timeout``): bounded whatever the tracker does.
        """
        with self._condition:
            self._end = (status, artifacts, config)
            self._stopping = True
            self._timeout = timeout
            self._deadline = time.monotonic() + timeout
            self._condition.notify()
        while self.is_alive():
            wait = self._wait_left()
            if wait <= 0:
                break
            self.join(wait)
        if self.store_refused:
            return  # said when it happened
        left = self.buffered
        if not (self.is_alive() or left or not self.ended):
            return
        uri = self.spec.tracking_uri
        if left:
            message = (
                f"the tracker at {uri} did not take the run's last records in {timeout:g} s: "
                f"{left} record(s) not sent"
            )
            if self.dropped:
                message += f", {self.dropped} dropped"
        else:
            message = f"the tracker at {uri} did not end the MLflow run in {timeout:g} s"
        if self._down_warned:
            message = message.replace(f"did not take the run's last records in {timeout:g} s", "is down")
        if self.ended:
            message += f"; MLflow run {self.mlflow_run_id} ended as {status}"
        elif self.mlflow_run_id is not None:
            message += f"; MLflow run {self.mlflow_run_id} could not be ended and shows RUNNING there"
        else:
            message += "; no MLflow run was created"
        self.warn(message)

    def _opening_locally(self) -> bool:
        """Whether the thread is still making a local store and opening the run, unfailed."""
        return self.local and self.mlflow_run_id is None and self._failures == 0 and not self.store_refused

    def _wait_left(self) -> float:
        """How long the end of the run still waits for the thread (past its deadline, the
        request in flight and one last attempt to end the run, each ``request_timeout``)."""
        if self._opening_locally():
            return 1.0  # no deadline yet: asked again each second
        with self._condition:
            deadline = self._deadline
        return deadline + 2 * self.request_timeout + 1 - time.monotonic()

    def _progressed(self) -> None:
        """The tracker took a call: at the end of the run, ``close_timeout`` more from now."""
        with self._condition:
            if self._stopping:
                self._deadline = max(self._deadline, time.monotonic() + self._timeout)

    # -- the thread ------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            with policy(self.request_timeout):
                self._work()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)

    def _work(self) -> None:
        while True:
            with self._condition:
                while not self._buffer and not self._stopping and self.mlflow_run_id is not None:
                    self._condition.wait()
                stopping = self._stopping
            if stopping and time.monotonic() >= self._deadline and not self._opening_locally():
                self._give_up()
                return
            try:
                started = self.mlflow_run_id is None
                if started:
                    self._start()
                    self._progressed()
                if self._send() or started:  # the tracker answered: an outage is over
                    self._failures, self._down_warned = 0, False
                if stopping and not self.buffered:
                    self._end_run()
                    return
            except Exception as error:
                if started and getattr(error, "error_code", None) == "INVALID_PARAMETER_VALUE":
                    self._refuse(error)  # not an outage: retrying cannot help
                    return
                self._failed(error)
                self._pause()

    def _refuse(self, error: BaseException) -> None:
        """The store refused the run at its start: say so once, naming the option, and stop."""
        self.store_refused = True
        with self._condition:
            self._buffer.clear()
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self.warn(
            f"the MLflow tracking store {self.spec.tracking_uri} refused this run ([plugins.mlflow] "
            f"tracking_uri): {first}; no MLflow run for this run, training goes on"
        )

    def _failed(self, error: BaseException) -> None:
        self._failures += 1
        if self._failures >= 2:
            with self._condition:
                if self._stopping:  # down at the end of the run: no use waiting the rest of it
                    self._deadline = min(self._deadline, time.monotonic())
        if self._failures < 2 or self._down_warned:
            return
        self._down_warned = True
        with self._condition:
            first = self._buffer[0] if self._buffer else None
        if first is not None:
            record = f"record {first[1]!r} at step {first[0]}"
        else:
            record = "the run's start" if self.mlflow_run_id is None else "the run's end"
        self.warn(
            f"cannot send {record} to the tracker at {self.spec.tracking_uri}: "
            f"{self._reason(error)}; training goes on, records are kept (up to {self.max_buffered}) "
            f"and sent again every {self.retry_seconds:g} s"
        )

    def _reason(self, error: BaseException) -> str:
        """Why a request failed, in a few words (MLflow wraps the cause in a long message)."""
        text = str(error)
        if "timeout exception" in text:  # MLflow's advice there (its variable) is not ours
            return f"no answer in {self.request_timeout:g} s (request_timeout)"
        errno = re.search(r"\[Errno -?\d+\][^'\"()]*", text)
        return errno.group(0).strip() if errno else _short(error)

    def _pause(self) -> None:
        seconds = min(GRACE_SECONDS, self.retry_seconds) if self._failures < 2 else self.retry_seconds
        end = time.monotonic() + seconds
        with self._condition:
            while (now := time.monotonic()) < min(end, self._deadline):
                self._condition.wait(min(end, self._deadline) - now)

    def _start(self) -> None:
        # MLflow prints "View run ... at URL" on stdout when a run ends; epochal's stdout is its own.
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        from mlflow import MlflowClient

        spec = self.spec
        if self.local and self._client is None:
            quiet_store_logs()
        if spec.local_store is not None and self._client is None:
            make_store_whole(Path(spec.local_store))
        client = self._client or MlflowClient(tracking_uri=spec.tracking_uri)
        self._client = client
        if self._opening is None:
            self._opening = self._open(client)
        # From here on every step is safe to repeat after a failure: the run exists once.
        run_id, tags, params, earlier = self._opening
        if earlier is not None:
            self._copy_history(client, earlier, run_id)
        self._log_tags(client, run_id, tags)
        self._log_params(params)
        self.mlflow_run_id = run_id

    def _open(self, client: Any) -> tuple[str, dict[str, str], dict[str, str], Any]:
        """Create the run, or find the earlier one and mark it running again.

        Returns ``(run id, tags, params, earlier run whose history to copy or None)``.
        """
        spec = self.spec
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
            return run_id, tags, params, None
        if earlier is not None:
            tags["epochal.continues"] = earlier.info.run_id
        run = client.create_run(experiment_id, tags=tags, run_name=spec.run_name)
        tags["epochal.runs"] = spec.run_id
        params = dict(spec.params)
        if earlier is not None:
            params = {**earlier.data.params, **params}
            self.forked_from = earlier.info.run_id
        return run.info.run_id, tags, params, earlier

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
        """Copy the metric history of *earlier* up to the restored iteration into *run_id*.

        Safe to repeat: MLflow keeps one copy of a metric logged twice with the same key,
        value, timestamp and step.
        """
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

    def _log_params(self, params: Mapping[str, str]) -> None:
        items = [(None, k, v) for k, v in params.items()]
        for start in range(0, len(items), PARAMS_PER_CALL):
            self._batch(self._send_params, items[start : start + PARAMS_PER_CALL], "param")

    def _send_params(self, items: Sequence[Item]) -> None:
        from mlflow.entities import Param

        assert self._opening is not None
        self._client.log_batch(self._opening[0], params=[Param(key, value) for _, key, value in items])

    def _send_metrics(self, items: Sequence[Item]) -> None:
        run_id = self.mlflow_run_id
        assert run_id is not None
        if self.rest:  # a tracking server: its REST endpoint, with the plugin's timeout
            post_metrics(self.spec.tracking_uri, run_id, items, self.request_timeout)
            return
        from mlflow.entities import Metric

        self._client.log_batch(
            run_id, metrics=[Metric(key, value, stamp, step) for step, key, value, stamp in items]
        )

    def _batch(self, send: Callable[[Sequence[Item]], None], items: Sequence[Item], what: str) -> int:
        """``send`` *items*; on a refusal halve until the refused item is found and skipped.

        Returns how many items were sent.
        """
        if not items:
            return 0
        try:
            send(items)
            return len(items)
        except Exception as error:
            if not refused(error):
                raise
            if len(items) == 1:
                step, key = items[0][0], items[0][1]
                with self._skip_lock:
                    if key in self._skip:  # another request found it first
                        return 0
                    self._skip.add(key)
                at = f" at step {step}" if step is not None else ""
                self.warn(
                    f"the tracker at {self.spec.tracking_uri} refused {what} {key!r}{at}: "
                    f"{_short(error)}; that {what} is left out of the MLflow run (the run goes on)"
                )
                return 0
            middle = len(items) // 2
            sent = self._batch(send, items[:middle], what)
            return sent + self._batch(send, [i for i in items[middle:] if i[1] not in self._skip], what)

    def _send_chunk(self, chunk: Sequence[Item]) -> int | Exception:
        """Send one call's worth of metrics: how many were sent, or why none could be."""
        try:
            return self._batch(self._send_metrics, [i for i in chunk if i[1] not in self._skip], "metric")
        except Exception as error:
            return error

    def _send(self) -> int:
        """Send the buffered metrics, ``parallel`` calls of up to 1000 at a time; how many were sent.

        Records leave the buffer while in flight; those of a failed call go back to its front,
        in order. Returns early, records left, once the end of the run's deadline has passed.
        """
        total = 0
        if self.parallel > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix=f"{self.name}-send")
        per_round = METRICS_PER_CALL * self.parallel
        while True:
            with self._condition:
                if self._stopping and time.monotonic() >= self._deadline:
                    return total
                taken = [self._buffer.popleft() for _ in range(min(per_round, len(self._buffer)))]
                self._inflight = len(taken)
            if not taken:
                return total
            chunks = [taken[i : i + METRICS_PER_CALL] for i in range(0, len(taken), METRICS_PER_CALL)]
            if len(chunks) > 1 and self._pool is not None:
                results = list(self._pool.map(self._send_chunk, chunks))
            else:
                results = [self._send_chunk(chunk) for chunk in chunks]
            failed = [c for c, result in zip(chunks, results, strict=True) if isinstance(result, Exception)]
            with self._condition:
                self._buffer.extendleft(reversed([item for chunk in failed for item in chunk]))
                self._inflight = 0
                self._trim()
            sent = sum(result for result in results if isinstance(result, int))
            self.sent += sent
            total += sent
            if sent:
                self._progressed()
            errors = [result for result in results if isinstance(result, Exception)]
            if errors:
                raise errors[0]

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
        if self.dropped:
            client.set_tag(run_id, "epochal.records_not_sent", str(self.dropped))
        client.set_terminated(run_id, status=status)
        self.ended = True

    def _give_up(self) -> None:
        """Past the end of the run's deadline: one attempt to end the MLflow run, no more sending."""
        run_id = self.mlflow_run_id or (self._opening[0] if self._opening is not None else None)
        if run_id is None or self._client is None:
            return
        self.mlflow_run_id = run_id
        status = self._end[0] if self._end is not None else "KILLED"
        try:
            self._client.set_terminated(run_id, status=status)
            self.ended = True
            if self.buffered + self.dropped:
                self._client.set_tag(run_id, "epochal.records_not_sent", str(self.buffered + self.dropped))
        except Exception:
            pass  # the tracker is still down: finish() says the run could not be ended


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def warn(message: str) -> None:
    """One warning from the plugin (the prefix names it)."""
    warnings.warn(f"mlflow: {message}", RuntimeWarning, stacklevel=2)
