"""Sparse tensors in message fields: as their dense components.

A sparse COO tensor is its indices and values, a compressed one (CSR, CSC, BSR, BSC) its
compressed indices, plain indices and values: ordinary tensors, each with a storage of
its own. So a sparse argument travels as Ext(SPARSE, (layout, size, components,
coalesced, requires_grad)) whose components are the usual tensor references, and the
server rebuilds the sparse tensor around the tensors they name. A sparse result comes back the same
way: the server keeps each component under a storage id of its own and describes it as
it describes a dense result (`describe`).

Autograd is the client's, so the server runs ops without it, except for the few sparse
kernels that compute extra results only when an input requires grad (the arg-max
indices of `_sparse_mm_reduce_impl`, which its backward reads): for them a sparse
argument says whether it requires grad, and they run in grad mode (`grad_mode`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ..dataplane.codec import Ext
from ..errors import ProtocolError
from . import values as tv

#: the wire code of a sparse tensor (see the module's docstring)
SPARSE = tv.SPARSE

COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
SPARSE_LAYOUTS = (torch.sparse_coo,) + COMPRESSED

#: first element of a RunReply result that describes a sparse tensor
SPARSE_RESULT = "sparse"

#: ops whose kernels look at requires_grad (and grad mode) to decide what to compute
READS_REQUIRES_GRAD = frozenset({"aten::_sparse_mm_reduce_impl", "aten::_sparse_mm_reduce_impl.default"})


def is_sparse(t: torch.Tensor) -> bool:
    return t.layout in SPARSE_LAYOUTS


def components(t: torch.Tensor) -> tuple:
    """The dense tensors a sparse tensor is made of, in wire order."""
    if t.layout == torch.sparse_coo:
        return t._indices(), t._values()
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices(), t.values()
    return t.ccol_indices(), t.row_indices(), t.values()


def encode(t: torch.Tensor, tensor_ref: Callable[[torch.Tensor], Any]) -> Ext:
    coalesced = t.is_coalesced() if t.layout == torch.sparse_coo else False
    return Ext(SPARSE, (tv.LAYOUT_NAMES[t.layout], tuple(t.shape), tuple(tensor_ref(c) for c in components(t)),
                        coalesced, t.requires_grad and torch.is_grad_enabled()))


def build(layout: torch.layout, size: tuple, parts: tuple, coalesced: bool, check: bool) -> torch.Tensor:
    """A sparse tensor around its components (on their device). `check` verifies the
    invariants (indices in range, compressed indices ordered): the server does, since a
    kernel would read out of bounds on a bad index."""
    if layout == torch.sparse_coo:
        indices, values = parts
        return torch.sparse_coo_tensor(indices, values, size, is_coalesced=coalesced, check_invariants=check)
    compressed, plain, values = parts
    return torch.sparse_compressed_tensor(compressed, plain, values, size, layout=layout, check_invariants=check)


def decode(payload: Any, tensor: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    """The payload of a SPARSE value as a sparse tensor; `tensor` resolves a component's
    reference. ProtocolError for anything malformed or inconsistent."""
    if type(payload) is not tuple or len(payload) != 5:
        raise ProtocolError("malformed sparse tensor")
    name, size, refs, coalesced, requires_grad = payload
    layout = tv.LAYOUTS.get(name) if type(name) is str else None
    if (layout not in SPARSE_LAYOUTS or type(coalesced) is not bool or type(requires_grad) is not bool
            or type(refs) is not tuple):
        raise ProtocolError("malformed sparse tensor")
    size = tv.check_shape(size, "sparse size")
    if len(refs) != (2 if layout == torch.sparse_coo else 3) or any(type(r) is not Ext or r.code != tv.TENSOR
                                                                    for r in refs):
        raise ProtocolError("malformed sparse tensor components")
    parts = tuple(tensor(r.value) for r in refs)
    try:
        t = build(layout, size, parts, coalesced, check=True)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise ProtocolError(f"invalid sparse tensor: {str(exc).splitlines()[0][:200]}") from None
    if requires_grad and (t.is_floating_point() or t.is_complex()):
        t.requires_grad_()
    return t


def grad_mode(op: str):
    """The grad mode an op runs in on the server: on for READS_REQUIRES_GRAD, else as it is."""
    return torch.enable_grad() if op in READS_REQUIRES_GRAD else contextlib.nullcontext()


def describe(t: torch.Tensor, keep: Callable[[torch.Tensor, int], tuple]) -> tuple:
    """A sparse result for RunReply: (SPARSE_RESULT, layout, size, component descriptions,
    coalesced); `keep(component, k)` stores component k and describes it."""
    coalesced = t.is_coalesced() if t.layout == torch.sparse_coo else False
    return (SPARSE_RESULT, tv.LAYOUT_NAMES[t.layout], tuple(t.shape),
            tuple(keep(c, k) for k, c in enumerate(components(t))), coalesced)


def n_components(layout: torch.layout) -> int:
    return 2 if layout == torch.sparse_coo else 3
