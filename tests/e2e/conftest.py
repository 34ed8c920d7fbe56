"""The end-to-end suites' usual setting: this process connected over TCP to one real server
process, started once per test module (a module sets SERVER_ARGS to start it with other
options, or defines its own `remote` for another setting)."""

from __future__ import annotations

import pytest

import remote_accel
from remote_accel.server.testing import ServerProcess


@pytest.fixture(scope="module")
def remote(request):
    with ServerProcess(*getattr(request.module, "SERVER_ARGS", ())) as server:
        remote_accel.init(transport="tcp", server="%s:%d" % server.tcp, token=server.token)
        yield server
        remote_accel.shutdown()
