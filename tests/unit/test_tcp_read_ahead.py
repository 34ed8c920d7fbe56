"""TcpTransport reads ahead: one system call may bring several messages, or the start of
the next one. Messages sent back to back in one send_many, with payloads around the
read-ahead sizes, come out whole, in order, into the buffers the sink chose."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from remote_accel.dataplane import tcp, wire
from remote_accel.dataplane.tcp import TcpListener, TcpTransport
from remote_accel.errors import PeerGone, TransportTimeout

AHEAD = tcp._READ_AHEAD
SIZES = (0, 1, 7, AHEAD // 2 - 1, AHEAD // 2, AHEAD - 50, AHEAD, AHEAD + 1, 3 * AHEAD + 5, 5)


def _payload(i: int, n: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture(params=["socketpair", "tcp"])
def pair(request):
    if request.param == "socketpair":
        a, b = TcpTransport.pair()
    else:
        listener = TcpListener("127.0.0.1", 0)
        accepted = []
        thread = threading.Thread(target=lambda: accepted.append(listener.accept(timeout=10)))
        thread.start()
        a = TcpTransport.connect("127.0.0.1", listener.port)
        thread.join()
        b = accepted[0]
        listener.close()
    yield a, b
    a.close()
    b.close()


def test_back_to_back_messages_around_the_read_ahead_sizes(pair):
    a, b = pair
    messages = [(1, b"meta-%d" % i, [_payload(i, n)] if n else [], i + 1) for i, n in enumerate(SIZES)]
    sender = threading.Thread(target=a.send_many, args=(messages,))
    sender.start()
    sinks = []

    def sink(header, meta, lengths):  # a caller's own buffers, as a download's destination
        sinks.append([np.full(n, 0xEE, dtype=np.uint8) for n in lengths])
        return sinks[-1]

    for i, n in enumerate(SIZES):
        msg = b.recv(timeout=10, sink=sink)
        assert (msg.type, bytes(msg.meta), msg.req_id) == (1, b"meta-%d" % i, i + 1)
        got = msg.payloads[0] if n else np.empty(0, dtype=np.uint8)
        assert got is (sinks[-1][0] if n else got)
        np.testing.assert_array_equal(got, _payload(i, n))
    sender.join()
    with pytest.raises(TransportTimeout):
        b.recv(timeout=0.05)  # nothing left over in the read-ahead buffer


def test_a_peer_closing_mid_message_is_reported_after_what_came_whole(pair):
    a, b = pair
    a.send_many([(1, b"whole", [_payload(0, 10)], 1)])
    # the second message's prologue and part of its payload, then the connection closes
    prologue = wire.encode_prologue(1, b"cut", [1000], req_id=2)
    a._sock.sendall(prologue + bytes(100))
    a.close()
    assert bytes(b.recv(timeout=10).meta) == b"whole"
    with pytest.raises(PeerGone, match="mid-message"):
        b.recv(timeout=10)
