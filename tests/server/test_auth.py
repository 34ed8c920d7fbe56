"""The handshake against a real server: replayed and reflected answers, a wrong token,
a peer that cannot prove it holds the token, the token never on the wire (a real
tcpdump capture), and the refusal to serve TCP off loopback without TLS."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from remote_accel._version import WIRE_VERSION
from remote_accel.dataplane import handshake as hs
from remote_accel.dataplane import messages as m
from remote_accel.dataplane.tcp import TcpListener, TcpTransport
from remote_accel.errors import AuthError, ConfigError
from remote_accel.server.testing import Client, ServerProcess

pytestmark = pytest.mark.any_torch


def token_pieces(token: str, width: int = 8) -> list[bytes]:
    """Every `width`-byte run of the token: none may show up anywhere on the wire."""
    raw = token.encode()
    return [raw[i:i + width] for i in range(len(raw) - width + 1)]


class RawHandshake:
    """The client half, step by step, so that a test can answer wrongly on purpose."""

    def __init__(self, server, nonce: bytes | None = None):
        self.t = TcpTransport.connect(*server.tcp)
        self.nonce = nonce or hs.new_nonce()
        self.t.send(m.Hello.TYPE, m.encode(m.Hello("raw test", WIRE_VERSION, self.nonce)))
        self.challenge = self.recv(m.Challenge).nonce

    def recv(self, cls):
        msg = self.t.recv(timeout=20)
        reply = m.decode(msg.type, msg.meta)
        assert type(reply) is cls, reply
        return reply

    def answer(self, proof: bytes):
        self.t.send(m.Auth.TYPE, m.encode(m.Auth(proof)))
        msg = self.t.recv(timeout=20)
        return m.decode(msg.type, msg.meta)


def test_a_replayed_answer_is_refused(server):
    first = RawHandshake(server)
    recorded = hs.client_proof(server.token, first.challenge, first.nonce)
    welcome = first.answer(recorded)
    assert type(welcome) is m.Welcome
    assert hs.matches(hs.server_proof(server.token, first.nonce, first.challenge), welcome.proof)
    first.t.close()
    # someone who recorded that session replays the client's side of it, byte for byte
    again = RawHandshake(server, nonce=first.nonce)
    assert again.challenge != first.challenge  # a fresh challenge...
    refused = again.answer(recorded)  # ...which the old answer does not meet
    assert type(refused) is m.ErrorReply and refused.kind == "auth" and "wrong token" in refused.message
    again.t.close()


def test_a_reflected_proof_is_refused(server):
    # the proof a server gives (its label) does not pass for a client's answer
    h = RawHandshake(server)
    refused = h.answer(hs.server_proof(server.token, h.nonce, h.challenge))
    assert type(refused) is m.ErrorReply and refused.kind == "auth"
    h.t.close()
    # nor does the right HMAC over the nonces in the other order
    h = RawHandshake(server)
    refused = h.answer(hs.client_proof(server.token, h.nonce, h.challenge))
    assert type(refused) is m.ErrorReply and refused.kind == "auth"
    h.t.close()


def test_a_wrong_token_fails_within_the_timeout_with_a_clear_message(server):
    t = TcpTransport.connect(*server.tcp)
    with pytest.raises(AuthError, match="wrong token.*REMOTE_ACCEL_TOKEN"):
        hs.client_handshake(t, "not-" + server.token, "test", timeout=5)  # AuthError, not TransportTimeout
    t.close()
    with pytest.raises(AuthError, match="no token"):
        hs.client_handshake(TcpTransport.connect(*server.tcp), "", "test", timeout=5)


def test_a_client_that_names_another_server_is_refused_before_the_challenge(server):
    """HELLO.server: a client told to reach HOST:PORT (over DPDK, whichever server is
    behind the port) is refused by a server that does not listen there, with where it does."""
    host, port = server.tcp
    t = TcpTransport.connect(host, port)
    with pytest.raises(ConfigError, match=f"this server is not {host}:{port + 1}: it listens on tcp:{host}:{port}") as got:
        hs.client_handshake(t, server.token, "test", timeout=5, server=f"{host}:{port + 1}")
    assert got.value.kind == "wrong_server"
    t.close()
    for name in (f"{host}:{port}", f"localhost:{port}", f"[::1]:{port}"):
        with TcpTransport.connect(host, port) as t:
            welcome = hs.client_handshake(t, server.token, "test", timeout=5, server=name)
            assert welcome.listens == (f"tcp:{host}:{port}",)


@pytest.mark.parametrize(("address", "listens", "answers"), [
    ("10.0.0.5:18515", ("tcp:0.0.0.0:18515",), True),  # a listener on every address
    ("10.0.0.5:18515", ("tcp:10.0.0.5:18515",), True),
    ("10.0.0.6:18515", ("tcp:10.0.0.5:18515",), False),
    ("10.0.0.5:18516", ("tcp:0.0.0.0:18515",), False),  # another port: another server
    ("gpu-host:18515", ("tls:10.0.0.5:18515",), True),  # a host name is not resolved here
    ("localhost:18515", ("tcp:10.0.0.5:18515",), False),
    ("127.0.0.2:18515", ("tcp:127.0.0.1:18515",), True),  # both loopback
    ("[::1]:18515", ("tcp:[::]:18515",), False),  # listens as the server writes them: no brackets
    ("[::1]:18515", ("tcp:::1:18515",), True),
    ("10.0.0.5:18515", (), True),  # no TCP listener: the server cannot tell
    ("10.0.0.5:18515", ("tcp:nonsense", "udp:10.0.0.5:18515", 7), False),  # a peer's bytes, not addresses
    ("no port here:x", ("tcp:0.0.0.0:18515",), False),
])
def test_which_named_address_a_server_answers_to(address, listens, answers):
    assert hs.answers_to(listens, address) is answers


def fake_server(answer):
    """A listener that runs the server half wrongly: `answer(hello, challenge nonce, auth)`
    gives the proof its WELCOME carries."""
    listener = TcpListener("127.0.0.1", 0)

    def serve():
        with listener.accept(timeout=20) as t:
            msg = t.recv(timeout=20)
            hello = m.decode(msg.type, msg.meta)
            nonce = hs.new_nonce()
            t.send(m.Challenge.TYPE, m.encode(m.Challenge(nonce)), req_id=msg.req_id)
            msg = t.recv(timeout=20)
            auth = m.decode(msg.type, msg.meta)
            welcome = m.Welcome(1, "cpu", 0, "fake", answer(hello, nonce, auth))
            t.send(m.Welcome.TYPE, m.encode(welcome), req_id=msg.req_id)
            try:
                t.recv(timeout=20)  # until the client hangs up
            except Exception:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.parametrize("answer", [
    lambda hello, nonce, auth: secrets.token_bytes(32),  # does not know the token
    lambda hello, nonce, auth: auth.proof,  # reflects the client's own answer
    lambda hello, nonce, auth: hs.server_proof("another token", hello.nonce, nonce),
], ids=["guess", "reflection", "other-token"])
def test_the_client_refuses_a_server_that_cannot_prove_the_token(answer):
    listener, thread = fake_server(answer)
    try:
        with pytest.raises(AuthError, match="could not prove that it knows the token"):
            Client.tcp(listener.host, listener.port, token="the token")
    finally:
        thread.join(30)
        listener.close()


def run_cli(*argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "remote_accel.server", *argv], capture_output=True, text=True,
                          timeout=timeout)


def this_hosts_address() -> str:
    """A non-loopback IPv4 address of this machine, found without sending anything (a UDP
    connect only picks a route); 0.0.0.0 when there is none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never answered, and UDP connect sends nothing
            return s.getsockname()[0]
        except OSError:
            return "0.0.0.0"


@pytest.mark.parametrize("host", ["0.0.0.0", this_hosts_address()])
def test_tcp_off_loopback_without_tls_refuses_to_start(tmp_path, host):
    out = run_cli("--device", "cpu", "--listen", f"{host}:0", "--token-file", str(tmp_path / "t"))
    assert out.returncode == 2
    assert f"refusing to serve TCP on {host} without TLS" in out.stderr
    for hint in ("--tls-cert", "--tls-key", "openssl req -x509", "tls_ca", "--insecure"):
        assert hint in out.stderr
    assert "listening" not in out.stdout


def test_insecure_serves_off_loopback(tmp_path):
    # it only binds the wildcard address: nothing is sent anywhere
    with ServerProcess("--listen", "0.0.0.0:0", "--insecure") as server:
        assert server.addresses[0].startswith("tcp:0.0.0.0:")
        with Client.tcp("127.0.0.1", server.tcp[1], token=server.token) as c:
            assert c.ping(3) == 3


@pytest.mark.skipif(shutil.which("tcpdump") is None or os.geteuid() != 0,
                    reason="needs tcpdump and root (CI runs as root; apt-get install -y tcpdump)")
def test_the_token_never_crosses_loopback_tcp(tmp_path):
    import torch

    token = secrets.token_hex(32)
    pcap = tmp_path / "lo.pcap"
    with ServerProcess(token=token) as server:
        port = server.tcp[1]
        dump = subprocess.Popen(["tcpdump", "-i", "lo", "-U", "-B", "65536", "-w", str(pcap), f"tcp port {port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while not (pcap.exists() and pcap.stat().st_size > 0) and time.monotonic() < deadline:
                time.sleep(0.05)  # tcpdump writes the file header once it listens
            with Client.tcp(*server.tcp, token=token) as c:
                x = c.upload(torch.randn(1000))
                c.download(x)
                c.sync()
                c.goodbye()
            with pytest.raises(AuthError):
                Client.tcp(*server.tcp, token=token[:-1] + "x")  # nearly the token: still not on the wire
            # tcpdump stops without draining the kernel's buffer, and may lag on a busy
            # machine: wait until its file holds packets and stops growing
            size, deadline = -1, time.monotonic() + 30
            while (pcap.stat().st_size != size or size <= 24) and time.monotonic() < deadline:
                size = pcap.stat().st_size
                time.sleep(1.0)
        finally:
            dump.send_signal(signal.SIGINT)
            dump.wait(timeout=20)
    captured = pcap.read_bytes()
    lines = subprocess.run([sys.executable, "-m", "remote_accel.tools.dump", str(pcap), "--port", str(port)],
                           capture_output=True, text=True, timeout=120).stdout
    kinds = [line.split()[5] for line in lines.splitlines()]
    assert kinds[:4] == ["HELLO", "CHALLENGE", "AUTH", "WELCOME"], lines  # the capture saw the session
    assert kinds.count("AUTH") == 2 and "ERROR" in kinds
    assert not [piece for piece in token_pieces(token) if piece in captured]
