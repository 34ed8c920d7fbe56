"""Remote tensors as the server sees them: storage ids, references, announcements.

A remote tensor is an ordinary torch.Tensor whose storage came from the C++ allocator:
the storage's id names the server-side storage, and (size, stride, storage_offset,
dtype, conj/neg bits) rebuild the exact view there. A storage is announced to the
server (ALLOC) the first time an op uses it, and freed when the C++ deleter reports it;
which storages the server knows is kept in C++, where the fallback serves cached ops.
"""

from __future__ import annotations

import torch

from ..dataplane.codec import Ext
from ..dataplane.wire import MsgType
from ..torch_wire import sparse as tw_sparse
from ..torch_wire import values as tv
from . import runtime
from ._native import load

_C = load()
_FREE = int(MsgType.FREE)  # the FreeStorage item NativeQueue.take appends


def device_index(t: torch.Tensor) -> int:
    return t.device.index or 0


class NativeQueue:
    """A device's request queue in C++ (csrc/op_queue.h): ops served from cached plans,
    and ALLOCs, wait there until the session takes them into its next batch."""

    def __init__(self, index: int):
        self.index = index
        _C.queue_open(index)  # also forgets the storages an earlier server knew

    def take(self) -> tuple[int, int, bytes]:
        """(requests, of which ops, their encodings back to back) queued since the last take,
        and last a FreeStorage of the storages freed since then that the server knows:
        every use of them is queued by now, here or in Python's batch before this take."""
        return _C.queue_take(self.index, _FREE)

    def wait(self, timeout: float) -> bool:
        """Sleep without the GIL until an op is queued here or wake() is called since the
        last take, or the queue closes (True), or `timeout` seconds pass (False): the
        timer flush's wait. It takes nothing: only take() clears what it waits for."""
        return _C.queue_wait(self.index, timeout)

    def wake(self) -> None:
        _C.queue_wake(self.index)

    def memory_allocated(self) -> int:
        """Bytes of this device's live storages, as the allocator counts them."""
        return _C.memory_allocated(self.index)[0]

    def close(self) -> None:
        _C.queue_close(self.index)


def set_memory_limit(index: int, limit: int) -> None:
    """The session's memory limit (0: none but the device's), enforced at allocation."""
    _C.set_memory_limit(index, limit)


def announce(t: torch.Tensor, index: int) -> int:
    """The tensor's storage id, queueing ALLOC first if the server has not seen it."""
    return _C.announce(t, index)


def tensor_ref(t: torch.Tensor, index: int) -> Ext:
    """The wire reference of a tensor argument (remote storage, or a small CPU value)."""
    if t.layout is not torch.strided:
        if t.device.type != "remote_accel":
            raise RuntimeError(f"remote_accel cannot mix in a {t.layout} tensor on {t.device}: move it first")
        return tw_sparse.encode(t, lambda part: tensor_ref(part, index))
    if t.device.type == "cpu":
        return tv.inline_cpu_tensor(t)
    return tv.encoded_tensor_ref(argument_sid(t, index), t.dtype, t.shape, t.stride(), t.storage_offset(),
                                 ref_flags(t))


def argument_sid(t: torch.Tensor, index: int) -> int:
    """The storage id of a remote tensor argument of an op on device `index`."""
    if t.device.type != "remote_accel":
        raise RuntimeError(f"remote_accel cannot mix in a tensor on {t.device}")
    if device_index(t) != index:
        raise RuntimeError(f"expected all tensors on remote_accel:{index}, found one on {t.device}")
    return announce(t, index)


def ref_flags(t: torch.Tensor) -> int:
    return (tv.FLAG_CONJ if t.is_conj() else 0) | (tv.FLAG_NEG if t.is_neg() else 0)


def output_sid(t: torch.Tensor, index: int) -> int:
    """The storage id of a fresh tensor an op is about to fill. No ALLOC: the server
    creates the storage when it binds the op's result to this id."""
    return _C.announce_output(t, index)


def output_ref(t: torch.Tensor, index: int):
    return tv.encoded_tensor_ref(output_sid(t, index), t.dtype, t.shape, t.stride(), t.storage_offset(), 0)


def generator_ref(gen: torch.Generator | None, index: int) -> Ext:
    gen_id, seed, epoch = _C.generator_info(gen if gen is not None else _C.default_generator(index))
    return stream_ref(index, gen_id, seed, epoch)


def stream_ref(index: int, gen_id: int, seed: int, epoch: int) -> Ext:
    # id 0 is the server's session-default stream, which also drives ops that take no
    # generator argument (native_dropout): manual_seed must reach those too
    return Ext(tv.GENERATOR, (0 if gen_id == _C.default_generator_id(index) else gen_id, seed, epoch))


def _get_generator_state(index: int, gen_id: int, seed: int, epoch: int) -> bytes:
    return runtime.session(index).rng("get", stream_ref(index, gen_id, seed, epoch))


def _set_generator_state(index: int, gen_id: int, seed: int, epoch: int, state: bytes) -> None:
    runtime.session(index).rng("set", stream_ref(index, gen_id, seed, epoch), state)


def install_generator_state_hooks() -> None:
    """Generator.get_state()/set_state() of remote_accel generators ask the server."""
    _C.set_generator_state_hooks(_get_generator_state, _set_generator_state)
