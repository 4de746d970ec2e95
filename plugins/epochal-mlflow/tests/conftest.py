"""A real ``mlflow server`` on 127.0.0.1 (a free port) in a temporary directory.

``mlflow_server`` is one server for the whole session; ``restartable_server`` is a
:class:`Server` of the module's own that a test may stop and start again on the same port and
backend store (an outage of the tracker).
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
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """``mlflow server`` (SQLite backend, artifacts proxied) in its own process group."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = root
        self.port = port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 180) -> None:
        """Start it and wait until it answers ``/health``."""
        mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
        command = [
            mlflow, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", str(self.root / "artifacts"),
        ]  # fmt: skip
        # No job runner (its consumer processes): the tests only log runs.
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
                log = (self.root / "server.log").read_text()[-2000:]
                raise RuntimeError(f"mlflow server did not start: {log}")
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
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.1)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URI of a running tracking server for the session."""
    server = Server(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    try:
        yield server.uri
    finally:
        server.stop()


@pytest.fixture(scope="module")
def restartable_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of the module's own (not started: a test calls ``start()``), stopped at the end."""
    server = Server(tmp_path_factory.mktemp("mlflow-restartable"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def down_uri() -> str:
    """The URI of a tracking server that is not there (a free loopback port nobody listens on)."""
    return f"http://127.0.0.1:{free_port()}"
