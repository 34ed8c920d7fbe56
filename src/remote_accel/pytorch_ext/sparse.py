"""Sparse tensors on remote_accel: COO and compressed (CSR, CSC, BSR, BSC).

A sparse remote_accel tensor is, as on CUDA, a sparse tensor of the client whose components
(indices and values, or compressed indices, plain indices and values) are ordinary remote
tensors; csrc/sparse.cpp registers ATen's device-generic kernels that build and read it.
Every op with a sparse argument or a sparse result runs on the server, which rebuilds the
sparse arguments around their components' storages (torch_wire.sparse). Such an op always
waits for the server's answer: a sparse result's number of elements (nnz) depends on the
data, so no meta kernel can tell it in advance. The server keeps each component of a
sparse result under a storage id of its own, and the client rebuilds the tensor here.
"""

from __future__ import annotations

import itertools

import torch

from ..torch_wire import sparse as wire

#: ops that make a sparse tensor out of strided ones: they dispatch on the dense key
SPARSE_RESULT_OPS = frozenset({
    "aten::_to_sparse", "aten::_to_sparse_csr", "aten::_to_sparse_csc", "aten::_to_sparse_bsr",
    "aten::_to_sparse_bsc", "aten::to_sparse", "aten::to_sparse_csr", "aten::to_sparse_csc",
    "aten::to_sparse_bsr", "aten::to_sparse_bsc",
})

#: the dispatch keys of sparse remote_accel tensors, where torch registers nothing
KEYS = ("SparsePrivateUse1", "SparseCsrPrivateUse1")


def involved(op, args, kwargs) -> bool:
    """Whether an op takes or makes a sparse tensor (then it runs with a reply)."""
    if op._schema.name in SPARSE_RESULT_OPS:
        return True
    if kwargs.get("layout") in wire.SPARSE_LAYOUTS:
        return True
    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, torch.Tensor):
            if value.layout is not torch.strided:
                return True
        elif type(value) is list or type(value) is tuple:
            if any(isinstance(v, torch.Tensor) and v.layout is not torch.strided for v in value):
                return True
    return False


def result_ids(n_results: int, new_id) -> tuple:
    """RunOp(reply=True) outs for an op whose results may be sparse: per result, one
    storage id per component of the largest sparse layout (a strided result takes the first)."""
    return tuple(tuple(new_id() for _ in range(3)) for _ in range(n_results))


def is_description(value) -> bool:
    return type(value) is tuple and len(value) == 5 and value[0] == wire.SPARSE_RESULT


def adopt(desc: tuple, ids: tuple, adopt_dense) -> torch.Tensor:
    """The client's sparse tensor for a server's description of a sparse result;
    `adopt_dense(temp id, component description)` takes one component over."""
    _, layout_name, size, parts, coalesced = desc
    layout = wire.tv.LAYOUTS[layout_name]
    if len(parts) != wire.n_components(layout):
        raise RuntimeError(f"remote_accel: the server described a {layout} result with {len(parts)} components")
    tensors = tuple(adopt_dense(ids[k], part) for k, part in enumerate(parts))
    # the server checked the invariants of what it made; checking again would read back
    return wire.build(layout, tuple(size), tensors, coalesced, check=False)


def write_back(arg: torch.Tensor, result: torch.Tensor) -> None:
    """An in-place op on a sparse argument: the server changed its own rebuilt copy, whose
    components may have grown; the client's tensor takes the result's components."""
    arg.copy_(result)  # COO takes any nnz; compressed layouts need the same nnz (ATen's own check)


#: the CPU key whose sparse kernels show which ops to send to the server, per key of ours
_CPU_KEYS = {"SparsePrivateUse1": "SparseCPU", "SparseCsrPrivateUse1": "SparseCsrCPU"}

_libraries: list = []


def register(run) -> None:
    """Send every op that reaches a sparse remote_accel tensor's key (none has a kernel
    there but csrc/sparse.cpp's) to the server: `run(op, args, kwargs)`.

    A fallback catches the ops without any kernel. It is not enough: an op with a
    CompositeExplicitAutograd kernel (mul.Tensor, add.Tensor...) runs that for a key
    without a kernel of its own, before any fallback, and those kernels handle strided
    tensors only. So every op that CPU has a sparse kernel for gets ours."""
    if _libraries:
        return
    fallbacks = torch.library.Library("_", "IMPL")
    kernels = torch.library.Library("aten", "IMPL")
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")]
    for key, cpu_key in _CPU_KEYS.items():
        fallbacks.fallback(lambda op, *args, **kwargs: run(op, args, kwargs), dispatch_key=key)
        for name in names:
            if (torch._C._dispatch_has_kernel_for_dispatch_key(name, cpu_key)
                    and not torch._C._dispatch_has_kernel_for_dispatch_key(name, key)):
                op = _overload(name)
                kernels.impl(name[len("aten::"):], lambda *args, _op=op, **kwargs: run(_op, args, kwargs), key)
    _libraries.extend((fallbacks, kernels))  # the registrations live as long as these objects


def _overload(name: str):
    """torch.ops.aten's OpOverload for "aten::mul.Tensor" (or "aten::sgn": its default)."""
    base, _, overload = name[len("aten::"):].partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")
