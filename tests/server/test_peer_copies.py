"""The server's half of server-to-server copies (server.peer), at the protocol level.

One real server plays both ends: one client session owns the source storage, another the
destination; the server connects to itself as the peer. Bad tickets, sizes, addresses
and keys are answered with clear errors, and the session goes on. The source gets a key
for the one copy (handshake.copy_key), never the destination's token.
"""

import secrets
import time

import pytest

from remote_accel.dataplane import handshake
from remote_accel.dataplane import messages as m
from remote_accel.dataplane.tcp import TcpTransport
from remote_accel.errors import AuthError, ProtocolError

# bytes from one storage to another, keys and tickets: nothing a torch version changes
pytestmark = pytest.mark.any_torch


def _ticket() -> bytes:
    return secrets.token_bytes(m.PEER_TICKET_BYTES)


def _send_half(ticket, sid, offset, nbytes, address, token, expires=None):
    """The PeerSend a client makes: a key for this copy under the destination's token."""
    expires = handshake.copy_expiry() if expires is None else expires
    return m.PeerSend(ticket, sid, offset, nbytes, address, handshake.copy_key(token, ticket, nbytes, expires), expires)


def test_copy_between_two_sessions_through_the_peer_link(server, connect):
    source, dest = connect(), connect()
    data = secrets.token_bytes(3 << 20)
    src = source.alloc(len(data))
    source.write(src, data)
    dst = dest.alloc(len(data) + 10)
    before = source.stats()
    ticket = _ticket()
    host, port = server.tcp
    # the source's half first: its PeerWrite waits on the server for the PeerReceive
    source.send(_send_half(ticket, src, 0, len(data), f"{host}:{port}", server.token))
    dest.send(m.PeerReceive(ticket, dst, 10, len(data)))
    assert source.sync() >= 0 and dest.sync() >= 0
    assert dest.read(dst, len(data), offset=10) == data
    after = dest.stats()
    assert after["peer_bytes_sent"] - before["peer_bytes_sent"] == len(data)
    assert after["peer_bytes_received"] - before["peer_bytes_received"] == len(data)
    assert after["peer_copies_received"] - before["peer_copies_received"] == 1


def test_bad_peer_writes_are_refused_at_once(connect):
    peer = connect()
    with pytest.raises(ProtocolError, match="ticket"):
        peer.request(m.PeerWrite(b"short", 4), (b"abcd",))
    with pytest.raises(ProtocolError, match="one payload"):
        peer.request(m.PeerWrite(_ticket(), 4), (b"ab", b"cd"))
    start = time.monotonic()
    with pytest.raises(ProtocolError, match="copy connection"):  # a client's session is no source
        peer.request(m.PeerWrite(_ticket(), 4), (b"abcd",))
    assert time.monotonic() - start < 5  # not after a timeout
    assert peer.ping() == 7  # the session goes on


def _copy_connection(server, ticket, nbytes, expires, key, welcome=None):
    link = TcpTransport.connect(*server.tcp, timeout=10)
    got = handshake.client_handshake(link, key, "test source", 10, copy=(ticket, nbytes, expires))
    if welcome is not None:
        welcome.append(got)
    return link


def _answer(link, req_id):
    reply = link.recv(timeout=10)
    assert reply.req_id == req_id
    return m.decode(reply.type, reply.meta)


def test_a_kept_copy_connection_writes_later_copies_each_proven_by_its_own_key(server, connect):
    """What a source server does for its next copies to the same destination: one
    connection, each later PeerWrite proving its own key over the connection's binding.
    A forged, replayed, expired or misbound proof is refused, and the connection goes on."""
    dest = connect()
    dst = dest.alloc(8)
    first, expires = _ticket(), handshake.copy_expiry()
    dest.send(m.PeerReceive(first, dst, 0, 8))
    welcome = []
    link = _copy_connection(server, first, 8, expires, handshake.copy_key(server.token, first, 8, expires), welcome)
    binding = welcome[0].proof
    try:
        link.send(m.PeerWrite.TYPE, m.encode(m.PeerWrite(first, 8)), [b"first..."], req_id=1)
        assert isinstance(_answer(link, 1), m.PeerDone)

        def later(ticket, data, req_id, token=server.token, bind=binding, terms_expire=expires, nbytes=8):
            key = handshake.copy_key(token, ticket, nbytes, terms_expire)
            write = m.PeerWrite(ticket, nbytes, terms_expire, handshake.write_proof(key, bind))
            link.send(m.PeerWrite.TYPE, m.encode(write), [data], req_id=req_id)
            return _answer(link, req_id)

        second = _ticket()
        dest.send(m.PeerReceive(second, dst, 0, 8))
        assert isinstance(later(second, b"second..", 2), m.PeerDone)
        assert dest.sync() >= 0 and dest.read(dst, 8) == b"second.."

        past = int(time.time()) - 600
        refused = {"forged": later(_ticket(), b"x" * 8, 3, token="not-the-token"),
                   "bound to another connection": later(_ticket(), b"x" * 8, 4, bind=secrets.token_bytes(32)),
                   "replayed": later(second, b"x" * 8, 5),
                   "expired": later(_ticket(), b"x" * 8, 6, terms_expire=past),
                   "no proof for a new ticket": _plain_write(link, _ticket(), 7)}
        for why, reply in refused.items():
            assert isinstance(reply, m.ErrorReply), why
        assert "wrong key" in refused["forged"].message and "token" in refused["forged"].message
        assert "wrong key" in refused["bound to another connection"].message
        assert "used already" in refused["replayed"].message
        assert "expired" in refused["expired"].message
        assert dest.read(dst, 8) == b"second.."  # none of them wrote

        third = _ticket()
        dest.send(m.PeerReceive(third, dst, 0, 8))
        assert isinstance(later(third, b"third...", 8), m.PeerDone)  # the connection went on
        assert dest.sync() >= 0 and dest.read(dst, 8) == b"third..."
    finally:
        link.close()


def _plain_write(link, ticket, req_id):
    link.send(m.PeerWrite.TYPE, m.encode(m.PeerWrite(ticket, 8)), [b"y" * 8], req_id=req_id)
    return _answer(link, req_id)


def test_a_source_keeps_its_connection_for_the_next_copies(server, connect):
    """Three copies from one session to another of the same server (it connects to
    itself as to a peer): one connection opened, every copy's bytes right."""
    source, dest = connect(), connect()
    address = f"{server.tcp[0]}:{server.tcp[1]}"
    src = source.alloc(3 << 10)
    chunks = [secrets.token_bytes(1 << 10) for _ in range(3)]
    source.write(src, b"".join(chunks))
    dst = dest.alloc(3 << 10)
    before = source.stats()
    for i in range(3):
        ticket = _ticket()
        dest.send(m.PeerReceive(ticket, dst, i << 10, 1 << 10))
        source.send(_send_half(ticket, src, i << 10, 1 << 10, address, server.token))
        assert source.sync() >= 0 and dest.sync() >= 0
    after = source.stats()
    assert dest.read(dst, 3 << 10) == b"".join(chunks)
    assert after["peer_copies_sent"] - before["peer_copies_sent"] == 3
    assert after["peer_links_opened"] - before["peer_links_opened"] <= 1  # 0 if an earlier test's was kept


def test_copy_keys_are_checked_bound_and_one_time(server, connect):
    dest = connect()
    dst = dest.alloc(8)
    ticket, expires = _ticket(), handshake.copy_expiry()
    key = handshake.copy_key(server.token, ticket, 8, expires)
    for bad in (handshake.copy_key(server.token, ticket, 9, expires),  # another size
                handshake.copy_key("not-the-token", ticket, 8, expires)):  # forged
        with pytest.raises(AuthError):
            _copy_connection(server, ticket, 8, expires, bad).close()
    past = int(time.time()) - 600
    with pytest.raises(AuthError, match="expired"):
        _copy_connection(server, ticket, 8, past, handshake.copy_key(server.token, ticket, 8, past)).close()
    # the right key writes its copy; the connection may do nothing else
    dest.send(m.PeerReceive(ticket, dst, 0, 8))
    link = _copy_connection(server, ticket, 8, expires, key)
    try:
        link.send(m.PeerWrite.TYPE, m.encode(m.PeerWrite(ticket, 8)), [b"12345678"], req_id=1)
        reply = link.recv(timeout=10)
        assert isinstance(m.decode(reply.type, reply.meta), m.PeerDone)
        link.send(m.Stats.TYPE, m.encode(m.Stats()), req_id=2)
        reply = m.decode(*(lambda r: (r.type, r.meta))(link.recv(timeout=10)))
        assert isinstance(reply, m.ErrorReply) and "not a request" in reply.message
    finally:
        link.close()
    assert dest.sync() >= 0 and dest.read(dst, 8) == b"12345678"
    with pytest.raises(AuthError, match="replayed"):  # the same key again
        _copy_connection(server, ticket, 8, expires, key).close()


def test_bad_halves_are_reported_at_the_next_sync(connect):
    client = connect()
    sid = client.alloc(16)
    client.send(m.PeerReceive(b"x", sid, 0, 16))  # a ticket of the wrong size
    with pytest.raises(ProtocolError, match="ticket"):
        client.sync()
    client.send(_send_half(_ticket(), sid, 8, 16, "127.0.0.1:1", "t"))  # outside the storage
    with pytest.raises(Exception, match="outside storage"):
        client.sync()
    client.send(_send_half(_ticket(), sid, 0, 16, "127.0.0.1:1", "t"))  # nobody listens there
    with pytest.raises(Exception, match="(?i)refused|connect"):
        client.sync()
    assert client.ping() == 7


def test_peer_send_with_a_wrong_token_is_an_auth_error(server, connect):
    source, dest = connect(), connect()
    src, dst = source.alloc(8), dest.alloc(8)
    source.send(_send_half(_ticket(), src, 0, 8, f"{server.tcp[0]}:{server.tcp[1]}", "wrong-token"))
    with pytest.raises(Exception, match="token|key"):
        source.sync()
    del dst


def test_peer_messages_round_trip_and_type_checks():
    msg = m.PeerSend(b"t" * 16, 3, 8, 64, "10.0.0.2:18515", "key", 1800000000)
    assert m.decode(m.PeerSend.TYPE, m.encode(msg)) == msg
    for bad in (m.PeerReceive(b"t" * 16, "3", 0, 1), m.PeerWrite("ticket", 1), m.PeerDone(1.5)):
        with pytest.raises(ProtocolError):
            m.decode(bad.TYPE, m.encode(bad))
