"""How torch values travel in message fields.

Op arguments are Python values, torch enums and tensors. They become `codec` values:
plain scalars and containers as themselves, torch types as `Ext` with the codes below.
Tensors are references to remote storage (TENSOR) or, for small CPU tensors that ops
take as arguments (wrapped scalars, index lists), inline bytes (CPU_TENSOR).
Decoding accepts only dtypes, layouts and memory formats from fixed tables.

A GENERATOR names a random stream: the server keeps one generator per (client, id) and
reseeds it whenever it sees a new (seed, epoch) for that id. Id 0 is the session's
default stream: the server also draws from it for ops that take no generator argument
(native_dropout) or are sent with None, so a client should send its default generator
as id 0 to make `manual_seed` reach those ops too.
"""

from __future__ import annotations

import struct
from typing import Any, Callable

import torch

from ..dataplane import codec
from ..dataplane.codec import Ext, Raw
from ..errors import ProtocolError

TENSOR = 1  # (sid, dtype, shape, stride, storage_offset, flags)
DTYPE = 2  # name
DEVICE = 3  # (type, index); "remote_accel" means the server's own device
LAYOUT = 4  # name
MEMORY_FORMAT = 5  # name
GENERATOR = 6  # (generator id, seed, epoch)
CPU_TENSOR = 7  # (dtype, shape, raw little-endian bytes), contiguous
GRAPH_VALUE = 8  # index of an earlier node's result inside a RunGraph
SCALAR = 9  # (dtype, raw little-endian bytes): a Scalar argument of a planned op, a RunPlanned hole
SPARSE = 10  # (layout, size, component tensor references, coalesced): see torch_wire.sparse

FLAG_CONJ = 1
FLAG_NEG = 2

#: Inline CPU tensors above this size are refused: large data moves with WRITE.
MAX_INLINE_BYTES = 1 << 16

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.complex32, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
        torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
    )
}
DTYPE_NAMES = {d: n for n, d in DTYPES.items()}
LAYOUTS = {
    "strided": torch.strided, "sparse_coo": torch.sparse_coo, "sparse_csr": torch.sparse_csr,
    "sparse_csc": torch.sparse_csc, "sparse_bsr": torch.sparse_bsr, "sparse_bsc": torch.sparse_bsc,
}
LAYOUT_NAMES = {v: k for k, v in LAYOUTS.items()}
MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve_format": torch.preserve_format,
}
MEMORY_FORMAT_NAMES = {v: k for k, v in MEMORY_FORMATS.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported by remote_accel") from None


def dtype_from_name(name: Any) -> torch.dtype:
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ProtocolError(f"unknown dtype {name!r}") from None


def encode_value(v: Any, tensor_ref: Callable[[torch.Tensor], Ext]) -> Any:
    """Python/torch value -> codec value; tensors go through `tensor_ref`."""
    t = type(v)
    if t in (int, float, bool, str, complex) or v is None:
        return v
    if isinstance(v, torch.Tensor):
        return tensor_ref(v)
    if t is list or t is tuple or isinstance(v, torch.Size):
        return [encode_value(x, tensor_ref) for x in v] if t is list else tuple(encode_value(x, tensor_ref) for x in v)
    if t is torch.dtype:
        return Ext(DTYPE, dtype_name(v))
    if t is torch.device:
        return Ext(DEVICE, (v.type, -1 if v.index is None else v.index))
    if t is torch.layout:
        return Ext(LAYOUT, LAYOUT_NAMES[v])
    if t is torch.memory_format:
        return Ext(MEMORY_FORMAT, MEMORY_FORMAT_NAMES[v])
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise TypeError("symbolic values cannot be sent to the server")
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    if t is dict:
        return {k: encode_value(x, tensor_ref) for k, x in v.items()}
    raise TypeError(f"cannot send a value of type {t.__name__} to the server")


_REF_HEAD = bytes((codec._EXT, TENSOR)) + codec.tuple_header(6)
_ref_tails: dict = {}
_REF_TAILS_MAX = 1 << 14


def encoded_tensor_ref(sid: int, dtype: torch.dtype, shape: tuple, stride: tuple, offset: int, flags: int) -> Raw:
    """Ext(TENSOR, (sid, dtype, shape, stride, offset, flags)), encoded: the same few
    layouts recur op after op, so their encoding is cached and only the id is encoded."""
    key = (dtype, shape, stride, offset, flags)
    tail = _ref_tails.get(key)
    if tail is None:
        tail = b"".join(codec.encode(v) for v in (dtype_name(dtype), tuple(shape), tuple(stride), offset, flags))
        if len(_ref_tails) >= _REF_TAILS_MAX:
            _ref_tails.clear()
        _ref_tails[key] = tail
    return Raw(_REF_HEAD + codec.encode_int(sid) + tail)


#: 0-dim CPU tensors of these dtypes (wrapped numbers above all) are packed from .item()
_SCALAR_PACK = {
    torch.float64: struct.Struct("<d"), torch.float32: struct.Struct("<f"), torch.int64: struct.Struct("<q"),
    torch.int32: struct.Struct("<i"), torch.bool: struct.Struct("<?"),
}


def inline_cpu_tensor(t: torch.Tensor) -> Ext:
    """A small CPU tensor, by value."""
    if t.dim() == 0 and not t.is_conj() and not t.is_neg():  # the common case
        return Ext(CPU_TENSOR, (dtype_name(t.dtype), (), scalar_bytes(t)))
    if t.nbytes > MAX_INLINE_BYTES:
        raise ValueError(f"CPU tensor of {t.nbytes} bytes is too large to pass inline")
    c = t.detach().resolve_conj().resolve_neg().contiguous()
    return Ext(CPU_TENSOR, (dtype_name(c.dtype), tuple(c.shape), c.view(-1).view(torch.uint8).numpy().tobytes()
                            if c.numel() else b""))


def scalar_bytes(t: torch.Tensor) -> bytes:
    """The value of a 0-dim CPU tensor as it lies in memory (little-endian)."""
    pack = _SCALAR_PACK.get(t.dtype)
    if pack is not None:  # a few microseconds instead of ten
        return pack.pack(t.item())
    return t.detach().reshape(1).view(torch.uint8).numpy().tobytes()


def decode_cpu_tensor(value: Any) -> torch.Tensor:
    if type(value) is not tuple or len(value) != 3:
        raise ProtocolError("malformed inline tensor")
    dtype = dtype_from_name(value[0])
    shape = check_shape(value[1])
    raw = value[2]
    if type(raw) is not bytes:
        raise ProtocolError("malformed inline tensor data")
    numel = 1
    for s in shape:
        numel *= s
    itemsize = dtype.itemsize
    if len(raw) != numel * itemsize:
        raise ProtocolError(f"inline tensor has {len(raw)} bytes, shape {shape} needs {numel * itemsize}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    pack = _SCALAR_PACK.get(dtype) if not shape else None
    if pack is not None:  # a scalar (wrapped numbers above all), in half the time
        return torch.scalar_tensor(pack.unpack(raw)[0], dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


#: how a Scalar argument's value travels as a SCALAR: its Python type -> (dtype name, packing)
_SCALAR_TYPES = {float: ("float64", struct.Struct("<d")), int: ("int64", struct.Struct("<q")),
                 bool: ("bool", struct.Struct("<?")), complex: ("complex128", struct.Struct("<dd"))}
_SCALAR_UNPACK = {name: (pack, kind) for kind, (name, pack) in _SCALAR_TYPES.items()}


def is_scalar_value(v: Any) -> bool:
    """Whether `v` (an argument of schema type Scalar) can travel as a SCALAR."""
    return type(v) in _SCALAR_TYPES


def scalar_value(v: Any) -> Ext:
    """A Scalar argument by value, as a hole that RunPlanned refills (the plan then serves
    every value of it, such as an optimizer's step size that changes every step)."""
    name, pack = _SCALAR_TYPES[type(v)]
    if type(v) is int and not -(1 << 63) <= v < 1 << 63:
        raise OverflowError(f"{v} does not fit a 64-bit integer")
    return Ext(SCALAR, (name, pack.pack(v.real, v.imag) if type(v) is complex else pack.pack(v)))


def decode_scalar(value: Any) -> Any:
    """SCALAR payload -> the Python number it carries."""
    if type(value) is not tuple or len(value) != 2 or type(value[1]) is not bytes:
        raise ProtocolError("malformed scalar")
    found = _SCALAR_UNPACK.get(value[0]) if type(value[0]) is str else None
    if found is None:
        raise ProtocolError(f"a scalar cannot have dtype {value[0]!r}")
    pack, kind = found
    if len(value[1]) != pack.size:
        raise ProtocolError(f"a {value[0]} scalar has {pack.size} bytes, not {len(value[1])}")
    fields = pack.unpack(value[1])
    return complex(*fields) if kind is complex else fields[0]


def check_shape(value: Any, name: str = "shape") -> tuple:
    if type(value) not in (tuple, list) or len(value) > 64 or any(type(s) is not int or s < 0 for s in value):
        raise ProtocolError(f"malformed {name} {value!r}")
    return tuple(value)


def decode_value(v: Any, resolve: Callable[[int, Any], Any]) -> Any:
    """codec value -> Python/torch value. `resolve(code, payload)` handles TENSOR,
    SPARSE, DEVICE, GENERATOR and GRAPH_VALUE (they need the server's state)."""
    t = type(v)
    if t is Ext:
        code, value = v
        if code == DTYPE:
            return dtype_from_name(value)
        if code == LAYOUT:
            if value not in LAYOUTS:
                raise ProtocolError(f"unknown layout {value!r}")
            return LAYOUTS[value]
        if code == MEMORY_FORMAT:
            if value not in MEMORY_FORMATS:
                raise ProtocolError(f"unknown memory format {value!r}")
            return MEMORY_FORMATS[value]
        if code == CPU_TENSOR:
            return decode_cpu_tensor(value)
        if code == SCALAR:
            return decode_scalar(value)
        if code in (TENSOR, SPARSE, DEVICE, GENERATOR, GRAPH_VALUE):
            return resolve(code, value)
        raise ProtocolError(f"unknown value code {code}")
    if t is list:
        return [decode_value(x, resolve) for x in v]
    if t is tuple:
        return tuple(decode_value(x, resolve) for x in v)
    if t is dict:
        return {k: decode_value(x, resolve) for k, x in v.items()}
    return v
