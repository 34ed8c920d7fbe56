"""Ops that move data between the host and the server, or between servers.

Uploads (`.to("remote_accel")`, copy_ from CPU) are queued like any op and never wait.
Downloads (`.cpu()`, `.item()`) are sync points: one round trip, straight into the
destination's memory when its layout allows.

The fallback (above this module) dispatches the SPECIAL_OPS here; a transfer that turns
out to be an op of one server hands it back through the `OnServer` it was given.
"""

from __future__ import annotations

import ctypes
import secrets
import struct
import sys
import threading
from typing import Callable, NamedTuple

import torch

from ..dataplane.messages import PEER_TICKET_BYTES

from . import handles, runtime

_C = handles._C

#: downloads this large first fault their destination in
PREFAULT_MIN = 4 << 20
_MADV_POPULATE_WRITE = 23
#: a direct copy's two halves leave together: each server holds its later requests until
#: its half is done, so copies issued from two threads (autograd's device threads) in
#: opposite directions, interleaved as "B: receive x, A: receive y, A: send x, B: send y",
#: would each wait for the other until the copy timeout
_PEER_PAIR = threading.Lock()
_madvise = ctypes.CDLL(None, use_errno=True).madvise if sys.platform == "linux" else None
if _madvise is not None:
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _prefault(t: torch.Tensor, nbytes: int) -> None:
    """Fault in a fresh `.cpu()` destination before the bytes arrive.

    A new large tensor is untouched mmap'd memory: receiving into it takes a page fault
    every 4 KiB (the kernel zeroing each page) in the middle of the receive loop, which
    makes it 4-5x slower than receiving into touched memory. Populating the range in one
    call does the faults in the kernel at once. Not on huge pages (MADV_HUGEPAGE): a
    fault there may stall on compaction for 0.6 s (dataplane/host_pages.h). A hint: on
    memory already touched, or a kernel without it, it does nothing."""
    if _madvise is None or nbytes < PREFAULT_MIN:
        return
    start = t.data_ptr()
    end = start + nbytes
    lo, hi = -(-start // 4096) * 4096, end // 4096 * 4096
    if hi > lo:
        _madvise(lo, hi - lo, _MADV_POPULATE_WRITE)


class OnServer(NamedTuple):
    """The fallback's ways to run an op on a server: queued, or waiting for its reply."""

    run_op: Callable
    run_with_reply: Callable


def _is_remote(t: torch.Tensor) -> bool:
    return t.device.type == "remote_accel"


def _plain_contiguous(t: torch.Tensor) -> bool:
    """True when the tensor's bytes are one dense run in its storage, with no lazy bits."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without copying."""
    if not t.numel():
        return memoryview(bytearray())
    # A contiguous tensor's size-1 dims may have any stride (x[:1, 2] keeps x's row
    # stride), and reshape keeps it, which view(uint8) refuses: its elements are one
    # dense run all the same, so name that run with unit stride.
    flat = t.as_strided((t.numel(),), (1,))
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy())


def upload(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> None:
    """CPU `src` -> remote `dst` (dst's dtype, broadcast like copy_).

    non_blocking from pinned memory (pin_memory(), DataLoader(pin_memory=True)): a large
    upload leaves in the background, as a CUDA copy from pinned memory does, while this
    thread goes on queueing ops; as on CUDA, `src` must not change until the copy is done
    (a sync point)."""
    index = handles.device_index(dst)
    session = runtime.session(index)
    data = src.expand_as(dst).to(dst.dtype).resolve_conj().resolve_neg().contiguous()
    if _plain_contiguous(dst):
        sid = handles.announce(dst, index)
        if data.numel():
            background = non_blocking and data.data_ptr() == src.data_ptr() and _C.is_pinned_ptr(src.data_ptr())
            # the tensor whose in-place changes would change these bytes: the caller's (views
            # made here, below autograd, get version counters of their own)
            source = src if data.data_ptr() == src.data_ptr() else data
            session.write(sid, dst.storage_offset() * dst.element_size(), _byte_view(data), background=background,
                          source=source)
        return
    # a strided or lazily-conjugated destination: upload dense, then copy on the server
    staging = torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
    upload(data, staging)
    dst.copy_(staging)


def download(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Remote `src` -> CPU `dst`: one round trip."""
    index = handles.device_index(src)
    session = runtime.session(index)
    if not _plain_contiguous(src):
        src = src.resolve_conj().resolve_neg().contiguous()  # runs on the server
    sid = handles.announce(src, index)
    direct = dst.dtype == src.dtype and tuple(dst.shape) == tuple(src.shape) and _plain_contiguous(dst)
    target = dst if direct else torch.empty(src.shape, dtype=src.dtype)
    nbytes = src.numel() * src.element_size()
    if nbytes:
        _prefault(target, nbytes)
        session.read(sid, src.storage_offset() * src.element_size(), nbytes, out=_byte_view(target))
    else:
        session.sync()  # still a sync point: pending errors surface here
    if not direct:
        dst.copy_(target)


def copy_between(src: torch.Tensor, dst: torch.Tensor, server: OnServer, non_blocking: bool = False) -> torch.Tensor:
    if _is_remote(dst) and _is_remote(src):
        if src.device == dst.device:
            server.run_op(torch.ops.aten.copy_.default, (dst, src, non_blocking), {})
        elif not copy_direct(src, dst):  # two servers that cannot reach each other: through this host
            staging = torch.empty(src.shape, dtype=src.dtype)
            download(src, staging)
            upload(staging, dst)
    elif _is_remote(dst):
        upload(src, dst, non_blocking)
    elif _is_remote(src):
        download(src, dst)
    else:
        dst.copy_(src)
    return dst


def copy_direct(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Copy between two servers without the bytes passing this host (server.peer): two
    small messages, one to each server. False when the destination cannot be reached
    by the source (a DPDK session, or direct copies turned off at init)."""
    src_index, dst_index = handles.device_index(src), handles.device_index(dst)
    source, dest = runtime.session(src_index), runtime.session(dst_index)
    if dest.peer_address is None or source.peer_address is None:
        return False
    if not _plain_contiguous(src):
        src = src.resolve_conj().resolve_neg().contiguous()  # runs on the source server
    if src.dtype != dst.dtype or tuple(src.shape) != tuple(dst.shape) or not _plain_contiguous(dst):
        # the bytes land dense in a fresh tensor, then one op on the destination converts
        staging = torch.empty(src.shape, dtype=src.dtype, device=dst.device)
        copy_direct(src, staging)
        dst.copy_(staging)
        return True
    nbytes = src.numel() * src.element_size()
    if not nbytes:
        return True
    ticket = secrets.token_bytes(PEER_TICKET_BYTES)
    dst_sid = handles.announce(dst, dst_index)
    src_sid = handles.announce(src, src_index)
    # the destination first: its half waits for the bytes (and may be asked second too)
    with _PEER_PAIR:
        dest.peer_receive(ticket, dst_sid, dst.storage_offset() * dst.element_size(), nbytes, source)
        source.peer_send(ticket, src_sid, src.storage_offset() * src.element_size(), nbytes, dest)
    return True


def _copy_from(op, args, kwargs, server: OnServer):
    src, dst = args[0], args[1]
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return copy_between(src, dst, server, non_blocking)


def _copy_from_and_resize(op, args, kwargs, server: OnServer):
    src, dst = args[0], args[1]
    if tuple(dst.shape) != tuple(src.shape):
        dst.resize_(src.shape)
    return copy_between(src, dst, server)


def _copy_(op, args, kwargs, server: OnServer):
    dst, src = args[0], args[1]
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return copy_between(src, dst, server, non_blocking)


def _local_scalar_dense(op, args, kwargs, server: OnServer):
    """`.item()`: read the element's bytes (one READ, answered by the server at once),
    rather than running the op there and waiting for its result's metadata."""
    (t,) = args
    if t.numel() != 1:  # torch's own error, raised by the server
        return server.run_with_reply(op, (t,), {}, handles.device_index(t))
    unpack = _SCALAR_FORMATS.get(t.dtype)
    if unpack is None or t.is_conj() or t.is_neg():
        host = torch.empty(t.shape, dtype=t.dtype)
        download(t, host)
        return host.item()
    # the common case without a host tensor: the element's bytes, unpacked as item() would
    index = handles.device_index(t)
    sid = handles.announce(t, index)
    size = t.element_size()
    data = runtime.session(index).read(sid, t.storage_offset() * size, size)
    value = unpack(data)[0]
    return complex(value, unpack(data, 4 if size == 8 else 8)[0]) if t.dtype.is_complex else value


def read_scalar(t: torch.Tensor):
    """The element's bytes of a one-element strided remote tensor (one READ), for the C++
    `.item()` kernel (csrc/op_fallback.cpp), which unpacks them; None for a dtype it does
    not unpack (it then takes the general path, _local_scalar_dense above)."""
    if t.dtype not in _READ_SCALAR_DTYPES:
        return None
    index = handles.device_index(t)
    sid = handles.announce(t, index)
    size = t.element_size()
    return runtime.session(index).read(sid, t.storage_offset() * size, size)


#: what local_scalar_dense in C++ unpacks (AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND3 with
#: Half, Bool and BFloat16)
_READ_SCALAR_DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                 torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
                                 torch.complex128))


#: struct readers of one element, as Tensor.item() returns it (a complex's real part;
#: its imaginary part follows); dtypes not here take the host-tensor path
_SCALAR_FORMATS = {dtype: struct.Struct("<" + fmt).unpack_from for dtype, fmt in (
    (torch.float32, "f"), (torch.float64, "d"), (torch.float16, "e"), (torch.int64, "q"), (torch.int32, "i"),
    (torch.int16, "h"), (torch.int8, "b"), (torch.uint8, "B"), (torch.bool, "?"),
    (torch.complex64, "f"), (torch.complex128, "d"))}


def _resize_(op, args, kwargs, server: OnServer):
    """Resize in place; growing moves the data into a larger storage on the server."""
    t, size = args[0], tuple(args[1])
    memory_format = args[2] if len(args) > 2 else kwargs.get("memory_format")
    numel = 1
    for s in size:
        numel *= s
    needed = (t.storage_offset() + numel) * t.element_size()
    storage = t.untyped_storage()
    if needed > storage.nbytes():
        grown = torch.empty(needed, dtype=torch.uint8, device=t.device)
        if storage.nbytes():
            old = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))
            grown[: storage.nbytes()].copy_(old)
        storage = grown.untyped_storage()
    stride = _contiguous_strides(size)
    t.set_(storage, t.storage_offset(), size, stride)
    if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
        t.set_(storage, t.storage_offset(), size, torch.empty(size, device="meta", memory_format=memory_format).stride())
    return t


def _contiguous_strides(size) -> tuple:
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def runs_on_server(op, args) -> bool:
    """Whether a call of a SPECIAL_OPS op is an ordinary op after all: copy_ between two
    tensors of one server."""
    return (op is torch.ops.aten.copy_.default and _is_remote(args[0]) and _is_remote(args[1])
            and args[0].device == args[1].device)


def on_one_server(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether copying src into dst is an op of one server that cannot fail on shapes."""
    return (_is_remote(src) and _is_remote(dst) and src.device == dst.device and src.dim() <= dst.dim()
            and all(s in (1, d) for s, d in zip(reversed(src.shape), reversed(dst.shape))))


#: SPECIAL_OPS whose calls may be ordinary ops of one server (runs_on_server, on_one_server):
#: a host transfer must not stop their later calls from being served from plans
SOMETIMES_ON_SERVER = frozenset({torch.ops.aten.copy_.default, torch.ops.aten._copy_from.default})

SPECIAL_OPS = {
    torch.ops.aten._copy_from.default: _copy_from,
    torch.ops.aten._copy_from_and_resize.default: _copy_from_and_resize,
    torch.ops.aten.copy_.default: _copy_,
    torch.ops.aten._local_scalar_dense.default: _local_scalar_dense,
    torch.ops.aten.resize_.default: _resize_,
}
