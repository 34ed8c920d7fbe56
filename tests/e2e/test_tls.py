"""TLS over TCP, end to end: a real server process with certificates made by the openssl
CLI, the real client device, the test client for the refusals."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn as nn

import remote_accel
from remote_accel.dataplane.tls import TlsListener, TlsTransport, client_context, server_context
from remote_accel.dataplane.wire import MsgType
from remote_accel.errors import AuthError, ConfigError, PeerGone, RemoteAccelError
from remote_accel.pytorch_ext import lifecycle, runtime
from remote_accel.server.testing import openssl, Client, ServerProcess

pytestmark = pytest.mark.any_torch

@pytest.fixture(scope="module")
def tls_server(pki):
    with ServerProcess("--tls-cert", pki["cert"], "--tls-key", pki["key"]) as server:
        yield server
        assert "Traceback" not in server.log(), server.log()


def _train(device, steps=6):
    """Fit one fixed batch: the loss must go down step after step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_model_trains_over_tls(tls_server, pki):
    host, port = tls_server.tcp
    remote_accel.init(transport="tcp", server=f"{host}:{port}", token=tls_server.token, tls_ca=pki["ca"])
    try:
        assert runtime.session(0).transport.peer.startswith("tls:")
        big = torch.randn(1 << 20)  # 4 MiB up and down: bulk data through TLS records
        assert torch.equal(big.to("remote_accel").cpu(), big)
        remote = _train("remote_accel")
    finally:
        remote_accel.shutdown()
    local = _train("cpu")
    assert remote == pytest.approx(local, rel=1e-4, abs=1e-5)
    assert remote[-1] < remote[0]


def test_tls_records_are_read_in_c_and_the_server_s_loop_serves_the_session(tls_server, pki):
    """Where Python's `ssl` hands its SSL object over (CPython with a shared OpenSSL, as
    here and in CI), the client reads many records a call in C and the server serves the
    session in its C++ loop: a change that disables either (a new object layout) fails
    here instead of going unseen as a slower TLS."""
    host, port = tls_server.tcp
    remote_accel.init(transport="tcp", server=f"{host}:{port}", token=tls_server.token, tls_ca=pki["ca"])
    try:
        session = runtime.session(0)
        assert session.transport._c_reads is not None
        x = torch.arange(64.0, device="remote_accel")
        before = session.stats()["fast_loop_served"]
        assert [(x * i).sum().item() for i in range(20)] == [2016.0 * i for i in range(20)]
        batches, reads, _ = session.stats()["fast_loop_served"]
        assert batches > before[0] and reads >= before[1] + 20, (before, session.stats()["fast_loop_served"])
        big = torch.randn(3 << 20)  # 12 MiB each way: many records in one read
        assert torch.equal((big.to("remote_accel") + 1).cpu(), big + 1)
    finally:
        remote_accel.shutdown()


def _syscalls() -> int:
    """This process's read and write syscalls so far (/proc/self/io)."""
    with open("/proc/self/io", encoding="ascii") as f:
        io = dict(line.split(": ") for line in f.read().splitlines())
    return int(io["syscr"]) + int(io["syscw"])


def test_tls_records_travel_many_to_a_syscall_and_every_message_arrives_whole(pki):
    """Both ends batch records (a write buffer flushed after each message, and read-ahead):
    16 MiB, 1,024 records, crosses in far fewer reads and writes than one write and two
    reads a record would take; the reply after it is not held back in a buffer; and sizes
    around the records' and the buffers' edges come back whole."""
    listener = TlsListener("127.0.0.1", 0, tls=server_context(pki["cert"], pki["key"]))
    served = {}

    def echo_server():
        t = served["t"] = listener.accept(timeout=30)
        while True:
            msg = t.recv(timeout=60)
            if msg.type == MsgType.GOODBYE:
                return
            t.send(MsgType.ECHO_REPLY, msg.meta, msg.payloads, req_id=msg.req_id)

    thread = threading.Thread(target=echo_server, daemon=True)
    thread.start()
    client = TlsTransport.connect("127.0.0.1", listener.port, tls=client_context(pki["ca"]))
    try:
        rng = np.random.default_rng(7)
        sizes = (1, (16 << 10) - 1, 16 << 10, (16 << 10) + 1, (64 << 10) - 1, 64 << 10, (64 << 10) + 1,
                 (256 << 10) - 1, 256 << 10, (256 << 10) + 1, (3 << 20) + 5)
        for i, n in enumerate(sizes):
            data = rng.integers(0, 256, n, dtype=np.uint8)
            client.send(MsgType.ECHO, b"m%d" % i, [data], req_id=i)
            reply = client.recv(timeout=60)
            assert (reply.type, reply.meta, reply.req_id) == (MsgType.ECHO_REPLY, b"m%d" % i, i)
            assert bytes(reply.payloads[0]) == data.tobytes(), n
        assert client._batching is not None and served["t"]._batching is not None
        data = rng.integers(0, 256, 16 << 20, dtype=np.uint8)
        before = _syscalls()
        client.send(MsgType.ECHO, b"big", [data])
        reply = client.recv(timeout=60)
        calls = _syscalls() - before
        assert bytes(reply.payloads[0]) == data.tobytes()
        # 32 MiB through both ends of this process (there and back): 2,048 records, which
        # one at a time would take 6,144 calls; batched about 128 writes and 512 reads
        assert calls < 1500, calls
        client.send(MsgType.GOODBYE, b"", [])
        thread.join(30)
    finally:
        client.close()
        listener.close()


def test_the_ca_comes_from_the_environment_too(pki, monkeypatch):
    monkeypatch.setenv("REMOTE_ACCEL_TLS_CA", pki["ca"])
    assert lifecycle._tls_context(None, None, None) is not None
    monkeypatch.delenv("REMOTE_ACCEL_TLS_CA")
    assert lifecycle._tls_context(None, None, None) is None
    with pytest.raises(ConfigError, match="no such file"):
        lifecycle._tls_context("/nonexistent/ca.pem", None, None)


def test_a_client_with_another_ca_refuses_the_server(tls_server, pki):
    with pytest.raises(AuthError, match="certificate verify failed|no certificate valid"):
        Client.tcp(*tls_server.tcp, token=tls_server.token, tls=client_context(pki["other_ca"]))


def test_a_certificate_for_another_name_is_refused(pki):
    with ServerProcess("--tls-cert", pki["wrong_name"], "--tls-key", pki["wrong_name_key"]) as server:
        with pytest.raises(AuthError, match="127.0.0.1"):
            Client.tcp(*server.tcp, token=server.token, tls=client_context(pki["ca"]))


def test_a_plaintext_client_is_told_to_use_tls(tls_server):
    with pytest.raises(AuthError, match="TLS connections only.*tls_ca"):
        Client.tcp(*tls_server.tcp, token=tls_server.token, timeout=30)


def test_a_tls_client_of_a_plaintext_server_gets_a_clear_error(pki):
    with ServerProcess() as server:
        with pytest.raises(PeerGone, match="TLS"):
            Client.tcp(*server.tcp, token=server.token, tls=client_context(pki["ca"]))


def test_mutual_tls(pki):
    with ServerProcess("--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-client-ca", pki["ca"]) as server:
        # without a certificate: TLS 1.3 lets the client finish its handshake first, so
        # the refusal comes as the answer to HELLO
        with pytest.raises(RemoteAccelError, match="certificate"):
            Client.tcp(*server.tcp, token=server.token, tls=client_context(pki["ca"]), timeout=30)
        ctx = client_context(pki["ca"], pki["client_cert"], pki["client_key"])
        with Client.tcp(*server.tcp, token=server.token, tls=ctx) as c:
            x = c.upload(torch.arange(6.0))
            assert torch.equal(c.download(x), torch.arange(6.0))
        assert server.alive()
        assert "Traceback" not in server.log(), server.log()


def test_the_readme_recipe_self_signed_pair(tmp_path):
    """The one-command self-signed pair of the README: the certificate is its own CA."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", "server.key",
            "-out", "server.crt", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
            cwd=tmp_path)
    with ServerProcess("--tls-cert", str(tmp_path / "server.crt"), "--tls-key", str(tmp_path / "server.key")) as s:
        with Client.tcp(*s.tcp, token=s.token, tls=client_context(str(tmp_path / "server.crt"))) as c:
            assert c.ping(5) == 5


def test_bad_tls_options_stop_the_server_with_a_reason(pki, tmp_path):
    for options, text in (((("--tls-cert", pki["cert"]),), "go together"),
                          ((("--tls-client-ca", pki["ca"]),), "needs --tls-cert"),
                          ((("--tls-cert", pki["cert"], "--tls-key", pki["client_key"]),), "cannot be used"),
                          ((("--tls-cert", str(tmp_path / "none.crt"), "--tls-key", pki["key"]),), "no such file")):
        server = ServerProcess(*options[0])
        with pytest.raises(RuntimeError, match=text):
            server.start()
        server.stop()
