"""A real ``mlflow server`` for tests and benchmarks: :class:`Server` starts one on 127.0.0.1.

The server keeps its runs in a SQLite file and its artifacts in a folder under the given root,
runs in its own process group (stopping it stops its workers), and may be stopped and started
again on the same port and store (an outage of the tracker). The plugin's tests
(``tests/conftest.py``) and ``bench/mlflow_drain.py`` use it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

__all__ = ["Server", "free_port", "wait_until_closed"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_closed(port: int, seconds: float = 20.0) -> None:
    """Wait until nothing accepts connections on 127.0.0.1:*port* (at most *seconds*)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.1)


class Server:
    """``mlflow server`` (SQLite backend, artifacts proxied) in its own process group."""

    def __init__(self, root: Path, port: int | None = None, workers: int = 1) -> None:
        self.root = root
        self.port = port or free_port()
        #: uvicorn worker processes (``mlflow server``'s own default is 4).
        self.workers = workers
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        """Whether the server's process runs."""
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 180) -> None:
        """Start it and wait until it answers ``/health``."""
        mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
        command = [
            mlflow, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(self.workers),
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", str(self.root / "artifacts"),
        ]  # fmt: skip
        # No job runner (its consumer processes): tests and benchmarks only log runs.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with (self.root / "server.log").open("a") as log:
            self.process = subprocess.Popen(
                command, cwd=self.root, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.root / "server.log").read_text()[-2000:]
                raise RuntimeError(f"mlflow server did not start: {tail}")
            time.sleep(0.3)

    def stop(self) -> None:
        """Stop the server and its workers; return once the port refuses connections."""
        process, self.process = self.process, None
        if process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(20)
                break
            except subprocess.TimeoutExpired:
                continue
        wait_until_closed(self.port)
