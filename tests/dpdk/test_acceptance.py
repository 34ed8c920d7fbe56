"""Issue #2's acceptance scenarios on DPDK, between two processes over memif:

- 1% drop, 0.1% corruption, reordering (and a few duplicates) injected: 1000 messages
  of log-uniform sizes (1 B .. 64 MiB) arrive exactly once, in order, bit-identical;
- a 256 MiB tensor goes to another Python process and comes back bit-identical (also
  over TCP, for comparison);
- two local clients with default EAL arguments served at once by one default server;
- killing the peer in the middle of a bulk transfer is a PeerGone, not a crash or hang.
- what a peer sent right before it exited or was killed is still read, then PeerGone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from remote_accel.dataplane import dpdk
from remote_accel.dataplane.wire import MsgType
from remote_accel.errors import PeerGone, TransportTimeout

from dpdk_helpers import memif_client_port, pattern, start_echo, stop

MIB = 1 << 20


@pytest.fixture
def memif_echo(eal, tmp_path):
    """An echo peer in another process (memif server, default EAL arguments) and a
    memif client port to it in this process."""
    proc = start_echo([], str(tmp_path))
    port = memif_client_port(str(tmp_path / "memif.sock"))
    yield port, proc
    stop(proc)
    dpdk.remove_vdev(port)


def lossy_sizes(n: int, seed: int, budget: int = 640 * MIB) -> list[int]:
    """Log-uniform sizes in [1 B, 64 MiB], with a 64 MiB one, trimmed to a total volume a
    two-core CI machine moves in seconds (the largest ones shrink first)."""
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(0, np.log(64 * MIB), n)).astype(np.int64)
    sizes[rng.integers(n)] = 64 * MIB
    keep = int(np.argmax(sizes))
    while sizes.sum() > budget:
        order = np.argsort(sizes)[::-1]
        big = next(i for i in order if i != keep)
        sizes[big] //= 8
    return [max(1, int(s)) for s in sizes]


@pytest.mark.timeout(600)
def test_lossy_link_1000_messages_exactly_once_in_order(memif_echo):
    port, _ = memif_echo
    dpdk.setup_port(port)  # faults from the first frame on, the handshake's too
    for direction, seed in (("tx", 11), ("rx", 12)):
        dpdk.set_fault(port, direction, drop=0.01, corrupt=0.001, reorder=0.01, duplicate=0.002, seed=seed)
    t = dpdk.DpdkTransport.connect(port, timeout=30)
    sizes = lossy_sizes(1000, seed=2024)
    assert min(sizes) == 1 and max(sizes) == 64 * MIB
    errors: list = []

    def sender():
        try:
            for i, n in enumerate(sizes):
                t.send(MsgType.ECHO, i.to_bytes(4, "big"), [pattern(n, i)], req_id=i)
        except Exception as exc:  # surfaces below
            errors.append(exc)

    th = threading.Thread(target=sender, daemon=True)
    th.start()
    for i, n in enumerate(sizes):
        reply = t.recv(timeout=120)
        assert reply.req_id == i and reply.meta == i.to_bytes(4, "big"), "out of order or duplicated"
        got = np.frombuffer(reply.payloads[0], np.uint8)
        assert got.nbytes == n and np.array_equal(got, pattern(n, i)), f"message {i} differs"
    th.join(60)
    assert not errors, errors
    with pytest.raises(TransportTimeout):  # nothing more: exactly once
        t.recv(timeout=0.5)
    port_st = dpdk.port_stats(port)
    st = t.stats()
    print(f"faults: {port_st['fault_dropped']} dropped, {port_st['fault_corrupted']} corrupted, "
          f"{port_st['fault_reordered']} reordered, {port_st['fault_duplicated']} duplicated; "
          f"{st['tx_retransmits']} retransmitted, {port_st['rx_bad_crc']} bad CRCs, {port_st['rx_dup']} dups")
    assert port_st["fault_dropped"] > 100 and port_st["fault_corrupted"] > 10 and port_st["fault_reordered"] > 100
    assert st["tx_retransmits"] > 0 and port_st["rx_bad_crc"] > 0
    for direction in ("tx", "rx"):
        dpdk.set_fault(port, direction)
    t.close()
    assert dpdk.pool_audit() == 0


def _tensor_roundtrip(transport) -> None:
    import torch

    x = torch.randn(64 * MIB, generator=torch.Generator().manual_seed(5))  # 256 MiB of float32
    out = np.empty(x.numel() * 4, np.uint8)
    started = time.monotonic()
    transport.send(MsgType.ECHO, b"tensor", [x.numpy()])
    reply = transport.recv(timeout=300, sink=lambda header, meta, lengths: [out])
    assert reply.meta == b"tensor"
    back = torch.frombuffer(out, dtype=torch.float32)
    assert torch.equal(back, x), "the tensor came back different"
    return time.monotonic() - started


@pytest.mark.timeout(600)
def test_256mib_tensor_over_memif(memif_echo):
    port, _ = memif_echo
    with dpdk.DpdkTransport.connect(port, timeout=30) as t:
        _tensor_roundtrip(t)


@pytest.mark.timeout(600)
def test_256mib_tensor_over_tcp():
    from remote_accel.dataplane.tcp import TcpTransport

    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "remote_accel.dataplane.echo", "--transport", "tcp"],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        _, host, tcp_port = line.split()[1].split(":")
        with TcpTransport.connect(host, int(tcp_port)) as t:
            _tensor_roundtrip(t)
    finally:
        stop(proc)


CLIENT = """
import sys
from remote_accel.dataplane.dpdk import DpdkTransport
from remote_accel.dataplane.wire import MsgType
t = DpdkTransport.connect(port=0, timeout=60)   # default EAL arguments: a memif client
for i in range(200):
    t.send(MsgType.ECHO, b"c%d" % i, [bytes([i % 256]) * (i * 1000)])
    r = t.recv(timeout=60)
    assert r.meta == b"c%d" % i and bytes(r.payloads[0]) == bytes([i % 256]) * (i * 1000)
print("OK", t.peer, flush=True)
t.close()
"""


@pytest.mark.timeout(300)
def test_two_local_clients_with_default_arguments(tmp_path):
    """One server, two clients, nobody passes an EAL option: each client takes its own
    memif interface of the server's socket."""
    server = start_echo([], str(tmp_path))
    env = dict(os.environ, REMOTE_ACCEL_RUNTIME_DIR=str(tmp_path))
    try:
        clients = [subprocess.Popen([sys.executable, "-c", CLIENT], stdout=subprocess.PIPE, text=True, env=env)
                   for _ in range(2)]
        outs = [c.communicate(timeout=240)[0] for c in clients]
        assert all(c.returncode == 0 for c in clients), outs
        peers = [o.split()[1] for o in outs]
        assert all(o.startswith("OK") for o in outs) and peers[0] != peers[1], peers
    finally:
        stop(server)


@pytest.mark.timeout(300)
def test_peer_killed_mid_transfer_is_peer_gone(memif_echo):
    """The far end dies while we stream to it: PeerGone promptly, and this process (which
    was inside memif bursts when the PMD unmapped its rings) lives on."""
    port, proc = memif_echo
    t = dpdk.DpdkTransport.connect(port, timeout=30)
    data = pattern(256 * MIB, 3)
    threading.Timer(0.3, lambda: proc.send_signal(signal.SIGKILL)).start()
    started = time.monotonic()
    with pytest.raises(PeerGone):
        for _ in range(100):
            t.send(MsgType.SINK, b"", [data])
    assert time.monotonic() - started < 15
    # the port is still usable for a new server on the same socket later; this process is fine
    assert dpdk.port_stats(port)["rx_frames"] > 0


# A peer that sends and then ends: it exits at once, as a script that ends without closing
# does (its process's exit, the shim's shutdown, must still deliver what it sent), or it
# is killed once our ack of its messages reached it (its port goes away with no GOODBYE).
# Either way our next send finds it gone, and the messages stay readable.
SENDER = """
import sys, time
from remote_accel.dataplane.connect import listen
from remote_accel.dataplane.wire import MsgType
sys.path.insert(0, sys.argv[1])
from dpdk_helpers import pattern
listener = listen("dpdk", port=None, eal_args=None)
print("READY", listener.address, flush=True)
t = listener.accept(60)
for i in range(6):
    t.send(MsgType.ECHO_REPLY, bytes([i]), [pattern(64 << 10, i)], req_id=i + 1)
if sys.argv[2] == "killed":
    t.recv(timeout=60)  # our ping: it carries our ack of all six
    print("ACKED", flush=True)
    time.sleep(600)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("end", ["exit", "killed"])
def test_what_a_peer_sent_right_before_it_ended_is_read(eal, tmp_path, end):
    env = dict(os.environ, REMOTE_ACCEL_RUNTIME_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", SENDER, os.path.dirname(__file__), end],
                            stdout=subprocess.PIPE, text=True, env=env)
    port = None
    try:
        assert proc.stdout.readline().startswith("READY"), "the sending peer did not start"
        port = memif_client_port(str(tmp_path / "memif.sock"))
        t = dpdk.DpdkTransport.connect(port, timeout=30)
        if end == "killed":
            time.sleep(0.5)  # the six arrive
            t.send(MsgType.PING, b"acks")
            assert proc.stdout.readline().startswith("ACKED")
            proc.kill()
        proc.wait(60)
        with pytest.raises(PeerGone):
            for _ in range(3000):
                t.send(MsgType.PING, b"beat")
                time.sleep(0.01)
        assert not t.closed
        for i in range(6):
            reply = t.recv(timeout=10)
            assert (reply.type, reply.req_id, reply.meta) == (MsgType.ECHO_REPLY, i + 1, bytes([i]))
            assert np.array_equal(np.frombuffer(reply.payloads[0], np.uint8), pattern(64 << 10, i))
        with pytest.raises(PeerGone):
            t.recv(timeout=10)
        t.close()
    finally:
        stop(proc)
        if port is not None:
            dpdk.remove_vdev(port)
