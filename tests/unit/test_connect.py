"""Transport choice: explicit argument, then environment, then the best available, with
a logged reason for falling back to TCP."""

from __future__ import annotations

import logging
import os
import socket
import threading

import pytest

from remote_accel.dataplane import connect, memif_slots
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
    with caplog.at_level(logging.DEBUG, logger="remote_accel.dataplane.connect"):
        with connect.connect("auto", server=tcp_server) as t:
            assert isinstance(t, TcpTransport)
    said = [r for r in caplog.records if "using TCP, not DPDK" in r.getMessage()]
    # no DPDK server here: nothing for the user to act on, so not a warning
    assert [r.levelname for r in said] == ["INFO"] and "no DPDK server listens" in said[0].getMessage()


def test_auto_says_once_and_as_a_warning_that_the_dpdk_server_is_full(tmp_path, monkeypatch, caplog):
    try:
        from remote_accel.dataplane import dpdk  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"DPDK transport unavailable: {exc}")
    monkeypatch.setenv("REMOTE_ACCEL_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("REMOTE_ACCEL_EAL_ARGS", raising=False)
    sock = str(tmp_path / "memif.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind("\0" + sock)  # where memif's server socket is by default
    server.listen(1)
    memif_slots.publish(sock, 1, "max_clients")
    lst = TcpListener("127.0.0.1", 0)
    fd = os.open(memif_slots.slots_path(sock), os.O_RDWR)
    try:
        assert memif_slots._try_lock(fd, 0)  # a live local client holds the only slot
        with caplog.at_level(logging.DEBUG, logger="remote_accel.dataplane.connect"):
            for _ in range(2):
                with connect.connect("auto", server=f"127.0.0.1:{lst.port}") as t:
                    assert isinstance(t, TcpTransport)
                lst.accept(10).close()
        said = [r for r in caplog.records if "using TCP, not DPDK" in r.getMessage()]
        assert len(said) == 1 and said[0].levelname == "WARNING"
        assert "is full" in said[0].getMessage() and "--max-clients" in said[0].getMessage()
        with pytest.raises(memif_slots.MemifSlotsFull, match="--max-clients"):
            connect.connect("dpdk")  # no fallback: the error says what to change
    finally:
        os.close(fd)
        memif_slots.unpublish(sock)
        lst.close()
        server.close()


def test_bad_transport_name():
    with pytest.raises(ConfigError):
        connect.connect("carrier-pigeon")


def test_listen_tcp():
    with connect.listen("tcp", address="127.0.0.1:0") as lst:
        assert isinstance(lst, TcpListener) and lst.port > 0
