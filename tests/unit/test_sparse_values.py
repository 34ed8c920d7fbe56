"""Sparse tensors as message values (torch_wire.sparse): encoded as their components,
decoded through the codec, rebuilt with their invariants checked; anything malformed or
inconsistent is a ProtocolError, never a tensor that a kernel would read out of bounds."""

from __future__ import annotations

import pytest
import torch

from remote_accel.dataplane import codec
from remote_accel.dataplane.codec import Ext
from remote_accel.errors import ProtocolError
from remote_accel.torch_wire import sparse as wire
from remote_accel.torch_wire import values as tv

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")


class Components:
    """Plays the storage table: a component travels as an index into `tensors`."""

    def __init__(self):
        self.tensors: list = []

    def ref(self, t: torch.Tensor) -> Ext:
        if wire.is_sparse(t):  # as the client's handles.tensor_ref does
            return wire.encode(t, self.ref)
        self.tensors.append(t)
        return Ext(tv.TENSOR, len(self.tensors) - 1)

    def resolve(self, code: int, payload):
        assert code == tv.SPARSE
        return wire.decode(payload, lambda ref: self.tensors[ref])


def _round_trip(t: torch.Tensor) -> torch.Tensor:
    parts = Components()
    encoded = codec.encode(tv.encode_value(t, parts.ref))
    return tv.decode_value(codec.decode(encoded), parts.resolve)


@pytest.mark.parametrize("make", [
    lambda x: x.to_sparse(), lambda x: x.to_sparse(1), lambda x: x.to_sparse_csr(), lambda x: x.to_sparse_csc(),
    lambda x: x.to_sparse_bsr((2, 2)), lambda x: x.to_sparse_bsc((2, 3)),
])
def test_every_sparse_layout_round_trips(make):
    x = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0, 4.0],
                      [0.0, 0.0, 5.0, 0.0, 0.0, 0.0], [0.0, 6.0, 0.0, 0.0, 0.0, 0.0]])
    t = make(x)
    back = _round_trip(t)
    assert back.layout == t.layout and back.shape == t.shape
    assert torch.equal(back.to_dense(), x)
    for got, want in zip(wire.components(back), wire.components(t)):
        assert torch.equal(got, want)


def test_coalesced_flag_and_requires_grad_travel():
    t = torch.sparse_coo_tensor(torch.tensor([[0, 0], [1, 1]]), torch.tensor([1.0, 2.0]), (2, 2),
                                check_invariants=True)
    assert not _round_trip(t).is_coalesced()
    assert _round_trip(t.coalesce()).is_coalesced()
    leaf = t.coalesce().requires_grad_()
    assert _round_trip(leaf).requires_grad
    with torch.no_grad():  # an op run without grad mode says so: the server runs it so
        assert not _round_trip(leaf).requires_grad


def _payload(layout="sparse_coo", size=(3, 4), parts=None, coalesced=False, grad=False):
    table = Components()
    if parts is None:
        parts = (torch.tensor([[0, 2], [1, 3]]), torch.tensor([1.0, 2.0]))
    refs = tuple(table.ref(p) for p in parts)
    return (layout, size, refs, coalesced, grad), table


@pytest.mark.parametrize("change, message", [
    (lambda p: p[:4], "malformed sparse tensor"),
    (lambda p: ("strided",) + p[1:], "malformed sparse tensor"),
    (lambda p: ("sparse_hex",) + p[1:], "malformed sparse tensor"),
    (lambda p: p[:3] + (1, False), "malformed sparse tensor"),
    (lambda p: p[:4] + ("yes",), "malformed sparse tensor"),
    (lambda p: (p[0], (3, -4)) + p[2:], "malformed sparse size"),
    (lambda p: p[:2] + (p[2][:1],) + p[3:], "malformed sparse tensor components"),
    (lambda p: p[:2] + ((1, 2),) + p[3:], "malformed sparse tensor components"),
    (lambda p: (p[0], (2, 4)) + p[2:], "invalid sparse tensor"),  # row index 2 of 2 rows
    (lambda p: p[:3] + (True,) + p[4:], "invalid sparse tensor"),  # (0, 1) twice, claimed coalesced
])
def test_malformed_or_inconsistent_payloads_are_refused(change, message):
    payload, table = _payload(parts=(torch.tensor([[0, 2, 0], [1, 3, 1]]), torch.tensor([1.0, 2.0, 3.0])))
    with pytest.raises(ProtocolError, match=message):
        wire.decode(change(payload), lambda ref: table.tensors[ref])


@pytest.mark.parametrize("crow, col", [
    ([0, 2, 1, 3], [0, 1, 2]),  # compressed indices go down
    ([0, 1, 2, 3], [0, 1, 9]),  # a column past the size
    ([0, 1, 2, 7], [0, 1, 2]),  # more elements than values
])
def test_compressed_invariants_are_checked(crow, col):
    payload, table = _payload("sparse_csr", (3, 4), (torch.tensor(crow), torch.tensor(col), torch.ones(3)))
    with pytest.raises(ProtocolError, match="invalid sparse tensor"):
        wire.decode(payload, lambda ref: table.tensors[ref])
