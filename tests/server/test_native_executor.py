"""Planned ops run by the server's C++ executor (server/csrc/), through a real server
process over TCP: every kind of op a plan can hold gives what local torch gives, errors
in a batch surface at the next sync, and the session's state stays right."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from remote_accel.dataplane import messages as m
from remote_accel.torch_wire import values as torch_values
from remote_accel.dataplane.codec import Ext
from remote_accel.errors import RemoteAccelError
from remote_accel.server.testing import Client, Ref, encode_arg


def define(client: Client, plan: int, op: str, *args, outs=(), **kwargs) -> None:
    """The first call of a plan: a RunOp that runs and keeps its template under `plan`."""
    client.send(m.RunOp(op, encode_arg(args), encode_arg(kwargs), encode_arg(tuple(outs)), False, None, plan))


def native_ops(client: Client) -> int:
    return client.stats()["native_ops_done"]


def values(*items) -> tuple:
    """RunPlanned values: Refs by storage id, CPU scalars by their bytes."""
    out = []
    for v in items:
        if isinstance(v, Ref):
            out.append(v.sid)
        elif isinstance(v, torch.Tensor):
            out.append(v.reshape(1).view(torch.uint8).numpy().tobytes())
        else:
            out.append(v)
    return tuple(out)


def test_in_place_chain_with_cpu_scalars(client):
    x = torch.randn(16)
    rx = client.upload(x)
    define(client, 1, "aten::mul_.Tensor", rx, torch.tensor(1.5))
    define(client, 2, "aten::add_.Tensor", rx, torch.tensor(-0.25))
    client.batch(*[m.RunPlanned(1 + i % 2, values(rx, torch.tensor(1.0 + i / 10))) for i in range(20)])
    expected = x * 1.5 - 0.25
    for i in range(20):
        expected = expected * (1.0 + i / 10) if i % 2 == 0 else expected + (1.0 + i / 10)
    assert client.sync() == 22
    assert native_ops(client) == 20
    torch.testing.assert_close(client.download(rx), expected)


def test_fresh_outputs_views_and_flags(client):
    base = torch.randn(6, 8)
    rb = client.upload(base)
    # a strided view with an offset as input, a fresh contiguous output
    view = rb.view((3, 4), (16, 2), offset=1)
    first, second = client.empty((3, 4)), client.empty((3, 4))
    define(client, 1, "aten::mul.Scalar", view, 2.0, outs=(first,))
    neg = view._replace(flags=2)  # a negative view (torch._neg_view) travels as a flag
    client.batch(m.RunPlanned(1, values(view, second)))
    define(client, 2, "aten::add.Scalar", neg, 1.0, outs=(client.empty((3, 4)),))
    third = client.empty((3, 4))
    client.batch(m.RunPlanned(2, values(neg, third)))
    # a promised column-major output (the plan's layout): the server copies into it
    define(client, 3, "aten::mul.Scalar", view, 2.0, outs=(client.empty((3, 4), stride=(1, 3)),))
    col = client.empty((3, 4), stride=(1, 3))
    client.batch(m.RunPlanned(3, values(view, col)))
    client.sync()
    v = base.as_strided((3, 4), (16, 2), 1)
    torch.testing.assert_close(client.download(second), v * 2)
    torch.testing.assert_close(client.download(third), -v + 1)
    torch.testing.assert_close(client.download(col), v * 2)
    assert native_ops(client) == 3


def test_out_variants_and_several_outputs(client):
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    ra, rb = client.upload(a), client.upload(b)
    out = client.upload(torch.zeros(4, 6))
    define(client, 1, "aten::mul.out", ra, rb, out=out, outs=(out,))
    out2 = client.upload(torch.zeros(4, 6))
    client.batch(m.RunPlanned(1, values(rb, rb, out2, out2)))
    vals, idx = client.empty((4,)), client.empty((4,), torch.int64)
    define(client, 2, "aten::max.dim", ra, 1, outs=(vals, idx))
    vals2, idx2 = client.empty((4,)), client.empty((4,), torch.int64)
    client.batch(m.RunPlanned(2, values(rb, vals2, idx2)))
    client.sync()
    torch.testing.assert_close(client.download(out), a * b)
    torch.testing.assert_close(client.download(out2), b * b)
    ev, ei = b.max(1)
    torch.testing.assert_close(client.download(vals2), ev)
    assert torch.equal(client.download(idx2), ei)
    assert native_ops(client) == 2


def test_scalar_arguments_are_holes(client):
    """Scalar arguments sent as SCALAR values: each RunPlanned brings its own value, in
    C++ (addcdiv_'s value, add's int alpha) and on the Python path (a generator op)."""
    p, g, v = torch.randn(6), torch.randn(6), torch.rand(6) + 0.5
    rp, rg, rv = client.upload(p), client.upload(g), client.upload(v)
    steps = [-0.01 / step for step in range(1, 6)]
    define(client, 1, "aten::addcdiv_", rp, rg, rv, value=torch_values.scalar_value(steps[0]))
    client.batch(*[m.RunPlanned(1, values(rp, rg, rv, torch_values.scalar_value(s).value[1])) for s in steps[1:]])
    expected = p.clone()
    for s in steps:
        expected.addcdiv_(g, v, value=s)
    ri = client.upload(torch.arange(4))
    out = client.empty((4,), torch.int64)
    define(client, 2, "aten::add.Tensor", ri, ri, alpha=torch_values.scalar_value(3), outs=(out,))
    out2 = client.empty((4,), torch.int64)
    client.batch(m.RunPlanned(2, values(ri, ri, torch_values.scalar_value(-2).value[1], out2)))
    client.sync()
    assert torch.equal(client.download(rp), expected)
    assert torch.equal(client.download(out), torch.arange(4) * 4)
    assert torch.equal(client.download(out2), -torch.arange(4))
    assert native_ops(client) == 5
    # a value of the wrong size for its dtype is the client's error, reported at the sync
    client.batch(m.RunPlanned(1, values(rp, rg, rv, b"\0" * 4)))
    with pytest.raises(RemoteAccelError, match="float64 scalar has 8 bytes|Double scalar has 8 bytes"):
        client.sync()
    assert torch.equal(client.download(rp), expected)  # nothing ran; the session goes on


def test_a_storage_an_op_writes_is_made_without_alloc(client):
    """A storage id the session has not seen, in an argument the op writes (out=), is made
    from the plan's layout, in C++ and on the Python path (an op with a generator); in
    an argument the op only reads it is an error, reported at the sync."""
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    ra, rb = client.upload(a), client.upload(b)
    define(client, 1, "aten::mul.out", ra, rb, out=client.upload(torch.zeros(4, 6)), outs=(None,))
    new = Ref(client.new_sid(), torch.float32, (4, 6), (6, 1))  # no ALLOC for it
    first = client.upload(torch.zeros(1000))
    before = client.stats()
    client.batch(m.RunPlanned(1, values(rb, rb, new)))
    gen = Ext(torch_values.GENERATOR, (5, 99, 0))
    client.send(m.RunOp("aten::normal.float_float_out", (0.0, 1.0, [1000]), {"generator": gen, "out": first.ext},
                        (None,), False, None, 2))
    drawn = Ref(client.new_sid(), torch.float32, (1000,), (1,))
    client.batch(m.RunPlanned(2, (drawn.sid,)))
    after = client.stats()
    assert after["storages_made"] - before["storages_made"] == 2
    assert after["alloc_requests"] == before["alloc_requests"]
    torch.testing.assert_close(client.download(new), b * b)
    assert abs(float(client.download(drawn).mean())) < 0.2
    assert after["storages"] == before["storages"] + 2 and after["memory_allocated"] >= before["memory_allocated"] + 96
    unknown = Ref(client.new_sid(), torch.float32, (4, 6), (6, 1))
    client.batch(m.RunPlanned(1, values(unknown, rb, client.empty((4, 6)))))
    with pytest.raises(RemoteAccelError, match=f"unknown storage {unknown.sid}"):
        client.sync()
    assert client.sync() > 0


def test_lists_of_tensors_in_and_out(client):
    a, b, c = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    ra, rb, rc = client.upload(a), client.upload(b), client.upload(c)
    define(client, 1, "aten::cat", [ra, rb], 0, outs=(client.empty((4, 3)),))
    catted = client.empty((4, 3))
    client.batch(m.RunPlanned(1, values(rb, rc, catted)))
    pieces = (client.empty((1, 3)), client.empty((3, 3)))
    define(client, 2, "aten::split_with_sizes_copy", catted, [1, 3], outs=(client.empty((1, 3)),
                                                                          client.empty((3, 3))))
    client.batch(m.RunPlanned(2, values(catted, *pieces)))
    client.sync()
    torch.testing.assert_close(client.download(catted), torch.cat([b, c]))
    torch.testing.assert_close(client.download(pieces[1]), torch.cat([b, c])[1:])
    assert native_ops(client) == 2


def test_optional_tensors(client):
    x = torch.randn(5, 4)
    idx = torch.tensor([3, 0, 2])
    rx, ri = client.upload(x), client.upload(idx)
    define(client, 1, "aten::index.Tensor", rx, [None, ri], outs=(client.empty((5, 3)),))
    got = client.empty((5, 3))
    client.batch(m.RunPlanned(1, values(rx, ri, got)))
    w = torch.randn(4)
    rw = client.upload(w)
    outs = (client.empty((5, 4)), client.empty((5, 1)), client.empty((5, 1)))
    define(client, 2, "aten::native_layer_norm", rx, [4], rw, None, 1e-5, outs=outs)
    outs2 = (client.empty((5, 4)), client.empty((5, 1)), client.empty((5, 1)))
    client.batch(m.RunPlanned(2, values(rx, rw, *outs2)))
    client.sync()
    torch.testing.assert_close(client.download(got), x[:, idx])
    torch.testing.assert_close(client.download(outs2[0]), torch.nn.functional.layer_norm(x, [4], w))
    assert native_ops(client) == 2


def test_plans_with_generators_run_in_python(client):
    x = client.upload(torch.zeros(1000))
    gen = Ext(torch_values.GENERATOR, (3, 1234, 0))
    client.send(m.RunOp("aten::normal_", (x.ext, 0.0, 1.0), {"generator": gen}, (), False, None, 1))
    first = client.download(x)
    client.batch(m.RunPlanned(1, (x.sid,)))
    second = client.download(x)
    assert native_ops(client) == 0 and client.sync() == 2
    assert not torch.equal(first, second)  # the stream went on
    assert abs(float(second.mean())) < 0.2


def test_an_error_mid_batch_names_the_op_and_the_session_goes_on(client):
    # A singular matrix fails linalg_inv on the host on every device (CUDA checks the
    # solver's info after it). An out-of-range index would not do here: on CUDA that is a
    # device-side assert, which ends the server (tests/e2e/test_server_death.py).
    x = torch.randn(8)
    rx = client.upload(x)
    eye, singular = client.upload(torch.eye(2) * 2), client.upload(torch.zeros(2, 2))
    inverse = client.empty((2, 2))
    define(client, 1, "aten::linalg_inv", eye, outs=(inverse,))
    acc = client.upload(torch.zeros(8))
    define(client, 2, "aten::add_.Tensor", acc, rx)
    lost, after = client.empty((2, 2)), client.empty((2, 2))
    client.batch(m.RunPlanned(2, values(acc, rx)), m.RunPlanned(1, values(singular, lost)),
                 m.RunPlanned(2, values(acc, rx)), m.RunPlanned(1, values(eye, after)))
    with pytest.raises(RemoteAccelError, match="linalg_inv") as info:
        client.sync()
    assert info.value.kind == "op"
    # the items around the failed one ran; the failed op's output is marked failed
    torch.testing.assert_close(client.download(acc), 3 * x)
    torch.testing.assert_close(client.download(after), torch.eye(2) / 2)
    client.batch(m.RunPlanned(2, values(lost.view((2, 2)), lost)))
    with pytest.raises(RemoteAccelError, match="the op that made it failed"):
        client.sync()
    assert client.sync() > 0  # the error was reported once; the session is usable


def test_freed_ids_are_reused(client):
    x = torch.randn(4)
    rx = client.upload(x)
    out = client.empty((4,))
    define(client, 1, "aten::mul.Scalar", rx, 3.0, outs=(out,))
    out2 = client.empty((4,))
    # free the output and make it again under the same id, twice, in one batch: once as a
    # fresh output, once allocated first
    client.batch(m.FreeStorage((out.sid,)), m.RunPlanned(1, values(rx, out)),
                 m.FreeStorage((out.sid,)), m.AllocStorage(out.sid, 16), m.RunPlanned(1, values(rx, out)),
                 m.RunPlanned(1, values(out, out2)))
    client.sync()
    torch.testing.assert_close(client.download(out), x * 3)
    torch.testing.assert_close(client.download(out2), x * 9)
    before = client.stats()["storages"]
    client.batch(m.FreeStorage((out.sid, rx.sid)))
    assert client.stats()["storages"] == before - 2
    assert native_ops(client) == 3


def test_two_clients_interleave(connect):
    one, two = connect(), connect()
    xs = [torch.randn(8), torch.randn(8)]
    refs = [c.upload(x) for c, x in zip((one, two), xs)]
    for c, r, scale in zip((one, two), refs, (2.0, 3.0)):
        define(c, 7, "aten::mul_.Tensor", r, torch.tensor(scale))  # the same plan id, each its own
    for i in range(10):
        for c, r in zip((one, two), refs):
            c.batch(*[m.RunPlanned(7, values(r, torch.tensor(1.01)))] * 5)
    for c, r, x, scale in zip((one, two), refs, xs, (2.0, 3.0)):
        c.sync()
        torch.testing.assert_close(c.download(r), x * scale * 1.01 ** 50)


def test_a_client_killed_mid_batch(server, client):
    script = textwrap.dedent(f"""
        import torch
        from remote_accel.dataplane import messages as m
        from remote_accel.server.testing import Client, encode_arg
        c = Client.tcp({server.tcp[0]!r}, {server.tcp[1]}, token={server.token!r})
        x = c.upload(torch.randn(64, 64))
        c.send(m.RunOp("aten::mm", encode_arg((x, x)), {{}}, encode_arg((c.empty((64, 64)),)), False, None, 1))
        for i in range(1 << 30):
            c.batch(*[m.RunPlanned(1, (x.sid, x.sid, c.new_sid())) for _ in range(200)])
            if i == 2:
                print("sending", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "sending"
        proc.kill()  # while batches are in flight and running
    finally:
        proc.wait()
    deadline = time.monotonic() + 30  # a bound on a hang, not a timing check
    while client.stats()["server_sessions"] != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = client.stats()
    assert stats["server_sessions"] == 1
    assert stats["server_memory_allocated"] == stats["memory_allocated"]
    a = client.upload(torch.ones(3))
    define(client, 1, "aten::add.Tensor", a, a, outs=(client.empty((3,)),))
    out = client.empty((3,))
    client.batch(m.RunPlanned(1, values(a, a, out)))
    assert torch.equal(client.download(out), torch.full((3,), 2.0))


def test_copy_from_between_tensors_of_the_session(client):
    # the client's name for dst.copy_(src) (PyTorch's copy_ between two remote tensors)
    b, c = torch.randn(4), torch.randn(4)
    rb, rc = client.upload(b), client.upload(c)
    dst = client.upload(torch.zeros(3, 4))
    define(client, 1, "aten::_copy_from", rb, dst, outs=(None,))  # broadcast into dst
    client.batch(m.RunPlanned(1, values(rc, dst)))
    client.sync()
    torch.testing.assert_close(client.download(dst), c.expand(3, 4))
    assert native_ops(client) == 1
