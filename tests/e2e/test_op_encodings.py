"""The fallback's cached RunOp encodings (fallback._Encoding), against a real server.

After the first call of an op on given argument metadata, later calls only fill storage
ids and CPU scalars into a cached encoding. It must say exactly what encoding the call
afresh says, and never replay a value of an earlier call.
"""

from __future__ import annotations

import pytest
import torch

import remote_accel
from remote_accel.dataplane import codec
from remote_accel.dataplane import messages as m
from remote_accel.dataplane import torch_values
from remote_accel.pytorch_ext import fallback, runtime
from remote_accel.server.testing import ServerProcess


@pytest.fixture(scope="module")
def session():
    with ServerProcess() as server:
        remote_accel.init(transport="tcp", server="%s:%d" % server.tcp, token=server.token)
        yield runtime.sessions()[0]
        remote_accel.shutdown()


def _queued_runops(session) -> list:
    """The RunOps queued since the last flush, decoded, then sent."""
    items = [codec.decode(bytes(i)) if isinstance(i, codec.Raw) else i for i in session._items]
    session.flush()
    return [m.from_fields(m.RunOp, tuple(fields)) for kind, fields in items if kind == m.RunOp.TYPE]


def _blank_ids(value):
    """A decoded value with every tensor reference's storage id set to 0."""
    if isinstance(value, m.RunOp):
        return (value.op, _blank_ids(value.args), _blank_ids(value.kwargs), _blank_ids(value.outs))
    if isinstance(value, codec.Ext):
        inner = value.value
        if value.code == torch_values.TENSOR:
            inner = (0,) + tuple(inner[1:])
        return (value.code, _blank_ids(inner))
    if isinstance(value, (list, tuple)):
        return tuple(_blank_ids(v) for v in value)
    if isinstance(value, dict):
        return {k: _blank_ids(v) for k, v in value.items()}
    return value


def test_a_cached_encoding_says_what_a_fresh_one_says(session):
    a = torch.randn(4, 5, device="remote_accel")
    b = torch.randn(4, 5, device="remote_accel")[1:]  # a view: another offset
    session.flush()
    fallback._encodings.clear()
    first = torch.addcmul(a[1:], b, b, value=0.5)
    fresh = _queued_runops(session)
    again = torch.addcmul(a[1:], b, b, value=0.5)
    cached = _queued_runops(session)
    assert any(type(e) is fallback._Encoding for e in fallback._encodings.values())
    assert [_blank_ids(r) for r in cached] == [_blank_ids(r) for r in fresh]
    last = fresh[-1], cached[-1]  # addcmul.out(self, tensor1, tensor2, value=, out=)
    assert last[0].args[1].value[0] == last[1].args[1].value[0]  # b: the same storage
    assert last[0].kwargs["out"].value[0] != last[1].kwargs["out"].value[0]  # a new result
    torch.testing.assert_close(again.cpu(), first.cpu())
    torch.testing.assert_close(again.cpu(), torch.addcmul(a.cpu()[1:], b.cpu(), b.cpu(), value=0.5))


def test_scalars_are_never_replayed(session):
    x = torch.zeros(3, device="remote_accel")
    for step in range(1, 6):  # wrapped numbers: CPU scalars filled in per call
        x.add_(float(step))
    assert x.cpu().tolist() == [15.0] * 3
    for value in (0.0, -0.0, 2.5):  # Scalar arguments: part of the cache key, -0.0 too
        x.fill_(value)
        assert torch.equal(torch.signbit(x).cpu(), torch.signbit(torch.full((3,), value)))
        assert x.cpu().tolist() == [value] * 3


def test_every_call_names_its_own_tensors(session):
    xs = [torch.full((2, 2), float(i), device="remote_accel") for i in range(4)]
    outs = [x * x + x for x in xs]  # one cached encoding per op, four different storages
    assert [o.cpu()[0, 0].item() for o in outs] == [i * i + i for i in range(4)]
