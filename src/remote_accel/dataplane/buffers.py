"""Pinned host buffers: DPDK memory (hugepages where EAL has them, else --no-huge
memory) seen from Python as numpy arrays or CPU tensors, without copies.

Sending such a buffer attaches it to mbufs as external buffers (no copy on our side);
receiving into one (`pinned_sink`) lets the transport write frames straight into it.

    arr = pinned_empty(1 << 20)                  # numpy uint8, writable (EAL must run)
    t = as_tensor(arr, torch.float32)            # shares the memory
    msg = transport.recv(sink=pinned_sink())     # payloads land in pinned memory
"""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np

from . import dpdk

#: one allocation per size class (powers of two) keeps rte_malloc off the hot path
_MIN_CLASS = 4096


def pinned_empty(nbytes: int, dtype=np.uint8) -> np.ndarray:
    """An uninitialised array of `nbytes` bytes in DPDK memory (shape: nbytes // itemsize)."""
    return np.frombuffer(dpdk.pinned_buffer(nbytes), dtype=np.uint8).view(dtype)


def is_pinned(buf) -> bool:
    return dpdk.is_pinned(buf)


def as_tensor(arr: np.ndarray, dtype=None):
    """A CPU tensor over the same memory (torch imported only here)."""
    import torch

    t = torch.frombuffer(memoryview(arr).cast("B"), dtype=torch.uint8)
    return t if dtype is None else t.view(dtype)


class PinnedPool:
    """Reuses pinned buffers by size class; `get` hands out an array, `put` takes it back.

    Thread-safe. Buffers still referenced elsewhere are simply not reused (get makes a
    new one), so a forgotten `put` costs memory, never correctness.
    """

    def __init__(self, max_cached_bytes: int = 1 << 30):
        self._free: dict[int, list] = defaultdict(list)
        self._cached = 0
        self._max = max_cached_bytes
        self._lock = threading.Lock()

    @staticmethod
    def _class(nbytes: int) -> int:
        return max(_MIN_CLASS, 1 << (max(nbytes, 1) - 1).bit_length())

    def get(self, nbytes: int) -> np.ndarray:
        size = self._class(nbytes)
        with self._lock:
            block = self._free[size].pop() if self._free[size] else None
            if block is not None:
                self._cached -= size
        if block is None:
            block = pinned_empty(size)
        return block[:nbytes]

    def put(self, arr: np.ndarray) -> None:
        block = arr.base if isinstance(arr.base, np.ndarray) else arr
        size = block.nbytes
        if size != self._class(size):
            return  # not one of ours
        with self._lock:
            if self._cached + size <= self._max:
                self._free[size].append(block)
                self._cached += size

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._cached = 0


def pinned_sink(pool: PinnedPool | None = None):
    """A PayloadSink whose buffers are pinned (from `pool` when given)."""

    def sink(header, meta, lengths):
        return [pool.get(n) if pool else pinned_empty(n) for n in lengths]

    return sink
