"""The message prologue: fixed example values, every field, the checksum and the limits."""

import pytest

from remote_accel.dataplane import messages, wire
from remote_accel.dataplane.wire import MsgType
from remote_accel.errors import MessageTooLarge, ProtocolError


def test_prologue_fields_and_checksum():
    meta = b"hello meta"
    data = wire.encode_prologue(MsgType.WRITE, meta, [3, 0, 70000], req_id=0xDEADBEEF, flags=0x0102)
    assert data[:2] == b"RA"
    assert len(data) == wire.HEADER_SIZE + 3 * 8 + len(meta)
    header, lengths, got_meta, used = wire.decode_prologue(data)
    assert (header.type, header.flags, header.n_payloads, header.req_id) == (MsgType.WRITE, 0x0102, 3, 0xDEADBEEF)
    assert (header.meta_len, header.payload_total) == (len(meta), 70003)
    assert lengths == [3, 0, 70000] and got_meta == meta and used == len(data)
    zeroed = data[: wire.HEADER_SIZE - 4] + b"\0\0\0\0" + data[wire.HEADER_SIZE :]
    assert header.crc == wire.crc32c(zeroed)


@pytest.mark.parametrize("position", range(0, 28 + 8 + 4))
def test_any_flipped_bit_is_detected(position):
    data = bytearray(wire.encode_prologue(MsgType.RUN, b"meta", [5]))
    data[position] ^= 0x10
    with pytest.raises(ProtocolError):
        wire.decode_prologue(bytes(data))


def test_limits_checked_before_allocation():
    limits = wire.Limits(max_meta=10, max_payloads=2, max_payload_total=100)
    with pytest.raises(MessageTooLarge):
        wire.encode_prologue(MsgType.RUN, b"x" * 11, [], limits=limits)
    with pytest.raises(MessageTooLarge):
        wire.encode_prologue(MsgType.RUN, b"", [1, 1, 1], limits=limits)
    with pytest.raises(MessageTooLarge):
        wire.encode_prologue(MsgType.RUN, b"", [101], limits=limits)
    huge = wire.HEADER.pack(b"RA", wire.WIRE_VERSION, MsgType.RUN, 0, 1, 0, 0, 1 << 50, 0)
    with pytest.raises(MessageTooLarge):
        wire.decode_header(huge, limits)


def test_messages_round_trip_and_validate():
    msg = messages.RunOp("aten::add.Tensor", (1, 2.0), {"alpha": 2}, (None,))
    assert messages.decode(MsgType.RUN, messages.encode(msg)) == msg
    with pytest.raises(ProtocolError, match="expected int"):
        messages.decode(MsgType.ALLOC, messages.codec.encode(("seven", 1)))
    with pytest.raises(ProtocolError, match="fields"):
        messages.decode(MsgType.ALLOC, messages.codec.encode((1,)))
    with pytest.raises(ProtocolError, match="unknown message type"):
        messages.decode(250, b"\x08\x00\x00\x00\x00")


def test_batch_rejects_forbidden_items():
    ok = messages.Batch((messages.batch_item(messages.AllocStorage(1, 16)),))
    assert messages.batch_items(ok) == [messages.AllocStorage(1, 16)]
    bad = messages.Batch(((int(MsgType.HELLO), ("tok", "c", 1)),))
    with pytest.raises(ProtocolError, match="not allowed"):
        messages.batch_items(bad)


@pytest.mark.parametrize("sid, offset, nbytes", [(1, 0, 4), (127, 128, 8), (2**40, 2**33, 4096), (-3, -128, 0)])
def test_a_read_encoded_directly_is_the_generic_encoding(sid, offset, nbytes):
    encoded = messages.encode_read(sid, offset, nbytes)
    assert encoded == messages.encode(messages.ReadStorage(sid, offset, nbytes))
    assert messages.decode(MsgType.READ, encoded) == messages.ReadStorage(sid, offset, nbytes)
