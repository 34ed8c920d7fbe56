"""The server's half of server-to-server copies (server.peer), at the protocol level.

One real server plays both ends: one client session owns the source storage, another the
destination; the server connects to itself as the peer. Bad tickets, sizes and
addresses are answered with clear errors, and the session goes on.
"""

import secrets

import pytest

from remote_accel.dataplane import messages as m
from remote_accel.errors import ProtocolError


def _ticket() -> bytes:
    return secrets.token_bytes(m.PEER_TICKET_BYTES)


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
    source.send(m.PeerSend(ticket, src, 0, len(data), f"{host}:{port}", server.token))
    dest.send(m.PeerReceive(ticket, dst, 10, len(data)))
    assert source.sync() >= 0 and dest.sync() >= 0
    assert dest.read(dst, len(data), offset=10) == data
    after = dest.stats()
    assert after["peer_bytes_sent"] - before["peer_bytes_sent"] == len(data)
    assert after["peer_bytes_received"] - before["peer_bytes_received"] == len(data)
    assert after["peer_copies_received"] - before["peer_copies_received"] == 1


def test_bad_peer_writes_are_refused(connect):
    peer = connect()
    with pytest.raises(ProtocolError, match="ticket"):
        peer.request(m.PeerWrite(b"short", 4), (b"abcd",))
    with pytest.raises(ProtocolError, match="one payload"):
        peer.request(m.PeerWrite(_ticket(), 4), (b"ab", b"cd"))
    assert peer.ping() == 7  # the session goes on


def test_bad_halves_are_reported_at_the_next_sync(connect):
    client = connect()
    sid = client.alloc(16)
    client.send(m.PeerReceive(b"x", sid, 0, 16))  # a ticket of the wrong size
    with pytest.raises(ProtocolError, match="ticket"):
        client.sync()
    client.send(m.PeerSend(_ticket(), sid, 8, 16, "127.0.0.1:1", "t"))  # outside the storage
    with pytest.raises(Exception, match="outside storage"):
        client.sync()
    client.send(m.PeerSend(_ticket(), sid, 0, 16, "127.0.0.1:1", "t"))  # nobody listens there
    with pytest.raises(Exception, match="(?i)refused|connect"):
        client.sync()
    assert client.ping() == 7


def test_peer_send_with_a_wrong_token_is_an_auth_error(server, connect):
    source, dest = connect(), connect()
    src, dst = source.alloc(8), dest.alloc(8)
    source.send(m.PeerSend(_ticket(), src, 0, 8, f"{server.tcp[0]}:{server.tcp[1]}", "wrong-token"))
    with pytest.raises(Exception, match="token"):
        source.sync()
    del dst


def test_peer_messages_round_trip_and_type_checks():
    msg = m.PeerSend(b"t" * 16, 3, 8, 64, "10.0.0.2:18515", "tok")
    assert m.decode(m.PeerSend.TYPE, m.encode(msg)) == msg
    for bad in (m.PeerReceive(b"t" * 16, "3", 0, 1), m.PeerWrite("ticket", 1), m.PeerDone(1.5)):
        with pytest.raises(ProtocolError):
            m.decode(bad.TYPE, m.encode(bad))
