"""How the server runs an op that its device has no kernel for: as a decomposition.

The client sends every op that reaches its PrivateUse1 fallback. Some of them are ops
that PyTorch's composite kernels pick for any non-CPU device and that have CUDA kernels
only: `nn.LSTM` and `nn.GRU` on remote_accel call `_thnn_fused_lstm_cell` and
`_thnn_fused_gru_cell` (and autograd their `_backward` ops) because the client's tensors
are not CPU tensors. A CPU server has no kernel for them. Calling the op there would fail,
so `ops.resolve` runs a decomposition instead, chosen in this order:

1. TABLE below: ops torch._decomp does not cover (the fused RNN cells and their
   backward ops), or covers with a call to another op the server lacks (torch._decomp's
   `addmm.dtype` calls `mm.dtype`);
2. `torch._decomp.decomposition_table` (PyTorch's own, e.g. `_fused_dropout`).

Only ops with no kernel for the server's device (its dense key, nor the sparse,
quantized, nested or mkldnn keys of that backend, whose ops are served for those tensors)
are decomposed: on a CUDA server the fused cells run their own kernels. A composite op
(CompositeImplicitAutograd or CompositeExplicitAutograd) always has a kernel for every
device, so it never needs one here. An op with neither a kernel nor a decomposition keeps
the dispatcher's own error ("Could not run ... with arguments from the 'CPU' backend").
tests/server/no_cpu_kernel_ops.txt lists the aten ops without a CPU kernel and what a
CPU server does with each (scripts/list_no_cpu_kernel_ops.py writes it).

The RNN cells follow the CUDA kernels (aten/src/ATen/native/cuda/RNN.cu): same results,
same workspace layout (the client's meta kernel promises its shape, and the backward op
reads it), float16/bfloat16 computed in float32 as CUDA's accumulate type is.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch._decomp

aten = torch.ops.aten

#: Per backend key, the other keys whose kernels serve that device's tensors.
_KEY_FAMILY = ("", "Sparse", "SparseCsr", "Quantized", "NestedTensor", "Mkldnn")


def has_kernel(name: str, device_type: str) -> bool:
    """Whether calling the op `name` ("aten::mm.dtype") with tensors of `device_type` finds a
    kernel (composite and fallback kernels included: the dispatcher's computed table)."""
    backend = torch._C._dispatch_key_for_device(device_type)  # "cpu" -> "CPU", "cuda" -> "CUDA"
    for prefix in _KEY_FAMILY:
        try:
            if torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, prefix + backend):
                return True
        except RuntimeError:  # no such key for this backend (MkldnnCUDA)
            continue
    return False


def find(op: torch._ops.OpOverload) -> Optional[Callable]:
    """The decomposition of `op`, kernel or not (TABLE's, else torch._decomp's); None where there is none."""
    fn = TABLE.get(op)
    return fn if fn is not None else torch._decomp.decomposition_table.get(op)


def for_device(op: torch._ops.OpOverload, device_type: str) -> Optional[Callable]:
    """What to call instead of `op` on a `device_type` server: None where the op has a kernel
    there, or no decomposition (calling it then reports the missing kernel)."""
    return None if has_kernel(op.name(), device_type) else find(op)


# -- the fused RNN cells --------------------------------------------------------------------------
def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # CUDA's kernels compute half and bfloat16 in float32 (their accumulate type)
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """-> (hy, cy, workspace); workspace: the activated gates [i, f, g, o], (batch, 4 * hidden)."""
    dtype = input_gates.dtype
    acc = _compute_dtype(input_gates)
    igates, hgates = input_gates.to(acc), hidden_gates.to(acc)
    if input_bias is not None:  # the CPU cell's order: (input linear) + (hidden linear)
        igates, hgates = igates + input_bias.to(acc), hgates + hidden_bias.to(acc)
    i, f, g, o = (igates + hgates).chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx.to(acc) + i * g
    hy = o * cy.tanh()
    return hy.to(dtype), cy.to(dtype), torch.cat((i, f, g, o), 1).to(dtype)


def _lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """-> (grad_gates, grad_cx, grad_bias or None); grad_gates serves both gate inputs."""
    if grad_hy is None and grad_cy is None:
        return None, None, None
    dtype = workspace.dtype
    acc = _compute_dtype(workspace)
    i, f, g, o = workspace.to(acc).chunk(4, 1)
    tanh_cy = cy.to(acc).tanh()
    grad_hy = torch.zeros_like(tanh_cy) if grad_hy is None else grad_hy.to(acc)
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        grad_c = grad_c + grad_cy.to(acc)
    grad_gates = torch.cat((
        grad_c * g * (1 - i) * i,
        grad_c * cx.to(acc) * (1 - f) * f,
        grad_c * i * (1 - g * g),
        grad_hy * tanh_cy * (1 - o) * o,
    ), 1).to(dtype)
    grad_cx = (grad_c * f).to(dtype)
    return grad_gates, grad_cx, grad_gates.sum(0) if has_bias else None


def _gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """-> (hy, workspace); workspace: [r, z, n, hx, hn + hidden bias], (batch, 5 * hidden)."""
    dtype = input_gates.dtype
    acc = _compute_dtype(input_gates)
    igates, hgates, h = input_gates.to(acc), hidden_gates.to(acc), hx.to(acc)
    if input_bias is not None:
        igates, hgates = igates + input_bias.to(acc), hgates + hidden_bias.to(acc)
    ir, iz, in_ = igates.chunk(3, 1)
    hr, hz, hn = hgates.chunk(3, 1)
    r = (hr + ir).sigmoid()
    z = (hz + iz).sigmoid()
    n = (in_ + hn * r).tanh()
    hy = (h - n) * z + n  # the CPU cell's order
    return hy.to(dtype), torch.cat((r, z, n, h, hn), 1).to(dtype)


def _gru_cell_backward(grad_hy, workspace, has_bias):
    """-> (grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias)."""
    dtype = workspace.dtype
    acc = _compute_dtype(workspace)
    r, z, n, hx, hn = workspace.to(acc).chunk(5, 1)
    grad = grad_hy.to(acc)
    grad_z = grad * (hx - n) * (1 - z) * z
    grad_n = grad * (1 - z) * (1 - n * n)
    grad_r = grad_n * hn * (1 - r) * r
    grad_input_gates = torch.cat((grad_r, grad_z, grad_n), 1).to(dtype)
    grad_hidden_gates = torch.cat((grad_r, grad_z, grad_n * r), 1).to(dtype)
    grad_hx = (grad * z).to(dtype)
    if not has_bias:
        return grad_input_gates, grad_hidden_gates, grad_hx, None, None
    return grad_input_gates, grad_hidden_gates, grad_hx, grad_input_gates.sum(0), grad_hidden_gates.sum(0)


# -- matrix products with an output dtype (torch.mm(..., out_dtype=)) ---------------------------
# CUDA multiplies float16/bfloat16 with float32 accumulation and a float32 result: the same
# as multiplying the inputs converted to out_dtype (a product of two float16 or bfloat16
# numbers is exact in float32). torch._decomp's addmm.dtype calls mm.dtype, which has no
# CPU kernel either, so these four and their out= forms are all here.
def _mm_dtype(self, mat2, out_dtype, *, out=None):
    return torch.mm(self.to(out_dtype), mat2.to(out_dtype), out=out)


def _bmm_dtype(self, mat2, out_dtype, *, out=None):
    return torch.bmm(self.to(out_dtype), mat2.to(out_dtype), out=out)


def _addmm_dtype(self, mat1, mat2, out_dtype, *, beta=1, alpha=1, out=None):
    return torch.addmm(self.to(out_dtype), mat1.to(out_dtype), mat2.to(out_dtype), beta=beta, alpha=alpha,
                       out=out)


def _baddbmm_dtype(self, batch1, batch2, out_dtype, *, beta=1, alpha=1, out=None):
    return torch.baddbmm(self.to(out_dtype), batch1.to(out_dtype), batch2.to(out_dtype), beta=beta, alpha=alpha,
                         out=out)


def _masked_scale(self, mask, scale):
    # _fused_dropout's backward (torch._decomp decomposes _fused_dropout itself)
    return self * mask * scale


def _table() -> dict:
    table = {
        "_thnn_fused_lstm_cell.default": _lstm_cell,
        "_thnn_fused_lstm_cell_backward_impl.default": _lstm_cell_backward,
        "_thnn_fused_gru_cell.default": _gru_cell,
        "_thnn_fused_gru_cell_backward.default": _gru_cell_backward,
        "mm.dtype": _mm_dtype, "mm.dtype_out": _mm_dtype,
        "bmm.dtype": _bmm_dtype, "bmm.dtype_out": _bmm_dtype,
        "addmm.dtype": _addmm_dtype, "addmm.dtype_out": _addmm_dtype,
        "baddbmm.dtype": _baddbmm_dtype, "baddbmm.dtype_out": _baddbmm_dtype,
        "_masked_scale.default": _masked_scale,
    }
    ops = {}
    for name, fn in table.items():
        packet, overload = name.split(".")
        try:
            ops[getattr(getattr(aten, packet), overload)] = fn
        except (AttributeError, RuntimeError):
            pass  # an op this torch lacks is simply not served
    return ops


#: OpOverload -> decomposition, for ops torch._decomp does not (usefully) cover.
TABLE: dict = _table()
