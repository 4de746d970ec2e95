"""A real ``mlflow server`` on 127.0.0.1 (a free port) in a temporary directory.

``mlflow_server`` is one server for the whole session; ``restartable_server`` is a
:class:`epochal_mlflow.testing.Server` of the module's own that a test may stop and start again
on the same port and backend store (an outage of the tracker).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from epochal_mlflow.testing import Server, free_port


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
