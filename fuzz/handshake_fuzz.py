"""atheris target: the handshake, both halves (server/auth.py, dataplane/handshake.py).

The handshake is Python over the wire's Python decoder (wire.py, messages.py, codec.py
and the C codec under it), so atheris (coverage-guided, libFuzzer's engine, for Python)
drives it through a transport that hands out the fuzzer's bytes as the peer's messages.
Input: one byte of flags, then the peer's messages. Bit 0 names the half under test
(0: the server's half, the fuzzer is a client; 1: the client's half, the fuzzer is a
server). Bit 1: the messages come as (type: 1 byte, meta length: 2 bytes little-endian,
meta) records that this harness puts prologues with good CRCs in front of, so mutations
reach the message decoders and the handshake's logic; without it, the bytes are the
stream itself (the prologue's checks then get the mutations, CRC included).

What must hold, beyond "no exception but the documented ones":
- the server admits a client only after an AUTH that is the HMAC under its token, and
  only one that named no server or a server it listens as (handshake.answers_to),
- the client returns a WELCOME only when its proof is the HMAC under the token,
- the server's half raises nothing (it refuses, logs and returns False),
- the client's half raises RemoteAccelError subclasses only.

The nonce this side draws is fixed (NONCE), so that seeds made from a real session
(make_corpus.py rebuilds the captured AUTH and WELCOME under it) get past the proofs.

Run: python fuzz/handshake_fuzz.py fuzz/corpus/handshake -runs=1000000 (fuzz/README.md).
"""

from __future__ import annotations

import logging
import sys
import types

import atheris

with atheris.instrument_imports(include=["remote_accel"]):  # not torch, numpy, ...
    from remote_accel.dataplane import handshake as hs
    from remote_accel.dataplane import messages as m
    from remote_accel.dataplane import wire
    from remote_accel.errors import PeerGone, RemoteAccelError
    from remote_accel.server import auth

TOKEN = "fuzz-token"
NONCE = bytes(range(hs.NONCE_BYTES))


class StreamTransport:
    """The peer's messages from a byte string, through wire.py as TCP reads them."""

    peer = "fuzz"

    def __init__(self, data: bytes):
        self.data, self.pos, self.sent, self.given = data, 0, [], []

    def send(self, msg_type, meta=b"", payloads=(), *, req_id=0, flags=0):
        self.sent.append((msg_type, bytes(meta)))

    def recv(self, timeout=None, sink=None):
        if self.pos >= len(self.data):
            raise PeerGone("fuzz: the peer closed")
        header, lengths, meta, used = wire.decode_prologue(self.data[self.pos:])
        self.pos += used
        if lengths:
            sink(header, meta, lengths)  # both halves' sinks refuse payloads
            raise AssertionError("a handshake sink accepted payloads")
        self.given.append((header.type, meta))
        return types.SimpleNamespace(type=header.type, meta=meta, payloads=[], req_id=header.req_id,
                                     flags=header.flags)

    def given_as(self, cls):
        """The messages of type `cls` this transport handed out, decoded again."""
        return [m.decode(t, meta) for t, meta in self.given if t == cls.TYPE]


class Server:
    token, max_clients, memory_limit = TOKEN, 4, 0

    def __init__(self):
        self.peer_copies = types.SimpleNamespace(was_used=lambda ticket: False)
        self.admitted = 0

    def admit(self, session) -> bool:
        self.admitted += 1
        return True

    def tcp_addresses(self) -> tuple:
        return ("tcp:127.0.0.1:18515", "tls:0.0.0.0:18516")


def server_half(data: bytes) -> None:
    transport = StreamTransport(data)
    session = types.SimpleNamespace(transport=transport, server=Server(), number=1, client="",
                                    device=types.SimpleNamespace(name="cpu"), admitted=False, copy_grant=None)
    ok = auth.handshake(session)  # raises nothing: a refusal is False
    if ok:
        # admitted: only after one HELLO and one AUTH whose proof is the HMAC under the
        # token (under the copy's key for a HELLO that names a copy)
        (hello,), (answer,) = transport.given_as(m.Hello), transport.given_as(m.Auth)
        key = TOKEN if hello.copy is None else hs.copy_key(TOKEN, *hello.copy)
        assert answer.proof == hs.client_proof(key, NONCE, hello.nonce), "admitted without the proof"
        assert session.server.admitted == 1 and transport.sent[-1][0] == m.Welcome.TYPE
        # and only a client that named no server, or this one
        assert not hello.server or hs.answers_to(Server().tcp_addresses(), hello.server), "admitted elsewhere"


def client_half(data: bytes) -> None:
    transport = StreamTransport(data)
    try:
        welcome = hs.client_handshake(transport, TOKEN, "fuzz", timeout=5.0)
    except RemoteAccelError:
        return
    (challenge,) = transport.given_as(m.Challenge)
    assert welcome.proof == hs.server_proof(TOKEN, NONCE, challenge.nonce), "accepted a server without the proof"


def framed(records: bytes) -> bytes:
    """The wire bytes of (type, meta length, meta) records, each with its prologue."""
    out, pos = [], 0
    while pos + 3 <= len(records):
        msg_type, n = records[pos], int.from_bytes(records[pos + 1:pos + 3], "little")
        meta = records[pos + 3:pos + 3 + n]
        out.append(wire.encode_prologue(msg_type, meta, []))  # the meta included
        pos += 3 + n
    return b"".join(out)


def one_input(data: bytes) -> None:
    if not data:
        return
    stream = framed(data[1:]) if data[0] & 2 else data[1:]
    (client_half if data[0] & 1 else server_half)(stream)


def main() -> None:
    logging.disable(logging.CRITICAL)  # every refusal logs a line
    hs.new_nonce = lambda: NONCE  # both halves draw it through the module
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
