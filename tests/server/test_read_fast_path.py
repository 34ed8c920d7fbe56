"""The session's fast path for small READs (fields read in C++, bytes copied in C++, the
Data meta encoded once) answers as the general path does: the same bytes, the same
errors, a pending one-way error first, and a malformed READ still gets a protocol error.

Reads over SMALL_READ bytes, and READs whose fields C++ does not take, go through the
general path, so each check compares the two on one server."""

from __future__ import annotations

import pytest
import torch

from remote_accel.dataplane import codec
from remote_accel.dataplane import messages as m
from remote_accel.errors import ProtocolError, RemoteOpError
from remote_accel.server.session import SMALL_READ
from remote_accel.server.testing import encode_arg


def run_op(op: str, *args, outs=()) -> m.RunOp:
    """A one-way RunOp for a Batch (which the C++ executor scans and runs)."""
    return m.RunOp(op, encode_arg(args), {}, encode_arg(tuple(outs)), False)


def raw_read(client, meta: bytes):
    """A READ with these meta bytes as they are: (reply, payloads)."""
    req_id = next(client._req)
    client.transport.send(int(m.MsgType.READ), meta, req_id=req_id)
    msg = client.transport.recv(timeout=10)
    while msg.type == m.MsgType.PONG and msg.req_id == 0:
        msg = client.transport.recv(timeout=10)
    assert msg.req_id == req_id
    return m.decode(msg.type, msg.meta), msg.payloads


def test_small_and_large_reads_give_the_stored_bytes(client):
    data = torch.arange(2048, dtype=torch.float32)  # 8 KiB: reads on both sides of SMALL_READ
    ref = client.upload(data)
    raw = data.numpy().tobytes()
    for offset, nbytes in ((0, 4), (4, 8), (8188, 4), (100, 0), (0, SMALL_READ), (0, SMALL_READ + 4), (0, 8192)):
        assert client.read(ref.sid, nbytes, offset) == raw[offset:offset + nbytes], (offset, nbytes)


def test_a_computed_scalar_reads_back_after_a_batch(client):
    x = client.upload(torch.linspace(1.0, 2.0, 16))
    s = client.empty(())
    client.batch(run_op("aten::sum", x, outs=(s,)))
    for _ in range(3):  # the same Data meta, reused
        value = torch.frombuffer(bytearray(client.read(s.sid, 4)), dtype=torch.float32)
        torch.testing.assert_close(value[0], torch.linspace(1.0, 2.0, 16).sum())


@pytest.mark.parametrize("nbytes", [4, SMALL_READ + 4])
def test_bad_reads_fail_alike_on_both_paths(client, nbytes):
    ref = client.upload(torch.zeros(SMALL_READ // 4 + 4))
    with pytest.raises(RemoteOpError, match="unknown storage 999") as info:
        client.read(999, nbytes)
    assert info.value.kind == "bad_handle"
    size = ref.shape[0] * 4
    with pytest.raises(RemoteOpError, match=f"outside storage {ref.sid} of {size} bytes") as info:
        client.read(ref.sid, nbytes, offset=size - nbytes + 4)
    assert info.value.kind == "bad_handle"
    with pytest.raises(ProtocolError, match=r"bad byte range -4\+"):
        client.read(ref.sid, nbytes, offset=-4)
    assert client.read(ref.sid, 4) == bytes(4)  # the session goes on


def test_a_pending_error_answers_the_read_first(client):
    a, b = client.upload(torch.ones(3)), client.upload(torch.ones(4))
    bad = client.empty((3,))
    client.batch(run_op("aten::add.Tensor", a, b, outs=(bad,)))  # shape mismatch
    with pytest.raises(RemoteOpError, match="size of tensor") as info:
        client.read(a.sid, 4)
    assert info.value.kind == "op"
    with pytest.raises(RemoteOpError, match=f"unknown storage {bad.sid}"):  # its result never came to be
        client.read(bad.sid, 4)
    assert client.read(a.sid, 4) == torch.ones(1).numpy().tobytes()


def test_reads_the_fast_path_declines_are_judged_by_the_decoder(client):
    ref = client.upload(torch.ones(4))
    for fields in ((ref.sid, 0), (ref.sid, 0, 4, 1), ("1", 0, 4), (True, 0, 4), (ref.sid, 0.0, 4), [ref.sid, 0, 4]):
        reply, _ = raw_read(client, codec.encode(fields))
        assert type(reply) is m.ErrorReply and reply.kind == "protocol", fields
    reply, _ = raw_read(client, b"\xff\x01")
    assert type(reply) is m.ErrorReply and reply.kind == "protocol"
    reply, data = raw_read(client, codec.encode((ref.sid, 4, 8)))  # the fast path's own form
    assert type(reply) is m.Data and bytes(data[0]) == torch.ones(2).numpy().tobytes()
