"""A server's part in torch.distributed process groups: its members and their connections.

A client that is rank r of a process group joins its server to the group (CollJoin,
pytorch_ext/process_group.py); the server then holds a `Member` for (group, r), owned by
that client's session. Collectives (collectives.py) run in that session's thread, in
order with its ops, and move data only between servers:

    rank r's server  --COLL_DATA(lane, seq, step) + bytes-->  rank s's server

Each member opens one connection to each peer's server as soon as it joins, so that a
peer that is gone or unreachable is known before the first collective, and the peers
hear from each other while nothing is sent (PINGs): a frozen server is found by its
silence, `silence` seconds (the clients' `timeout`), a dead one at once by its closed
connection. A connection is authenticated under the destination rank's group key
(handshake.group_key, derived from the destination server's token by its own client and
shared through torch's store): it may deliver that rank's data and nothing else. Where
the destination listens with TLS, the connection checks its certificate by the CA its
client shared (the PEM text, as direct copies do).

Data arrives in the thread of the connection's own session on the destination (the peer
server is a client there, session.py): `deliver` puts it in the member's inbox, where the
collective's thread takes it (`take`). A member that cannot go on (a peer gone, a
mismatch, its own client gone) is broken: it tells every peer why (COLL_ABORT), and every
collective of the group, then and later, fails with that reason at its rank's next sync
point: no rank goes on with data it did not get.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import defaultdict
from typing import Optional

import torch

from .. import config
from ..dataplane import handshake
from ..dataplane import messages as m
from ..dataplane.tcp import TcpTransport
from ..dataplane.tls import PeerContexts, TlsTransport
from ..dataplane.wire import MsgType
from ..errors import ProtocolError, RemoteOpError, TransportError
from .storage import host_bytes

log = logging.getLogger(__name__)

#: Connecting to a peer's server and the handshake.
CONNECT_TIMEOUT_S = 10.0
#: A peer connection that has sent nothing for this share of `silence` sends a PING.
PING_SHARE = 0.25
#: Received buffers kept per member for reuse, by size: a ring step receives the same
#: sizes collective after collective, and fresh memory costs a page fault per 4 KiB.
BUFFERS_KEPT = 8
_POLL_S = 0.2
_PING = m.encode(m.Ping(0))


class GroupError(RemoteOpError):
    """A collective could not complete: a peer is gone, the ranks disagree, a timeout."""


class Groups:
    """The members of process groups on this server, by (group, rank)."""

    def __init__(self, tls: Optional[PeerContexts] = None):
        self.tls = tls or PeerContexts()  # settings of connections to peers that speak TLS (shared with peer.py)
        self._cond = threading.Condition()
        self._members: dict[tuple[bytes, int], Member] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.collectives = 0

    def join(self, owner, request: m.CollJoin) -> "Member":
        """Make rank `request.rank` of the group a member here, owned by the session `owner`."""
        if type(request.group) is not bytes or len(request.group) != m.GROUP_ID_BYTES:
            raise ProtocolError(f"CollJoin needs a group id of {m.GROUP_ID_BYTES} bytes")
        if not 0 <= request.rank < request.size <= 1 << 20 or len(request.peers) != request.size:
            raise ProtocolError("CollJoin: rank, size and peers do not agree")
        if not request.timeout > 0 or not request.silence > 0:
            raise ProtocolError("CollJoin: timeout and silence must be positive")
        key = (request.group, request.rank)
        with self._cond:
            if key in self._members and not self._members[key].broken:
                raise ProtocolError(f"rank {request.rank} of this group joined this server already")
            member = Member(self, owner, request)
            self._members[key] = member
            self._cond.notify_all()
        member.connect_all()
        return member

    def member(self, group: bytes, rank: int, alive) -> Optional["Member"]:
        """The member (group, rank), waiting for its client to join while `alive()` (a peer
        may send before this rank's client has joined); None once `alive()` is False."""
        with self._cond:
            while True:
                member = self._members.get((group, rank))
                if member is not None:
                    return member
                if not alive():
                    return None
                self._cond.wait(_POLL_S)

    def find(self, group: bytes, rank: int) -> Optional["Member"]:
        with self._cond:
            return self._members.get((group, rank))

    def leave(self, owner, why: str, failed: bool) -> None:
        """The session `owner` ended: its members go. `failed` (the client vanished, the
        server stops): they break first, and their peers are told why; else (the client
        said goodbye, every collective it queued has run) the peers only see the
        connections end, and fail only a collective that still needs this rank."""
        with self._cond:
            mine = [key for key, member in self._members.items() if member.owner is owner]
            members = [self._members.pop(key) for key in mine]
        for member in members:
            if failed:
                member.fail(why)
            member.close()

    def stats(self) -> dict:
        with self._cond:
            members = len(self._members)
        return {"group_members": members, "group_collectives": self.collectives,
                "group_bytes_sent": self.bytes_sent, "group_bytes_received": self.bytes_received}


class _Link:
    """This member's connection to one peer's server; sends are serialised on it."""

    def __init__(self, rank: int):
        self.rank = rank
        self.transport = None
        self.lock = threading.Lock()
        self.last_send = time.monotonic()

    def send(self, msg_type: int, meta: bytes, payloads=()) -> None:
        with self.lock:
            self.transport.send(msg_type, meta, payloads)
            self.last_send = time.monotonic()

    def close(self) -> None:
        if self.transport is not None:
            try:
                with self.lock:
                    self.transport.send(MsgType.GOODBYE, m.encode(m.Goodbye()))
            except Exception:  # noqa: BLE001 (closing a connection that may be gone)
                pass
            self.transport.close()


class Member:
    """Rank `rank` of one process group on this server."""

    def __init__(self, groups: Groups, owner, request: m.CollJoin):
        self.groups = groups
        self.owner = owner  # the client's session: collectives run in its thread
        self.group, self.rank, self.size = request.group, request.rank, request.size
        self.peers = request.peers
        self.timeout, self.silence = float(request.timeout), float(request.silence)
        self.name = f"group {request.group.hex()[:8]} rank {request.rank}"
        self._cond = threading.Condition()
        self._inbox: dict[tuple, tuple] = {}  # (lane, source, seq, step) -> (CollData, buffer)
        # each peer's last delivery or ping, from its first on: a peer's server connects
        # when its own client joins, which may be long after this one did
        self._heard: list[Optional[float]] = [None] * self.size
        self._lost: dict[int, str] = {}  # peers whose connection to us ended, and why
        self._buffers: dict[int, list] = defaultdict(list)
        self._links = [_Link(r) for r in range(self.size)]
        self.broken: Optional[str] = None
        self.seq = 0  # the last collective run
        self.p2p_sent: dict[int, int] = defaultdict(int)  # point-to-point messages, per peer
        self.p2p_received: dict[int, int] = defaultdict(int)
        self.receives: dict = {}  # posted receives by the client's id, completed at its wait (collectives.py)
        self._closed = threading.Event()
        self._connected = threading.Event()  # connect_all is over (every link tried)
        self._pinger: Optional[threading.Thread] = None
        self._teller: Optional[threading.Thread] = None  # tells the peers why the group broke

    # -- connections ----------------------------------------------------------------------
    def connect_all(self) -> None:
        """Connect to every peer's server, in the background: the session goes on with
        its client's ops; a collective waits for the connection it needs."""
        threading.Thread(target=self._connect_all, name=f"{self.name} connect", daemon=True).start()

    def _connect_all(self) -> None:
        try:
            for link in self._links:
                if link.rank == self.rank:
                    continue
                try:
                    transport = self._connect(link.rank)
                except Exception as exc:  # noqa: BLE001 (any failure to reach a peer breaks the group)
                    self.fail(f"rank {link.rank}'s server at {self._address(link.rank)} cannot be reached: {exc}")
                    continue  # the others are still told why
                with self._cond:
                    link.transport = transport
                    self._cond.notify_all()
                if self._closed.is_set():
                    link.close()
        finally:
            self._connected.set()
        self._pinger = threading.Thread(target=self._ping_loop, name=f"{self.name} pings", daemon=True)
        self._pinger.start()

    def _address(self, rank: int) -> str:
        return str(self.peers[rank][0]) if type(self.peers[rank]) is tuple and self.peers[rank] else "?"

    def _connect(self, rank: int):
        peer = self.peers[rank]
        if type(peer) is not tuple or len(peer) != 3 or type(peer[0]) is not str or type(peer[1]) is not str:
            raise ProtocolError(f"CollJoin: peer {rank} is not (address, key, tls_ca)")
        address, key, ca_text = peer
        host, port = config.parse_host_port(address)
        if ca_text is not None:
            if type(ca_text) is not str:
                raise ProtocolError(f"CollJoin: peer {rank}'s tls_ca must be PEM text")
            link = TlsTransport.connect(host, port, timeout=CONNECT_TIMEOUT_S,
                                        tls=self.groups.tls.get(ca_text, "CollJoin"))
        else:
            link = TcpTransport.connect(host, port, timeout=CONNECT_TIMEOUT_S)
        try:
            handshake.client_handshake(link, key, f"{self.name} from {socket.gethostname()}", CONNECT_TIMEOUT_S,
                                       group=(self.group, self.rank, rank))
        except BaseException:
            link.close()
            raise
        return link

    def _ping_loop(self) -> None:
        """Tell every peer this server is alive while no data goes its way."""
        every = max(0.05, self.silence * PING_SHARE)
        while not self._closed.wait(every / 2):
            now = time.monotonic()
            for link in self._links:
                if link.transport is None or now - link.last_send < every:
                    continue
                try:
                    link.send(MsgType.PING, _PING)
                except TransportError as exc:
                    self.fail(f"rank {link.rank}'s server at {self._address(link.rank)} is gone ({exc})")
                    return

    def close(self) -> None:
        """End the connections, after the peers were told why the group broke, if it did."""
        self._closed.set()
        if self._teller is not None:
            self._teller.join(CONNECT_TIMEOUT_S * (self.size + 1))
        for link in self._links:
            link.close()

    # -- sending and receiving ----------------------------------------------------------------
    def send(self, dest: int, lane: int, seq: int, step: int, signature: tuple, data) -> None:
        """Data for `dest`'s collective `seq` (part `step`); `data`: a contiguous host
        tensor or a buffer. Blocks until the connection took it."""
        link = self._links[dest]
        deadline = time.monotonic() + CONNECT_TIMEOUT_S + self.silence
        with self._cond:
            while link.transport is None:
                self._check(dest)
                if time.monotonic() > deadline:
                    raise self._failed(f"no connection to rank {dest}'s server at {self._address(dest)} "
                                       f"after {CONNECT_TIMEOUT_S + self.silence:g} s")
                self._cond.wait(_POLL_S)
        view = _bytes(data)
        try:
            link.send(MsgType.COLL_DATA, m.encode(m.CollData(lane, seq, step, view.nbytes, signature)), [view])
        except TransportError as exc:
            raise self._failed(f"rank {dest}'s server at {self._address(dest)} is gone ({exc})") from None
        self.groups.bytes_sent += view.nbytes

    def take(self, source: int, lane: int, seq: int, step: int, signature: tuple, started: float):
        """The bytes `source` sent for part `step` of collective `seq`, as a host uint8
        tensor; give it back with `recycle` once used. Waits up to the group's timeout
        from `started`; fails at once when the member breaks or the source's
        connection ends, and when the source is silent for `silence`."""
        key = (lane, source, seq, step)
        with self._cond:
            while key not in self._inbox:
                self._check(source)
                now, heard = time.monotonic(), self._heard[source]
                if heard is not None and now - heard > self.silence:
                    raise self._failed(f"rank {source}'s server at {self._address(source)} has been silent for "
                                       f"{now - heard:.0f} s: it froze or the network to it is cut")
                if now - started > self.timeout:
                    what = "message" if lane == m.LANE_P2P else "collective"
                    raise self._failed(f"{what} {seq} waited {self.timeout:g} s (the group's timeout) for rank "
                                       f"{source}, which did not take part (its server is alive)")
                self._cond.wait(_POLL_S)
            got, buffer = self._inbox.pop(key)
        if got.signature != signature:
            self.recycle(buffer)
            raise self._failed(_mismatch(self.rank, signature, source, got.signature))
        return buffer

    def recycle(self, buffer) -> None:
        with self._cond:
            kept = self._buffers[buffer.numel()]
            if len(kept) < BUFFERS_KEPT:
                kept.append(buffer)

    def buffer(self, nbytes: int):
        """Host memory to receive `nbytes` bytes into, reused where one of that size is kept."""
        with self._cond:
            kept = self._buffers.get(nbytes)
            if kept:
                return kept.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def deliver(self, source: int, got: m.CollData, buffer) -> None:
        """A peer's data arrived (in its connection's session thread)."""
        with self._cond:
            self._inbox[(got.lane, source, got.seq, got.step)] = (got, buffer)
            self._heard[source] = time.monotonic()
            self._cond.notify_all()
        self.groups.bytes_received += got.nbytes

    def heard(self, source: int) -> None:
        with self._cond:
            self._heard[source] = time.monotonic()

    def link_ended(self, source: int, why: str) -> None:
        """The connection from `source`'s server ended: a collective waiting for it fails."""
        with self._cond:
            self._lost.setdefault(source, why)
            self._cond.notify_all()

    # -- failures ----------------------------------------------------------------------------------
    def _check(self, source: int) -> None:
        """Raise if the group is broken or `source`'s connection ended (held: _cond)."""
        if self.broken:
            raise GroupError(self.broken)
        why = self._lost.get(source)
        if why is not None:
            raise self._failed(f"rank {source}'s server at {self._address(source)} closed its connection ({why})")

    def _failed(self, why: str) -> GroupError:
        self.fail(why)
        return GroupError(self.broken)

    def fail(self, why: str) -> None:
        """Break the group here, once, and tell every peer why. (_cond is reentrant: a
        caller that holds it may call this.)"""
        with self._cond:
            first = self.broken is None
            if first:
                self.broken = f"{self.name}: {why}"
            self._cond.notify_all()
        if first:
            log.warning("process %s", self.broken)
            self._teller = threading.Thread(target=self._tell_peers, args=(self.broken,), daemon=True)
            self._teller.start()

    def abort_from(self, source: int, reason: str) -> None:
        """A peer broke the group: so does this member (its own reason first, if it had one)."""
        with self._cond:
            if self.broken is None:
                self.broken = f"rank {source} stopped the group: {reason}"
            self._cond.notify_all()

    def _tell_peers(self, reason: str) -> None:
        """Every peer hears why, also one whose connection was still being made: a peer
        waiting for this rank's data must not wait out the group's timeout."""
        self._connected.wait(CONNECT_TIMEOUT_S * self.size)
        meta = m.encode(m.CollAbort(reason))
        for link in self._links:
            if link.transport is not None:
                try:
                    link.send(MsgType.COLL_ABORT, meta)
                except TransportError:
                    pass


def _bytes(data) -> memoryview:
    return host_bytes(data) if isinstance(data, torch.Tensor) else memoryview(data).cast("B")


def _mismatch(rank: int, mine: tuple, source: int, theirs: tuple) -> str:
    def words(sig: tuple) -> str:
        kind, op, dtype, elements = (tuple(sig) + ("?",) * 4)[:4]
        return f"{kind}{f' ({op})' if op else ''} of {elements} {dtype} elements"

    return (f"the ranks disagree: rank {rank} runs {words(mine)}, rank {source} sent data of {words(theirs)} "
            "(every rank must call the same collectives in the same order, with the same sizes and dtypes)")


# -- a peer server's connection, served here as a session (session.py) ---------------------------------
#: what a peer server's group connection may send
LINK_TYPES = frozenset({MsgType.COLL_DATA, MsgType.COLL_ABORT, MsgType.PING, MsgType.GOODBYE})


def place_link_message(session, header, meta, lengths: list) -> tuple:
    """(the decoded message, its plan, where its payload lands) for a message on a peer
    server's group connection, as its prologue arrives: a COLL_DATA's bytes land in host
    memory of the member they are for, which may wait for its own client to join."""
    if header.type not in LINK_TYPES:
        raise ProtocolError(f"a group connection sends data, and nothing else (not type {header.type})")
    msg = m.decode(header.type, meta)
    if header.type != MsgType.COLL_DATA:
        if lengths:
            raise ProtocolError("only COLL_DATA carries a payload")
        return msg, None, []
    if lengths != [msg.nbytes] or msg.lane not in (m.LANE_COLLECTIVE, m.LANE_P2P):
        raise ProtocolError("COLL_DATA carries one payload of nbytes bytes, in a known lane")
    group, _, rank = session.group_grant
    server = session.server
    member = server.groups.member(group, rank, lambda: not server.stopping and not session.transport.closed)
    if member is None:
        raise ProtocolError("the server is stopping")
    if msg.nbytes > member.owner.table.limit:  # held until its collective takes it: bounded as the rank's storages
        raise ProtocolError(f"COLL_DATA of {msg.nbytes} bytes exceeds the rank's memory limit")
    buffer = member.buffer(msg.nbytes)
    return msg, (member, buffer), [host_bytes(buffer)]


def on_link_message(session, msg_type: int, request, plan) -> bool:
    """A message on a peer server's group connection, in its session's thread; False: it ends."""
    group, source, rank = session.group_grant
    if msg_type == MsgType.COLL_DATA:
        member, buffer = plan
        member.deliver(source, request, buffer)
        return True
    if msg_type == MsgType.GOODBYE:
        return False
    member = session.server.groups.find(group, rank)
    if member is not None:
        if msg_type == MsgType.COLL_ABORT:
            member.abort_from(source, request.reason)
        else:
            member.heard(source)
    return True


def link_ended(session, why: str) -> None:
    group, source, rank = session.group_grant
    member = session.server.groups.find(group, rank)
    if member is not None:
        member.link_ended(source, why)
