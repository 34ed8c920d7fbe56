"""A real server process per test module (started once: about 1.5 s), clients per test."""

from __future__ import annotations


import pytest

from remote_accel.server.testing import Client, ServerProcess

# `REMOTE_ACCEL_TEST_DEVICE=cuda pytest tests/server` runs the same tests on a GPU
# (ServerProcess reads it).


@pytest.fixture(scope="module")
def server(request):
    """The module's server; a module sets SERVER_ARGS to start it with other options."""
    args = getattr(request.module, "SERVER_ARGS", ("--log-level", "debug"))
    with ServerProcess(*args) as proc:
        yield proc
        assert proc.alive(), f"the server died:\n{proc.log()}"
        assert "Traceback" not in proc.log(), f"the server hit a bug:\n{proc.log()}"


@pytest.fixture
def connect(server):
    """connect() -> a new authenticated client of the module's server; all closed afterwards."""
    clients = []

    def make(token: str = server.token, **kwargs) -> Client:
        client = Client.tcp(*server.tcp, token=token, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def client(connect):
    return connect()
