"""The metrics port under bad HTTP: malformed, oversized, slow and flooding peers are
refused or cut off, and neither the metrics endpoint nor the server's clients suffer."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest
import torch

from remote_accel.server.metrics_http import MAX_CONNECTIONS, MAX_REQUEST_HEAD
from remote_accel.server.testing import Client, ServerProcess, scrape

pytestmark = pytest.mark.any_torch

#: Far above the endpoint's deadline for a request head (5 s): a bound, not a timing.
CUT_OFF_WITHIN_S = 60.0


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--metrics", "127.0.0.1:0", "--log-level", "debug") as proc:
        yield proc
        assert proc.alive(), f"the server died:\n{proc.log()}"
        assert "Traceback" not in proc.log(), f"the server hit a bug:\n{proc.log()}"


def endpoint(server) -> tuple[str, int]:
    parts = urlsplit(server.metrics_url)
    return parts.hostname, parts.port


def exchange(server, data: bytes) -> bytes:
    """Send `data`, then read the answer until the server closes (b"" if it reset us)."""
    with socket.create_connection(endpoint(server), timeout=CUT_OFF_WITHIN_S) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # EPIPE, ECONNRESET, ENOTCONN: the server stopped reading (an oversized head)
            pass
        return read_all(sock)


def read_all(sock: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def server_works(server) -> None:
    """A scrape answers and a client's op runs: the server was not disturbed."""
    assert scrape(server.metrics_url).value("remote_accel_clients") >= 0
    with Client.tcp(*server.tcp, token=server.token) as c:
        x = c.upload(torch.arange(4.0))
        y = c.empty((4,))
        c.run("aten::mul.Tensor", x, x, outs=(y,))
        assert c.download(y).tolist() == [0.0, 1.0, 4.0, 9.0]


def threads_of(server) -> int:
    with open(f"/proc/{server.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_only_get_and_head_of_metrics(server):
    ok = exchange(server, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ok.startswith(b"HTTP/1.0 200") and b"\r\n\r\n# HELP" in ok and b"text/plain" in ok
    head = exchange(server, b"HEAD /metrics HTTP/1.0\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and head.endswith(b"\r\n\r\n")
    open_metrics = exchange(server, b"GET /metrics HTTP/1.0\r\nAccept: application/openmetrics-text\r\n\r\n")
    assert b"application/openmetrics-text" in open_metrics and open_metrics.rstrip().endswith(b"# EOF")
    assert exchange(server, b"GET / HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 404")
    assert exchange(server, b"GET /../../etc/passwd HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 404")
    assert exchange(server, b"POST /metrics HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc").startswith(b"HTTP/1.0 501")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(server.metrics_url.replace("/metrics", "/favicon.ico"), timeout=30)
    assert err.value.code == 404
    server_works(server)


@pytest.mark.parametrize("request_bytes,status", [
    (b"\x00\xff\x13\x37" * 64 + b"\r\n\r\n", b"400"),                 # binary garbage
    (b"GET\r\n\r\n", b"400"),                                         # no path, no version
    (b"GET /metrics HTTP/9.9\r\n\r\n", b"505"),                       # a version that does not exist
    (b"GET /metrics HTTP/1.1x\r\n\r\n", b"400"),                      # a version that is not one
    (b"BREW /metrics HTTP/1.0\r\n\r\n", b"501"),                      # a method it does not serve
    (b"\r\n\r\n", b""),                                               # nothing at all: no answer
])
def test_malformed_requests_are_refused(server, request_bytes, status):
    answer = exchange(server, request_bytes)
    assert answer.startswith(b"HTTP/1.0 " + status) if status else answer == b"", answer[:200]
    server_works(server)


@pytest.mark.parametrize("head", [
    b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n",             # one huge header
    b"GET /metrics HTTP/1.1\r\n" + b"X-Many: 1\r\n" * 5000 + b"\r\n",                 # very many headers
    b"GET /" + b"m" * (1 << 20) + b" HTTP/1.1\r\n\r\n",                              # a huge request line
])
def test_oversized_requests_are_refused(server, head):
    assert len(head) > MAX_REQUEST_HEAD
    answer = exchange(server, head)
    # 431, or a reset when the server closed with our unread bytes still coming in
    assert answer == b"" or answer.startswith(b"HTTP/1.0 431"), answer[:200]
    server_works(server)


def test_slow_and_stalled_peers_are_cut_off(server):
    """Slowloris: many connections that never finish their request head, and one that
    trickles a byte at a time. Threads stay bounded, clients and scrapes go on, and
    every such connection is closed by the server."""
    scrape(server.metrics_url)
    baseline = threads_of(server)
    stalled = []
    for _ in range(3 * MAX_CONNECTIONS):
        sock = socket.create_connection(endpoint(server), timeout=CUT_OFF_WITHIN_S)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        stalled.append(sock)
    trickler = socket.create_connection(endpoint(server), timeout=CUT_OFF_WITHIN_S)
    stop = threading.Event()

    def trickle():
        try:
            for byte in b"GET /metrics HTTP/1.1\r\n" + b"X" * 10_000:
                if stop.wait(0.5):
                    return
                trickler.send(bytes([byte]))
        except OSError:  # the server closed it: what this test wants
            pass

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    try:
        # one thread per accepted connection at most, the rest closed at once
        assert threads_of(server) <= baseline + MAX_CONNECTIONS
        with Client.tcp(*server.tcp, token=server.token) as c:  # clients are served meanwhile
            x = c.upload(torch.ones(8))
            y = c.empty((8,))
            c.run("aten::add.Tensor", x, x, outs=(y,))
            assert c.download(y).tolist() == [2.0] * 8
        for sock in stalled:
            answer = read_all(sock)  # the server answers 408 or drops it; never leaves it open
            assert answer == b"" or answer.startswith(b"HTTP/1.0 408"), answer[:100]
        sender.join(CUT_OFF_WITHIN_S)
        assert not sender.is_alive(), "the trickling peer was never cut off"
    finally:
        stop.set()
        trickler.close()
        for sock in stalled:
            sock.close()
    deadline = time.monotonic() + CUT_OFF_WITHIN_S
    while threads_of(server) > baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    assert threads_of(server) <= baseline
    server_works(server)


def test_connection_flood(server):
    for _ in range(300):
        with socket.create_connection(endpoint(server), timeout=CUT_OFF_WITHIN_S):
            pass  # connect and hang up at once
    server_works(server)
