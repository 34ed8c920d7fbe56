"""ONE conformance suite for every transport (see conftest.peer for the list).

Each test talks to an echo peer: ECHO comes back as ECHO_REPLY with the same meta and
payloads, GOODBYE makes the peer close.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

from remote_accel.errors import (MessageTooLarge, PeerGone, ProtocolError, TransportClosed,
                                 TransportError, TransportTimeout)
from remote_accel.dataplane import wire
from remote_accel.dataplane.wire import MsgType

RECV_TIMEOUT_S = 60


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Cheap, position- and seed-dependent bytes (so misplaced chunks are caught)."""
    words = (np.arange((nbytes + 7) // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(seed)
    return words.view(np.uint8)[:nbytes]


def echo(transport, meta: bytes, payloads, req_id: int = 0):
    transport.send(MsgType.ECHO, meta, payloads, req_id=req_id)
    reply = transport.recv(timeout=RECV_TIMEOUT_S)
    assert reply.type == MsgType.ECHO_REPLY
    assert reply.req_id == req_id
    return reply


def assert_same(got, want) -> None:
    got = np.frombuffer(memoryview(got).cast("B"), dtype=np.uint8)
    assert got.nbytes == len(want)
    assert np.array_equal(got, want)


def test_small_messages(peer):
    for i in range(50):
        payloads = [pattern(n, i) for n in (0, 1, 63, 1500)[: i % 5]]
        meta = bytes([i]) * (i * 7)
        reply = echo(peer.transport, meta, payloads, req_id=i)
        assert reply.meta == meta
        assert len(reply.payloads) == len(payloads)
        for got, want in zip(reply.payloads, payloads):
            assert_same(got, want)


def test_empty_message(peer):
    reply = echo(peer.transport, b"", [])
    assert reply.meta == b"" and reply.payloads == []


@pytest.mark.slow
def test_one_gib_message(peer):
    data = pattern(1 << 30, 7)
    out = np.empty(1 << 30, dtype=np.uint8)
    peer.transport.send(MsgType.ECHO, b"big", [data])
    reply = peer.transport.recv(timeout=300, sink=lambda header, meta, lengths: [out])
    assert reply.meta == b"big"
    assert reply.payloads[0] is out
    assert np.array_equal(out, data)


def test_a_large_message_lands_whole_at_any_alignment_and_nowhere_else(peer):
    """From 4 MiB on, a DPDK receiver copies a message into its buffers with streaming
    stores (dpdk_shim/chan/chan.c). Buffers starting anywhere within a cache line, with
    lengths that end mid-line, get every byte, and the bytes either side of them none."""
    sizes = [1, (1 << 20) + 63, 17, (3 << 20) + 5, 64 * 1000 + 1]
    line_offsets = [0, 1, 15, 33, 63]
    payloads = [pattern(n, 20 + i) for i, n in enumerate(sizes)]
    guard = 4096
    arena = np.full(sum(sizes) + (guard + 64) * (len(sizes) + 1), 0xA5, np.uint8)
    base, at, spans = arena.ctypes.data, guard, []
    for n, offset in zip(sizes, line_offsets):
        at += (offset - (base + at)) % 64  # this buffer starts `offset` bytes into a line
        spans.append((at, at + n))
        at += n + guard
    peer.transport.send(MsgType.ECHO, b"aligned", payloads, req_id=11)
    reply = peer.transport.recv(timeout=RECV_TIMEOUT_S,
                                sink=lambda header, meta, lengths: [arena[a:b] for a, b in spans])
    assert (reply.meta, reply.req_id) == (b"aligned", 11)
    outside = np.ones(arena.nbytes, bool)
    for (a, b), want in zip(spans, payloads):
        assert_same(arena[a:b], want)
        outside[a:b] = False
    assert np.all(arena[outside] == 0xA5), "bytes landed outside the buffers"


def _pipelined(transport, sizes: list[int]) -> None:
    """Send all messages while a thread receives, then check order and content."""
    got: queue.Queue = queue.Queue()

    def receive():
        try:
            for _ in sizes:
                got.put(transport.recv(timeout=RECV_TIMEOUT_S))
        except Exception as exc:  # surfaces in the main thread below
            got.put(exc)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    for seq, n in enumerate(sizes):
        transport.send(MsgType.ECHO, seq.to_bytes(4, "big"), [pattern(n, seq)], req_id=seq)
    for seq, n in enumerate(sizes):
        reply = got.get(timeout=RECV_TIMEOUT_S)
        if isinstance(reply, Exception):
            raise reply
        assert reply.req_id == seq, "messages arrived out of order"
        assert reply.meta == seq.to_bytes(4, "big")
        assert_same(reply.payloads[0], pattern(n, seq))
    thread.join(RECV_TIMEOUT_S)


def test_a_discarded_payload_is_read_through_and_the_next_kept(peer):
    """A sink may throw payloads away (transport.Discard): the transport reads their bytes
    without a buffer of their size, and the payloads beside them and the next message land
    intact. Sizes cross the small buffer's (256 KiB) and a frame's bounds."""
    from remote_accel.dataplane.transport import Discard

    kept_size = 3 << 20
    sizes = [1, 5000, kept_size, (256 << 10) * 3 + 17, 9 << 20]
    payloads = [pattern(n, i) for i, n in enumerate(sizes)]
    peer.transport.send(MsgType.ECHO, b"discard", payloads, req_id=5)
    kept = np.empty(kept_size, np.uint8)
    sink = lambda header, meta, lengths: [Discard(n) if n != kept_size else kept for n in lengths]  # noqa: E731
    reply = peer.transport.recv(timeout=RECV_TIMEOUT_S, sink=sink)
    assert (reply.type, reply.req_id, reply.meta) == (MsgType.ECHO_REPLY, 5, b"discard")
    assert [type(p) for p in reply.payloads] == [Discard, Discard, np.ndarray, Discard, Discard]
    assert [p.nbytes for p in reply.payloads] == sizes
    assert_same(kept, payloads[2])
    after = echo(peer.transport, b"next", [pattern(70000, 9)], req_id=6)
    assert after.meta == b"next"
    assert_same(after.payloads[0], pattern(70000, 9))


@pytest.mark.slow
def test_small_and_large_interleaved(peer):
    _pipelined(peer.transport, [64 if i % 2 else (8 << 20) + i for i in range(24)])


def test_many_messages_in_flight(peer):
    _pipelined(peer.transport, [1 + (i * 37) % 2000 for i in range(1000)])


def test_send_many_delivers_every_message_in_order(peer):
    """A sync point's flush and request go out with one send_many (TCP: one sendmsg;
    DPDK: one burst); a large message among small ones must not break the batch."""
    send_many = peer.transport.send_many  # every transport has one (Transport's default: one by one)
    sizes = [10, 0, (8 << 20) + 3, 1500, 64]
    msgs = [(MsgType.ECHO, bytes([i]) * i, [pattern(n, i)] if n else [], 100 + i) for i, n in enumerate(sizes)]
    send_many(msgs)
    for _, meta, payloads, req_id in msgs:
        reply = peer.transport.recv(timeout=RECV_TIMEOUT_S)
        assert (reply.type, reply.req_id, reply.meta) == (MsgType.ECHO_REPLY, req_id, meta)
        assert len(reply.payloads) == len(payloads)
        for got, want in zip(reply.payloads, payloads):
            assert_same(got, want)


def test_recv_timeout_keeps_transport_usable(peer):
    started = time.monotonic()
    with pytest.raises(TransportTimeout):
        peer.transport.recv(timeout=0.2)
    assert time.monotonic() - started < 5
    assert echo(peer.transport, b"after", []).meta == b"after"


def test_oversized_send_is_refused_before_sending(peer):
    too_many = [b""] * (wire.DEFAULT_LIMITS.max_payloads + 1)
    with pytest.raises(MessageTooLarge):
        peer.transport.send(MsgType.ECHO, b"", too_many)
    with pytest.raises(MessageTooLarge):
        peer.transport.send(MsgType.ECHO, b"x" * (wire.DEFAULT_LIMITS.max_meta + 1))
    assert echo(peer.transport, b"still fine", []).meta == b"still fine"


def test_peer_close(peer):
    peer.transport.send(MsgType.GOODBYE)
    started = time.monotonic()
    with pytest.raises(PeerGone):
        peer.transport.recv(timeout=30)
    assert time.monotonic() - started < peer.dead_peer_timeout_s + 5


def test_what_a_closed_peer_sent_is_read_after_a_send_to_it_failed(peer):
    """A server's busy beat that meets a client already gone must not drop what the client
    sent before it left: the failed send leaves the transport readable (and says the peer
    is gone), recv returns the peer's last messages in order, then raises PeerGone."""
    for i in range(3):
        peer.transport.send(MsgType.ECHO, bytes([i]), [pattern(1000, i)], req_id=i + 1)
    peer.transport.send(MsgType.GOODBYE)  # the echo peer closes after its three replies
    assert not peer.transport.peer_gone
    deadline = time.monotonic() + peer.dead_peer_timeout_s + 10
    with pytest.raises(PeerGone):
        while time.monotonic() < deadline:
            peer.transport.send(MsgType.PING, b"beat")
            time.sleep(0.01)
    assert not peer.transport.closed
    assert peer.transport.peer_gone  # what a wait on something else than this peer asks
    for i in range(3):
        reply = peer.transport.recv(timeout=RECV_TIMEOUT_S)
        assert (reply.type, reply.req_id, reply.meta) == (MsgType.ECHO_REPLY, i + 1, bytes([i]))
        assert_same(reply.payloads[0], pattern(1000, i))
    with pytest.raises(PeerGone):
        peer.transport.recv(timeout=30)


def test_peer_killed(peer):
    if peer.kill is None:
        pytest.skip(f"{peer.kind}: both ends live in this process, there is no peer to kill")
    echo(peer.transport, b"alive", [])
    peer.kill()
    started = time.monotonic()
    with pytest.raises(PeerGone):
        # sends may still be buffered; a receive must notice the death
        for _ in range(1000):
            peer.transport.send(MsgType.ECHO, b"x", [])
            peer.transport.recv(timeout=peer.dead_peer_timeout_s + 5)
    assert time.monotonic() - started < peer.dead_peer_timeout_s + 10


def test_use_after_close(peer):
    peer.transport.close()
    peer.transport.close()  # idempotent
    assert peer.transport.closed
    with pytest.raises(TransportClosed):
        peer.transport.send(MsgType.ECHO, b"x")
    with pytest.raises(TransportClosed):
        peer.transport.recv(timeout=1)


def test_close_wakes_blocked_receiver(peer):
    errors: list = []

    def receive():
        try:
            peer.transport.recv(timeout=30)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    time.sleep(0.2)
    peer.transport.close()
    thread.join(10)
    assert not thread.is_alive(), "close() did not wake a blocked recv()"
    assert errors and isinstance(errors[0], TransportError)


GARBAGE = [
    b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 16,  # not our magic
    wire.HEADER.pack(b"RA", 99, 1, 0, 0, 0, 0, 0, 0),  # unknown version
    wire.HEADER.pack(b"RA", 1, MsgType.ECHO, 0, 0, 0, 1 << 31, 0, 0),  # meta too large
    wire.HEADER.pack(b"RA", 1, MsgType.ECHO, 0, 5000, 0, 0, 0, 0),  # too many payloads
    wire.HEADER.pack(b"RA", 1, MsgType.ECHO, 0, 0, 0, 4, 0, 12345) + b"meta",  # bad checksum
]


@pytest.mark.parametrize("garbage", GARBAGE, ids=["magic", "version", "meta-size", "payload-count", "checksum"])
def test_malformed_frames_are_dropped(peer, garbage):
    if peer.inject_garbage is None:
        pytest.skip(f"{peer.kind}: no raw access to the far end")
    peer.inject_garbage(garbage)
    # the far end survived and still serves this (and new) connections
    assert echo(peer.transport, b"ok", [b"123"]).meta == b"ok"
    if peer.reconnect:
        with peer.reconnect() as fresh:
            assert echo(fresh, b"fresh", []).meta == b"fresh"


def test_malformed_input_on_our_side_raises_protocol_error():
    """A stream that delivers garbage makes recv raise ProtocolError (not hang or crash)."""
    import socket

    from remote_accel.dataplane.tcp import TcpTransport

    a, b = socket.socketpair()
    ours = TcpTransport(b)
    a.sendall(GARBAGE[4])
    with pytest.raises(ProtocolError):
        ours.recv(timeout=5)
    assert ours.closed
    a.close()
