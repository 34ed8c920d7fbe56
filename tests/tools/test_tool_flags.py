"""Tool options that no other test uses: ra-dump's --frame-port, --width and --absolute
(on a synthesised capture of DPDK frames), and ra-top's --timeout (against an endpoint
that serves a real server's metrics, slowly)."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.utils import wrpcap

from remote_accel.dataplane import messages, wire
from remote_accel.server.testing import ServerProcess
from remote_accel.tools.wire_layers import FRAME_UDP_PORT, RAFrame, RAHello

OTHER_PORT = 4791
START = 1_700_000_000.0


def _message(msg, req_id: int) -> bytes:
    return wire.encode_prologue(msg.TYPE, messages.encode(msg), [], req_id=req_id)


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """The same two frames (a HELLO, a RUN message in one DATA frame) on the default DPDK
    frame port, then on another UDP port, half a second apart."""
    a, b = ("169.254.0.1", "02:00:00:00:00:01"), ("169.254.0.2", "02:00:00:00:00:02")
    run = _message(messages.RunOp(op="aten::add.Tensor", args=("x" * 300,), kwargs={}, outs=(1,)), req_id=21)
    frames, t = [], START
    for port in (FRAME_UDP_PORT, OTHER_PORT):
        for frame in (RAFrame(type="HELLO", conn=9) / RAHello(max_chunk=1416, window=256, peer_timeout_ns=8 * 10**9),
                      RAFrame(type="DATA", conn=9, seq=0, msg_id=0, msg_len=len(run)) / run):
            pkt = Ether(bytes(Ether(src=a[1], dst=b[1]) / IP(src=a[0], dst=b[0]) / UDP(sport=port, dport=port)
                              / frame))
            pkt.time = t
            t += 0.5
            frames.append(pkt)
    path = tmp_path_factory.mktemp("dump") / "frames.pcap"
    wrpcap(str(path), frames)
    return path


def ra_dump(capture, *args) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "remote_accel.tools.dump", str(capture), *args], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_dump_frame_port(capture):
    default = ra_dump(capture)
    assert len(default) == 2 and all(f":{FRAME_UDP_PORT} > " in line for line in default), default
    other = ra_dump(capture, "--frame-port", str(OTHER_PORT))
    assert len(other) == 2 and all(f":{OTHER_PORT} > " in line for line in other), other
    assert "frame HELLO" in other[0] and " RUN req=21 " in other[1], other


def test_dump_width_and_absolute(capture):
    (run,) = [line for line in ra_dump(capture) if " RUN " in line]
    assert "RunOp(op='aten::add.Tensor', args=('xxxx" in run
    (cut,) = [line for line in ra_dump(capture, "--width", "20") if " RUN " in line]
    assert cut.endswith("  RunOp(op='aten::a..."), cut  # the decoded fields in 20 characters
    assert run.split()[0] == "0.500000"  # seconds since the first packet
    absolute = ra_dump(capture, "--absolute")
    assert [line.split()[0] for line in absolute] == [f"{START:.6f}", f"{START + 0.5:.6f}"], absolute


# -- ra-top --timeout --------------------------------------------------------------------
DELAY_S = 1.0  # how long the slow endpoint takes to answer


@pytest.fixture(scope="module")
def slow_endpoint():
    """http://127.0.0.1:PORT/metrics answering a real server's metrics after DELAY_S."""
    with ServerProcess("--metrics", "127.0.0.1:0") as server:
        with urllib.request.urlopen(server.metrics_url, timeout=30) as reply:
            text = reply.read()

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            time.sleep(DELAY_S)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def ra_top(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remote_accel.tools.top", *args], capture_output=True, text=True,
                          timeout=120)


def test_top_timeout(slow_endpoint):
    short = ra_top("--server", slow_endpoint, "--once", "--timeout", "0.2")  # shorter than the endpoint takes
    assert short.returncode == 1 and short.stdout == "", short.stdout
    assert f"ra-top: cannot read http://{slow_endpoint}/metrics" in short.stderr, short.stderr
    patient = ra_top("--server", slow_endpoint, "--once", "--timeout", "60")
    assert patient.returncode == 0, patient.stderr
    assert "remote-accel-server" in patient.stdout, patient.stdout
