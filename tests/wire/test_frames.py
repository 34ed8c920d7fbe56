"""The scapy layer of DPDK frames, checked against the shim's C header and its frames."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from remote_accel.dataplane import messages, wire
from remote_accel.tools.wire_layers import (FRAME_HEADER_SIZE, FRAME_TYPES, FRAME_UDP_PORT, RAFrame, RAHello, RAPrologue,
                                            frame_crc)

SHIM_HEADER = Path(__file__).resolve().parents[2] / "src" / "dpdk_shim" / "wire" / "wire.h"
PROLOGUE = wire.encode_prologue(wire.MsgType.ECHO, messages.encode(messages.Echo(seq=4)), [5], req_id=77)
CHUNK = PROLOGUE + b"hello"


def example() -> RAFrame:
    return RAFrame(type="DATA", flags="ACK_NOW", conn=0x01020304, seq=1000, ack=55, limit=1256,
                   sack=0x8000000000000001, msg_id=12, offset=0, msg_len=len(CHUNK)) / CHUNK


def test_build_and_parse_back_every_field():
    raw = bytes(Ether() / IP() / UDP(sport=FRAME_UDP_PORT, dport=FRAME_UDP_PORT) / example())
    f = Ether(raw)[RAFrame]
    assert f.magic == b"RF" and f.version == 1
    assert f.type == 1 and f.sprintf("%type%") == "DATA"
    assert f.flags == 0x1 and "ACK_NOW" in str(f.flags)
    assert f.len == len(CHUNK)
    assert (f.conn, f.seq, f.ack, f.limit, f.sack) == (0x01020304, 1000, 55, 1256, 0x8000000000000001)
    assert (f.msg_id, f.offset, f.msg_len) == (12, 0, len(CHUNK))
    head = bytes(f)[:FRAME_HEADER_SIZE]
    assert f.crc32c == frame_crc(head, CHUNK)
    expected = wire.crc32c(CHUNK, wire.crc32c(head[:36] + b"\0\0\0\0" + head[40:]))
    assert f.crc32c == expected
    assert f.crc_ok()
    assert f.chunk() == CHUNK
    # the chunk at offset 0 starts with the message prologue
    p = f[RAPrologue]
    assert (p.type, p.req_id, p.lengths, p.crc_ok()) == (wire.MsgType.ECHO, 77, [5], True)
    assert bytes(p.payload) == b"hello"


def test_fixed_example_bytes():
    f = RAFrame(type="ACK", conn=7, seq=2, ack=3, limit=4)
    raw = bytes(f)
    assert len(raw) == FRAME_HEADER_SIZE
    assert raw[:36] == bytes.fromhex("5246" "01" "02" "0000" "0000" "00000007" "00000002" "00000003"
                                     "00000004" "0000000000000000" "00000000")
    assert struct.unpack_from("!I", raw, 36)[0] == frame_crc(raw, b"")


def test_continuation_chunk_and_hello_body():
    f = RAFrame(bytes(RAFrame(type="DATA", offset=8192, msg_len=20000) / (b"RA" + b"\0" * 40)))
    assert isinstance(f.payload, Raw)  # mid-message bytes are not a prologue, even if they look like one
    h = RAFrame(bytes(RAFrame(type="HELLO") / RAHello(max_chunk=16286, window=256, peer_timeout_ns=8 * 10**9)))
    assert (h[RAHello].max_chunk, h[RAHello].window, h[RAHello].peer_timeout_ns) == (16286, 256, 8 * 10**9)
    assert h.crc_ok()


def test_bad_frame_checksum_is_flagged():
    raw = bytearray(bytes(example()))
    raw[FRAME_HEADER_SIZE + 3] ^= 0x10  # a bit of the chunk
    assert not RAFrame(bytes(raw)).crc_ok()
    raw = bytearray(bytes(example()))
    raw[12] ^= 0x01  # a bit of the header (seq)
    assert not RAFrame(bytes(raw)).crc_ok()


@pytest.mark.skipif(not SHIM_HEADER.exists(), reason="dpdk_shim sources not in this tree")
def test_layer_matches_the_c_header():
    text = re.sub(r"/\*.*?\*/", "", SHIM_HEADER.read_text(), flags=re.S)
    body = re.search(r"struct frame_hdr \{(.*?)\} __attribute__", text, re.S).group(1)
    sizes = {"uint8_t": 1, "rte_be16_t": 2, "rte_be32_t": 4, "rte_be64_t": 8}
    c_fields = [(name, sizes[kind]) for kind, name in re.findall(r"(\w+)\s+(\w+);", body)]
    pkt = RAFrame()
    ours = []
    for fld in RAFrame.fields_desc:
        value = fld.i2m(pkt, fld.default if fld.default is not None else 0)
        ours.append(({"crc32c": "crc"}.get(fld.name, fld.name), len(fld.addfield(pkt, b"", value))))
    assert ours == c_fields
    define = dict(re.findall(r"#define (\w+) (\w+)", text))
    assert int(define["SHIM_UDP_PORT"]) == FRAME_UDP_PORT
    assert int(define["FRAME_MAGIC"], 16).to_bytes(2, "big") == RAFrame().magic
    assert int(define["FRAME_VERSION"]) == RAFrame().version
    enum = dict((name, int(v)) for name, v in re.findall(r"FT_(\w+) = (\d+)", text))
    assert {v: k for k, v in enum.items()} == FRAME_TYPES


@pytest.mark.dpdk
def test_frames_built_by_the_shim_dissect_and_match():
    dpdk = pytest.importorskip("remote_accel.dataplane.dpdk", exc_type=ImportError)
    shim = dpdk.build_frame(1, 0x01020304, 1000, CHUNK)
    pkt = Ether(shim)
    assert pkt[UDP].sport == pkt[UDP].dport == FRAME_UDP_PORT
    f = pkt[RAFrame]
    assert (f.type, f.conn, f.seq, f.len) == (1, 0x01020304, 1000, len(CHUNK))
    assert f.crc_ok() and f[RAPrologue].req_id == 77
    # scapy builds the very same frame bytes from the same values
    ours = RAFrame(type="DATA", conn=0x01020304, seq=1000) / CHUNK
    assert bytes(pkt[RAFrame]) == bytes(ours)
    assert shim[-len(bytes(ours)):] == bytes(ours)
    # and the shim's checksum function agrees with ours
    assert dpdk.crc32c(CHUNK) == wire.crc32c(CHUNK)
