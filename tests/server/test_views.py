"""Views are rebuilt from (storage, offset, size, stride, conj/neg): aliasing is exact."""

from __future__ import annotations

import pytest
import torch

from remote_accel.torch_wire import values as torch_values
from remote_accel.dataplane.messages import AllocStorage, RunOp, WriteStorage
from remote_accel.errors import RemoteOpError
from remote_accel.server.testing import encode_arg


def test_in_place_op_on_a_view_changes_the_base(client):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    rb = client.upload(base)
    column = rb.view((3,), (4,), offset=1)  # base[:, 1]
    client.run("aten::mul_.Scalar", column, 10)
    expected = base.clone()
    expected[:, 1] *= 10
    assert torch.equal(client.download(rb), expected)


def test_out_into_a_view_and_transposed_inputs(client):
    base = torch.zeros(4, 4)
    rb = client.upload(base)
    a = torch.randn(2, 4)
    ra = client.upload(a)
    # read a transposed view, write into the lower half of base
    lower = rb.view((2, 4), (4, 1), offset=8)
    client.run("aten::add.out", ra, ra.view((2, 4), (4, 1)), out=lower)
    t = client.empty((4, 2))
    client.run("aten::clone", ra.view((4, 2), (1, 4)), outs=(t,))
    expected = base.clone()
    expected[2:] = a + a
    assert torch.equal(client.download(rb), expected)
    assert torch.equal(client.download(t), a.t())


def test_two_references_alias_one_storage(client):
    x = torch.arange(8, dtype=torch.float32)
    rx = client.upload(x)
    first, second = rx.view((4,), (1,), 0), rx.view((4,), (1,), 4)
    client.run("aten::copy_", second, first)  # second half = first half
    client.run("aten::add_.Scalar", first, 100)
    assert torch.equal(client.download(rx), torch.tensor([100, 101, 102, 103, 0, 1, 2, 3], dtype=torch.float32))


def test_overlapping_write_and_read_ranges(client):
    rx = client.upload(torch.zeros(16, dtype=torch.uint8))
    client.write(rx.sid, bytes(range(1, 5)), offset=6)
    assert client.read(rx.sid, 6, offset=4) == bytes([0, 0, 1, 2, 3, 4])


def test_reinterpreting_bytes_as_another_dtype(client):
    x = torch.tensor([1.0, -2.0], dtype=torch.float32)
    rx = client.upload(x)
    as_int = rx._replace(dtype=torch.int32)
    out = client.empty((2,), torch.int32)
    client.run("aten::clone", as_int, outs=(out,))
    assert torch.equal(client.download(out), x.view(torch.int32))


def test_conj_and_neg_bits_travel_with_the_view(client):
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    rz = client.upload(z)
    out = client.empty((2,), torch.complex64)
    client.run("aten::mul.Tensor", rz._replace(flags=torch_values.FLAG_CONJ), rz, outs=(out,))
    torch.testing.assert_close(client.download(out), z.conj() * z)
    neg = client.empty((2,), torch.complex64)
    client.run("aten::clone", rz._replace(flags=torch_values.FLAG_NEG), outs=(neg,))
    torch.testing.assert_close(client.download(neg), -z)


def test_batch_runs_in_order_with_writes_landing_in_place(client):
    # ALLOC, WRITE, op reading it, WRITE over the same bytes, op again: in order.
    sid, out1, out2 = client.new_sid(), client.empty((4,)), client.empty((4,))
    src = client.empty((4,))._replace(sid=sid)
    one, two = torch.ones(4), torch.full((4,), 5.0)
    items = (
        AllocStorage(sid, 16),
        WriteStorage(sid, 0, 16),
        RunOp("aten::mul.Scalar", encode_arg((src, 2)), {}, encode_arg((out1,))),
        WriteStorage(sid, 0, 16),
        RunOp("aten::mul.Scalar", encode_arg((src, 2)), {}, encode_arg((out2,))),
    )
    client.batch(*items, payloads=(one.numpy(), two.numpy()))
    assert torch.equal(client.download(out1), one * 2)
    assert torch.equal(client.download(out2), two * 2)
    assert torch.equal(client.download(src), two)


def test_freed_storage_is_gone(client):
    rx = client.upload(torch.ones(3))
    client.free(rx.sid)
    out = client.empty((3,))
    client.run("aten::neg", rx, outs=(out,))
    with pytest.raises(RemoteOpError) as info:
        client.sync()
    assert info.value.kind == "bad_handle"
