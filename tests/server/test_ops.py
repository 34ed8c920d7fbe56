"""Ops through a real server process over TCP give what local torch gives."""

from __future__ import annotations

import os
import struct

import torch

from remote_accel.dataplane import messages as m
from remote_accel.torch_wire import values as torch_values
from remote_accel.dataplane.codec import Ext
from remote_accel.server.testing import Ref, encode_arg

ON_CPU = os.environ.get("REMOTE_ACCEL_TEST_DEVICE", "cpu") == "cpu"


def close(actual, expected):
    # A GPU may use TF32 for convolutions; on CPU the server runs the very same kernels.
    tol = {} if ON_CPU else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(actual, expected, **tol)


def test_add_and_matmul(client):
    a, b, w = torch.randn(4, 5), torch.randn(4, 5), torch.randn(5, 3)
    ra, rb, rw = client.upload(a), client.upload(b), client.upload(w)
    s, p = client.empty((4, 5)), client.empty((4, 3))
    client.run("aten::add.Tensor", ra, rb, outs=(s,), alpha=2)
    client.run("aten::mm", s, rw, outs=(p,))
    assert client.sync() == 2
    close(client.download(s), a + 2 * b)
    close(client.download(p), (a + 2 * b) @ w)


def test_convolution_and_its_backward(client):
    x, w, b = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(4)
    rx, rw, rb = client.upload(x), client.upload(w), client.upload(b)
    conv_args = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    y = client.empty((2, 4, 8, 8))
    # the client device sends the PrivateUse1 names; the server runs the generic kernels
    client.run("aten::convolution_overrideable", rx, rw, rb, *conv_args, outs=(y,))
    expected = torch.nn.functional.conv2d(x, w, b, padding=1)
    close(client.download(y), expected)

    g = torch.randn_like(expected)
    rg = client.upload(g)
    grads = (client.empty(x.shape), client.empty(w.shape), client.empty(b.shape))
    client.run("aten::convolution_backward_overrideable", rg, rx, rw, *conv_args, [True, True, True], outs=grads)
    ex, ew, eb = torch.ops.aten.convolution_backward(g, x, w, [4], *conv_args, [True, True, True])
    for ref, want in zip(grads, (ex, ew, eb)):
        close(client.download(ref), want)

    direct = client.empty((2, 4, 8, 8))
    client.run("aten::convolution", rx, rw, rb, *conv_args, outs=(direct,))
    close(client.download(direct), expected)


def test_softmax_and_scalar_argument(client):
    x = torch.randn(3, 7)
    rx = client.upload(x)
    y, z = client.empty((3, 7)), client.empty((3, 7))
    client.run("aten::_softmax", rx, 1, False, outs=(y,))
    # a wrapped-number scalar travels as an inline 0-dim CPU tensor
    client.run("aten::mul.Tensor", y, torch.tensor(3.0), outs=(z,))
    close(client.download(y), torch.softmax(x, 1))
    close(client.download(z), torch.softmax(x, 1) * 3)


def test_a_planned_op_runs_again_with_other_storages_and_scalars(client):
    a, b = torch.randn(5), torch.randn(5)
    ra, rb = client.upload(a), client.upload(b)
    first, second = client.empty((5,)), client.empty((5,))
    args = encode_arg((ra, torch.tensor(3.0)))  # a tensor reference and an inline CPU scalar
    client.send(m.RunOp("aten::mul.Tensor", args, {}, encode_arg((first,)), False, None, 41))
    # RunPlanned's values fill the holes in wire order: args, kwargs, outs
    client.batch(m.RunPlanned(41, (rb.sid, struct.pack("<f", -0.5), second.sid)))
    assert client.sync() == 2
    close(client.download(first), a * 3)
    close(client.download(second), b * -0.5)


def test_in_place_and_out_variants(client):
    a, b = torch.randn(6), torch.randn(6)
    ra, rb = client.upload(a), client.upload(b)
    client.run("aten::add_.Tensor", ra, rb)  # result aliases ra: no outs
    out = client.upload(torch.zeros(6))
    client.run("aten::mul.out", ra, rb, out=out)
    close(client.download(ra), a + b)
    close(client.download(out), (a + b) * b)


def test_multi_output_ops(client):
    x = torch.randn(4, 6)
    rx = client.upload(x)
    values, indices = client.empty((4,)), client.empty((4,), torch.int64)
    client.run("aten::max.dim", rx, 1, outs=(values, indices))
    sv, si = client.empty((4, 6)), client.empty((4, 6), torch.int64)
    client.run("aten::sort", rx, 1, True, outs=(sv, si))
    pieces = (client.empty((2, 6)), client.empty((2, 6)))
    client.run("aten::split_with_sizes_copy", rx, [2, 2], outs=pieces)  # Tensor[] results expand in place
    ev, ei = x.max(1)
    close(client.download(values), ev)
    close(client.download(indices), ei)
    esv, esi = x.sort(1, descending=True)
    close(client.download(sv), esv)
    close(client.download(si), esi)
    close(client.download(pieces[1]), x[2:])


def test_reply_gives_data_dependent_shapes(client):
    x = torch.tensor([[0.0, 1.0], [2.0, 0.0], [3.0, 4.0]])
    rx = client.upload(x)
    sid = client.new_sid()
    (meta,) = client.run_reply("aten::nonzero", rx, outs=(sid,))
    nbytes, dtype, shape, stride, offset = meta
    expected = torch.nonzero(x)
    assert (dtype, shape) == ("int64", tuple(expected.shape))
    close(client.download(Ref(sid, torch.int64, shape, stride, offset)), expected)
    (value,) = client.run_reply("aten::_local_scalar_dense", rx.view((), (), 4))
    assert value == 3.0


def test_promised_layout_is_honoured(client):
    # The client promises a column-major result: the server copies into that layout.
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    out = client.empty((3, 5), stride=(1, 3))
    client.run("aten::mm", client.upload(a), client.upload(b), outs=(out,))
    raw = client.download(out.view((15,), (1,)))
    close(raw, (a @ b).t().reshape(-1))


def test_type_promotion_and_dtypes(client):
    i = torch.arange(6, dtype=torch.int32)
    f = torch.rand(6, dtype=torch.float64)
    out = client.empty((6,), torch.float64)
    client.run("aten::add.Tensor", client.upload(i), client.upload(f), outs=(out,))
    close(client.download(out), i + f)
    h = client.empty((6,), torch.bfloat16)
    client.run("aten::_to_copy", client.upload(f), dtype=torch.bfloat16, outs=(h,))
    close(client.download(h), f.to(torch.bfloat16))


def test_factories_on_the_server_device(client):
    out = client.empty((2, 3))
    remote = Ext(torch_values.DEVICE, ("remote_accel", 0))  # the client's name for the server's device
    client.run("aten::full", [2, 3], 1.5, dtype=torch.float32, device=remote, outs=(out,))
    close(client.download(out), torch.full((2, 3), 1.5))


def test_generators_reproduce_local_streams(client):
    gen = Ext(torch_values.GENERATOR, (5, 1234, 0))
    first, second = client.upload(torch.zeros(8)), client.upload(torch.zeros(8))
    client.run("aten::normal_", first, 0.0, 1.0, generator=gen)
    client.run("aten::normal_", second, 0.0, 1.0, generator=gen)  # continues the stream
    again = client.upload(torch.zeros(8))
    client.run("aten::normal_", again, 0.0, 1.0, generator=Ext(torch_values.GENERATOR, (5, 1234, 1)))  # reseeded
    a, b, c = client.download(first), client.download(second), client.download(again)
    assert not torch.equal(a, b)
    torch.testing.assert_close(a, c)
    if ON_CPU:  # the server's CPU generator is torch's: the same seed gives the same numbers
        local = torch.Generator().manual_seed(1234)
        torch.testing.assert_close(a, torch.empty(8).normal_(generator=local))


def test_dropout_uses_a_per_session_stream(connect):
    def dropout_mask(client):
        x = client.upload(torch.ones(1000))
        out, mask = client.empty((1000,)), client.empty((1000,), torch.bool)
        client.run("aten::native_dropout", x, 0.5, True, outs=(out, mask))
        return client.download(mask)

    one, two = connect(), connect()
    # Two fresh sessions start from the same default seed, whatever the other does meanwhile.
    m1 = dropout_mask(one)
    m2 = dropout_mask(two)
    assert torch.equal(m1, m2)
    assert 300 < int(m1.sum()) < 700
    assert not torch.equal(dropout_mask(one), m1)
