"""The shared token, and the server's half of the handshake that proves both sides hold it.

The handshake itself (nonces, labels, why) is described in `dataplane.handshake`. By default it lives in `config.default_token_file()`, inside a folder only this user can
enter, so that a client on the same host and account reads it without being told.
A token file that others may read is refused: anyone who can read it can use the server.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import time
from typing import Optional

from .._version import WIRE_VERSION
from .._version import __version__ as SERVER_VERSION
from ..dataplane import handshake as hs
from ..dataplane import messages as m
from ..dataplane.wire import type_name
from ..errors import ConfigError, PeerGone, ProtocolError, TransportError, TransportTimeout
from . import failure
from .host import Guest

log = logging.getLogger(__name__)

TOKEN_BYTES = 32
#: A client has this long from connecting to WELCOME (TLS handshake included).
HANDSHAKE_TIMEOUT_S = 10.0


def load_or_create(path: str) -> str:
    """The token in `path`; a new random one is written there (mode 0600) if it is absent."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read(path)
    except OSError as exc:
        raise ConfigError(f"cannot create token file {path}: {exc.strerror}") from None
    token = secrets.token_hex(TOKEN_BYTES)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    log.info("created a new token in %s", path)
    return token


def _read(path: str) -> str:
    try:
        info = os.stat(path)
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"token file {path} is accessible to other users: "
                              f"run `chmod 600 {path}` (and make sure you own it)")
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"token file {path} is not text") from None
    if not token:
        raise ConfigError(f"token file {path} is empty")
    return token


def handshake(session: Guest) -> bool:
    """Run the server's half on a new connection: True once the client proved it holds
    the token, got our proof and a WELCOME, and is counted by the server; False after
    telling it why not (or when it left), with the reason logged."""
    transport, server = session.transport, session.server
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    got = _receive(session, m.Hello, deadline)
    if got is None:
        return False
    hello, req_id = got
    session.client = hello.client[:200]
    if hello.wire_version != WIRE_VERSION:
        return _refuse(session, req_id, failure.PROTOCOL,
                       f"client speaks wire version {hello.wire_version}, this server {WIRE_VERSION}")
    if not hs.valid_nonce(hello.nonce):
        return _refuse(session, req_id, failure.PROTOCOL, f"HELLO needs a nonce of {hs.NONCE_BYTES} bytes")
    listens = server.tcp_addresses()
    if hello.server and not hs.answers_to(listens, hello.server):
        return _refuse(session, req_id, failure.WRONG_SERVER,
                       f"this server is not {hello.server}: it listens on {', '.join(listens)}")
    key = server.token
    if hello.copy is not None or hello.group is not None:
        key, why = _copy_key(session, hello.copy) if hello.copy is not None else _group_key(session, hello.group)
        if key is None:
            log.warning("refused %s (%s): %s", transport.peer, session.client, why)
            return _refuse(session, req_id, failure.AUTH, why)
    nonce = hs.new_nonce()
    _send(session, m.Challenge(nonce), req_id)
    got = _receive(session, m.Auth, deadline)
    if got is None:
        return False
    answer, req_id = got
    if not hs.matches(hs.client_proof(key, nonce, hello.nonce), answer.proof):
        log.warning("refused %s (%s): wrong token", transport.peer, session.client)
        return _refuse(session, req_id, failure.AUTH, hs.WRONG_TOKEN)
    session.admitted = server.admit(session)
    if not session.admitted:
        log.warning("refused %s (%s): %d clients already", transport.peer, session.client, server.max_clients)
        return _refuse(session, req_id, failure.BUSY, f"the server serves at most {server.max_clients} clients "
                                                       "(its --max-clients option)")
    proof = hs.server_proof(key, hello.nonce, nonce)
    if session.copy_grant is not None:
        session.copy_binding = proof  # what a kept copy connection's later writes prove keys over
    _send(session, m.Welcome(session.number, session.device.name, server.memory_limit, SERVER_VERSION, proof, listens),
          req_id)
    log.info("client connected: session %d, %s (%s)", session.number, transport.peer, session.client)
    return True


def _copy_key(session: Guest, copy) -> tuple:
    """(the key a source server must prove it holds, None) for a HELLO that names one
    copy to write, or (None, why it is refused). The session may then only write it, and
    later copies each proven by its own key (server/peer.py)."""
    why = hs.copy_refusal(copy)
    if why is not None:
        return None, f"HELLO.copy: {why}"
    if session.server.peer_copies.was_used(copy[0]):
        return None, "this copy was written already (a replayed key)"
    session.copy_grant = copy
    return hs.copy_key(session.server.token, *copy), None


def _group_key(session: Guest, group) -> tuple:
    """(the key a peer server must prove it holds, None) for a HELLO that names a process
    group's connection (group, source rank, rank here), or (None, why it is refused).
    The session may then only deliver that rank's data (server/collectives.py)."""
    why = hs.group_refusal(group)
    if why is not None:
        return None, f"HELLO.group: {why}"
    session.group_grant = group
    return hs.group_key(session.server.token, group[0], group[2]), None


def _receive(session: Guest, cls, deadline: float) -> Optional[tuple]:
    """The next message if it is a `cls`, with its req_id; None (the client told, the
    reason logged) otherwise."""
    transport, what = session.transport, type_name(cls.TYPE)
    try:
        msg = transport.recv(timeout=max(0.0, deadline - time.monotonic()), sink=_refuse_payloads)
    except TransportTimeout:
        log.info("%s sent no %s within %.0f s of connecting; closing", transport.peer, what, HANDSHAKE_TIMEOUT_S)
        return None
    except (TransportError, ProtocolError) as exc:
        # a connection closed before its first message is a port check (another server's
        # check that a copy's source still listens, server/peer.py; a load balancer's)
        quiet = cls is m.Hello and isinstance(exc, PeerGone)
        (log.debug if quiet else log.info)("%s dropped before %s: %s", transport.peer, what, exc)
        return None
    try:
        request = m.decode(msg.type, msg.meta)
        if type(request) is not cls:
            raise ProtocolError(f"the handshake expects {what} here, not {type_name(msg.type)}")
    except ProtocolError as exc:
        _refuse(session, msg.req_id, failure.AUTH, str(exc))
        return None
    return request, msg.req_id


def _send(session: Guest, reply, req_id: int) -> None:
    session.transport.send(reply.TYPE, m.encode(reply), req_id=req_id)


def _refuse(session: Guest, req_id: int, kind: str, text: str) -> bool:
    try:
        _send(session, m.ErrorReply(kind, text, ""), req_id)
    except TransportError:
        pass
    return False


def _refuse_payloads(header, meta, lengths) -> list:
    if lengths:  # the payload bytes are not read: the session ends in any case
        raise ProtocolError(f"{type_name(header.type)} with payloads during the handshake")
    return []
