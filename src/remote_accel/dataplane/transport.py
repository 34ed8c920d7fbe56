"""The Transport interface: what every link (TCP, DPDK ring/memif/af_packet/NIC) offers.

A transport carries whole messages (see `wire`) between two peers, reliably and in order,
or fails with an exception. It never delivers a truncated, duplicated or corrupted
message. Thread-safety: one thread may call `recv` while others call `send`; concurrent
`send` calls are serialised by the transport; concurrent `recv` calls are not allowed.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

from .wire import Header

#: Chooses where payloads land: called with the header, the meta bytes and the payload
#: lengths once the prologue is in, it returns one writable buffer per payload, each of
#: exactly that length (a numpy array, a CPU tensor's memory, a hugepage buffer...), or
#: a Discard of that length for bytes the receiver does not keep.
PayloadSink = Callable[[Header, bytes, list], Sequence]


class Discard(NamedTuple):
    """A payload the receiver throws away (a write to a storage that could not be made, a
    benchmark's SINK): the transport reads its bytes through a small buffer of its own, so
    that a peer cannot make the receiver hold memory by sending bytes nobody keeps. It
    stands in the received Message's payloads for that payload."""

    nbytes: int


#: What a transport reads a Discard's bytes through: a buffer of this size, reused.
DISCARD_CHUNK = 256 << 10


@dataclass
class Message:
    type: int
    meta: bytes = b""
    payloads: list = field(default_factory=list)
    req_id: int = 0
    flags: int = 0


class Transport(abc.ABC):
    """A reliable, ordered, message-oriented link to one peer."""

    #: human-readable peer address, for logs ("tcp:127.0.0.1:40000", "memif:/run/..:0")
    peer: str = "?"
    #: set by a send the peer refused (see `peer_gone`)
    _peer_gone: bool = False

    @abc.abstractmethod
    def send(self, msg_type: int, meta: bytes = b"", payloads: Sequence = (), *, req_id: int = 0, flags: int = 0) -> None:
        """Send one message. Payloads are any buffer-protocol objects (not copied where the
        link allows it; they must stay unchanged until send returns).

        Raises: MessageTooLarge (limits; nothing was sent), TransportClosed (closed here),
        PeerGone (the peer closed, died or stopped acknowledging within the timeout). A peer
        that closed, reset or whose link went down leaves the transport open: recv still
        returns the messages it sent before (a client's last work, its GOODBYE), then raises
        PeerGone; a send that stalled closes it.
        """

    @abc.abstractmethod
    def recv(self, timeout: Optional[float] = None, sink: Optional[PayloadSink] = None) -> Message:
        """Receive the next message, waiting at most `timeout` seconds for it to start
        (None: wait for ever). Payloads land in buffers from `sink`, or in fresh host
        buffers when no sink is given.

        Raises: TransportTimeout (nothing arrived; the transport stays usable),
        PeerGone (peer closed or died; also mid-message), TransportClosed (closed here),
        ProtocolError (the peer sent bytes that are not a valid message; on a byte stream
        the transport is then unusable and closed).
        """

    def send_many(self, messages: Sequence, *, flags: int = 0) -> None:
        """Send (type, meta, payloads, req_id) messages in order. A link that can sends them
        as one (TCP: one system call), so that a sync point's flush and its request wake the
        peer once; this default sends them one by one. Raises as send."""
        for msg_type, meta, payloads, req_id in messages:
            self.send(msg_type, meta, payloads, req_id=req_id, flags=flags)

    def native_link(self) -> Optional[tuple]:
        """What a server session's receive loop in C++ (server/csrc/fast_loop.h) needs to
        read and write this link itself: ("tcp", TcpTransport.native_socket()), ("tls",
        the same and the SSL object: TlsTransport.native_link) or ("dpdk",
        DpdkTransport.native_addresses()). Such a transport also offers the hand-over the
        session makes around that loop (finish_recv, recv_error, send_locked; TCP and TLS:
        read_ahead, set_read_ahead, add_native_counts). None, this default: every message
        goes through Python."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Close the link; idempotent. Blocked calls in other threads fail with TransportClosed."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    @property
    def peer_gone(self) -> bool:
        """True once a send found the peer gone (it closed, reset or went away; not a
        stall). Such a send leaves the transport open, so that recv still returns what the
        peer sent before it left; a thread that waits on something other than this peer
        (a server's copy from another server for this client) asks this, not `closed`."""
        return self._peer_gone

    def stats(self) -> dict:
        """Counters since creation: messages/bytes sent and received, drops, retransmits."""
        return {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Listener(abc.ABC):
    """Accepts transports from clients (a TCP socket, a DPDK port's peers)."""

    address: str = "?"

    @abc.abstractmethod
    def accept(self, timeout: Optional[float] = None) -> Transport:
        """Wait for the next client. Raises TransportTimeout, TransportClosed."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def default_sink(header: Header, meta: bytes, lengths: list) -> list:
    """Fresh, uninitialised host buffers (numpy avoids zero-filling large payloads)."""
    import numpy as np

    return [np.empty(n, dtype=np.uint8) for n in lengths]


def byte_view(buf) -> memoryview:
    """Any buffer-protocol payload as a flat memoryview of bytes, without copying."""
    view = memoryview(buf)
    if view.ndim != 1 or view.itemsize != 1 or view.format != "B":
        view = view.cast("B")
    return view
