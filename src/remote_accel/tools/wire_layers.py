"""Scapy layers of the remote_accel wire format, for dissectors, captures and tests.

`RAPrologue` is the message prologue of `dataplane.wire` (header, payload length table,
meta); the payload bytes follow it as the layer's payload. The layout comes from
`wire.HEADER`, and a test keeps the two in step: a packet built here decodes with
`wire.decode_prologue`, and `wire.encode_prologue` output dissects here.

`RAFrame` is the header the DPDK transport puts on every frame, after Ethernet/IPv4/UDP
(`struct frame_hdr` in dpdk_shim/wire/wire.h); a message travels as chunks of
frames, and the chunk at offset 0 starts with its prologue. Tests compare this layer
with the C header and with frames the shim builds.

Scapy is a tools and tests concern, so this lives in tools/, not in the data plane.
"""

from __future__ import annotations

import struct

from .._version import WIRE_VERSION
from ..dataplane import wire
from .extras import requires

with requires("the wire dissector"):
    from scapy.fields import (
        ByteEnumField,
        ByteField,
        FieldLenField,
        FieldListField,
        FlagsField,
        IntField,
        LongField,
        ShortField,
        StrFixedLenField,
        StrLenField,
        XIntField,
        XLongField,
        XShortField,
    )
    from scapy.layers.inet import UDP
    from scapy.packet import Packet, Raw, bind_layers

MSG_TYPES = {int(t): t.name for t in wire.MsgType}

# Offsets of the fields post_build fills in: the header ends with payload_total (u64)
# and the crc (u32); the wire test fails if that layout changes under us.
_CRC_OFFSET = wire.HEADER_SIZE - 4
_TOTAL_OFFSET = _CRC_OFFSET - 8


class RAPrologue(Packet):
    name = "remote_accel message"
    fields_desc = [
        StrFixedLenField("magic", wire.MAGIC, 2),
        ByteField("version", WIRE_VERSION),
        ByteEnumField("type", int(wire.MsgType.PING), MSG_TYPES),
        XShortField("flags", 0),
        FieldLenField("n_payloads", None, count_of="lengths", fmt="H"),
        IntField("req_id", 0),
        FieldLenField("meta_len", None, length_of="meta", fmt="I"),
        LongField("payload_total", None),
        XIntField("crc32c", None),
        FieldListField("lengths", [], LongField("length", 0), count_from=lambda pkt: pkt.n_payloads),
        StrLenField("meta", b"", length_from=lambda pkt: pkt.meta_len),
    ]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        if self.payload_total is None:
            total = sum(self.lengths)
            pkt = pkt[:_TOTAL_OFFSET] + struct.pack("!Q", total) + pkt[_TOTAL_OFFSET + 8:]
        if self.crc32c is None:
            crc = prologue_crc(pkt)
            pkt = pkt[:_CRC_OFFSET] + struct.pack("!I", crc) + pkt[_CRC_OFFSET + 4:]
        return pkt + pay

    def extract_padding(self, s: bytes):
        # The payloads belong to this message; whatever follows them (the next message
        # on a byte stream, Ethernet padding) does not.
        total = self.payload_total or 0
        return s[:total], s[total:]

    def mysummary(self) -> str:
        return self.sprintf(
            "RA %type% req=%req_id% meta=%meta_len%B payloads=%n_payloads%/%payload_total%B"
        )

    # -- checks --------------------------------------------------------------------------
    def prologue_bytes(self) -> bytes:
        """The prologue as on the wire (fields as they are now, crc included)."""
        return self.do_build()[: wire.HEADER_SIZE + 8 * len(self.lengths) + len(self.meta)]

    def crc_ok(self) -> bool:
        """Whether the crc32c field matches the header, length table and meta."""
        raw = self.prologue_bytes()
        return struct.unpack_from("!I", raw, _CRC_OFFSET)[0] == prologue_crc(raw)


def prologue_crc(prologue: bytes) -> int:
    """CRC32C of a prologue with its crc field taken as zero, as `wire` computes it."""
    return wire.crc32c(prologue[_CRC_OFFSET + 4:], wire.crc32c(prologue[:_CRC_OFFSET] + b"\0\0\0\0"))


# -- DPDK frames -----------------------------------------------------------------------
#: UDP port of DPDK frames (SHIM_UDP_PORT), both source and destination
FRAME_UDP_PORT = 18516
FRAME_MAGIC = b"RF"
FRAME_VERSION = 1
FRAME_TYPES = {1: "DATA", 2: "ACK", 3: "HELLO", 4: "ACCEPT", 5: "KEEPALIVE", 6: "GOODBYE", 7: "RESET"}
FRAME_DATA, FRAME_HELLO, FRAME_ACCEPT = 1, 3, 4
FRAME_HEADER_SIZE = 56
#: Ethernet + IPv4 + UDP + our frame header: a frame's bytes that are not payload
FRAME_OVERHEAD = 14 + 20 + 8 + FRAME_HEADER_SIZE
_FRAME_CRC_OFFSET = 36
_FRAME_LEN_OFFSET = 6
FRAME_NO_DATA_CRC = 0x2  # flags: DATA whose chunk the CRC leaves out (memif, ring)


class RAFrame(Packet):
    name = "remote_accel DPDK frame"
    fields_desc = [
        StrFixedLenField("magic", FRAME_MAGIC, 2),
        ByteField("version", FRAME_VERSION),
        ByteEnumField("type", FRAME_DATA, FRAME_TYPES),
        FlagsField("flags", 0, 16, ["ACK_NOW", "NO_DATA_CRC", "WANT_CRC"]),
        ShortField("len", None),  # chunk bytes after this header
        IntField("conn", 0),  # connection id, chosen by the client
        IntField("seq", 0),  # DATA: frame number; others: the sender's next one
        IntField("ack", 0),  # every frame below this one arrived
        IntField("limit", 0),  # the peer may send frames below this one
        XLongField("sack", 0),  # bit i: frame ack + 1 + i arrived
        IntField("msg_id", 0),
        XIntField("crc32c", None),  # over this header (crc zero) and the chunk
        LongField("offset", 0),  # of this chunk in its message
        LongField("msg_len", 0),
    ]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        if self.len is None:
            pkt = pkt[:_FRAME_LEN_OFFSET] + struct.pack("!H", len(pay)) + pkt[_FRAME_LEN_OFFSET + 2:]
        if self.crc32c is None:
            crc = frame_crc(pkt, b"" if _uncovered(pkt) else pay)
            pkt = pkt[:_FRAME_CRC_OFFSET] + struct.pack("!I", crc) + pkt[_FRAME_CRC_OFFSET + 4:]
        return pkt + pay

    def extract_padding(self, s: bytes):
        n = self.len if self.len is not None else len(s)
        return s[:n], s[n:]

    def guess_payload_class(self, payload: bytes):
        if self.type == FRAME_DATA and self.offset == 0 and payload[:2] == wire.MAGIC \
                and len(payload) >= wire.HEADER_SIZE:
            return RAPrologue
        if self.type in (FRAME_HELLO, FRAME_ACCEPT):
            return RAHello
        return Raw

    def mysummary(self) -> str:
        return self.sprintf("RF %type% conn=%conn% seq=%seq% ack=%ack% msg=%msg_id% off=%offset% len=%len%")

    def chunk(self) -> bytes:
        """The frame's chunk of its message, as on the wire."""
        raw = self.do_build()
        return raw[FRAME_HEADER_SIZE: FRAME_HEADER_SIZE + (self.len or 0)]

    def crc_ok(self) -> bool:
        raw = self.do_build()
        head, chunk = raw[:FRAME_HEADER_SIZE], raw[FRAME_HEADER_SIZE: FRAME_HEADER_SIZE + (self.len or 0)]
        return struct.unpack_from("!I", head, _FRAME_CRC_OFFSET)[0] == frame_crc(head, b"" if _uncovered(head) else chunk)


class RAHello(Packet):
    """Body of HELLO and ACCEPT frames: what each end can take."""

    name = "remote_accel DPDK hello"
    fields_desc = [
        IntField("max_chunk", 0),
        IntField("window", 0),
        LongField("peer_timeout_ns", 0),
    ]


def _uncovered(head: bytes) -> bool:
    """A DATA frame whose CRC covers the header only (sent over memif and ring ports)."""
    return head[3] == FRAME_DATA and bool(struct.unpack_from("!H", head, 4)[0] & FRAME_NO_DATA_CRC)


def frame_crc(head: bytes, chunk: bytes) -> int:
    """CRC32C of a frame header (crc field taken as zero) and its chunk, as the shim computes it."""
    zeroed = head[:_FRAME_CRC_OFFSET] + b"\0\0\0\0" + head[_FRAME_CRC_OFFSET + 4: FRAME_HEADER_SIZE]
    return wire.crc32c(chunk, wire.crc32c(zeroed))


bind_layers(UDP, RAFrame, dport=FRAME_UDP_PORT)
