"""Each wire fact is written in C (the shim) and in Python (wire.py, the scapy layers of
ra-dump, the tools): these tests read both from the source and fail when they disagree,
so that a change to one side cannot ship without the other."""

from __future__ import annotations

import re
import struct
from pathlib import Path

from remote_accel.dataplane import wire
from remote_accel.tools import wire_layers as layers

SHIM = Path(__file__).resolve().parents[2] / "src" / "dpdk_shim"
C_SIZES = {"uint8_t": 1, "rte_be16_t": 2, "rte_be32_t": 4, "rte_be64_t": 8}
#: the scapy fields' names where they differ from the C struct's
SCAPY_NAMES = {"crc": "crc32c"}


def _source(name: str) -> str:
    return (SHIM / name).read_text()


def _define(name: str, text: str) -> str:
    found = re.search(rf"^#define\s+{name}\s+(.+?)\s*(/\*.*)?$", text, re.M)
    assert found, f"#define {name} not found"
    return found.group(1)


def _struct_fields(name: str, text: str) -> list[tuple[str, int]]:
    body = re.search(rf"struct {name} {{(.*?)}}", text, re.S).group(1)
    fields = []
    for ctype, names in re.findall(r"^\s*(\w+)\s+([\w, ]+);", body, re.M):
        fields += [(n.strip(), C_SIZES[ctype]) for n in names.split(",")]
    return fields


def _scapy_fields(packet) -> list[tuple[str, int]]:
    """(name, bytes) of each field, as the layer writes it (computed ones as zero)."""
    out = []
    for f in packet.fields_desc:
        value = packet.getfieldval(f.name)
        out.append((f.name, len(f.addfield(packet, b"", 0 if value is None else value))))
    return out


def test_frame_offsets_and_overhead_match_the_shim():
    """The fields themselves: tests/wire/test_frames.py; here what the tools compute from them."""
    text = _source("wire/wire.h")
    offsets, at = {}, 0
    for n, size in _struct_fields("frame_hdr", text):
        offsets[SCAPY_NAMES.get(n, n)] = at
        at += size
    assert layers.FRAME_HEADER_SIZE == at
    assert (layers._FRAME_CRC_OFFSET, layers._FRAME_LEN_OFFSET) == (offsets["crc32c"], offsets["len"])
    assert _define("FRAME_OVERHEAD", text) == "(L2L4_LEN + (int)sizeof(struct frame_hdr))"
    assert _define("L2L4_LEN", text) == "(RTE_ETHER_HDR_LEN + 20 + 8)"  # Ethernet 14, IPv4, UDP
    assert layers.FRAME_OVERHEAD == 14 + 20 + 8 + at


def test_hello_body_matches_the_shim():
    c_fields = _struct_fields("hello_body", _source("wire/wire.h"))
    assert _scapy_fields(layers.RAHello()) == c_fields


def test_message_prologue_matches_the_shim_and_the_dissector():
    assert int(_define("SHIM_WIRE_HEADER", _source("shim.h"))) == wire.HEADER_SIZE
    # the scapy layer: the header fields of wire.HEADER, in order and width
    header = _scapy_fields(layers.RAPrologue())[:9]
    assert [size for _, size in header] == [struct.calcsize("!" + c) for c in ("2s", "B", "B", "H", "H", "I", "I",
                                                                                "Q", "I")]
    assert wire.HEADER.format in ("!2sBBHHIIQI", b"!2sBBHHIIQI")
    assert wire.HEADER.size == sum(size for _, size in header)


def test_goodbye_copies_are_one_number():
    """The shim sends GOODBYE a few times (frames may be lost); every sender uses the one count."""
    loop = r"for \(int \w+ = 0; \w+ < (\w+); \w+\+\+\)\s*\n\s*conn_send_ctrl\(c, FT_GOODBYE"
    text = "\n".join(p.read_text() for p in sorted(SHIM.rglob("*.c")))
    loops = re.findall(loop, text)  # a close (the timers) and the shutdown
    assert len(loops) == len(re.findall(r"conn_send_ctrl\(\w+, FT_GOODBYE", text)) >= 2, loops
    assert set(loops) == {"GOODBYE_COPIES"}, loops
