"""Scapy layers of the remote_accel wire format, for dissectors, captures and tests.

`RAPrologue` is the message prologue of `dataplane.wire` (header, payload length table,
meta); the payload bytes follow it as the layer's payload. The layout comes from
`wire.HEADER`, and a test keeps the two in step: a packet built here decodes with
`wire.decode_prologue`, and `wire.encode_prologue` output dissects here.

Scapy is a tools and tests concern, so this lives in tools/, not in the data plane.
"""

from __future__ import annotations

import struct

from scapy.fields import (
    ByteEnumField,
    ByteField,
    FieldLenField,
    FieldListField,
    IntField,
    LongField,
    StrFixedLenField,
    StrLenField,
    XIntField,
    XShortField,
)
from scapy.packet import Packet

from .._version import WIRE_VERSION
from ..dataplane import wire

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
