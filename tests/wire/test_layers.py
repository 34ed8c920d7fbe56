"""The scapy layer of the message prologue, checked against dataplane.wire both ways."""

from __future__ import annotations

import struct

import pytest
from scapy.packet import Padding, Raw

from remote_accel._version import WIRE_VERSION
from remote_accel.dataplane import messages, wire
from remote_accel.errors import ProtocolError
from remote_accel.tools.wire_layers import RAPrologue, prologue_crc

META = messages.encode(messages.WriteStorage(sid=7, offset=4096, nbytes=10))
LENGTHS = [10, 0, 3]
PAYLOAD = b"0123456789" + b"abc"


def example() -> RAPrologue:
    return RAPrologue(type=wire.MsgType.WRITE, flags=0x0102, req_id=0xDEADBEEF,
                      lengths=LENGTHS, meta=META) / PAYLOAD


def test_build_and_parse_back_every_field():
    raw = bytes(example())
    pkt = RAPrologue(raw)
    assert pkt.magic == b"RA"
    assert pkt.version == WIRE_VERSION
    assert pkt.type == wire.MsgType.WRITE == 18
    assert pkt.sprintf("%type%") == "WRITE"
    assert pkt.flags == 0x0102
    assert pkt.n_payloads == 3
    assert pkt.req_id == 0xDEADBEEF
    assert pkt.meta_len == len(META)
    assert pkt.payload_total == 13
    assert pkt.lengths == LENGTHS
    assert pkt.meta == META
    assert bytes(pkt.payload) == PAYLOAD
    # the checksum over header (crc zeroed), length table and meta
    prologue = raw[: wire.HEADER_SIZE + 8 * 3 + len(META)]
    expected = wire.crc32c(prologue[28:], wire.crc32c(prologue[:24] + b"\0" * 4))
    assert pkt.crc32c == expected == prologue_crc(prologue)
    assert pkt.crc_ok()
    assert messages.decode(pkt.type, pkt.meta) == messages.WriteStorage(7, 4096, 10)
    assert pkt.mysummary() == "RA WRITE req=3735928559 meta=%dB payloads=3/13B" % len(META)


def test_fixed_example_bytes():
    # one fixed message written out by hand, so a layout change cannot go unnoticed
    pkt = RAPrologue(type=wire.MsgType.PING, req_id=1, lengths=[], meta=b"\x0c\x80")
    raw = bytes(pkt)
    assert raw[:24] == bytes.fromhex("5241" "03" "04" "0000" "0000" "00000001" "00000002" "0000000000000000")
    assert raw[28:] == b"\x0c\x80"
    assert struct.unpack("!I", raw[24:28])[0] == prologue_crc(raw)


def test_scapy_built_packet_decodes_with_wire():
    raw = bytes(example())
    header, lengths, meta, used = wire.decode_prologue(raw)
    assert header.type == wire.MsgType.WRITE
    assert header.flags == 0x0102
    assert header.req_id == 0xDEADBEEF
    assert header.n_payloads == 3
    assert header.payload_total == 13
    assert lengths == LENGTHS
    assert meta == META
    assert raw[used:] == PAYLOAD


def test_wire_encoded_prologue_dissects_with_scapy():
    for msg_type, meta, lengths, req_id, flags in [
        (wire.MsgType.ECHO, messages.encode(messages.Echo(seq=42)), [64], 9, 0),
        (wire.MsgType.GOODBYE, b"", [], 0, 0),
        (wire.MsgType.DATA, messages.encode(messages.Data(nbytes=1 << 20)), [1 << 20], (1 << 32) - 1, 0xFFFF),
    ]:
        prologue = wire.encode_prologue(msg_type, meta, lengths, req_id=req_id, flags=flags)
        pkt = RAPrologue(prologue)
        assert (pkt.type, pkt.req_id, pkt.flags) == (msg_type, req_id, flags)
        assert (pkt.lengths, pkt.meta, pkt.payload_total) == (lengths, meta, sum(lengths))
        assert pkt.crc_ok()
        # and scapy rebuilds the very same bytes
        assert bytes(RAPrologue(type=msg_type, req_id=req_id, flags=flags, lengths=lengths, meta=meta)) == prologue


def test_bad_checksum_is_flagged():
    raw = bytearray(bytes(example()))
    raw[wire.HEADER_SIZE + 8 * 3] ^= 0x01  # one bit of the meta
    pkt = RAPrologue(bytes(raw))
    assert not pkt.crc_ok()
    with pytest.raises(ProtocolError, match="checksum"):
        wire.decode_prologue(bytes(raw))
    # a wrong crc set on purpose is kept, not recomputed
    bad = RAPrologue(type=wire.MsgType.PING, crc32c=0x12345678, meta=b"\x0c\x80")
    assert RAPrologue(bytes(bad)).crc32c == 0x12345678
    assert not RAPrologue(bytes(bad)).crc_ok()


def test_payload_then_next_message_on_a_stream():
    first = bytes(example())
    second = wire.encode_prologue(wire.MsgType.SYNC, messages.encode(messages.Sync()), [])
    pkt = RAPrologue(first + second)
    assert pkt[Raw].load == PAYLOAD
    assert pkt[Padding].load == second
    assert RAPrologue(pkt[Padding].load).type == wire.MsgType.SYNC
