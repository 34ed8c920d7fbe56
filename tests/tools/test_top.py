"""ra-top against a real server's metrics endpoint, with a real client using the server."""

from __future__ import annotations

import http.server
import json
import os
import pty
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

from remote_accel.server.testing import Client, ServerProcess

PROG = [sys.executable, "-m", "remote_accel.tools.top"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--metrics", "127.0.0.1:0") as proc:
        yield proc
        assert proc.alive(), f"the server died:\n{proc.log()}"


@pytest.fixture
def busy_client(server):
    """A connected client holding known memory, running ops in a thread until the test ends."""
    client = Client.tcp(*server.tcp, token=server.token)
    x, y = client.upload(torch.ones(1024)), client.upload(torch.zeros(1024))
    stop = threading.Event()

    def work():
        while not stop.is_set():
            client.run("aten::add.Tensor", x, y, outs=(y,))  # into y's storage: memory stays put
            client.sync()

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    yield client
    stop.set()
    worker.join(60)
    client.close()


def address(server) -> str:
    return urlsplit(server.metrics_url).netloc


def ra_top(*args, timeout=120):
    return subprocess.run([*PROG, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_once_json_against_a_real_server(server, busy_client):
    out = ra_top("--server", address(server), "--once", "--json")
    assert out.returncode == 0, out.stderr
    frame = json.loads(out.stdout)
    assert frame["server"] == server.metrics_url
    assert frame["device"]["name"] == "cpu" or server.device != "cpu"
    assert frame["clients_connected"] == 1 and frame["max_clients"] == 64
    [client] = frame["clients"]
    assert client["transport"] == "tcp"
    assert client["memory_bytes"] == 2 * 4096
    assert client["ops_total"] > 0 and client["ops_per_s"] > 0  # it ran ops all through the interval
    assert client["bytes_received_per_s"] > 0 and client["bytes_sent_per_s"] > 0
    assert client["age_s"] >= 0
    assert frame["ops_total"] >= client["ops_total"] and frame["ops_per_s"] > 0


def test_once_table(server, busy_client):
    out = ra_top("--server", server.metrics_url, "--once", "--interval", "0.2")  # a URL works too
    assert out.returncode == 0, out.stderr
    header, clients = out.stdout.split("CLIENT", 1)
    assert "remote-accel-server" in header and "clients 1/64" in header
    assert "TRANSPORT" in clients and "tcp" in clients and "8.0 KiB" in clients


def test_live_json_lines_until_interrupted(server):
    proc = subprocess.Popen([*PROG, "--server", address(server), "--json", "--interval", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        frames = [json.loads(proc.stdout.readline()) for _ in range(3)]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, proc.stderr.read()
    assert all(f["clients_connected"] == 0 and f["clients"] == [] for f in frames)


def test_live_view_on_a_terminal(server, busy_client):
    leader, follower = pty.openpty()
    proc = subprocess.Popen([*PROG, "--server", address(server), "--interval", "0.1"], stdout=follower,
                            stderr=subprocess.PIPE)
    os.close(follower)
    text = b""
    try:
        while text.count(b"CLIENT") < 3:  # three frames drawn
            text += os.read(leader, 65536)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, proc.stderr.read()
        os.close(leader)
    assert b"\x1b[" in text and b"tcp" in text  # redrawn in place: cursor movements


def test_unreachable_server_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        out = ra_top("--server", f"127.0.0.1:{port}", "--once")
    assert out.returncode == 1 and out.stdout == ""
    assert f"ra-top: cannot read http://127.0.0.1:{port}/metrics" in out.stderr


def test_not_a_remote_accel_endpoint():
    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"some_other_metric 1\n" if self.path == "/metrics" else b"")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        out = ra_top("--server", f"127.0.0.1:{httpd.server_address[1]}", "--once", "--interval", "0.1")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert out.returncode == 1 and "has no remote_accel metrics" in out.stderr


def test_bad_options():
    for args in (["--interval", "0"], ["--server", "host:port"], ["--server", "127.0.0.1:0"]):
        out = ra_top(*args)
        assert out.returncode == 2 and "ra-top: error" in out.stderr


def test_installed_as_a_console_script():
    script = Path(sys.executable).parent / "ra-top"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--once" in out.stdout and "--json" in out.stdout
