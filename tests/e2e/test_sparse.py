"""Sparse COO and CSR tensors on remote_accel against the same on CPU, with a real server
process: made on the device, read back (cpu, to_dense, print), computed on by the server,
and differentiated through; bad sparse input is refused with an error, and the server
lives on."""

from __future__ import annotations

import pytest
import torch

import remote_accel
from remote_accel.dataplane.codec import Ext
from remote_accel.errors import RemoteAccelError
from remote_accel.pytorch_ext import handles, runtime
from remote_accel.server.testing import ServerProcess
from remote_accel.torch_wire import sparse as wire
from remote_accel.torch_wire import values as tv

R = "remote_accel"
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")


@pytest.fixture(scope="module")
def server():
    with ServerProcess() as proc:
        host, port = proc.tcp
        remote_accel.init(transport="tcp", server=f"{host}:{port}", token=proc.token)
        try:
            yield proc
        finally:
            remote_accel.shutdown()


def _dense(seed: int, shape=(4, 5)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    return x * (torch.rand(shape, generator=gen) < 0.4)  # mostly zeros


def test_to_sparse_matches_cpu(server):
    x = _dense(0)
    for args in ((), (1,)):
        want = x.to_sparse(*args)
        got = x.to(R).to_sparse(*args)
        assert got.device.type == R and got.layout == torch.sparse_coo
        assert (got.sparse_dim(), got.dense_dim(), got._nnz()) == (want.sparse_dim(), want.dense_dim(), want._nnz())
        assert got.is_coalesced() == want.is_coalesced()
        back = got.cpu()
        assert back.layout == torch.sparse_coo and back.device.type == "cpu"
        assert torch.equal(back._indices(), want._indices())
        assert torch.equal(back._values(), want._values())
        assert torch.equal(got.to_dense().cpu(), x)


def test_to_sparse_gradients_match_cpu(server):
    x = _dense(1)
    seed = torch.randn(x.shape)
    a = x.clone().requires_grad_()
    (a.to_sparse().to_dense() * 3).backward(seed)
    b = x.to(R).requires_grad_()
    (b.to_sparse().to_dense() * 3).backward(seed.to(R))
    assert torch.allclose(b.grad.cpu(), a.grad)
    # gradient through the sparse values (to_sparse's backward gets a sparse gradient)
    a.grad = b.grad = None
    torch.sparse.sum(a.to_sparse() * 2).backward()
    torch.sparse.sum(b.to_sparse() * 2).backward()
    assert torch.allclose(b.grad.cpu(), a.grad)


def test_coalesce_and_arithmetic_on_the_server(server):
    indices = torch.tensor([[0, 2, 0, 1], [1, 0, 1, 3]])  # (0, 1) twice: not coalesced
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    want = torch.sparse_coo_tensor(indices, values, (3, 4), check_invariants=True)
    got = torch.sparse_coo_tensor(indices.to(R), values.to(R), (3, 4), check_invariants=True)
    assert got.device.type == R and not got.is_coalesced()
    c = got.coalesce()
    assert c.is_coalesced() and c._nnz() == 3
    assert torch.equal(c.cpu()._indices(), want.coalesce()._indices())
    assert torch.equal(c.cpu()._values(), want.coalesce()._values())
    dense = torch.randn(4, 2)
    assert torch.allclose(torch.sparse.mm(got, dense.to(R)).cpu(), torch.sparse.mm(want, dense))
    assert torch.allclose((got + got).to_dense().cpu(), (want + want).to_dense())
    assert torch.allclose((got * 2.5).to_dense().cpu(), (want * 2.5).to_dense())


def test_printing_shows_indices_values_and_device(server):
    s = torch.tensor([[0.0, 1.5], [2.5, 0.0]]).to(R).to_sparse()
    text = str(s)
    assert "indices=tensor([[0, 1]," in text and "values=tensor([1.5000, 2.5000])" in text
    assert "device='remote_accel:0'" in text and "layout=torch.sparse_coo" in text


def test_sparse_tensors_move_both_ways(server):
    x = _dense(2)
    for to_sparse in (torch.Tensor.to_sparse, torch.Tensor.to_sparse_csr):
        local = to_sparse(x)
        remote = local.to(R)
        assert remote.device.type == R and remote.layout == local.layout
        assert torch.equal(remote.to_dense().cpu(), x)
        assert torch.equal(remote.cpu().to_dense(), x)


def test_csr_matches_cpu(server):
    x = _dense(3)
    want = x.to_sparse_csr()
    got = x.to(R).to_sparse_csr()
    assert got.layout == torch.sparse_csr and got.device.type == R
    assert torch.equal(got.crow_indices().cpu(), want.crow_indices())
    assert torch.equal(got.col_indices().cpu(), want.col_indices())
    assert torch.equal(got.values().cpu(), want.values())
    assert torch.equal(got.to_dense().cpu(), x)
    assert "layout=torch.sparse_csr" in str(got)


def test_sampled_addmm_with_gradients_matches_cpu(server):
    mask = torch.eye(4, 5)
    m1, m2 = torch.randn(4, 3), torch.randn(3, 5)

    def run(device):
        s = mask.to(device).to_sparse_csr().requires_grad_()
        a, b = m1.to(device).requires_grad_(), m2.to(device).requires_grad_()
        out = torch.sparse.sampled_addmm(s, a, b, alpha=0.5, beta=0.3)
        assert out.layout == torch.sparse_csr
        out.to_dense().sum().backward()
        return out.to_dense().cpu(), a.grad.cpu(), b.grad.cpu()

    for got, want in zip(run(R), run("cpu")):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("reduce", ["sum", "mean", "amax", "amin"])
def test_mm_with_reduce_and_gradients_matches_cpu(server, reduce):
    a, b = _dense(4, (5, 5)), torch.randn(5, 3)

    def run(device):
        s = a.to(device).to_sparse_csr().requires_grad_()
        other = b.to(device).requires_grad_()
        out = torch.sparse.mm(s, other, reduce)
        out.backward(torch.ones(out.shape, device=device))
        return out.cpu(), s.grad.to_dense().cpu(), other.grad.cpu()

    for got, want in zip(run(R), run("cpu")):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adagrad])
def test_embedding_with_sparse_gradients_trains_as_on_cpu(server, optimizer):
    def train(device):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4, sparse=True).to(device)
        opt = optimizer(emb.parameters(), lr=0.1)
        idx = torch.tensor([[1, 2, 4], [4, 3, 9]]).to(device)
        for _ in range(3):
            opt.zero_grad()
            emb(idx).pow(2).sum().backward()
            assert emb.weight.grad.layout == torch.sparse_coo and emb.weight.grad.device.type == device
            opt.step()
        return emb.weight.detach().cpu(), emb.weight.grad.to_dense().cpu()

    for got, want in zip(train(R), train("cpu")):
        torch.testing.assert_close(got, want)


def test_unsupported_sparse_op_is_a_clear_error_and_the_server_lives_on(server):
    s = _dense(5).to(R).to_sparse()
    with pytest.raises(RemoteAccelError, match="view"):
        s.view(-1)
    with pytest.raises(RuntimeError, match="cannot mix in a torch.sparse_coo tensor on cpu"):
        torch.sparse.mm(_dense(5).to_sparse(), torch.ones(5, 2, device=R))
    assert torch.equal(s.to_dense().cpu(), _dense(5))  # the session goes on


def test_server_refuses_a_sparse_tensor_with_indices_out_of_range(server):
    session = runtime.session(0)
    indices = torch.tensor([[0, 7], [1, 1]]).to(R)  # row 7 of a 3-row tensor
    values = torch.tensor([1.0, 2.0]).to(R)
    bad = Ext(wire.SPARSE, ("sparse_coo", (3, 4), (handles.tensor_ref(indices, 0), handles.tensor_ref(values, 0)), False, False))
    with pytest.raises(RemoteAccelError, match="invalid sparse tensor"):
        session.run_with_reply("aten::_to_dense", (bad,), {}, ((-(1 << 40), -(1 << 40) - 1, -(1 << 40) - 2),))
    malformed = Ext(wire.SPARSE, ("sparse_coo", (3, 4), (1, 2), False, False))
    with pytest.raises(RemoteAccelError, match="malformed sparse tensor"):
        session.run_with_reply("aten::_to_dense", (malformed,), {}, ((-(1 << 40) - 3,),))
    assert torch.equal(values.cpu(), torch.tensor([1.0, 2.0]))  # the server lives on


def test_server_refuses_a_forged_argmax_for_mm_reduce_backward(server):
    s = _dense(6, (5, 5)).to(R).to_sparse_csr()
    other, grad = torch.randn(5, 3, device=R), torch.ones(5, 3, device=R)
    forged = torch.full((5, 3), 1 << 30, dtype=torch.int64, device=R)
    with pytest.raises(RemoteAccelError, match="arg_out"):
        torch.ops.aten._sparse_mm_reduce_impl_backward(s, grad, other, "amax", forged, [True, True])
    with pytest.raises(RemoteAccelError, match="arg_out"):
        torch.ops.aten._sparse_mm_reduce_impl_backward(s, grad, other, "amax", forged[:0], [True, True])
    assert torch.equal(grad.cpu(), torch.ones(5, 3))


def test_layout_names_round_trip():
    for layout in wire.SPARSE_LAYOUTS:
        assert tv.LAYOUTS[tv.LAYOUT_NAMES[layout]] is layout
