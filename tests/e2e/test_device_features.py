"""What users do with the remote_accel device, each checked against the same code on CPU.

Two real server processes (CPU) serve `remote_accel:0` and `remote_accel:1` over TCP.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import remote_accel
from remote_accel.server.testing import ServerProcess


@pytest.fixture(scope="module")
def remote():
    with ServerProcess(token="shared") as a, ServerProcess(token="shared") as b:
        remote_accel.init(transport="tcp", servers=[f"{a.tcp[0]}:{a.tcp[1]}", f"{b.tcp[0]}:{b.tcp[1]}"],
                          token="shared")
        yield a, b
        remote_accel.shutdown()


R = "remote_accel"


def test_device_module_mirrors_cuda(remote):
    assert torch.remote_accel.is_available()
    assert torch.remote_accel.device_count() == 2
    assert torch.remote_accel.current_device() == 0
    with torch.remote_accel.device(1):
        assert torch.remote_accel.current_device() == 1
        assert torch.empty(2, device=R).device == torch.device("remote_accel:1")
    assert torch.remote_accel.current_device() == 0
    before = torch.remote_accel.memory_allocated()
    x = torch.ones(1024, 1024, device=R)
    torch.remote_accel.synchronize()
    assert torch.remote_accel.memory_allocated() >= before + 4 * 1024 * 1024
    assert torch.remote_accel.max_memory_allocated() >= torch.remote_accel.memory_allocated()
    del x
    torch.remote_accel.empty_cache()
    torch.remote_accel.synchronize()


def test_factories(remote):
    torch.manual_seed(0)
    cases = {
        "zeros": lambda d: torch.zeros(3, 4, device=d),
        "ones": lambda d: torch.ones(5, dtype=torch.int64, device=d),
        "full": lambda d: torch.full((2, 2), 7.5, device=d),
        "arange": lambda d: torch.arange(0, 10, 3, device=d),
        "linspace": lambda d: torch.linspace(0, 1, 11, device=d),
        "eye": lambda d: torch.eye(4, device=d),
        "empty_like+fill": lambda d: torch.empty_like(torch.zeros(3, device=d)).fill_(2),
        "tensor": lambda d: torch.tensor([[1, 2], [3, 4]], device=d),
    }
    for name, make in cases.items():
        got = make(R)
        assert got.device.type == R, name
        torch.testing.assert_close(got.cpu(), make("cpu"), msg=name)


def test_to_and_back_both_ways_non_blocking(remote):
    x = torch.randn(64, 33)
    r = x.to(R, non_blocking=True)
    assert r.is_remote_accel
    back = r.to("cpu", non_blocking=True)
    torch.remote_accel.synchronize()
    assert torch.equal(back, x)
    assert torch.equal(x.remote_accel().cpu(), x)
    # strided and non-contiguous sources and destinations
    assert torch.equal(x.t().to(R).cpu(), x.t())
    dst = torch.zeros(33, 64, device=R)
    dst.t().copy_(x)
    assert torch.equal(dst.cpu(), x.t())
    out = torch.empty(64, 33).t()
    out.copy_(r.t())
    assert torch.equal(out, x.t())
    assert torch.equal(r.to(torch.float64).cpu(), x.double())


def test_in_place_and_out(remote):
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    ra, rb = a.to(R), b.to(R)
    out = torch.empty(4, 5, device=R)
    torch.add(ra, rb, alpha=2, out=out)
    assert torch.allclose(out.cpu(), a + 2 * b)
    resized = torch.empty(0, device=R)
    torch.mul(ra, rb, out=resized)  # out= of another shape is resized, as in eager
    assert resized.shape == (4, 5) and torch.allclose(resized.cpu(), a * b)
    ra.mul_(3).sub_(rb)
    assert torch.allclose(ra.cpu(), a * 3 - b)
    values, indices = torch.empty(0, device=R), torch.empty(0, dtype=torch.long, device=R)
    torch.sort(rb, dim=1, out=(values, indices))
    want = torch.sort(b, dim=1)
    assert torch.equal(values.cpu(), want.values) and torch.equal(indices.cpu(), want.indices)


def test_views_alias_their_base(remote):
    x = torch.arange(24.0).reshape(2, 3, 4)
    r = x.to(R)
    for fn in (lambda t: t[1], lambda t: t.transpose(0, 2), lambda t: t.narrow(2, 1, 2),
               lambda t: t.view(6, 4)[::2], lambda t: t.unsqueeze(0).expand(3, 2, 3, 4)[1],
               lambda t: t.permute(2, 0, 1).diagonal(dim1=1, dim2=2)):
        fn(r).add_(1)
        fn(x).add_(1)
        assert torch.equal(r.cpu(), x)
    a, b = r.chunk(2, dim=2)
    a.zero_()
    x.chunk(2, dim=2)[0].zero_()
    assert torch.equal(r.cpu(), x) and torch.equal(b.cpu(), x.chunk(2, dim=2)[1])


def test_multi_output_ops(remote):
    x = torch.randn(6, 7)
    r = x.to(R)
    for name, fn in {
        "topk": lambda t: t.topk(3, dim=1),
        "max": lambda t: t.max(dim=0),
        "sort": lambda t: t.sort(descending=True),
        "split": lambda t: t.split([2, 4], dim=0),
        "unbind": lambda t: t.unbind(1),
        "aminmax": lambda t: torch.aminmax(t, dim=1),
        "var_mean": lambda t: torch.var_mean(t, dim=0),
    }.items():
        for got, want in zip(fn(r), fn(x)):
            torch.testing.assert_close(got.cpu(), want, msg=name)


def test_conjugate_and_negative_views(remote):
    z = torch.randn(5, dtype=torch.complex64)
    r = z.to(R)
    assert r.conj().is_conj()
    torch.testing.assert_close(r.conj().cpu(), z.conj())
    torch.testing.assert_close((r.conj() * r).cpu(), z.conj() * z)
    torch.testing.assert_close(torch._neg_view(r).cpu(), -z)
    torch.testing.assert_close(r.conj().imag.cpu(), z.conj().imag)
    c = r.clone()
    c.conj().mul_(2)  # in place through a conjugate view
    torch.testing.assert_close(c.cpu(), z * 2)


def test_autograd_and_double_backward(remote):
    x = torch.randn(5, requires_grad=True)
    rx = x.detach().to(R).requires_grad_()
    for t in (x, rx):
        y = (t ** 3).sum()
        (g,) = torch.autograd.grad(y, t, create_graph=True)
        g.sum().backward()
    torch.testing.assert_close(rx.grad.cpu(), x.grad)  # 6 x
    torch.testing.assert_close(rx.grad.cpu(), 6 * x.detach())


@pytest.mark.parametrize("opt_cls,kwargs", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True}),
    (torch.optim.Adam, {"lr": 0.01, "foreach": False}),
    (torch.optim.Adam, {"lr": 0.01, "fused": True}),
    (torch.optim.AdamW, {"lr": 0.01, "foreach": True}),
    (torch.optim.AdamW, {"lr": 0.01, "fused": True}),
])
def test_optimizers_match_cpu(remote, opt_cls, kwargs):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(16, 6), torch.randn(16, 1)
    results = []
    for device in ("cpu", R):
        m = copy.deepcopy(model).to(device)
        opt = opt_cls(m.parameters(), **kwargs)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(m(x.to(device)), y.to(device)).backward()
            opt.step()
        results.append([p.detach().cpu() for p in m.parameters()])
    for local, remote_p in zip(*results):
        torch.testing.assert_close(remote_p, local, rtol=1e-5, atol=1e-6)


def test_state_dict_save_and_load_with_map_location(remote, tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).to(R)
    model(torch.randn(8, 4, device=R))  # moves the running stats
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    on_device = torch.load(buf, map_location=R)
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    for key, value in model.state_dict().items():
        assert on_device[key].device.type == R
        assert torch.equal(on_device[key].cpu(), value.cpu()) and torch.equal(on_cpu[key], value.cpu())
    fresh = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).to(R)
    fresh.load_state_dict(on_device)
    assert torch.equal(fresh[0].weight.cpu(), model[0].weight.cpu())


def test_generator_on_the_device(remote):
    g = torch.Generator(device=R)
    assert g.device.type == R
    g.manual_seed(42)
    a = torch.randn(50, device=R, generator=g).cpu()
    b = torch.rand(50, device=R, generator=g).cpu()
    g.manual_seed(42)
    assert torch.equal(torch.randn(50, device=R, generator=g).cpu(), a)
    assert torch.equal(torch.rand(50, device=R, generator=g).cpu(), b)
    state = g.get_state()
    c = torch.randn(10, device=R, generator=g).cpu()
    g.set_state(state)
    assert torch.equal(torch.randn(10, device=R, generator=g).cpu(), c)
    torch.remote_accel.manual_seed(7)
    d = torch.randn(10, device=R).cpu()
    torch.remote_accel.manual_seed(7)
    assert torch.equal(torch.randn(10, device=R).cpu(), d)
    rng = torch.remote_accel.get_rng_state()
    e = torch.randn(10, device=R).cpu()
    torch.remote_accel.set_rng_state(rng)
    assert torch.equal(torch.randn(10, device=R).cpu(), e)


def test_autocast_lowers_matmul_precision(remote):
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    ra, rb = a.to(R), b.to(R)
    with torch.autocast(R, dtype=torch.bfloat16):
        got = ra @ rb
        summed = (ra + rb)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = a @ b
    assert got.dtype == want.dtype == torch.bfloat16
    assert summed.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want)


def test_two_servers(remote):
    x = torch.randn(10, 3)
    r0 = x.to("remote_accel:0")
    r1 = r0.to("remote_accel:1")
    assert r1.device == torch.device("remote_accel:1")
    assert torch.equal(r1.cpu(), x)
    back = (r1 * 2).to("remote_accel:0")
    assert back.device.index == 0 and torch.equal(back.cpu(), x * 2)
    with pytest.raises(RuntimeError):
        r0 + r1  # like CUDA, tensors on two devices do not mix
    m = nn.Linear(3, 2).to("remote_accel:1")
    assert m(r1).device.index == 1


def test_printing_and_sync_points(remote):
    x = torch.arange(6.0).reshape(2, 3)
    r = x.to(R)
    assert repr(r) == repr(x).replace(")", ", device='remote_accel:0')")
    assert (r.sum() > 10).item() is True and r.max().item() == 5.0
    if r.mean() > 2:
        pass
    else:
        raise AssertionError("bool(tensor) on the device")
    assert r.tolist() == x.tolist()
    assert torch.equal(torch.nonzero(r > 2).cpu(), torch.nonzero(x > 2))
    assert torch.equal(r[r > 2].cpu(), x[x > 2])


def test_downloads_of_views_with_odd_strides(remote):
    # contiguous views whose size-1 dims keep their base's strides, 0-dim and empty ones
    x = torch.arange(60.0).reshape(3, 4, 5)
    r = x.to(R)
    views = {
        "one element, row stride": lambda t: t[0, :1, 2],
        "one element, 2-d": lambda t: t[1, 2:3, 3:4],
        "transposed one element": lambda t: t[0, :1, 2:3].t(),
        "size-1 leading dims": lambda t: t[1:2, 3:4, :],
        "0-dim": lambda t: t[2, 1, 4],
        "empty": lambda t: t[:0, 1],
        "empty, 3-d": lambda t: t[:, :0, 1:2],
        "bool": lambda t: (t > 30)[2, :1, 3],
        "int64": lambda t: t.long()[1, 2:3, 4:5],
    }
    for name, view in views.items():
        got, want = view(r), view(x)
        back = got.cpu()
        assert back.shape == want.shape and back.dtype == want.dtype, name
        assert torch.equal(back, want), name
        assert repr(got).replace(", device='remote_accel:0'", "") == repr(want), name
    # and uploads into such views
    dst = torch.zeros(3, 4, 5, device=R)
    dst[0, :1, 2].copy_(torch.tensor([7.0]))
    dst[2, 1, 4] = 9.0
    want = torch.zeros(3, 4, 5)
    want[0, 0, 2], want[2, 1, 4] = 7.0, 9.0
    assert torch.equal(dst.cpu(), want)


def test_out_kernels_that_flip_the_conj_bit(remote):
    # CPU's linalg_lu_solve.out (which the functional call reaches for this device) marks
    # its out= tensor conjugated instead of writing the values
    torch.manual_seed(3)
    a = torch.randn(3, 3, dtype=torch.complex64)
    lu, piv = torch.linalg.lu_factor(a)
    b = torch.randn(4, 3, dtype=torch.complex64)
    for left, adjoint, rhs in ((False, True, b), (False, False, b), (True, True, b.mT)):
        want = torch.linalg.lu_solve(lu, piv, rhs, left=left, adjoint=adjoint)
        got = torch.linalg.lu_solve(lu.to(R), piv.to(R), rhs.to(R), left=left, adjoint=adjoint)
        torch.testing.assert_close(got.cpu(), want)
        out = torch.empty_like(want, device=R)
        torch.linalg.lu_solve(lu.to(R), piv.to(R), rhs.to(R), left=left, adjoint=adjoint, out=out)
        torch.testing.assert_close(out.cpu(), want)
