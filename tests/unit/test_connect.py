"""Transport choice: explicit argument, then environment, then the best available, with
a logged reason for falling back to TCP."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
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
    with caplog.at_level(logging.DEBUG, logger="remote_accel.dataplane.connect"):
        with connect.connect("auto", server=tcp_server) as t:
            assert isinstance(t, TcpTransport)
    said = [r for r in caplog.records if "using TCP, not DPDK" in r.getMessage()]
    # no DPDK server here: nothing for the user to act on, so not a warning
    assert [r.levelname for r in said] == ["INFO"] and "no DPDK server listens" in said[0].getMessage()


FULL_SERVER = """
import logging, os, socket, sys
from remote_accel.dataplane import connect, memif_slots
from remote_accel.dataplane.tcp import TcpListener, TcpTransport
records = []
logging.getLogger("remote_accel").addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: records.append(r)})())
logging.getLogger("remote_accel").setLevel(logging.DEBUG)
sock = os.path.join(os.environ["REMOTE_ACCEL_RUNTIME_DIR"], "memif.sock")
server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
server.bind("\\0" + sock)  # where memif's server socket is by default
server.listen(1)
memif_slots.publish(sock, 1, "max_clients")
lst = TcpListener("127.0.0.1", 0)
fd = os.open(memif_slots.slots_path(sock), os.O_RDWR)
assert memif_slots._try_lock(fd, 0)  # a live local client holds the only slot
for _ in range(2):
    with connect.connect("auto", server=f"127.0.0.1:{lst.port}") as t:
        assert isinstance(t, TcpTransport)
    lst.accept(10).close()
said = [(r.levelname, r.getMessage()) for r in records if "using TCP, not DPDK" in r.getMessage()]
print(said)
try:
    connect.connect("dpdk")  # no fallback: the error says what to change
except memif_slots.MemifSlotsFull as exc:
    print("dpdk:", exc)
"""


def test_auto_says_once_and_as_a_warning_that_the_dpdk_server_is_full(tmp_path):
    """In a process of its own: a local client claims its memif slot when its EAL starts,
    once per process (pytest's own EAL may already run)."""
    try:
        from remote_accel.dataplane import dpdk  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"DPDK transport unavailable: {exc}")
    env = dict(os.environ, REMOTE_ACCEL_RUNTIME_DIR=str(tmp_path))
    env.pop("REMOTE_ACCEL_EAL_ARGS", None)
    proc = subprocess.run([sys.executable, "-c", FULL_SERVER], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    said, dpdk_error = proc.stdout.splitlines()
    said = ast.literal_eval(said)
    assert len(said) == 1 and said[0][0] == "WARNING", said  # once, and as something to act on
    assert "is full" in said[0][1] and "--max-clients" in said[0][1]
    assert "is full" in dpdk_error and "--max-clients (now 1)" in dpdk_error
    assert proc.stderr == ""


def test_bad_transport_name():
    with pytest.raises(ConfigError):
        connect.connect("carrier-pigeon")


def test_listen_tcp():
    with connect.listen("tcp", address="127.0.0.1:0") as lst:
        assert isinstance(lst, TcpListener) and lst.port > 0
