"""Checks before sparse kernels that trust their arguments.

The server rebuilds every sparse argument with its invariants checked
(torch_wire.sparse.decode), but a few kernels also index with a dense argument that only
an earlier op of theirs could have made valid: a client that sends another one would
make them read out of bounds and bring the whole server down.
"""

from __future__ import annotations

import torch


def sparse_mm_reduce_impl_backward(self, grad_out, other, reduce, arg_out, output_mask):
    # For amax/amin the CPU kernel reads values[arg_out[m, k]] for every element of
    # grad_out (nnz meaning "none"): arg_out must be the forward's, in shape and range.
    if not (isinstance(self, torch.Tensor) and isinstance(grad_out, torch.Tensor)
            and isinstance(other, torch.Tensor) and isinstance(arg_out, torch.Tensor)):
        raise TypeError("_sparse_mm_reduce_impl_backward takes tensors")
    if self.dim() != 2 or other.dim() != 2 or other.shape[0] != self.shape[1]:
        raise ValueError(f"_sparse_mm_reduce_impl_backward: shapes {tuple(self.shape)} and {tuple(other.shape)} "
                         "do not multiply")
    if tuple(grad_out.shape) != (self.shape[0], other.shape[1]):
        raise ValueError(f"_sparse_mm_reduce_impl_backward: grad_out has shape {tuple(grad_out.shape)}, "
                         f"expected {(self.shape[0], other.shape[1])}")
    if reduce in ("amax", "amin") and self.layout is torch.sparse_csr:
        nnz = self._nnz()
        if tuple(arg_out.shape) != tuple(grad_out.shape):
            raise ValueError(f"_sparse_mm_reduce_impl_backward: arg_out has shape {tuple(arg_out.shape)}, "
                             f"expected {tuple(grad_out.shape)}")
        if arg_out.numel() and (int(arg_out.min()) < 0 or int(arg_out.max()) > nnz):
            raise ValueError("_sparse_mm_reduce_impl_backward: arg_out indexes past the sparse tensor's values")
    return torch.ops.aten._sparse_mm_reduce_impl_backward.default(self, grad_out, other, reduce, arg_out, output_mask)


SUBSTITUTES = {
    "aten::_sparse_mm_reduce_impl_backward": sparse_mm_reduce_impl_backward,
    "aten::_sparse_mm_reduce_impl_backward.default": sparse_mm_reduce_impl_backward,
}
