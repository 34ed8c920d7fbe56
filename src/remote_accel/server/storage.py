"""One session's storage table: client storage ids -> device storages, with accounting.

Tensors never live in the table, only untyped storages. Every tensor an op sees is
rebuilt from a reference (sid, dtype, shape, stride, storage_offset, conj/neg flags) over
its storage, so two references into one storage alias exactly as they do on the client.
A reference is checked against its storage's size first: `Tensor.set_` would otherwise
silently grow the storage to fit whatever a peer asks for.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Iterable, NamedTuple, Optional

import torch

from ..errors import ProtocolError
from ..torch_wire import values as torch_values
from . import native
from .device import ComputeDevice
from .failure import bad_handle

#: Larger views are refused: no real tensor has 2**50 elements, and huge expanded views
#: would only keep a kernel busy.
MAX_NUMEL = 1 << 50
_INT64 = (-(1 << 63), (1 << 63) - 1)


def host_bytes(t: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU uint8 tensor as a writable byte buffer. Unlike
    Tensor.numpy(), this leaves the storage resizable, so storages behave the same for
    ops whether or not bytes have been written into them."""
    return memoryview((ctypes.c_ubyte * t.numel()).from_address(t.data_ptr())).cast("B")


class TensorRef(NamedTuple):
    sid: int
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int
    flags: int
    span: int  # bytes of storage the view reaches, from the storage's start


def parse_ref(value: Any) -> TensorRef:
    """The payload of a torch_values.TENSOR value, type-checked; ProtocolError otherwise."""
    sid, layout = ref_parts(value)
    return TensorRef(sid, *layout[:6])


def ref_parts(value: Any) -> tuple:
    """parse_ref without the TensorRef, where references come by the hundred (a graph call's
    inputs and outs): (sid, layout), layout being the TensorRef's fields after sid and then
    the key compiled code is kept by (dtype, shape, stride, flags: graphs.value_signature)."""
    if type(value) is not tuple or len(value) != 6 or type(value[0]) is not int:
        raise ProtocolError("malformed tensor reference")
    try:
        return value[0], _parse_cached(value[1:])
    except TypeError:  # unhashable (lists inside): not worth caching, and malformed anyway
        return value[0], _parse(value[1:])


def _parse(layout: Any) -> tuple:
    """A reference's layout (all but its storage id) checked: the TensorRef fields after sid,
    then the key compiled code is kept by."""
    dtype, shape, stride, offset, flags = layout
    if type(offset) is not int or offset < 0 or type(flags) is not int:
        raise ProtocolError("malformed tensor reference")
    if flags & ~(torch_values.FLAG_CONJ | torch_values.FLAG_NEG):
        raise ProtocolError(f"unknown tensor flags {flags:#x}")
    shape = torch_values.check_shape(shape)
    stride = torch_values.check_shape(stride, "stride")
    if len(stride) != len(shape):
        raise ProtocolError(f"stride {stride} does not match shape {shape}")
    dtype = torch_values.dtype_from_name(dtype)
    span = span_bytes(shape, stride, offset, dtype.itemsize)
    return dtype, shape, stride, offset, flags, span, (dtype, shape, stride, flags)


# A client names the same few layouts over and over (weights, activations, fresh outputs
# of a graph): checking one costs more than the op it feeds on small tensors, and the
# check depends on the layout alone, not on the storage id (keyed by the whole reference,
# a graph's fresh outputs would push the weights out). Errors are not cached (lru_cache
# lets them through).
_parse_cached = functools.lru_cache(maxsize=4096)(_parse)


def span_bytes(shape: Iterable[int], stride: Iterable[int], offset: int, itemsize: int) -> int:
    """Bytes of storage a view needs, counted from the storage's start."""
    extent = 1
    numel = 1
    for size, step in zip(shape, stride):
        numel *= size
        extent += (size - 1) * step
    if numel == 0:
        return 0  # as ATen's computeStorageNbytes: an empty view needs no bytes, whatever its offset
    if numel > MAX_NUMEL:
        raise ProtocolError(f"a view of {numel} elements is too large")
    return (offset + extent) * itemsize


#: Storage id of every storage without bytes: the client's allocator hands out no id
#: (nor memory) for them, so any tensor with no elements names storage 0.
EMPTY_SID = 0


def is_sid(sid: Any) -> bool:
    """Whether `sid` can name a storage: ids are signed 64-bit ints."""
    return type(sid) is int and _INT64[0] <= sid <= _INT64[1]


class StorageTable:
    """The Python face of the C++ table (native.Executor), which the C++ executor shares:
    entries and accounting live there, so a batch run in C++ binds results without Python."""

    def __init__(self, device: ComputeDevice, limit: int, pool: Optional["native.Pool"] = None):
        self.device = device
        # `pool`: the server's device memory, shared by every session (swap.py)
        self.native = native.Executor(str(device.device), limit, pool)
        self.limit = limit  # bytes this session may hold

    @property
    def used(self) -> int:
        return self.native.used()

    @property
    def peak(self) -> int:
        return self.native.peak()

    def __len__(self) -> int:
        return self.native.size()

    def __contains__(self, sid: Any) -> bool:
        return is_sid(sid) and self.native.contains(sid)

    # -- accounting --------------------------------------------------------------------------
    def check_fits(self, nbytes: int) -> None:
        """Refuse, before touching the device, what would take the session over its limit.
        What its host blocks hold beyond its storages counts too (dataplane/host_blocks.cpp): its
        cached free blocks make room first, its live blocks' rounding up cannot."""
        self.native.check_fits(nbytes)  # table.cpp: every charge counted in one place

    def hold(self, nbytes: int) -> None:
        """Charge `nbytes` that the server holds for this session outside its storages (an
        echo's payload, kept plans and graphs) until release(nbytes); refused as out of
        memory past the limit, as a storage would be."""
        self.check_fits(nbytes)
        self.native.hold(nbytes)

    def release(self, nbytes: int) -> None:
        self.native.hold(-nbytes)

    def resync(self, sids: Iterable[int]) -> None:
        """Re-count storages an op may have resized (resize_, set_, out= with a wrong size).
        Such growth is only seen afterwards: past the limit, it is reported as out of
        memory and every later allocation of the session is refused until it frees some."""
        self.native.resync([sid for sid in sids if is_sid(sid)])

    # -- entries -------------------------------------------------------------------------------
    def _check_new(self, sid: Any) -> None:
        if not is_sid(sid):
            raise ProtocolError(f"storage id {sid!r} is not a 64-bit integer")
        if self.native.contains(sid):
            raise bad_handle(f"storage {sid} already exists")
        if sid == EMPTY_SID:
            raise bad_handle(f"storage {EMPTY_SID} is every empty tensor's and cannot be allocated")

    def alloc(self, sid: int, nbytes: int) -> None:
        self._check_new(sid)
        if type(nbytes) is not int or nbytes < 0:
            raise ProtocolError(f"bad allocation size {nbytes!r}")
        self.check_fits(nbytes)
        self.native.alloc(sid, nbytes)

    def put(self, sid: int, storage: "torch.UntypedStorage | torch.Tensor", replace: bool = True) -> None:
        """Keep an op's result storage (or a tensor's whole storage) under `sid`, in place
        of what `sid` held if `replace`; the caller has checked the limit (check_fits) beforehand."""
        if not (replace and sid in self):
            self._check_new(sid)
        if isinstance(storage, torch.Tensor):  # C++ keeps the tensor's storage: no uint8 view needed
            self.native.put(sid, storage, replace)
            return
        whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        self.native.put(sid, whole, replace)

    def get(self, sid: Any) -> Optional[torch.UntypedStorage]:
        if not is_sid(sid):
            return None
        whole = self.native.get(sid)
        return None if whole is None else whole.untyped_storage()

    def free(self, sid: int) -> bool:
        return is_sid(sid) and self.native.free(sid)

    def clear(self) -> tuple[int, int]:
        """Drop everything; returns (storages, bytes) released."""
        return self.native.clear()

    def storage(self, sid: Any) -> torch.UntypedStorage:
        if sid == EMPTY_SID and type(sid) is int:
            # a fresh one each time: an op that resizes its output must not grow a shared one
            return torch.UntypedStorage(0, device=self.device.device)
        storage = self.get(sid)
        if storage is None:
            raise bad_handle(f"unknown storage {sid!r}")
        return storage

    # -- views ------------------------------------------------------------------------------------
    def tensor(self, ref: TensorRef) -> torch.Tensor:
        storage = self.storage(ref.sid)
        need = ref.span
        if need > storage.nbytes():
            raise bad_handle(f"view {tuple(ref.shape)}/{tuple(ref.stride)}+{ref.offset} of {ref.dtype} "
                             f"needs {need} bytes, storage {ref.sid} has {storage.nbytes()}")
        t = torch.empty(0, dtype=ref.dtype, device=storage.device)
        t.set_(storage, ref.offset, ref.shape, ref.stride)
        if ref.flags & torch_values.FLAG_CONJ:
            t = t.conj()
        if ref.flags & torch_values.FLAG_NEG:
            t = torch._neg_view(t)
        return t

    def host_copy(self, sid: Any, offset: Any, nbytes: Any) -> bytes:
        """A copy of bytes [offset, offset + nbytes) of a storage in host memory (a CPU
        server's scalar for `.item()`), without making a tensor view: a fraction of the
        cost of a small read. A bad range goes through byte_range, which says what is wrong."""
        whole = self.native.get(sid) if is_sid(sid) else None
        if (whole is None or type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0
                or offset + nbytes > whole.numel()):
            return bytes(host_bytes(self.byte_range(sid, offset, nbytes)))
        return ctypes.string_at(whole.data_ptr() + offset, nbytes)

    def byte_range(self, sid: Any, offset: Any, nbytes: Any) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of a storage, as a uint8 tensor sharing its memory."""
        storage = self.storage(sid)
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
            raise ProtocolError(f"bad byte range {offset!r}+{nbytes!r}")
        if offset + nbytes > storage.nbytes():
            raise bad_handle(f"bytes {offset}..{offset + nbytes} are outside storage {sid} "
                             f"of {storage.nbytes()} bytes")
        t = torch.empty(0, dtype=torch.uint8, device=storage.device)
        return t.set_(storage, offset, (nbytes,), (1,))
