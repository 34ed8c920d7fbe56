"""The boxed fallback: every aten op on remote_accel tensors lands here.

An op becomes a RunOp request queued on the device's session; it returns at once with
result tensors whose shape, dtype and strides come from running the op on `meta`
tensors (cached per op and argument metadata). Ops whose results depend on data
(nonzero, unique, item, ...) or that have no meta kernel are sync points: they run at
once and the server answers with the results' metadata.
"""

from __future__ import annotations

import itertools
import logging

import torch

from ..dataplane import torch_values as tv
from ..dataplane.codec import Ext
from . import handles, meta, runtime, transfer

log = logging.getLogger(__name__)
_C = handles._C
_temp_ids = itertools.count(1)


def _device_index(args, kwargs) -> int:
    """The remote_accel device an op runs on: its first remote tensor's, else a device=
    argument's, else the current one. Tensors sit at the top level or in lists."""
    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, torch.Tensor):
            if value.device.type == "remote_accel":
                return value.device.index or 0
        elif type(value) is list or type(value) is tuple:
            for item in value:
                if isinstance(item, torch.Tensor) and item.device.type == "remote_accel":
                    return item.device.index or 0
        elif isinstance(value, torch.device) and value.type == "remote_accel":
            return value.index if value.index is not None else _C.current_device()
    return _C.current_device()


def encode_args(op, args, kwargs, index: int) -> tuple:
    """Arguments -> wire values; default generators made explicit for random ops."""
    ref = lambda t: handles.tensor_ref(t, index)  # noqa: E731
    enc_args = tuple(_encode(a, ref, index) for a in args)
    enc_kwargs = {k: _encode(v, ref, index) for k, v in kwargs.items()}
    locator = meta.takes_generator(op)
    if locator is not None and meta.argument(args, kwargs, locator) is None:
        # the server keeps one generator per client generator: name the default one
        if locator[0] == "pos" and locator[1] < len(args):
            enc_args = enc_args[: locator[1]] + (handles.generator_ref(None, index),) + enc_args[locator[1] + 1 :]
        else:
            enc_kwargs[locator[-1]] = handles.generator_ref(None, index)
    return enc_args, enc_kwargs


def _encode(value, ref, index):
    if isinstance(value, torch.Generator):
        return handles.generator_ref(value, index)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Generator) for v in value):
        return type(value)(_encode(v, ref, index) for v in value)
    return tv.encode_value(value, ref)


def remote_fallback(op: torch._ops.OpOverload, *args, **kwargs):
    special = transfer.SPECIAL_OPS.get(op)
    if special is not None:
        return special(op, args, kwargs)
    return run_op(op, args, kwargs)


def run_op(op, args, kwargs):
    args, kwargs = meta.rewrap_numbers(op, args, kwargs, _C.wrapped_number)
    index = _device_index(args, kwargs)
    session = runtime.session(index)
    plan = meta.infer(op, args, kwargs)
    if plan is None:
        return run_with_reply(op, args, kwargs, index)
    plan = meta.for_server_device(op, plan, args, kwargs, session.device_type)
    device = torch.device("remote_accel", index)
    results, out_refs = [], []
    for spec in plan.results:
        value, refs = _materialise(spec, args, kwargs, device, index)
        results.append(value)
        out_refs.append(refs)
    enc_args, enc_kwargs = encode_args(op, args, kwargs, index)
    # the server numbers results with Tensor[] returns expanded in place
    flat_refs = []
    for spec, refs in zip(plan.results, out_refs):
        if spec[0] == "list":
            flat_refs.extend(refs)
        else:
            flat_refs.append(refs)
    session.run(meta.op_name(op), enc_args, enc_kwargs, tuple(flat_refs), _stream(op, index))
    return meta.pack_results(op, results)


def _stream(op, index: int):
    """The default stream's reference for seeded ops without a generator argument."""
    return handles.generator_ref(None, index) if meta.schema_of(op).seeded_without_generator else None


def _materialise(spec, args, kwargs, device, index):
    """One result of an op: (the tensor(s) the caller gets, their wire references)."""
    kind = spec[0]
    if kind == "arg":  # in-place / out=: the result is an argument itself
        value = meta.argument(args, kwargs, spec[1])
        if spec[2] is not None and tuple(value.shape) != spec[2]:
            value.resize_(spec[2])  # out= tensors of another shape are resized, as in eager
        return value, None
    if kind == "view":  # a non-writing alias of an argument: metadata only
        base = meta.argument(args, kwargs, spec[1])
        _, _, shape, stride, offset, dtype = spec
        return torch.as_strided(base, shape, stride, base.storage_offset() + offset), None
    if kind == "tensor":
        _, shape, stride, dtype = spec
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        return t, handles.output_ref(t, index)
    if kind == "list":
        items = [_materialise(s, args, kwargs, device, index) for s in spec[1]]
        return [v for v, _ in items], tuple(r for _, r in items)
    if kind == "none":
        return None, None
    raise AssertionError(f"unknown result kind {kind}")


def run_with_reply(op, args, kwargs, index):
    """Run now; the server tells the results' shapes (data-dependent ops, no meta kernel).
    `args` come as run_op hands them on: numbers in Tensor slots already re-wrapped."""
    session = runtime.session(index)
    n_out = meta.count_tensor_returns(op)
    temp = tuple(-next(_temp_ids) for _ in range(n_out))
    enc_args, enc_kwargs = encode_args(op, args, kwargs, index)
    reply = session.run_with_reply(meta.op_name(op), enc_args, enc_kwargs, temp, _stream(op, index))
    device = torch.device("remote_accel", index)
    results = []
    for i, value in enumerate(reply):  # the server kept result i under temp[i]
        if type(value) is tuple and len(value) == 5 and type(value[1]) is str:
            results.append(_adopt(session, temp[i], value, device, index))
        else:
            results.append(value)
    results = meta.regroup(op, results)
    _write_back(op, args, kwargs, results)
    return meta.pack_results(op, results)


def _write_back(op, args, kwargs, results: list) -> None:
    """In-place and out= results are the argument tensors themselves; an out= tensor that
    the op resized on the server takes the new storage and shape."""
    schema = meta.schema_of(op)
    for i, (target, writes) in enumerate(zip(schema.alias_of, schema.writes)):
        if not writes or target is None or i >= len(results):
            continue
        arg, result = meta.argument(args, kwargs, target), results[i]
        if isinstance(arg, torch.Tensor) and isinstance(result, torch.Tensor):
            if result.shape != arg.shape:
                arg.set_(result)
            results[i] = arg


def _adopt(session, temp_sid: int, desc: tuple, device, index) -> torch.Tensor:
    """Move a server-side temporary result into a storage the client allocator owns."""
    nbytes, dtype_name, shape, stride, offset = desc
    dtype = tv.dtype_from_name(dtype_name)
    storage = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if nbytes:
        whole = Ext(tv.TENSOR, (temp_sid, "uint8", (nbytes,), (1,), 0, 0))
        session.run("aten::copy_", (handles.tensor_ref(storage, index), whole), {}, (None,))
    session.free([temp_sid])
    return torch.empty(0, dtype=dtype, device=device).set_(storage.untyped_storage(), offset, shape, stride)


_library = None


def register() -> None:
    """Install the fallback for every op at the PrivateUse1 key (once per process)."""
    global _library
    if _library is None:
        _library = torch.library.Library("_", "IMPL")
        _library.fallback(remote_fallback, dispatch_key="PrivateUse1")
        # these have a throwing default kernel, so the fallback never sees them unless
        # registered by name; the server runs them as convolution(_backward)
        global _aten_library
        _aten_library = torch.library.Library("aten", "IMPL")
        for name in ("convolution_overrideable", "convolution_backward_overrideable"):
            op = getattr(torch.ops.aten, name).default
            _aten_library.impl(name, lambda *a, _op=op, **k: run_op(_op, a, k), "PrivateUse1")


_aten_library = None
