"""The session handshake: mutual challenge-response under the shared token.

    client                                         server
    HELLO(client, wire_version, Nc)           ->
                                              <-   CHALLENGE(Ns)
    AUTH(HMAC(token, CLIENT_LABEL|Ns|Nc))     ->   compared in constant time
                                              <-   WELCOME(..., HMAC(token, SERVER_LABEL|Nc|Ns))
                                                   or ERROR(kind="auth")

Each side draws a fresh 32-byte nonce per connection, so an answer recorded in one
session is worth nothing in the next (replay); the two directions hash under different
labels, so one side's proof never passes for the other's (reflection). The server
proves itself last, only to a client that proved itself first, so that a stranger who
connects learns no HMAC under the token to guess it from. The token never crosses the
wire, on any transport.

What this does not give is a private or tamper-proof link: someone who can change
traffic may relay a handshake and then ride the session. TCP between hosts takes TLS
for that (`tls`); DPDK links are meant for a trusted L2 fabric.

The client half lives here once, for every client (the device's session, the test
client, ra-testpmd), with the one mapping of the server's error kinds to exceptions
(`remote_error`); the server half is `server.auth.handshake`, on the same helpers.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from typing import Optional, Sequence

from .. import errors
from .._version import WIRE_VERSION
from ..config import parse_host_port
from ..errors import AuthError, ConfigError, PeerGone, ProtocolError, RemoteAccelError, RemoteOpError, TransportTimeout
from . import messages as m
from .transport import Transport
from .wire import type_name

NONCE_BYTES = 32
CLIENT_LABEL = b"remote_accel/2 client proof\0"
SERVER_LABEL = b"remote_accel/2 server proof\0"
#: What a client is told when the server refuses its proof (also the server's log line).
WRONG_TOKEN = ("wrong token: the client's answer to the challenge is not an HMAC under this "
               "server's token (compare the client's token=... or REMOTE_ACCEL_TOKEN with the "
               "server's --token-file)")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def valid_nonce(nonce: bytes) -> bool:
    return type(nonce) is bytes and len(nonce) == NONCE_BYTES


def client_proof(token: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What the client answers to CHALLENGE (both nonces have a fixed length, so plain
    concatenation is unambiguous)."""
    return _hmac(token, CLIENT_LABEL + server_nonce + client_nonce)


def server_proof(token: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What the server puts in WELCOME."""
    return _hmac(token, SERVER_LABEL + client_nonce + server_nonce)


#: Server-to-server copies (server/peer.py): the client gives the source server a key good
#: for one copy, derived from the destination's token, never the token itself. The source
#: authenticates to the destination with it (the handshake above, under the key); the
#: destination derives the same key from its token and the (ticket, nbytes, expires) that
#: HELLO names. A captured key writes at most that one copy, before it expires.
COPY_LABEL = b"remote_accel/3 copy key\0"
COPY_KEY_S = 120  # how long a key is good for: the copy may wait behind earlier work
COPY_CLOCK_SKEW_S = 60  # clocks of client and destination may differ this much


def copy_key(token: str, ticket: bytes, nbytes: int, expires: int) -> str:
    """The key for one copy of `nbytes` bytes under `ticket`, good until `expires`."""
    return _hmac(token, COPY_LABEL + ticket + nbytes.to_bytes(8, "big") + expires.to_bytes(8, "big")).hex()


def copy_expiry() -> int:
    return int(time.time()) + COPY_KEY_S


def copy_refusal(copy) -> Optional[str]:
    """Why the destination refuses the terms (ticket, nbytes, expires) of a copy, from
    the peer; None for terms it may check the key of."""
    if (type(copy) is not tuple or len(copy) != 3 or type(copy[0]) is not bytes
            or len(copy[0]) != m.PEER_TICKET_BYTES or type(copy[1]) is not int or type(copy[2]) is not int
            or copy[1] < 0):
        return "a copy is named by (ticket, nbytes, expires)"
    now = time.time()
    if copy[2] < now - COPY_CLOCK_SKEW_S:
        return "the key for this copy has expired"
    if copy[2] > now + COPY_KEY_S + COPY_CLOCK_SKEW_S:
        return "the key for this copy expires too late (a key is good for minutes at most)"
    return None


#: Process groups (server/collectives.py): rank r's server takes connections from the
#: other ranks' servers under a key its own token gives for (group, r), never the token.
#: Rank r's client derives it and shares it with the group through torch's store, as
#: torch.distributed shares everything else there: whoever holds it may deliver data for
#: rank r of that one group, and nothing else.
GROUP_LABEL = b"remote_accel/4 group key\0"


def group_key(token: str, group: bytes, rank: int) -> str:
    """The key of rank `rank` of process group `group` on the server holding `token`."""
    return _hmac(token, GROUP_LABEL + group + rank.to_bytes(4, "big")).hex()


def group_refusal(group) -> Optional[str]:
    """Why a server refuses a HELLO's group terms (group, source rank, rank here) from the
    peer; None for terms it may check the key of."""
    if (type(group) is not tuple or len(group) != 3 or type(group[0]) is not bytes
            or len(group[0]) != m.GROUP_ID_BYTES or any(type(r) is not int or not 0 <= r < 1 << 20
                                                        for r in group[1:])):
        return "a group connection is named by (group, source rank, rank)"
    return None


#: A source server keeps its connection to a destination for later copies (server/peer.py).
#: Each later copy proves its key over the connection's binding, the WELCOME proof its
#: handshake ended with (fresh nonces of both sides): the key itself never crosses the
#: wire, and a proof seen on one connection is worth nothing on another.
WRITE_LABEL = b"remote_accel/3 kept connection write\0"


def write_proof(key: str, binding: bytes) -> bytes:
    return _hmac(key, WRITE_LABEL + binding)


def matches(expected: bytes, given: bytes) -> bool:
    """Constant-time comparison: the time taken says nothing about how much was right."""
    return type(given) is bytes and hmac.compare_digest(expected, given)


#: ErrorReply kinds with an exception class of their own ("oom" too, below); the rest,
#: op failures above all, raise RemoteOpError
_ERROR_CLASSES = {"auth": AuthError, "protocol": ProtocolError, "wrong_server": ConfigError}


def remote_error(reply: m.ErrorReply, who: str = "remote_accel server") -> RemoteAccelError:
    """The exception a client raises for the server's ErrorReply: the kind picks the
    class and stays in `.kind`, the server's traceback becomes a note."""
    if reply.kind == "oom":  # a torch.OutOfMemoryError: errors makes it on first use
        cls = errors.RemoteOutOfMemoryError
    else:
        cls = _ERROR_CLASSES.get(reply.kind, RemoteOpError)
    exc = cls(f"{who}: [{reply.kind}] {reply.message}")
    exc.kind = reply.kind
    if reply.trace:
        exc.add_note("server traceback:\n" + reply.trace)
    return exc


def _hmac(token: str, data: bytes) -> bytes:
    return hmac.new(token.encode("utf-8"), data, hashlib.sha256).digest()


def client_handshake(transport: Transport, token: str, client: str, timeout: float, copy=None,
                     server: str = "", group=None) -> m.Welcome:
    """Authenticate to the server at the other end of `transport`, and it to us.

    copy: (ticket, nbytes, expires) of the one copy a source server comes to write;
    `token` is then that copy's key (copy_key).
    server: "HOST:PORT" of the server meant, for a transport that may reach another
    (DPDK): one that listens elsewhere refuses, ConfigError with kind "wrong_server".
    group: (group, source rank, destination rank) of a server that carries a process
    group's data; `token` is then the destination rank's group key (group_key).

    Returns its WELCOME. Raises AuthError (no token, the server refused ours, or the
    peer could not prove it holds the token), ProtocolError (the peer does not speak
    this handshake), TransportTimeout (no answer within `timeout` seconds in all),
    PeerGone (the connection ended). The transport is left open either way.
    """
    if not token:
        raise AuthError("no token: pass remote_accel.init(token=...), set REMOTE_ACCEL_TOKEN, or run as the "
                        "server's user on its host (the token file is found by itself)")
    deadline = time.monotonic() + timeout
    nonce = new_nonce()
    transport.send(m.Hello.TYPE, m.encode(m.Hello(client, WIRE_VERSION, nonce, copy, server, group)))
    challenge = _expect(transport, m.Challenge, deadline, timeout)
    if not valid_nonce(challenge.nonce) or challenge.nonce == nonce:
        raise ProtocolError(f"{transport.peer} sent a bad challenge (a nonce of {len(challenge.nonce)} bytes, "
                            "or our own)")
    transport.send(m.Auth.TYPE, m.encode(m.Auth(client_proof(token, challenge.nonce, nonce))))
    welcome = _expect(transport, m.Welcome, deadline, timeout)
    if not matches(server_proof(token, nonce, challenge.nonce), welcome.proof):
        raise AuthError(f"{transport.peer} accepted us but could not prove that it knows the token: it is not "
                        "the server this token belongs to")
    return welcome


def answers_to(listens: Sequence[str], address: str) -> bool:
    """Whether a client told to reach "HOST:PORT" reached the server that listens on
    `listens` ("tcp:HOST:PORT" or "tls:HOST:PORT": Server.tcp_addresses, a WELCOME's
    listens): one of them has that port, on that address or on every address. A DPDK
    port reaches whichever server is behind it, so a client that named a server says
    which one it meant (HELLO.server), as a TLS client names its host. True where the
    server cannot tell (no TCP listener) or the name is a host name (not resolved here);
    False for a name that is no address at all, or listens that are not addresses."""
    if not listens:
        return True
    try:
        host, port = parse_host_port(address)
    except ConfigError:
        return False
    return any(bound is not None and bound[2] == port and _same_host(host, bound[1])
               for bound in map(_parse_listen, listens))


def _parse_listen(listen) -> Optional[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """("tcp" or "tls", address, port) of a listens entry; None for anything else (a
    WELCOME's listens come from the peer)."""
    if type(listen) is not str:
        return None
    kind, _, rest = listen.partition(":")
    host, _, port = rest.rpartition(":")
    try:
        return (kind, ipaddress.ip_address(host), int(port)) if kind in ("tcp", "tls") and port.isdigit() else None
    except ValueError:
        return None


def _same_host(named: str, bound) -> bool:
    """A named host and a listener's bound address that can be the same: equal, the
    listener on every address, both loopback, or a host name (not resolved here)."""
    try:
        ip = ipaddress.ip_address(named)
    except ValueError:
        return named != "localhost" or bound.is_loopback or bound.is_unspecified
    return ip == bound or bound.is_unspecified or (ip.is_loopback and bound.is_loopback)


#: Waits are cut into slices this long so that Ctrl-C is seen between them (a DPDK
#: receive waits in C, where Python's signal handlers cannot run).
WAIT_SLICE_S = 0.1


def _expect(transport: Transport, cls, deadline: float, timeout: float):
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportTimeout("")
            try:
                msg = transport.recv(timeout=min(left, WAIT_SLICE_S), sink=_no_payloads)
                break
            except TransportTimeout:
                continue
    except TransportTimeout:
        raise TransportTimeout(f"{transport.peer} did not complete the handshake within {timeout:g} s "
                               "(is it a remote_accel server?)") from None
    except PeerGone as exc:
        raise PeerGone(f"{exc} (during the handshake: the server may take TLS connections only, or it "
                       "refused the connection)") from exc
    reply = m.decode(msg.type, msg.meta)
    if isinstance(reply, m.ErrorReply):
        raise remote_error(reply, f"the remote_accel server at {transport.peer} refused us")
    if not isinstance(reply, cls):
        raise ProtocolError(f"{transport.peer} answered the handshake with {type_name(msg.type)}, "
                            f"not {type_name(cls.TYPE)}")
    return reply


def _no_payloads(header, meta, lengths) -> list:
    if lengths:  # no handshake message has any: this is not our peer
        raise ProtocolError(f"a {type_name(header.type)} with payloads in the handshake")
    return []
