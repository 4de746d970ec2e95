"""The plugin's own HTTP policy for MLflow: short timeouts and no hidden retries, in its threads only.

MLflow's HTTP layer reads ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` (7), ``..._BACKOFF_FACTOR`` (2),
``..._BACKOFF_JITTER`` and ``..._TIMEOUT`` (120 s) from the environment at every request
(``mlflow.utils.rest_utils.http_request`` calls ``MLFLOW_HTTP_REQUEST_*.get()``), so with the
defaults one request to a stopped tracker takes about two minutes to fail, and setting the
variables would change every MLflow client of the user's process. Instead:

- the metrics, the plugin's bulk of traffic, go to the tracker's REST endpoint
  (``POST /api/2.0/mlflow/runs/log-batch``) through MLflow's own ``http_request`` with the
  retries, backoff and timeout passed as arguments (:func:`post_metrics`);
- every other request of the plugin (create the run, tags, artifacts, end the run) goes through
  ``MlflowClient`` inside :func:`policy`, which makes those four variables read the plugin's
  values *in the calling thread only*: each variable object's ``get`` is wrapped once so that it
  answers from a thread-local table when the thread set one, else exactly as before. Other
  threads, the user's own MLflow calls included, see their environment unchanged.

The plugin retries on its own schedule (``retry_seconds``) and warns once per outage, so MLflow's
retries are off (0): no request of the plugin waits longer than its ``request_timeout``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

#: MLflow's REST endpoint for ``log_batch`` (documented REST API, version 2.0).
LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"

_NAMES = (
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
)
_local = threading.local()
_install_lock = threading.Lock()
_installed = False


def _install() -> None:
    """Wrap the four variables' ``get`` once per process (a no-op for threads without a policy)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        import mlflow.environment_variables as variables

        for name in _NAMES:
            variable = getattr(variables, name, None)
            original = getattr(variable, "get", None)
            if variable is None or not callable(original):  # another MLflow: keep its defaults
                continue

            def get(original: Any = original, name: str = name) -> Any:
                values = getattr(_local, "values", None)
                if values is not None:
                    return values[name]
                return original()

            variable.get = get
        _installed = True


def settings(timeout: float) -> dict[str, Any]:
    """The keyword arguments of ``http_request`` for the plugin's requests."""
    return {"max_retries": 0, "backoff_factor": 0, "backoff_jitter": 0.0, "timeout": timeout}


@contextlib.contextmanager
def policy(timeout: float) -> Iterator[None]:
    """In this thread, MLflow's requests wait at most *timeout* s (connect, read) and never retry."""
    _install()
    previous = getattr(_local, "values", None)
    given = settings(timeout)
    _local.values = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": given["max_retries"],
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": given["backoff_factor"],
        "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": given["backoff_jitter"],
        "MLFLOW_HTTP_REQUEST_TIMEOUT": timeout,
    }
    try:
        yield
    finally:
        _local.values = previous


def is_http(uri: str) -> bool:
    """Whether *uri* names a tracking server spoken to over HTTP (not a local or Databricks store)."""
    return uri.startswith(("http://", "https://"))


def post_metrics(uri: str, run_id: str, records: Sequence[tuple[Any, ...]], timeout: float) -> None:
    """``log_batch`` *records* ``(step, key, value, timestamp_ms)`` to the server at *uri*.

    Raises MLflow's ``RestException`` (with the server's ``error_code``) when the server refuses
    the batch, and ``MlflowException`` when it cannot be reached or fails.
    """
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request, verify_rest_response

    body = {
        "run_id": run_id,
        "metrics": [
            {"key": key, "value": float(value), "timestamp": stamp, "step": step}
            for step, key, value, stamp in records
        ],
    }
    response = http_request(get_default_host_creds(uri), LOG_BATCH, "POST", json=body, **settings(timeout))
    verify_rest_response(response, LOG_BATCH)
