"""Backward passes whose gradients once went wrong on the device, each against CPU's:
transposed convolutions with a bias (the bias gradient's size), and ops whose formulas
make PyTorch's storage-less zero tensors (`_efficientzerotensor`). A real CPU server
process over TCP.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn


R = "remote_accel"


def _grads(module, inputs):
    out = module(inputs)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.device))
    return out, inputs.grad, [p.grad for p in module.parameters()]


@pytest.mark.parametrize("cls, in_ch, out_ch, kwargs", [
    (nn.ConvTranspose1d, 4, 6, {"groups": 2, "stride": 2}),
    (nn.ConvTranspose1d, 3, 5, {}),
    (nn.ConvTranspose2d, 3, 5, {"stride": 2, "output_padding": 1}),
    (nn.ConvTranspose2d, 6, 4, {"groups": 2, "padding": 1}),
    (nn.ConvTranspose2d, 6, 9, {"groups": 3, "dilation": 2}),
    (nn.ConvTranspose3d, 4, 2, {"groups": 2}),
    (nn.ConvTranspose3d, 2, 3, {"stride": 2}),
    (nn.Conv2d, 6, 4, {"groups": 2}),  # the plain convolution's bias gradient, unchanged
])
def test_transposed_convolution_gradients(remote, cls, in_ch, out_ch, kwargs):
    torch.manual_seed(0)
    cpu = cls(in_ch, out_ch, 3, bias=True, **kwargs)
    dev = copy.deepcopy(cpu).to(R)
    dims = {nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2, nn.ConvTranspose3d: 3, nn.Conv2d: 2}[cls]
    x = torch.randn(2, in_ch, *([5] * dims), requires_grad=True)
    want = _grads(cpu, x)
    # twice: the second call is served from the plans the first made (csrc/op_queue.cpp)
    for _ in range(2):
        dev.zero_grad()
        got = _grads(dev, x.detach().to(R).requires_grad_())
        torch.testing.assert_close(torch.utils._pytree.tree_map(lambda t: t.cpu(), got), want,
                                   rtol=1e-4, atol=1e-4)
    assert dev.bias.grad.shape == (out_ch,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
@pytest.mark.parametrize("fn", [torch.sgn, torch.abs, lambda t: torch.sgn(t) * t.abs() ** 2, torch.angle],
                         ids=["sgn", "abs", "sgn*abs2", "angle"])
def test_gradients_through_zero_tensors(remote, fn, dtype):
    torch.manual_seed(1)
    x = torch.randn(7, dtype=dtype)
    x[3] = 0  # where sgn's and abs's formulas special-case zero
    leaf = x.clone().requires_grad_()
    fn(leaf).abs().sum().backward()
    for _ in range(2):
        dev = x.to(R).requires_grad_()
        fn(dev).abs().sum().backward()
        torch.testing.assert_close(dev.grad.cpu(), leaf.grad)


def test_efficient_zero_tensor_on_the_device(remote):
    z = torch._efficientzerotensor((2, 3), dtype=torch.complex64, device=R)
    assert torch.equal(z.cpu(), torch.zeros(2, 3, dtype=torch.complex64))
    assert torch.equal((z + 1).cpu(), torch.ones(2, 3, dtype=torch.complex64))
    assert repr(torch._efficientzerotensor(3, device=R)) == "tensor([0., 0., 0.], device='remote_accel:0')"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [lambda: nn.LayerNorm(3), lambda: nn.GroupNorm(2, 6), lambda: nn.BatchNorm1d(6)],
                         ids=["layer_norm", "group_norm", "batch_norm"])
def test_reduced_precision_norms_match_cpu_kernels(remote, make, dtype):
    # the server runs CPU's fused kernels (float32 accumulation), not a decomposition in
    # the input's precision, and its statistics come back in the dtype CPU gives them
    torch.manual_seed(2)
    cpu = make().to(dtype)
    dev = copy.deepcopy(cpu).to(R)
    x = torch.randn(4, 6, 3, dtype=dtype) * 5 + 3
    want = _grads(cpu, x.clone().requires_grad_())
    got = _grads(dev, x.to(R).requires_grad_())
    torch.testing.assert_close(torch.utils._pytree.tree_map(lambda t: t.cpu(), got), want, rtol=0, atol=0)
    x = x.to(R)
    out, mean, rstd = torch.ops.aten.native_layer_norm(x, [3], None, None, 1e-5)
    assert mean.dtype == rstd.dtype == dtype  # as on CPU
