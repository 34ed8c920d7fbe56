"""Server-to-server copies without Ray: two plain server processes, init(servers=[a, b]).

`t.to("remote_accel:1")` of a tensor on remote_accel:0 travels from server 0 to server 1
over their own connection; the client's byte counters show the bytes did not pass it.
"""

import json
import logging
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

import remote_accel
from remote_accel.dataplane import messages as m
from remote_accel.errors import ProtocolError
from remote_accel.pytorch_ext import handles, recovery, runtime
from remote_accel.server import peer
from remote_accel.server.peer import PeerCopies
from remote_accel.server.testing import ServerProcess, tcp_sockets, wait_for

pytestmark = pytest.mark.any_torch

MIB = 1 << 20


@pytest.fixture(scope="module")
def two_servers():
    a = ServerProcess(token="token-a").start()
    b = ServerProcess(token="token-b").start()
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


@pytest.fixture
def pair(two_servers):
    a, b = two_servers
    remote_accel.init(transport="tcp", servers=[f"{a.tcp[0]}:{a.tcp[1]}", f"{b.tcp[0]}:{b.tcp[1]}"],
                      tokens=[a.token, b.token], timeout=30.0)
    try:
        yield a, b
    finally:
        remote_accel.shutdown()


def _client_bytes() -> int:
    return sum(remote_accel.stats(f"remote_accel:{i}")["bytes_sent"] + remote_accel.stats(f"remote_accel:{i}")
               ["bytes_received"] for i in (0, 1))


def test_copy_of_64_mib_is_bit_identical_and_bypasses_the_client(pair):
    gen = torch.Generator().manual_seed(3)
    host = torch.randint(-2**31, 2**31 - 1, (16 * MIB,), dtype=torch.int32, generator=gen)  # 64 MiB
    x = host.to("remote_accel:0")
    torch.remote_accel.synchronize(0)
    before_client = _client_bytes()
    before = [remote_accel.server_stats(i) for i in (0, 1)]
    y = x.to("remote_accel:1")
    assert y.device == torch.device("remote_accel:1")
    torch.remote_accel.synchronize(1)
    torch.remote_accel.synchronize(0)  # the source counts its bytes once the destination said done
    after = [remote_accel.server_stats(i) for i in (0, 1)]
    moved = _client_bytes() - before_client
    assert moved < 1 * MIB, f"{moved} bytes crossed the client's links for a 64 MiB copy"
    assert after[0]["peer_bytes_sent"] - before[0]["peer_bytes_sent"] == 64 * MIB
    assert after[1]["peer_bytes_received"] - before[1]["peer_bytes_received"] == 64 * MIB
    assert remote_accel.stats("remote_accel:0")["peer_bytes"] == 64 * MIB
    assert torch.equal(y.cpu(), host)


def test_copies_of_views_dtypes_and_back(pair):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    x = base.to("remote_accel:0")
    # a strided view, a dtype change on the way, and a copy back to server 0
    t = x.t().to("remote_accel:1")
    assert torch.equal(t.cpu(), base.t())
    h = x[:, 1:4].to("remote_accel:1", dtype=torch.float64)
    assert torch.equal(h.cpu(), base[:, 1:4].double())
    back = (t * 2).to("remote_accel:0")
    assert torch.equal(back.cpu(), base.t() * 2)
    # copy_ into an existing tensor of the other server, broadcast
    dst = torch.zeros(3, 6, device="remote_accel:1")
    dst.copy_(x[0])
    assert torch.equal(dst.cpu(), base[0].expand(3, 6))
    assert remote_accel.server_stats(1)["peer_copies_received"] >= 3


def test_direct_copies_off_goes_through_the_client(two_servers):
    a, b = two_servers
    remote_accel.init(transport="tcp", servers=[f"{a.tcp[0]}:{a.tcp[1]}", f"{b.tcp[0]}:{b.tcp[1]}"],
                      tokens=[a.token, b.token], direct_copies=False)
    try:
        host = torch.randn(MIB // 4)  # 1 MiB
        x = host.to("remote_accel:0")
        before = remote_accel.server_stats(1)["peer_bytes_received"]
        y = x.to("remote_accel:1")
        assert torch.equal(y.cpu(), host)
        assert remote_accel.server_stats(1)["peer_bytes_received"] == before
        assert remote_accel.stats("remote_accel:0")["bytes_down"] >= MIB
    finally:
        remote_accel.shutdown()


def test_wrong_token_for_the_destination_is_a_clear_error(two_servers):
    a, b = two_servers
    # the client itself reaches server 1 with its right token; the source is then given
    # a wrong one for it, as when a pool's server was replaced under the client
    remote_accel.init(transport="tcp", servers=[f"{a.tcp[0]}:{a.tcp[1]}", f"{b.tcp[0]}:{b.tcp[1]}"],
                      tokens=[a.token, b.token])
    try:
        remote_accel.pytorch_ext.runtime.session(1).token = "not-the-token"
        x = torch.ones(1000).to("remote_accel:0")
        y = x.to("remote_accel:1")
        with pytest.raises(remote_accel.RemoteAccelError, match="token"):
            torch.remote_accel.synchronize(0)
        del y
    finally:
        remote_accel.shutdown()


def test_tokens_must_match_servers(two_servers):
    a, b = two_servers
    with pytest.raises(remote_accel.RemoteAccelError, match="one token"):
        remote_accel.init(transport="tcp", servers=[f"{a.tcp[0]}:{a.tcp[1]}", f"{b.tcp[0]}:{b.tcp[1]}"],
                          tokens=[a.token])
    assert not remote_accel.is_initialized()


def test_a_list_as_token_gives_each_server_its_own(two_servers):
    """init(servers=[a, b], token=[ta, tb]): the README's other spelling of tokens=[...]."""
    a, b = two_servers
    remote_accel.init(transport="tcp", servers=[f"{a.tcp[0]}:{a.tcp[1]}", f"{b.tcp[0]}:{b.tcp[1]}"],
                      token=[a.token, b.token])
    try:
        assert [runtime.session(i).token for i in (0, 1)] == [a.token, b.token]
        y = torch.arange(4.0).to("remote_accel:0").to("remote_accel:1")  # b's token keys the direct copy
        assert torch.equal(y.cpu(), torch.arange(4.0))
    finally:
        remote_accel.shutdown()


def test_a_server_of_the_pair_keeps_other_clients_isolated(pair):
    from remote_accel.server.testing import Client

    a, b = pair
    x = torch.arange(1000, dtype=torch.float32).to("remote_accel:0")
    y = x.to("remote_accel:1")  # a storage of this client's session on server b
    torch.remote_accel.synchronize(1)
    sid = remote_accel.pytorch_ext.handles.announce(y, 1)
    with Client.tcp(*b.tcp, token=b.token) as other:  # another client of server b, at the same time
        with pytest.raises(Exception, match="(?i)storage|handle"):
            other.read(sid, 16)
        assert other.stats()["storages"] == 0
    assert torch.equal(y.cpu(), torch.arange(1000, dtype=torch.float32))


# -- recovery (init()'s default) when a server of a copy dies ------------------------------------------
def _copied(host: torch.Tensor) -> tuple:
    """host on remote_accel:0, copied server to server onto remote_accel:1 (shown by the
    destination's count of direct copies), both checked."""
    before = remote_accel.server_stats(1)["peer_copies_received"]
    x = host.to("remote_accel:0")
    y = x.to("remote_accel:1")
    assert torch.equal(y.cpu(), host)
    assert remote_accel.server_stats(1)["peer_copies_received"] == before + 1  # it came from server 0
    return x, y


def test_a_destination_killed_after_a_direct_copy_is_a_clear_error_never_other_data(pair, caplog):
    """The copy's bytes came from the other server and are on no client: until the
    destination's session takes its next snapshot it cannot be rebuilt, and says so,
    instead of replaying the copy from a source whose storage may have changed since."""
    a, b = pair
    host = torch.arange(1000.0)
    x, y = _copied(host)
    b.kill()
    b.restart()
    with caplog.at_level(logging.ERROR, logger="remote_accel"), \
            pytest.raises(remote_accel.RemoteAccelError, match="is gone"):
        (y + 1).cpu()
    assert "this session cannot be rebuilt: a direct copy from another server came in" in caplog.text, caplog.text
    with pytest.raises(remote_accel.RemoteAccelError):
        y.cpu()  # and so it stays: never data
    assert torch.equal((x * 2).cpu(), host * 2)  # the source's session never noticed
    assert remote_accel.stats(0)["recoveries"] == 0


def test_a_destination_recovers_again_once_a_snapshot_followed_the_copy(pair, monkeypatch):
    a, b = pair
    # a snapshot at every sync point with work since the last (time share permitting):
    # the copy's read below is one; by default one comes within a minute
    monkeypatch.setattr(recovery, "SNAPSHOT_EVERY_S", 0.0)
    monkeypatch.setattr(recovery, "SNAPSHOT_SHARE", 1.0)
    host = torch.arange(1000.0)
    snapshots = remote_accel.stats(1)["recovery_snapshots"]
    x, y = _copied(host)
    assert remote_accel.stats(1)["recovery_snapshots"] > snapshots  # the scenario: one after the copy
    b.kill()
    b.restart()
    assert torch.equal((y + 1).cpu(), host + 1)
    assert remote_accel.stats(1)["recoveries"] == 1


def test_a_source_killed_after_a_direct_copy_recovers_and_sends_no_copy_again(pair):
    """The source's session keeps no part of the copy to replay (its PeerSend): it is
    rebuilt, and the destination gets no second copy."""
    a, b = pair
    host = torch.arange(1000.0)
    x, y = _copied(host)
    received = remote_accel.server_stats(1)["peer_copies_received"]
    a.kill()
    a.restart()
    assert torch.equal((x * 2).cpu(), host * 2)
    assert remote_accel.stats(0)["recoveries"] == 1  # the scenario: server 0 died and its session recovered
    assert remote_accel.server_stats(1)["peer_copies_received"] == received
    assert torch.equal(y.cpu(), host)


def test_peer_bytes_are_in_the_servers_metrics():
    from remote_accel.server.testing import scrape

    with ServerProcess("--metrics", "0", token="m-a") as a, ServerProcess("--metrics", "0", token="m-b") as b:
        remote_accel.init(transport="tcp", servers=[f"{a.tcp[0]}:{a.tcp[1]}", f"{b.tcp[0]}:{b.tcp[1]}"],
                          tokens=[a.token, b.token])
        try:
            y = torch.ones(1 << 18).to("remote_accel:0").to("remote_accel:1")  # 1 MiB
            torch.remote_accel.synchronize(1)
            torch.remote_accel.synchronize(0)
            assert scrape(a.metrics_url).value("remote_accel_peer_bytes_total", direction="sent") == MIB
            assert scrape(b.metrics_url).value("remote_accel_peer_bytes_total", direction="received") == MIB
            del y
        finally:
            remote_accel.shutdown()


def test_the_destinations_token_never_crosses_the_wire(tmp_path, require_in_ci):
    """A loopback capture of a direct copy (client to both servers, source to
    destination) holds no run of the destination's token: the source got a key for the
    one copy instead (server/peer.py)."""
    if shutil.which("tcpdump") is None or os.geteuid() != 0:
        require_in_ci("needs tcpdump and root (apt-get install -y tcpdump)")
    with ServerProcess(token=secrets.token_hex(32)) as a, ServerProcess(token=secrets.token_hex(32)) as b:
        captured = _capture_a_copy(a, b, tmp_path / "lo.pcap")
    assert len(captured) > 16 << 10  # the copy's bytes were seen
    for token in (a.token, b.token):
        raw = token.encode()
        assert len(raw) == 64 and not [raw[i:i + 8] for i in range(len(raw) - 7) if raw[i:i + 8] in captured]


def _capture_a_copy(a, b, pcap) -> bytes:
    dump = subprocess.Popen(["tcpdump", "-i", "lo", "-U", "--immediate-mode", "-B", "65536", "-w", str(pcap),
                             f"tcp port {a.tcp[1]} or tcp port {b.tcp[1]}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not (pcap.exists() and pcap.stat().st_size > 0) and time.monotonic() < deadline:
            time.sleep(0.05)  # tcpdump writes the file header once it listens
        remote_accel.init(transport="tcp", servers=[f"{a.tcp[0]}:{a.tcp[1]}", f"{b.tcp[0]}:{b.tcp[1]}"],
                          tokens=[a.token, b.token], timeout=30.0)
        try:
            x = torch.arange(4096, dtype=torch.float32).to("remote_accel:0")
            y = x.to("remote_accel:1")
            assert torch.equal(y.cpu(), torch.arange(4096, dtype=torch.float32))
            assert remote_accel.server_stats(1)["peer_copies_received"] >= 1
        finally:
            remote_accel.shutdown()
        # tcpdump stops without draining the kernel's buffer: wait until the file stops growing
        size, deadline = -1, time.monotonic() + 20
        while pcap.stat().st_size != size and time.monotonic() < deadline:
            size = pcap.stat().st_size
            time.sleep(1.0)
    finally:
        dump.send_signal(signal.SIGINT)
        dump.wait(timeout=20)
    return pcap.read_bytes()


LIBS = str(pathlib.Path(__file__).parents[1] / "libs")  # ra_test_ops: ra_test::crash_after ends a server


def test_a_copy_whose_source_died_fails_soon_naming_it():
    """The source server dies before its half of a copy (an earlier op of its client
    ended it): the destination finds nothing listening there any more and fails the copy,
    naming the source, instead of waiting out the copy timeout (server/peer.py,
    PEER_TIMEOUT_S: two minutes) while the client waits at its sync."""
    sys.path.insert(0, LIBS)
    import ra_test_ops  # noqa: F401  (the op's schema, on this side too)

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [LIBS, os.environ.get("PYTHONPATH")]))}
    with ServerProcess("--op-namespaces", "ra_test=ra_test_ops", env=env, token="token-a") as a, \
            ServerProcess(token="token-b") as b:
        remote_accel.init(transport="tcp", servers=[f"{a.tcp[0]}:{a.tcp[1]}", f"{b.tcp[0]}:{b.tcp[1]}"],
                          tokens=[a.token, b.token], timeout=30.0, recovery=False)
        try:
            x = torch.arange(4.0).to("remote_accel:0")
            assert x.sum().item() == 6.0
            doomed = torch.ops.ra_test.crash_after(x, 1.0)  # server 0 ends a second after it runs
            y = doomed.to("remote_accel:1")  # a direct copy 0 -> 1, queued before that
            with pytest.raises(remote_accel.RemoteAccelError, match=r"source server of a copy, .* is gone"):
                y.cpu()
            assert b.alive()
            z = torch.ones(3).to("remote_accel:1")  # the destination's session goes on
            assert torch.equal((z * 2).cpu(), torch.full((3,), 2.0))
        finally:
            remote_accel.shutdown()


# A client that queues ~SOURCE_WORK_S of work on server 0, then a copy 0 -> 1 behind it,
# and waits for the copy's result: server 1 waits for the copy while server 0 works.
LEAVER = textwrap.dedent("""
    import sys, torch, remote_accel
    a, b, token_a, token_b, seconds, here = sys.argv[1:7]
    sys.path.insert(0, here)
    from failure_client import long_work
    remote_accel.init(transport="tcp", servers=[a, b], tokens=[token_a, token_b], timeout=60.0, recovery=False)
    y = long_work(torch.randn(512, 512).to("remote_accel:0"), float(seconds))
    copy = y.to("remote_accel:1")
    print("waiting", flush=True)
    copy.cpu()
""")
SOURCE_WORK_S = 20.0


def test_a_client_that_leaves_during_a_copy_ends_the_destination_s_wait():
    """The client is killed while the destination waits for a copy that its source, busy
    with the client's earlier work, has not sent yet: the destination's session ends within
    seconds (its heartbeat to the client fails), not when the source comes to the copy."""
    with ServerProcess("--threads", "1", token="token-a") as a, \
            ServerProcess("--log-level", "debug", token="token-b") as b:
        client = subprocess.Popen([sys.executable, "-c", LEAVER, "%s:%d" % a.tcp, "%s:%d" % b.tcp, a.token, b.token,
                                   str(SOURCE_WORK_S), os.path.dirname(__file__)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert client.stdout.readline().strip() == "waiting", client.stderr.read()
            # the scenario: the destination's session is in its wait for the copy
            wait_for(lambda: "waiting for a copy" in b.log(), "the destination to wait for the copy")
            client.kill()
            client.wait()
            wait_for(lambda: "client disconnected" in b.log(), "the destination's session to end", SOURCE_WORK_S)
            # beats every 0.5 s; the source still works for the gone client (its session
            # ends after its batch), so the copy had not come
            assert "client disconnected" not in a.log(), (b.log(), a.log())
            assert a.alive() and b.alive()
            a.kill()  # stopped, it would first finish the gone client's work
        finally:
            client.kill()
            client.wait()


# -- TLS servers -------------------------------------------------------------------------------------
def _tls_pair(a, b, pki):
    remote_accel.init(transport="tcp", servers=[f"{a.tcp[0]}:{a.tcp[1]}", f"{b.tcp[0]}:{b.tcp[1]}"],
                      tokens=[a.token, b.token], timeout=30.0, tls_ca=pki["ca"], tls_cert=pki["client_cert"],
                      tls_key=pki["client_key"])


def test_a_copy_between_tls_servers_goes_direct_over_tls(pki):
    """Both servers speak TLS and ask clients for certificates (--tls-client-ca): the source
    checks the destination with the CA the client gave it and shows its own certificate,
    and the 16 MiB cross neither the client nor the network in the clear."""
    tls = ("--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-client-ca", pki["ca"])
    with ServerProcess(*tls, token="token-a") as a, ServerProcess(*tls, token="token-b") as b:
        _tls_pair(a, b, pki)
        try:
            host = torch.randn(4 * MIB)
            x = host.to("remote_accel:0")
            torch.remote_accel.synchronize(0)
            before_client = _client_bytes()
            before = remote_accel.server_stats(1)["peer_bytes_received"]
            y = x.to("remote_accel:1")
            assert torch.equal(y.cpu(), host)
            assert _client_bytes() - before_client < 20 * MIB  # the download of y, and no upload
            assert remote_accel.server_stats(1)["peer_bytes_received"] - before == 16 * MIB
            z = (y * 2).to("remote_accel:0")  # and back, the other way
            assert torch.equal(z.cpu(), host * 2)
        finally:
            remote_accel.shutdown()
        for server in (a, b):
            assert "Traceback" not in server.log(), server.log()


def test_a_tls_destination_the_clients_ca_does_not_vouch_for_fails_the_copy(pki):
    """The source checks the destination as the client would: a destination whose
    certificate another CA signed is refused, with a clear error at the client's next sync."""
    with ServerProcess("--tls-cert", pki["cert"], "--tls-key", pki["key"], token="token-a") as a, \
            ServerProcess("--tls-cert", pki["other_cert"], "--tls-key", pki["other_key"], token="token-b") as b:
        remote_accel.init(transport="tcp", servers=[f"{a.tcp[0]}:{a.tcp[1]}"], tokens=[a.token], timeout=30.0,
                          tls_ca=pki["ca"], recovery=False)
        try:
            session = runtime.session(0)
            x = torch.arange(8.0).to("remote_accel:0")
            # a destination as a session names it: b, to be checked by a's CA
            stranger = types.SimpleNamespace(peer_address=f"{b.tcp[0]}:{b.tcp[1]}", token=b.token,
                                             peer_tls_ca=session.peer_tls_ca)
            sid = handles.announce(x, 0)
            session.peer_send(b"t" * m.PEER_TICKET_BYTES, sid, 0, 32, stranger)
            with pytest.raises(remote_accel.RemoteAccelError, match="certificate"):
                torch.remote_accel.synchronize(0)
            assert torch.equal(x.cpu(), torch.arange(8.0))  # the source's session goes on
        finally:
            remote_accel.shutdown()
        assert a.alive() and b.alive()


def test_a_copys_ca_that_is_no_certificate_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="no PEM certificate"):
        PeerCopies().tls.get("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n", "PeerSend")


DPDK_AND_TCP = textwrap.dedent("""
    import copy, json, sys, torch, remote_accel
    from remote_accel.errors import ConfigError
    from remote_accel.parallel import DataParallel
    from remote_accel.pytorch_ext import runtime
    a, b, token_a, token_b, transport = sys.argv[1:6]
    try:
        remote_accel.init(transport=transport, servers=[a, b], tokens=[token_a, token_b], timeout=30.0)
    except ConfigError as exc:
        print(json.dumps({"error": " ".join([str(exc), *getattr(exc, "__notes__", [])]), "kind": exc.kind}))
        sys.exit(0)
    host = torch.randn(1 << 18)  # 1 MiB
    x = host.to("remote_accel:0")
    y = x.to("remote_accel:1") * 2
    z = y.to("remote_accel:0")
    out = {"peers": [runtime.session(i).transport.peer for i in (0, 1)],
           "equal": torch.equal(z.cpu(), host * 2),
           "bytes_down": [remote_accel.stats(f"remote_accel:{i}")["bytes_down"] for i in (0, 1)],
           "peer_received": [remote_accel.server_stats(i)["peer_bytes_received"] for i in (0, 1)]}
    # DataParallel over the two: the gradients of one device with the whole batch
    torch.manual_seed(0)
    local = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = copy.deepcopy(local).to("remote_accel:0")
    batch, target = torch.randn(8, 16), torch.randn(8, 4)
    torch.nn.functional.mse_loss(local(batch), target).backward()
    dp = DataParallel(model, devices=[0, 1])
    torch.nn.functional.mse_loss(dp(batch.to("remote_accel:0")), target.to("remote_accel:0")).backward()
    out["grads_close"] = all(torch.allclose(p.grad.cpu(), q.grad, atol=1e-5) for p, q in zip(model.parameters(),
                                                                                           local.parameters()))
    out["dp_peer_received"] = [remote_accel.server_stats(i)["peer_bytes_received"] for i in (0, 1)]
    print(json.dumps(out))
""")


@pytest.mark.dpdk
def test_a_dpdk_port_reaches_only_the_server_named_and_its_copies_go_direct(needs_dpdk):
    """servers=[a, b] where a DPDK port leads to a's memif: "auto" reaches a over DPDK
    and b over TCP (not a again), and copies between them (DataParallel's too) skip the
    client; "dpdk" is
    told clearly that the port does not lead to b. Before, both devices were a's (or b
    was refused a's token)."""
    with ServerProcess("--transport", "tcp,dpdk", token="token-a") as a, ServerProcess(token="token-b") as b:
        where = [f"{a.tcp[0]}:{a.tcp[1]}", f"{b.tcp[0]}:{b.tcp[1]}"]
        runs = {}
        for transport in ("auto", "dpdk"):
            proc = subprocess.run([sys.executable, "-c", DPDK_AND_TCP, *where, a.token, b.token, transport],
                                  env=dict(os.environ, **a.client_env()), text=True, capture_output=True, timeout=180)
            assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
            runs[transport] = json.loads(proc.stdout.splitlines()[-1])
        auto = runs["auto"]
        assert auto["peers"][0].startswith("dpdk:") and auto["peers"][1] == f"tcp:{where[1]}", auto
        assert auto["equal"]
        # the client read only z (1 MiB from server 0); x and y went server to server
        assert auto["bytes_down"] == [1 << 20, 0] and auto["peer_received"] == [1 << 20, 1 << 20], auto
        # DataParallel's broadcast and reduce between them went server to server too
        assert auto["grads_close"] and all(d > p for d, p in zip(auto["dp_peer_received"], auto["peer_received"])), auto
        assert runs["dpdk"]["kind"] == "wrong_server", runs["dpdk"]
        assert f"is not {where[1]}" in runs["dpdk"]["error"] and "transport='tcp' or 'auto'" in runs["dpdk"]["error"]


def test_copies_keep_one_connection_and_open_another_once_the_destination_ended_it():
    """A source keeps its connection to a destination for the next copies (a connection
    and its handshake cost more than a small copy's bytes); a destination ends one idle
    longer than its heartbeat timeout, and the next copy connects again."""
    with ServerProcess(token="keep-a") as a, ServerProcess("--heartbeat-timeout", "5", token="keep-b") as b:
        remote_accel.init(transport="tcp", servers=[f"{a.tcp[0]}:{a.tcp[1]}", f"{b.tcp[0]}:{b.tcp[1]}"],
                          tokens=[a.token, b.token], timeout=30.0)
        try:
            host = torch.randn(1000)
            x = host.to("remote_accel:0")
            for i in range(5):
                assert torch.equal((x + i).to("remote_accel:1").cpu(), host + i)
            torch.remote_accel.synchronize(0)
            stats = remote_accel.server_stats(0)
            assert (stats["peer_copies_sent"], stats["peer_links_opened"]) == (5, 1)
            # a copy connection is no client of b: b counts only this client's session
            assert remote_accel.server_stats(1)["server_sessions"] == 1
            # b ends the idle copy connection after 5 s (the client's own session pings): a's
            # end of it, then, is the one connection to b's port the kernel shows half closed
            wait_for(lambda: [s for s in tcp_sockets(b.tcp[1]) if s.remote_port == b.tcp[1]
                              and s.state == "CLOSE_WAIT"], "b to end the idle copy connection", 60)
            assert torch.equal((x * 3).to("remote_accel:1").cpu(), host * 3)
            torch.remote_accel.synchronize(0)
            stats = remote_accel.server_stats(0)
            assert (stats["peer_copies_sent"], stats["peer_links_opened"], stats["peer_links_kept"]) == (6, 2, 1)
            # with no copy to follow, a closes it itself, KEEP_LINK_S after the copy
            wait_for(lambda: remote_accel.server_stats(0)["peer_links_kept"] == 0, "a to close its kept connection",
                     peer.KEEP_LINK_S + 60, every=0.2)
            assert "Traceback" not in a.log() + b.log()
        finally:
            remote_accel.shutdown()
