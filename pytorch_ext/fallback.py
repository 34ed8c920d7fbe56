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

from ..dataplane import messages as m
from ..dataplane import torch_values as tv
from ..dataplane.codec import Ext, Raw, encode, encode_int
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
    plan, key = meta.infer_keyed(op, args, kwargs)
    if plan is None:
        return run_with_reply(op, args, kwargs, index)
    plan = meta.for_server_device(op, plan, args, kwargs, session.device_type)
    device = torch.device("remote_accel", index)
    results, outs = [], []  # outs: the fresh result tensors, numbered as the server does
    for spec in plan.results:
        value = _materialise(spec, args, kwargs, device)
        results.append(value)
        if spec[0] == "tensor":
            outs.append(value)
        elif spec[0] == "list":  # Tensor[] returns are expanded in place
            outs.extend(v if s[0] == "tensor" else None for v, s in zip(value, spec[1]))
        else:
            outs.append(None)
    tensors = _tensor_arguments(args, kwargs) if key is not None else None
    encoding = _cached_encoding(op, key, args, kwargs, tensors, outs, index) if key is not None else None
    if encoding is not None:
        session.run_encoded(encoding.fill(tensors, outs, index))
    else:
        enc_args, enc_kwargs = encode_args(op, args, kwargs, index)
        out_refs = tuple(None if t is None else handles.output_ref(t, index) for t in outs)
        session.run(meta.op_name(op), enc_args, enc_kwargs, out_refs, _stream(op, index))
    return meta.pack_results(op, results)


# -- cached encodings -----------------------------------------------------------------------------
# A training loop sends the same ops on the same layouts again and again; their RunOp
# items differ only in storage ids. So the encoding is made once per meta key (op and
# argument metadata), device and argument offsets, with marker ids where the real ones
# go, and each later call only joins the pieces with its ids.

#: marker ids: no session hands out ids this large, and each encodes as 9 unusual bytes
_MARK = 0x5A5A_A5A5 << 28
_ENCODINGS_MAX = 1 << 14
_encodings: dict = {}
_UNCACHEABLE = object()


class _Encoding:
    __slots__ = ("pieces",)

    def __init__(self, pieces: tuple):
        self.pieces = pieces  # the item's bytes around its holes: one more than there are holes

    def fill(self, tensors: list, outs, index: int) -> Raw:
        """The item for this call, `tensors` its _tensor_arguments. Holes: a remote
        argument's storage id, a CPU scalar's whole inline value (wrapped numbers differ
        call to call), a result's storage id."""
        holes = [encode_int(handles.argument_sid(t, index)) if t.device.type != "cpu"
                 else encode(tv.inline_cpu_tensor(t)) for t in tensors]
        holes += [encode_int(handles.output_sid(t, index)) for t in outs if t is not None]
        pieces = self.pieces
        parts = [pieces[0]]
        for i, hole in enumerate(holes, 1):
            parts.append(hole)
            parts.append(pieces[i])
        return Raw(b"".join(parts))


def _tensor_arguments(args, kwargs) -> list:
    """Tensor arguments in encoding order: positional, then keyword by name."""
    found = []
    for value in itertools.chain(args, (kwargs[k] for k in sorted(kwargs))):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif type(value) is list or type(value) is tuple:
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _cached_encoding(op, key, args, kwargs, tensors, outs, index: int):
    full_key = (key, index, tuple(t.storage_offset() for t in tensors))
    encoding = _encodings.get(full_key)
    if encoding is None:
        encoding = _make_encoding(op, args, kwargs, tensors, outs, index)
        if len(_encodings) >= _ENCODINGS_MAX:
            _encodings.clear()
        _encodings[full_key] = encoding
    return None if encoding is _UNCACHEABLE else encoding


def _make_encoding(op, args, kwargs, tensors, outs, index: int):
    schema = meta.schema_of(op)
    if schema.generator_arg is not None or schema.seeded_without_generator:
        return _UNCACHEABLE  # random streams move on: their references change call to call
    marks = itertools.count(_MARK)

    def marked_ref(t):
        if t.device.type == "cpu":
            return Raw(encode_int(next(marks)))
        # a tensor on another device is refused by fill (handles.argument_sid)
        return tv.encoded_tensor_ref(next(marks), t.dtype, t.shape, t.stride(), t.storage_offset(),
                                     handles.ref_flags(t))

    enc_args = tuple(_encode(a, marked_ref, index) for a in args)
    enc_kwargs = {k: _encode(kwargs[k], marked_ref, index) for k in sorted(kwargs)}
    n_in = next(marks) - _MARK  # the marks handed out so far
    if n_in != len(tensors):
        return _UNCACHEABLE  # tensors nested deeper than _tensor_arguments looks
    out_marks = itertools.count(_MARK + n_in)
    out_refs = [None if t is None else tv.encoded_tensor_ref(next(out_marks), t.dtype, t.shape, t.stride(),
                                                             t.storage_offset(), 0) for t in outs]
    item = encode(m.batch_item(m.RunOp(meta.op_name(op), enc_args, enc_kwargs, tuple(out_refs), False, None)))
    pieces, rest = [], item
    for k in range(len(tensors) + sum(t is not None for t in outs)):
        mark = encode_int(_MARK + k)
        at = rest.find(mark)
        if at < 0 or rest.find(mark, at + 1) >= 0:
            return _UNCACHEABLE  # not exactly once where expected: do not guess
        pieces.append(rest[:at])
        rest = rest[at + len(mark):]
    pieces.append(rest)
    return _Encoding(tuple(pieces))


def _stream(op, index: int):
    """The default stream's reference for seeded ops without a generator argument."""
    return handles.generator_ref(None, index) if meta.schema_of(op).seeded_without_generator else None


def _materialise(spec, args, kwargs, device):
    """One result of an op: the tensor(s) the caller gets."""
    kind = spec[0]
    if kind == "arg":  # in-place / out=: the result is an argument itself
        value = meta.argument(args, kwargs, spec[1])
        if spec[2] is not None and tuple(value.shape) != spec[2]:
            value.resize_(spec[2])  # out= tensors of another shape are resized, as in eager
        return value
    if kind == "view":  # a non-writing alias of an argument: metadata only
        base = meta.argument(args, kwargs, spec[1])
        _, _, shape, stride, offset, dtype = spec
        return torch.as_strided(base, shape, stride, base.storage_offset() + offset)
    if kind == "tensor":
        _, shape, stride, dtype = spec
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if kind == "list":
        return [_materialise(s, args, kwargs, device) for s in spec[1]]
    if kind == "none":
        return None
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
