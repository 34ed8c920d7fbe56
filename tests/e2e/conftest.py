"""The end-to-end suites' usual setting: this process connected over TCP to one real server
process, started once per test module (a module sets SERVER_ARGS to start it with other
options, or defines its own `remote` for another setting)."""

from __future__ import annotations

import pytest

import remote_accel
from remote_accel.server.testing import ServerProcess, make_ca, make_leaf


@pytest.fixture(scope="module")
def remote(request):
    with ServerProcess(*getattr(request.module, "SERVER_ARGS", ())) as server:
        remote_accel.init(transport="tcp", server="%s:%d" % server.tcp, token=server.token)
        yield server
        remote_accel.shutdown()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Certificates made by the openssl CLI: a CA ("ca") and its server certificate for
    127.0.0.1, a client certificate, a certificate for another name, and another CA
    ("other_ca") with a server certificate of its own ("other_cert")."""
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca(d, "ca"), make_ca(d, "other")
    cert, key = make_leaf(d, "server", "ca", "IP:127.0.0.1,DNS:localhost")
    wrong_name, wrong_name_key = make_leaf(d, "elsewhere", "ca", "DNS:gpu.example.org")
    client_cert, client_key = make_leaf(d, "client", "ca", "DNS:client")
    other_cert, other_key = make_leaf(d, "stranger", "other", "IP:127.0.0.1,DNS:localhost")
    return dict(ca=ca, other_ca=other_ca, cert=cert, key=key, wrong_name=wrong_name, wrong_name_key=wrong_name_key,
                client_cert=client_cert, client_key=client_key, other_cert=other_cert, other_key=other_key)
