"""The peers the conformance suite runs against: one fixture, every transport.

Each kind yields a `Peer`: `transport` is our end, connected to an echo peer
(remote_accel.dataplane.echo) that runs in another process where the transport can
cross processes. A new transport is correct when it passes tests/conformance.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest

from remote_accel.dataplane import echo
from remote_accel.dataplane.tcp import TcpTransport

READY_TIMEOUT_S = 60


@dataclass
class Peer:
    kind: str
    transport: object
    #: SIGKILL the far end (None where both ends share this process)
    kill: Optional[Callable[[], None]] = None
    #: send raw bytes that are not a valid message to the far end
    inject_garbage: Optional[Callable[[bytes], None]] = None
    #: a fresh connection to the same far end, to show it survived
    reconnect: Optional[Callable[[], object]] = None
    #: how long a dead peer may take to be noticed
    dead_peer_timeout_s: float = 5.0
    cleanups: list = field(default_factory=list)


def start_echo_process(args: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "remote_accel.dataplane.echo", *args],
        stdout=subprocess.PIPE, stderr=None, text=True, env=env,
    )
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(READY_TIMEOUT_S)
    line = ready[0] if ready else ""
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"echo peer did not start: {line!r}")
    return proc, line.split(" ", 1)[1].strip()


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _tcp_peer() -> Peer:
    proc, address = start_echo_process(["--transport", "tcp", "--listen", "127.0.0.1:0"])
    _, host, port = address.split(":")

    def connect():
        return TcpTransport.connect(host, int(port), timeout=10)

    def inject_garbage(data: bytes) -> None:
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            raw.sendall(data)
            raw.settimeout(10)
            # the peer must close this connection (ProtocolError), not hang or crash
            assert raw.recv(1) == b""

    peer = Peer("tcp", connect(), kill=lambda: proc.send_signal(signal.SIGKILL),
                inject_garbage=inject_garbage, reconnect=connect)
    peer.cleanups.append(lambda: stop_process(proc))
    return peer


_certs: dict = {}


def _self_signed() -> tuple[str, str]:
    """One certificate for 127.0.0.1 per test session, made by the openssl CLI."""
    if not _certs:
        d = tempfile.mkdtemp(prefix="ra-conformance-tls-")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout",
                        f"{d}/key.pem", "-out", f"{d}/cert.pem", "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=120)
        _certs.update(cert=f"{d}/cert.pem", key=f"{d}/key.pem", dir=d)
        atexit.register(shutil.rmtree, d, True)
    return _certs["cert"], _certs["key"]


def _tls_peer() -> Peer:
    from remote_accel.dataplane.tls import TlsTransport, client_context

    cert, key = _self_signed()
    proc, address = start_echo_process(["--transport", "tcp", "--listen", "127.0.0.1:0", "--tls-cert", cert,
                                        "--tls-key", key])
    _, host, port = address.split(":")
    ctx = client_context(cert)

    def connect():
        return TlsTransport.connect(host, int(port), timeout=10, tls=ctx)

    def inject_garbage(data: bytes) -> None:
        with ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=10), server_hostname=host) as raw:
            raw.sendall(data)  # inside TLS: garbage as messages, not as TLS records
            # the peer must close this connection (ProtocolError), not hang or crash
            assert raw.recv(1) == b""

    peer = Peer("tls", connect(), kill=lambda: proc.send_signal(signal.SIGKILL),
                inject_garbage=inject_garbage, reconnect=connect)
    peer.cleanups.append(lambda: stop_process(proc))
    return peer


def _socketpair_peer() -> Peer:
    ours, theirs = TcpTransport.pair()
    stop = threading.Event()
    thread = threading.Thread(target=echo.serve, args=(theirs, stop), daemon=True)
    thread.start()
    peer = Peer("socketpair", ours)
    peer.cleanups += [stop.set, lambda: thread.join(5), theirs.close]
    return peer


#: name -> factory; the DPDK transports add themselves in tests/conformance/dpdk_peers.py
PEER_FACTORIES: dict[str, Callable[[], Peer]] = {"tcp": _tcp_peer, "tls": _tls_peer, "socketpair": _socketpair_peer}
PEER_MARKS: dict[str, list] = {}

sys.path.insert(0, os.path.dirname(__file__))
try:
    from dpdk_peers import DPDK_PEER_FACTORIES, DPDK_PEER_MARKS  # noqa: E402

    PEER_FACTORIES.update(DPDK_PEER_FACTORIES)
    PEER_MARKS.update(DPDK_PEER_MARKS)
except ImportError as exc:  # only while the DPDK peers module does not exist yet
    if "dpdk_peers" not in str(exc):
        raise


@pytest.fixture(params=[pytest.param(k, marks=PEER_MARKS.get(k, [])) for k in PEER_FACTORIES])
def peer(request):
    made = PEER_FACTORIES[request.param]()
    yield made
    try:
        made.transport.close()
    finally:
        for cleanup in reversed(made.cleanups):
            cleanup()
