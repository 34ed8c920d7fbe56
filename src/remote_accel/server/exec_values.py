"""The executor's value helpers: walking wire values and results without a session.

Plans (RunOp.plan) are templates whose holes, tensor references, inline CPU tensors and
Scalar arguments sent as values, RunPlanned fills in order; graph values name earlier results of a graph; results are
flattened, checked against the promised layout and have lazy conj/neg bits settled.
None of this needs an Executor's state, so it lives apart from executor.py.
"""

from __future__ import annotations

from typing import Any

import torch

from ..dataplane import codec
from ..dataplane.codec import Ext
from ..errors import ProtocolError
from ..torch_wire import values as torch_values
from .storage import TensorRef, parse_ref


def flatten(result: Any) -> list:
    if isinstance(result, (tuple, list)):
        flat = []
        for item in result:
            if isinstance(item, (tuple, list)):
                flat.extend(item)
            else:
                flat.append(item)
        return flat
    return [result]


def _settle_lazy_bits(decoded: list) -> None:
    """Some kernels flip an out= tensor's conj or neg bit in place instead of writing the
    values (CPU's linalg_lu_solve.out conjugates its result so). The client's tensor keeps
    the flags it sent: rewrite the bytes so that, read with those flags, they hold the
    values the kernel meant."""
    for t, flags in decoded:
        conj, neg = bool(flags & torch_values.FLAG_CONJ), bool(flags & torch_values.FLAG_NEG)
        if t.is_conj() == conj and t.is_neg() == neg:
            continue
        values = t.resolve_conj().resolve_neg()
        if values.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            values = values.clone()
        target = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        if conj:
            target = target.conj()
        if neg:
            target = torch._neg_view(target)
        target.copy_(values)


def _count_holes(value: Any) -> int:
    """RunPlanned holes in a wire value: its tensor references, inline CPU tensors and scalars."""
    t = type(value)
    if t is Ext:
        if value.code == torch_values.TENSOR or value.code == torch_values.CPU_TENSOR:
            payload = value.value
            if type(payload) is not tuple or len(payload) != (6 if value.code == torch_values.TENSOR else 3):
                raise ProtocolError("malformed tensor in a plan")
            return 1
        if value.code == torch_values.SCALAR:
            if type(value.value) is not tuple or len(value.value) != 2:
                raise ProtocolError("malformed scalar in a plan")
            return 1
        return 0  # generators, devices: never holes
    if t is tuple or t is list:
        return sum(_count_holes(v) for v in value)
    if t is dict:
        return sum(_count_holes(v) for v in value.values())
    return 0


def _written_holes(args: Any, kwargs: Any, written: frozenset) -> tuple:
    """(hole index, span) of each tensor reference in an argument that the op writes
    (`written`: positions and keyword names): a storage id the session has not seen
    there is made from that layout when the plan runs, as the C++ executor does."""
    found, pos = [], 0
    items = list(enumerate(args)) if type(args) in (tuple, list) else []
    items += list(kwargs.items()) if type(kwargs) is dict else []
    for key, value in items:
        if key in written:
            for k, ext in enumerate(_hole_values(value)):
                if ext.code == torch_values.TENSOR:
                    ref = parse_ref(ext.value)
                    found.append((pos + k, ref.span))
        pos += _count_holes(value)
    return tuple(found)


def _hole_values(value: Any) -> list:
    """The Ext of each hole in `value`, in _count_holes' order."""
    t = type(value)
    if t is Ext:
        return [value] if value.code in (torch_values.TENSOR, torch_values.CPU_TENSOR, torch_values.SCALAR) else []
    if t is tuple or t is list:
        return [h for v in value for h in _hole_values(v)]
    if t is dict:
        return [h for v in value.values() for h in _hole_values(v)]
    return []


def _fill(value: Any, values) -> Any:
    """`value` with its holes (in _count_holes' order) taken from the iterator `values`."""
    t = type(value)
    if t is Ext:
        if value.code == torch_values.TENSOR:
            sid = next(values)
            if type(sid) is not int:
                raise ProtocolError("a RunPlanned value for a tensor reference must be a storage id")
            return Ext(value.code, (sid,) + value.value[1:])
        if value.code == torch_values.CPU_TENSOR:
            data = next(values)
            if type(data) is not bytes:
                raise ProtocolError("a RunPlanned value for a CPU tensor must be bytes")
            return Ext(value.code, value.value[:2] + (data,))
        if value.code == torch_values.SCALAR:
            data = next(values)
            if type(data) is not bytes:
                raise ProtocolError("a RunPlanned value for a scalar must be bytes")
            return Ext(value.code, (value.value[0], data))
        return value
    if t is tuple:
        return tuple([_fill(v, values) for v in value])
    if t is list:
        return [_fill(v, values) for v in value]
    if t is dict:
        return {k: _fill(v, values) for k, v in value.items()}
    return value


def _graph_value(values: list, payload: Any) -> Any:
    if type(payload) is int and 0 <= payload < len(values):
        return values[payload]
    if (type(payload) is tuple and len(payload) == 2 and all(type(p) is int for p in payload)
            and 0 <= payload[0] < len(values)):
        value = values[payload[0]]
        if isinstance(value, (tuple, list)) and 0 <= payload[1] < len(value):
            return value[payload[1]]
    raise ProtocolError(f"graph value {payload!r} does not name an earlier value")


def _has_layout(t: torch.Tensor, ref: TensorRef, device: torch.device) -> bool:
    return (t.device == device and t.dtype == ref.dtype and tuple(t.stride()) == ref.stride
            and t.storage_offset() == ref.offset and not ref.flags and not t.is_conj() and not t.is_neg())


def definition_bytes(*fields) -> int:
    """About what a kept definition (a plan, a graph) holds: its fields as the wire
    encodes them."""
    return len(codec.encode(fields))
