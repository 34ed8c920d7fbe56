"""Result shapes without the server: run the op on `meta` tensors, cache the answer.

`infer(op, args, kwargs)` returns a Plan describing each result (an argument itself for
in-place/out= ops, a view of an argument, or a fresh tensor with exact shape, strides
and dtype), or None when the results depend on data or the op has no meta kernel.
Meta inference costs 100 us to 1 ms, so plans are cached per (op, argument metadata).
"""

from __future__ import annotations

import math

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

#: Ops whose result shapes or values depend on tensor data: always a round trip.
DATA_DEPENDENT = frozenset({
    "aten::nonzero", "aten::masked_select", "aten::unique_consecutive", "aten::unique_dim",
    "aten::_unique", "aten::_unique2", "aten::unique_dim_consecutive", "aten::_local_scalar_dense",
    "aten::equal", "aten::is_nonzero", "aten::bincount", "aten::repeat_interleave",
    "aten::_assert_async", "aten::_assert_async.msg", "aten::histc", "aten::allclose",
    # meta kernels that promise shapes the real kernels do not keep (residuals exist only
    # for full-rank inputs; offset2bag is empty on some modes)
    "aten::linalg_lstsq", "aten::_embedding_bag", "aten::_embedding_bag_forward_only",
})

#: Batch-norm ops whose CPU kernels return empty save_mean/save_invstd in eval mode, where
#: the meta kernels (and CUDA's) return one value per channel: op -> index of `training`
#: (None: always eval).
_CPU_EVAL_BATCH_NORM = {
    "aten::native_batch_norm": 5,
    "aten::_native_batch_norm_legit": 5,
    "aten::_native_batch_norm_legit_no_training": None,
    "aten::_batch_norm_no_update": None,
}

#: Normalisation ops whose CPU kernels keep their statistics (mean, rstd, save_mean,
#: save_invstd) in a float16/bfloat16 input's own dtype unless a parameter is float32
#: (ATen's param_scalar_type), where the meta kernels (and CUDA's) keep them in float32:
#: op -> positions of those results.
_CPU_REDUCED_PRECISION_STATS = {
    "aten::native_layer_norm": (1, 2),
    "aten::native_batch_norm": (1, 2),
    "aten::_native_batch_norm_legit": (1, 2),
    "aten::_native_batch_norm_legit.no_stats": (1, 2),
    "aten::_native_batch_norm_legit_no_training": (1, 2),
    "aten::_batch_norm_with_update": (1, 2),
    "aten::_batch_norm_no_update": (1, 2),
}

_CACHE_LIMIT = 1 << 16
_cache: dict = {}


@dataclass(frozen=True)
class Plan:
    results: tuple


@dataclass(frozen=True)
class _Schema:
    """What the fallback needs from an op's schema, computed once per op."""

    arg_names: tuple  # all arguments, in schema order
    kwarg_only: frozenset
    alias_of: tuple  # per return: the argument locator it aliases, or None
    writes: tuple  # per return: True for in-place / out= results
    kinds: tuple  # per return: "tensor", "list", "optional", "other"
    generator_arg: Optional[tuple]  # locator of a Generator? argument
    seeded_without_generator: bool  # random, but draws from the default stream implicitly


@functools.lru_cache(maxsize=None)
def schema_of(op) -> _Schema:
    schema = op._schema
    names, kw_only, alias_sets, generator = [], set(), {}, None
    for i, a in enumerate(schema.arguments):
        names.append(a.name)
        locator = ("kw", a.name) if a.kwarg_only else ("pos", i, a.name)
        if a.kwarg_only:
            kw_only.add(a.name)
        if a.alias_info is not None:
            for s in a.alias_info.before_set:
                alias_sets.setdefault(s, locator)
        if "Generator" in str(a.type):
            generator = locator
    alias_of, writes, kinds = [], [], []
    for r in schema.returns:
        info = r.alias_info
        target = None
        if info is not None:
            for s in info.before_set:
                target = alias_sets.get(s, target)
        alias_of.append(target)
        writes.append(bool(info and info.is_write))
        text = str(r.type)
        kinds.append("list" if text.startswith("List[Tensor]") or text == "Tensor[]" else
                     "optional" if text in ("Optional[Tensor]", "Tensor?") else
                     "tensor" if text == "Tensor" else "other")
    seeded = generator is None and torch.Tag.nondeterministic_seeded in op.tags
    return _Schema(tuple(names), frozenset(kw_only), tuple(alias_of), tuple(writes), tuple(kinds), generator, seeded)


def op_name(op) -> str:
    """"aten::add.Tensor"; the default overload without its suffix ("aten::relu")."""
    name = op._schema.name
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def argument(args, kwargs, locator):
    if locator[0] == "kw":
        return kwargs.get(locator[1])
    _, i, name = locator
    return args[i] if i < len(args) else kwargs.get(name)


def takes_generator(op) -> Optional[tuple]:
    return schema_of(op).generator_arg


def count_tensor_returns(op) -> int:
    """Upper bound on tensor results of a data-dependent op (lists count as many)."""
    s = schema_of(op)
    return sum(64 if k == "list" else 1 for k in s.kinds if k != "other") if s.kinds else 0


def regroup(op, flat: list) -> list:
    """Results numbered with a `Tensor[]` return expanded in place -> one value per return."""
    kinds = schema_of(op).kinds
    if "list" not in kinds:
        return flat
    at = kinds.index("list")
    length = len(flat) - (len(kinds) - 1)
    return flat[:at] + [flat[at : at + length]] + flat[at + length :]


def pack_results(op, results: list):
    n = len(op._schema.returns)
    if n == 0:
        return None
    if n == 1:
        return results[0]
    return tuple(results)


# -- inference ---------------------------------------------------------------------------------
def _signature(value) -> Any:
    """A hashable description of an argument, enough to determine result metadata."""
    if isinstance(value, torch.Tensor):
        return ("T", value.dtype, tuple(value.shape), tuple(value.stride()), value.device.type == "cpu",
                value.is_conj(), value.is_neg())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_signature(v) for v in value)
    if isinstance(value, torch.Generator):
        return "G"
    if isinstance(value, torch.device):
        return ("D", value.type)
    hash(value)
    if value == 0 and type(value) is float:
        return ("float", value, math.copysign(1.0, value))  # -0.0 == 0.0, but it is sent as is
    return (type(value).__name__, value)


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.dim() == 0:
            return value  # CPU scalars mix with device tensors, as on CUDA
        t = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        if value.is_conj():
            t = t._conj()
        if value.is_neg():
            t = torch._neg_view(t)
        return t.requires_grad_(False)
    if isinstance(value, torch.device) and value.type == "remote_accel":
        return torch.device("meta")
    if isinstance(value, torch.Generator):
        return None  # meta kernels ignore generators
    return value


@functools.lru_cache(maxsize=None)
def always_replies(op) -> bool:
    """Whether every call of `op` needs the server to say its results (data-dependent
    ops, and ops that return other things than tensors)."""
    name = op._schema.name
    return (name in DATA_DEPENDENT or f"{name}.{op._overloadname}" in DATA_DEPENDENT
            or "other" in schema_of(op).kinds)


def infer(op, args, kwargs) -> Optional[Plan]:
    """The results' plan, cached per op and argument metadata; None when the server must
    say (always_replies, or no meta kernel for these arguments)."""
    if always_replies(op):
        return None
    try:
        key = (op, _signature(args), _signature(tuple(sorted(kwargs.items()))))
    except TypeError:  # an unhashable argument: infer without caching
        key = None
    plan = _cache.get(key) if key is not None else None
    if plan is None:
        plan = _infer(op, schema_of(op), args, kwargs)
        if key is not None and plan is not None:
            if len(_cache) >= _CACHE_LIMIT:
                _cache.clear()
            _cache[key] = plan
    return plan


def for_server_device(op, plan: Plan, args, kwargs, server_device_type: str) -> Plan:
    """Adjust a plan where the server's kernels give other shapes than the meta kernels."""
    name = op_name(op)
    if server_device_type == "cpu":
        stats = _CPU_REDUCED_PRECISION_STATS.get(name)
        if stats is not None:
            plan = _stats_in_input_dtype(plan, args, stats)
        training_at = _CPU_EVAL_BATCH_NORM.get(name, -1)
        if training_at == -1:
            return plan
        if training_at is not None and (args[training_at] if len(args) > training_at else kwargs.get("training")):
            return plan
        return _emptied(plan, (1, 2))  # save_mean, save_invstd
    if server_device_type == "cuda" and name == "aten::log_sigmoid_forward":
        return _emptied(plan, (1,))  # CUDA keeps no buffer for the backward
    return plan


def _stats_in_input_dtype(plan: Plan, args, positions) -> Plan:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16):
        return plan
    if any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args[1:]):
        return plan  # mixed precision: float32 statistics on CPU too
    results = list(plan.results)
    for i in positions:  # ("tensor", shape, stride, dtype)
        if results[i][0] == "tensor":
            results[i] = results[i][:3] + (x.dtype,)
    return Plan(tuple(results))


def _emptied(plan: Plan, positions) -> Plan:
    """`plan` with the tensor results at `positions` made 1-d and empty, as kernels that
    skip an auxiliary output return it."""
    results = list(plan.results)
    for i in positions:  # ("tensor", shape, stride, dtype)
        results[i] = ("tensor", (0,), (1,), results[i][3])
    return Plan(tuple(results))


def _meta_substitute(op):
    """Ops without a meta kernel whose public twin has one, with the same arguments."""
    aten = torch.ops.aten
    return {
        aten.convolution_overrideable.default: aten.convolution.default,
        aten.convolution_backward_overrideable.default: aten.convolution_backward.default,
    }.get(op, op)


def _empty_like_rows(t, columns: int):
    return torch.empty((t.shape[0], columns), dtype=t.dtype, device="meta")


def _lstm_cell_meta(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    # torch's own meta kernel reads .device of the biases, which are None without bias
    return torch.empty_like(cx), torch.empty_like(cx), _empty_like_rows(input_gates, input_gates.shape[1])


def _lstm_cell_backward_meta(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    if grad_hy is None and grad_cy is None:
        return None, None, None
    grad_gates = torch.empty_like(workspace)
    return grad_gates, torch.empty_like(cx), torch.empty(workspace.shape[1:], dtype=workspace.dtype,
                                                         device="meta") if has_bias else None


def _gru_cell_meta(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    return torch.empty_like(hx), _empty_like_rows(hx, 5 * hx.shape[1])


def _gru_cell_backward_meta(grad_hy, workspace, has_bias):
    hidden = grad_hy.shape[1]
    gates = _empty_like_rows(grad_hy, 3 * hidden)
    bias = (lambda: torch.empty((3 * hidden,), dtype=grad_hy.dtype, device="meta")) if has_bias else (lambda: None)
    return gates, torch.empty_like(gates), torch.empty_like(grad_hy), bias(), bias()


#: Result layouts of ops whose meta kernel is missing (a round trip per call otherwise) or
#: wrong: the CUDA-only fused RNN cells that nn.LSTM and nn.GRU call on remote_accel, laid
#: out as their CUDA kernels (and the server's decompositions) make them.
_META_FUNCTIONS = {
    torch.ops.aten._thnn_fused_lstm_cell.default: _lstm_cell_meta,
    torch.ops.aten._thnn_fused_lstm_cell_backward_impl.default: _lstm_cell_backward_meta,
    torch.ops.aten._thnn_fused_gru_cell.default: _gru_cell_meta,
    torch.ops.aten._thnn_fused_gru_cell_backward.default: _gru_cell_backward_meta,
}


def _infer(op, schema: _Schema, args, kwargs) -> Optional[Plan]:
    meta_args, meta_kwargs = pytree.tree_map(_to_meta, (args, kwargs))
    if op is torch.ops.aten.convolution_backward_overrideable.default:
        # convolution_backward also takes the bias sizes, right after the weight: the output
        # channels, which a transposed convolution's weight (in, out / groups, ...) holds in
        # dim 1 (as the server's substitute in server/ops.py computes them)
        weight, transposed, groups, mask = meta_args[2], meta_args[6], meta_args[8], meta_args[9]
        channels = weight.shape[1] * groups if transposed else weight.shape[0]
        meta_args = (*meta_args[:3], [channels] if mask[2] else None, *meta_args[3:])
    op = _meta_substitute(op)
    op = _META_FUNCTIONS.get(op, op)
    try:
        with torch.no_grad():
            out = op(*meta_args, **meta_kwargs)
    except NotImplementedError:
        return None  # no meta kernel: let the server tell us
    except RuntimeError as exc:
        text = str(exc)
        if "meta" in text.lower() or "data-dependent" in text or "Data dependent" in text:
            return None
        raise  # a genuine user error (shape mismatch, bad dtype): raise it at the op, like eager
    outs = out if isinstance(out, tuple) else (out,)
    if len(schema.kinds) == 0:
        outs = ()
    specs = []
    for i, (kind, value) in enumerate(zip(schema.kinds, outs)):
        target = schema.alias_of[i]
        if target is not None and schema.writes[i]:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
            specs.append(("arg", target, shape))
        elif target is not None and kind == "tensor":
            specs.append(("view", target, tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype))
        elif target is not None and kind == "list":  # split-like: views of an argument
            specs.append(("list", tuple(("view", target, tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype)
                                        for v in value)))
        elif kind == "list":
            specs.append(("list", tuple(_fresh(v) for v in value)))
        elif kind == "optional" and value is None:
            specs.append(("none",))
        else:
            specs.append(_fresh(value))
    return Plan(tuple(specs))


def _fresh(value) -> tuple:
    if value is None:
        return ("none",)
    return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype)
