"""A real ``mlflow server`` on 127.0.0.1 (a free port) in a temporary directory, for the module."""

from __future__ import annotations

import os
import shutil
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


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URI of a running tracking server (SQLite backend, artifacts proxied by the server)."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    command = [
        mlflow, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    log = (root / "server.log").open("w")
    server = subprocess.Popen(command, cwd=root, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}"
                )
            time.sleep(0.5)
        yield uri
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture
def fast_http(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's HTTP client gives up quickly (a down tracker is found in seconds, not minutes)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")


@pytest.fixture
def down_uri() -> str:
    """The URI of a tracking server that is not there (a free loopback port nobody listens on)."""
    return f"http://127.0.0.1:{free_port()}"
