"""Transport choice: explicit argument, then environment, then the best available, with
a logged reason for falling back to TCP."""

from __future__ import annotations

import logging
import threading

import pytest

from remote_accel.dataplane import connect
from remote_accel.dataplane.tcp import TcpListener, TcpTransport
from remote_accel.errors import ConfigError


@pytest.fixture
def tcp_server():
    lst = TcpListener("127.0.0.1", 0)
    accepted = []
    th = threading.Thread(target=lambda: accepted.append(lst.accept(10)), daemon=True)
    th.start()
    yield f"127.0.0.1:{lst.port}"
    th.join(10)
    for t in accepted:
        t.close()
    lst.close()


def test_explicit_tcp(tcp_server):
    with connect.connect("tcp", server=tcp_server) as t:
        assert isinstance(t, TcpTransport)


def test_environment_chooses(tcp_server, monkeypatch):
    monkeypatch.setenv("REMOTE_ACCEL_TRANSPORT", "tcp")
    monkeypatch.setenv("REMOTE_ACCEL_SERVER", tcp_server)
    with connect.connect(None) as t:
        assert isinstance(t, TcpTransport)


def test_auto_falls_back_to_tcp_with_a_reason(tcp_server, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("REMOTE_ACCEL_RUNTIME_DIR", str(tmp_path))  # no memif server there
    monkeypatch.delenv("REMOTE_ACCEL_EAL_ARGS", raising=False)
    with caplog.at_level(logging.WARNING, logger="remote_accel.dataplane.connect"):
        with connect.connect("auto", server=tcp_server) as t:
            assert isinstance(t, TcpTransport)
    assert any("using TCP, not DPDK" in r.getMessage() for r in caplog.records)


def test_bad_transport_name():
    with pytest.raises(ConfigError):
        connect.connect("carrier-pigeon")


def test_listen_tcp():
    with connect.listen("tcp", address="127.0.0.1:0") as lst:
        assert isinstance(lst, TcpListener) and lst.port > 0
