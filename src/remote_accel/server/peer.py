"""Server-to-server copies: `t.to("remote_accel:1")` for a tensor on remote_accel:0.

The client sends two small requests and no tensor bytes:

    client -> B (destination)   PeerReceive(ticket, sid, offset, nbytes)
    client -> A (source)        PeerSend(ticket, sid, offset, nbytes, B's address, key, expires)
    A -> B                      a TCP connection (TLS where B speaks it), the handshake under
                                the copy's key (HELLO names the copy), then
                                PeerWrite(ticket, nbytes) + the bytes
    B -> A                      PeerDone(nbytes)

The key is an HMAC under B's token over (ticket, nbytes, expires) (handshake.copy_key): B's
token never leaves the client, and A's connection may write that one copy and nothing
else, before the key expires; a replayed key (a ticket B has seen written) is refused at
once, and so is a PeerWrite from any other connection.

A keeps the connection for its next copies to B (KEEP_LINK_S, peer_links.py): a
connection and its handshake cost 1.6-2.3 ms on loopback, more than the bytes of a small
copy, and a DataParallel step makes several copies between the same servers. Each later PeerWrite
carries its own copy's terms and a proof of its key over the connection's binding (the
WELCOME proof its handshake ended with, handshake.write_proof): B checks it as it
checked the first copy's key, and the connection still writes nothing but copies.

Where B speaks TLS, PeerSend carries the PEM text of the CA the client checks B by (a
public certificate), and A checks B's certificate and name with it as the client does.
A presents its own certificate, if it has one (--tls-cert), so that a B that asks for
client certificates (--tls-client-ca) accepts it where the same CA signed both.

A handles PeerSend in its client's session thread, B handles PeerReceive in its
client's session thread and PeerWrite in the thread of A's (separate, authenticated)
session. The ticket, fresh random bytes chosen by the client, pairs the two halves on B:
only a peer that holds the copy's key can write, and only into that copy's bytes.
Each side holds its client's later requests until the copy is done, so every later op
sees the bytes; a failure is kept for the client's next sync point, as for any one-way
request.

The two halves may arrive at B in either order (A may be quicker than B's client
session, which is busy with earlier work): a PeerWrite waits for its PeerReceive until its
key expires (PEER_TIMEOUT_S at most).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict
from typing import Optional

from .. import config
from ..dataplane import handshake
from ..dataplane import messages as m
from ..dataplane.tcp import TcpTransport
from ..dataplane.tls import PeerContexts, TlsTransport
from ..dataplane.wire import MsgType
from ..errors import PeerGone, ProtocolError, RemoteOpError, TransportTimeout
from .failure import Failure
from .peer_links import KEEP_LINK_S, KeptLink, KeptLinks
from .storage import host_bytes

# each function takes the server.session.Session it serves (not imported: session imports this)
log = logging.getLogger(__name__)

#: How long one half of a copy waits for the other (and a source for the destination's
#: PeerDone): both servers work through their client's requests in order, so the other
#: half may wait behind earlier work.
PEER_TIMEOUT_S = 120.0
#: Connecting and the handshake with the destination.
CONNECT_TIMEOUT_S = 10.0
_POLL_S = 0.2
#: A destination whose copy has not started after this long checks that its source
#: server still listens (PeerReceive.source), every PROBE_EVERY_S, and gives up after two
#: refused checks in a row: a source that died mid-step costs its client seconds, not
#: the copy timeout. A healthy copy starts within milliseconds of its source's turn.
PROBE_AFTER_S = 3.0
PROBE_EVERY_S = 1.0
#: tickets of finished copies remembered, so that a replayed key is refused at once (an
#: older one is refused all the same once its key expired)
MAX_USED_TICKETS = 65536
#: A destination ends a copy connection idle this long (or its heartbeat timeout): the
#: connection a source that went away kept (peer_links.py) is left behind.
COPY_IDLE_S = 3 * KEEP_LINK_S


class _Slot:
    """Where the bytes of one expected copy land."""

    __slots__ = ("buffer", "nbytes", "claimed", "done", "error")

    def __init__(self, buffer, nbytes: int):
        self.buffer = buffer
        self.nbytes = nbytes
        self.claimed: Optional[object] = None  # the peer's session, once its PeerWrite came
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


class PeerCopies:
    """A server's expected copies (by ticket) and its peer counters: bytes and copies
    sent to and received from other servers, which never passed through a client."""

    def __init__(self, tls: Optional[PeerContexts] = None):
        #: the TLS settings of copies to destinations that speak TLS (shared with groups.py)
        self.tls = tls or PeerContexts()
        self._cond = threading.Condition()
        self._slots: dict[bytes, _Slot] = {}
        self._used: "OrderedDict[bytes, None]" = OrderedDict()  # tickets written, newest last
        self._links = KeptLinks()  # this server's connections to destinations, as a source
        self.bytes_sent = 0
        self.bytes_received = 0
        self.copies_sent = 0
        self.copies_received = 0
        self.links_opened = 0  # connections to destinations: fewer than copies_sent when kept

    def stats(self) -> dict:
        return {"peer_bytes_sent": self.bytes_sent, "peer_bytes_received": self.bytes_received,
                "peer_copies_sent": self.copies_sent, "peer_copies_received": self.copies_received,
                "peer_links_opened": self.links_opened, "peer_links_kept": self.links_kept()}

    def links_kept(self) -> int:
        return self._links.count()

    # -- the source's kept connections (peer_links.py) ----------------------------------------
    def take_link(self, where: tuple) -> Optional[KeptLink]:
        """A kept connection to the destination `where`, open and quiet; None: connect."""
        return self._links.take(where)

    def sent(self, where: tuple, kept: KeptLink, nbytes: int) -> None:
        """A copy to `where` is done: counted, and its connection kept for the next copy
        to the same destination."""
        with self._cond:
            self.bytes_sent += nbytes
            self.copies_sent += 1
        self._links.keep(where, kept)

    def close_links(self) -> None:
        """At shutdown: every kept connection, each with a GOODBYE."""
        self._links.close_all()

    # -- the destination's expected copies ------------------------------------------------------
    def expect(self, ticket: bytes, slot: _Slot) -> None:
        with self._cond:
            if ticket in self._slots:
                raise ProtocolError("PeerReceive: this ticket is already expected")
            self._slots[ticket] = slot
            self._cond.notify_all()

    def drop(self, ticket: bytes) -> None:
        with self._cond:
            self._slots.pop(ticket, None)

    def was_used(self, ticket: bytes) -> bool:
        with self._cond:
            return ticket in self._used

    def claim(self, ticket: bytes, nbytes: int, session, expires: int = 0, proof: bytes = b"") -> _Slot:
        """The slot a PeerWrite fills, once its PeerReceive has come (the two halves may
        arrive in either order, until the copy's key expires); ProtocolError at once for
        a PeerWrite that is not the one its session's key was made for (or, on a kept
        connection, that does not prove its own key), or whose ticket was used already;
        and when no PeerReceive comes in time."""
        grant = session.copy_grant
        if grant is None:
            raise ProtocolError("PeerWrite comes only from a source server's copy connection")
        if proof:
            grant = session.copy_grant = self._later_grant(session, (ticket, nbytes, expires), proof)
        if grant[:2] != (ticket, nbytes):
            raise ProtocolError("PeerWrite: not the copy this connection's key was made for")
        until_expiry = grant[2] + handshake.COPY_CLOCK_SKEW_S - time.time()
        deadline = time.monotonic() + min(PEER_TIMEOUT_S, max(0.0, until_expiry))
        with self._cond:
            while ticket not in self._slots:
                if ticket in self._used:
                    raise ProtocolError("PeerWrite: this ticket was used already")
                left = deadline - time.monotonic()
                if left <= 0 or session.server.stopping:
                    raise ProtocolError("PeerWrite: no copy expects this ticket (none came before its key expired)")
                self._cond.wait(min(left, _POLL_S))
            slot = self._slots[ticket]
            if slot.claimed is not None:
                raise ProtocolError("PeerWrite: this ticket was used already")
            if slot.nbytes != nbytes:
                raise ProtocolError(f"PeerWrite of {nbytes} bytes for a copy of {slot.nbytes}")
            slot.claimed = session
            self._used[ticket] = None
            while len(self._used) > MAX_USED_TICKETS:
                self._used.popitem(last=False)
            return slot

    def _later_grant(self, session, copy: tuple, proof) -> tuple:
        """The terms of a later copy on a kept connection, once its proof holds: the key
        the destination derives from its own token for these terms, over the binding of
        this connection. Refused like a HELLO naming them: expired or wrong (a replayed
        ticket is refused by claim, which checks every write's)."""
        why = handshake.copy_refusal(copy)
        if why is not None:
            raise ProtocolError(f"PeerWrite: {why}")
        key = handshake.copy_key(session.server.token, *copy)
        if not session.copy_binding or not handshake.matches(handshake.write_proof(key, session.copy_binding), proof):
            raise ProtocolError("PeerWrite: wrong key for this copy: it is no HMAC under this server's token (the "
                                "client holds another token for this server than its --token-file)")
        return copy


def _valid_ticket(ticket) -> bool:
    return type(ticket) is bytes and len(ticket) == m.PEER_TICKET_BYTES


# -- the destination --------------------------------------------------------------------------------
def on_receive(session, request: m.PeerReceive) -> None:
    """PeerReceive, in the client's session thread: wait until the peer wrote the bytes."""
    if not _valid_ticket(request.ticket):
        raise ProtocolError(f"PeerReceive needs a ticket of {m.PEER_TICKET_BYTES} bytes")
    server, device = session.server, session.device
    view = session.table.byte_range(request.sid, request.offset, request.nbytes)
    staging = device.staging(request.nbytes) if device.accelerator else None
    slot = _Slot(host_bytes(view if staging is None else staging), request.nbytes)
    copies = server.peer_copies
    copies.expect(request.ticket, slot)
    log.debug("session %d: waiting for a copy of %d bytes from %s", session.number, request.nbytes, request.source)
    try:
        started = time.monotonic()
        deadline = started + PEER_TIMEOUT_S
        probe = _SourceProbe(request.source, started)
        while not slot.done.wait(_POLL_S):
            if server.stopping or session.transport.closed or session.transport.peer_gone:
                raise Failure("op", "server shutting down (or the client left) during a copy from another server")
            if slot.claimed is None:
                if time.monotonic() > deadline:
                    raise Failure("op", f"a copy from another server did not arrive within {PEER_TIMEOUT_S:.0f} s "
                                        "(is the source server up, and can it reach this one?)")
                probe.check()
            elif slot.claimed.transport.closed and not slot.done.is_set():  # however long the bytes take
                raise Failure("op", "the source server's connection dropped in the middle of a copy")
    finally:
        copies.drop(request.ticket)
    if slot.error is not None:
        raise slot.error
    if staging is not None:
        view.copy_(staging, non_blocking=True)


class _SourceProbe:
    """Whether a copy's source server still listens, checked by connecting to it (and
    closing at once) while the copy has not started (PROBE_AFTER_S)."""

    def __init__(self, source, started: float):
        self.address = _host_port(source)
        self.source = source
        self.next = started + PROBE_AFTER_S
        self.failed = 0

    def check(self) -> None:
        now = time.monotonic()
        if self.address is None or now < self.next:
            return
        self.next = now + PROBE_EVERY_S
        try:
            socket.create_connection(self.address, timeout=PROBE_EVERY_S).close()
            self.failed = 0
        except OSError as exc:
            self.failed += 1
            if self.failed >= 2:
                raise Failure("op", f"the source server of a copy, {self.source}, is gone "
                                    f"({exc.strerror or exc}): its copy will not come") from None


def _host_port(source) -> Optional[tuple]:
    """("host", port) of a PeerReceive.source "host:port" ("[::1]:port" too); None if absent
    or malformed (the copy then waits for its timeout, as without a source)."""
    if type(source) is not str or ":" not in source:
        return None
    host, _, port = source.rpartition(":")
    host = host.strip("[]")
    return (host, int(port)) if host and port.isdigit() and 0 < int(port) < 65536 else None


def place_write(session, request: m.PeerWrite, lengths: list) -> tuple[list, _Slot]:
    """PeerWrite's payload, as its prologue arrives (in the peer's session thread): the
    buffer of the copy that expects it."""
    if not _valid_ticket(request.ticket):
        raise ProtocolError(f"PeerWrite needs a ticket of {m.PEER_TICKET_BYTES} bytes")
    if lengths != [request.nbytes]:
        raise ProtocolError("PeerWrite carries exactly one payload of nbytes bytes")
    slot = session.server.peer_copies.claim(request.ticket, request.nbytes, session, request.expires, request.proof)
    return [slot.buffer], slot


def on_write(session, request: m.PeerWrite, slot: Optional[_Slot]) -> m.PeerDone:
    """The payload is in: release the waiting PeerReceive."""
    if slot is None:  # a transport that skipped the sink: no payload came
        raise ProtocolError("PeerWrite without its payload")
    copies = session.server.peer_copies
    copies.bytes_received += request.nbytes
    copies.copies_received += 1
    slot.done.set()
    return m.PeerDone(request.nbytes)


# -- the source ------------------------------------------------------------------------------------
def on_send(session, request: m.PeerSend) -> None:
    """PeerSend, in the client's session thread: send over a kept connection to the
    destination, or connect, then keep the connection for the next copy."""
    if not _valid_ticket(request.ticket):
        raise ProtocolError(f"PeerSend needs a ticket of {m.PEER_TICKET_BYTES} bytes")
    if request.tls_ca is not None and not isinstance(request.tls_ca, str):
        raise ProtocolError("PeerSend: tls_ca must be PEM text")
    device = session.device
    view = session.table.byte_range(request.sid, request.offset, request.nbytes)
    if device.accelerator:
        staging = device.staging(request.nbytes)
        staging.copy_(view, non_blocking=True)
        device.synchronize(session._stream)  # noqa: SLF001 (the session lends it)
        view = staging
    copies = session.server.peer_copies
    where = (request.address, request.tls_ca)
    kept = copies.take_link(where)
    if kept is not None:
        proof = handshake.write_proof(request.key, kept.binding)
        try:
            _write(kept, m.PeerWrite(request.ticket, request.nbytes, request.expires, proof), view, request)
        except PeerGone as exc:
            # the destination ended the kept connection (idle too long) as this copy
            # began: nothing of it was written there, so a new connection writes it
            log.debug("a kept connection to %s ended under a copy (%s); connecting again", request.address, exc)
        else:
            copies.sent(where, kept, request.nbytes)
            return
    kept = _connect(session, request)
    _write(kept, m.PeerWrite(request.ticket, request.nbytes), view, request)  # the copy its handshake named
    copies.sent(where, kept, request.nbytes)


def _write(kept: KeptLink, write: m.PeerWrite, view, request: m.PeerSend) -> None:
    """One PeerWrite and its PeerDone; the connection closed on any failure."""
    try:
        kept.link.send(MsgType.PEER_WRITE, m.encode(write), [host_bytes(view)], req_id=1)
        reply = _reply(kept.link, 1)
        if isinstance(reply, m.ErrorReply):
            raise RemoteOpError(f"the destination server {request.address} refused the copy: {reply.message}")
        if not isinstance(reply, m.PeerDone) or reply.nbytes != request.nbytes:
            raise ProtocolError(f"the destination server {request.address} answered PeerWrite with {reply!r}")
    except BaseException:
        kept.link.close()
        raise


def _connect(session, request: m.PeerSend) -> KeptLink:
    """A new connection to the copy's destination, authenticated under the copy's key."""
    host, port = config.parse_host_port(request.address)
    try:
        if request.tls_ca is not None:
            tls = session.server.peer_copies.tls.get(request.tls_ca, "PeerSend")
            link = TlsTransport.connect(host, port, timeout=CONNECT_TIMEOUT_S, tls=tls)
        else:
            link = TcpTransport.connect(host, port, timeout=CONNECT_TIMEOUT_S)
    except PeerGone as exc:  # said as the source's loss is said (_SourceProbe)
        raise PeerGone(f"the destination server of a copy, {request.address}, is gone ({exc})") from exc
    try:
        name = f"peer copy from {socket.gethostname()} session {session.number}"
        welcome = handshake.client_handshake(link, request.key, name, CONNECT_TIMEOUT_S,
                                             copy=(request.ticket, request.nbytes, request.expires))
    except BaseException:
        link.close()
        raise
    session.server.peer_copies.links_opened += 1
    return KeptLink(link, welcome.proof)


def _reply(link: TcpTransport, req_id: int):
    """The answer to `req_id`, skipping the heartbeats (PONGs with id 0) of a busy peer."""
    deadline = time.monotonic() + PEER_TIMEOUT_S + CONNECT_TIMEOUT_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportTimeout(f"no answer from {link.peer} to a copy within {PEER_TIMEOUT_S:.0f} s")
        try:
            msg = link.recv(timeout=min(left, 1.0))
        except TransportTimeout:
            continue
        if msg.type == MsgType.PONG or msg.req_id != req_id:
            continue
        return m.decode(msg.type, msg.meta)
