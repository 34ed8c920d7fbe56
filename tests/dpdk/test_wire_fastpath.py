"""The C fast path of the message prologue must be wire.py, byte for byte: encoding
gives the same bytes, and the check accepts exactly what wire.py decodes cleanly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from remote_accel.dataplane import dpdk, wire

payload_lists = st.lists(st.binary(max_size=64), max_size=12)


@settings(max_examples=300, deadline=None)
@given(msg_type=st.integers(0, 255), meta=st.binary(max_size=300), payloads=payload_lists,
       req_id=st.integers(0, (1 << 32) - 1), flags=st.integers(0, 0xFFFF))
def test_encode_matches_wire(msg_type, meta, payloads, req_id, flags):
    want = wire.encode_prologue(msg_type, meta, [len(p) for p in payloads], req_id=req_id, flags=flags)
    assert dpdk.wire_encode(msg_type, meta, payloads, req_id=req_id, flags=flags) == want


@settings(max_examples=300, deadline=None)
@given(msg_type=st.integers(0, 255), meta=st.binary(max_size=300), payloads=payload_lists,
       req_id=st.integers(0, (1 << 32) - 1), flags=st.integers(0, 0xFFFF),
       flip=st.one_of(st.none(), st.integers(0, 10_000)))
def test_check_agrees_with_wire(msg_type, meta, payloads, req_id, flags, flip):
    pro = bytearray(wire.encode_prologue(msg_type, meta, [len(p) for p in payloads], req_id=req_id, flags=flags))
    total = sum(map(len, payloads))
    if flip is not None:
        pro[flip % len(pro)] ^= 1 << (flip % 8)
    try:
        header, lengths, got_meta, used = wire.decode_prologue(bytes(pro))
        valid = used + header.payload_total == len(pro) + total
    except wire.ProtocolError:
        valid = False
    fast = dpdk.wire_check(bytes(pro), len(pro) + total)
    if valid:
        assert fast == (header.type, header.flags, header.req_id, got_meta, lengths)
    else:
        assert fast is None  # the fast path never accepts what wire.py refuses


def test_check_respects_limits():
    pro = wire.encode_prologue(1, b"x" * 100, [5, 5])
    tight = wire.Limits(max_meta=50)
    assert dpdk.wire_check(pro, len(pro) + 10) is not None
    assert dpdk.wire_check(pro, len(pro) + 10, tight) is None
    assert dpdk.wire_check(pro[:40], len(pro) + 10) is None  # prologue beyond the head


def test_check_refuses_lengths_that_wrap():
    """Payload lengths whose u64 sum wraps round to the header's total (2**63 + 2**63 + 5
    is 5 in 64 bits) add up only in C: wire.py refuses them, so the check must too
    (found by fuzz/prologue_fuzz.c; the fast path once passed 2**63-byte lengths on)."""
    head = bytearray(wire.HEADER.pack(wire.MAGIC, wire.WIRE_VERSION, 1, 0, 2, 0, 0, 5, 0))
    table = (1 << 63).to_bytes(8, "big") + ((1 << 63) + 5).to_bytes(8, "big")
    crc = wire.crc32c(table, wire.crc32c(bytes(head)))
    pro = bytes(head[:24]) + crc.to_bytes(4, "big") + table
    with pytest.raises(wire.ProtocolError, match="add up"):
        wire.decode_prologue(pro)
    assert dpdk.wire_check(pro, len(pro) + 5) is None
