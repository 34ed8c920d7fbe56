"""More memory than the device has: storages swapped out to host memory and back.

The server may use `--device-memory` bytes of its device, all clients together. With
`--swap-space` (host bytes for swapped-out storages) an allocation that would go over
moves least-recently-used storages of any client to host memory (pinned on CUDA),
never one that an op in progress uses (pinned) and, while anything else can go, none
that the rest of the batch being run names. An op whose input is swapped out brings it
back first; a batch's next ops are looked at before each op runs and their swapped-out
inputs brought back ahead of use (prefetch: on CUDA on a stream of its own, overlapping
the session's kernels; on a CPU server the copy is done there and then, so it only
moves the cost, it does not hide it). Without swap space an allocation over the device
memory fails as out of memory, as before.

The work is in C++ (csrc/swap.cpp), next to the storage table it changes: a storage's
bytes move while its id, its accounting and the views that later ops rebuild from it
stay as they are. Swapping is invisible to results; `memory_allocated()` counts what a
client holds wherever it is. One op needs all its storages on the device at once: when
they alone exceed the device memory (a `_foreach_` op over every parameter), the op
goes over it for a while (`swap_overcommits` counts those), which a real GPU with less
memory than that would answer with its own out-of-memory error.
"""

from __future__ import annotations

from . import native
from .device import ComputeDevice

#: Per-session figures of native.Executor.swap_stats() that memory_stats() passes on.
STAT_KEYS = ("swapped_out_bytes", "swap_ins", "swap_outs", "prefetch_hits", "prefetch_misses",
             "swap_in_bytes", "swap_out_bytes", "swap_in_ns", "swap_out_ns", "swap_overcommits")


def make_pool(device: ComputeDevice, device_memory: int = 0, swap_space: int = 0) -> "native.Pool":
    """The server's one pool: `device_memory` bytes (0: all the device has, the machine's
    memory on a CPU server) and `swap_space` bytes of host memory (0: no swapping)."""
    if device_memory < 0 or swap_space < 0:
        raise ValueError("device memory and swap space cannot be negative")
    return native.Pool(str(device.device), device_memory or device.total_memory(), swap_space)


def server_figures(pool: "native.Pool") -> dict:
    capacity, swap_capacity, resident, swapped, peak = pool.figures()
    return {"server_device_memory": capacity, "server_swap_space": swap_capacity,
            "server_resident_bytes": resident, "server_swapped_bytes": swapped,
            "server_peak_resident_bytes": peak}


def hit_rate(stats: dict) -> float:
    """Share of uses of once-swapped storages that a prefetch had brought back in time."""
    used = stats.get("prefetch_hits", 0) + stats.get("prefetch_misses", 0)
    return stats.get("prefetch_hits", 0) / used if used else 1.0


def summary(stats: dict) -> str:
    """One line for the log at disconnect."""
    gbps_in = stats["swap_in_bytes"] / stats["swap_in_ns"] if stats["swap_in_ns"] else 0.0
    gbps_out = stats["swap_out_bytes"] / stats["swap_out_ns"] if stats["swap_out_ns"] else 0.0
    return (f"swap: {stats['swap_outs']} out ({stats['swap_out_bytes']} bytes, {gbps_out:.2f} GB/s), "
            f"{stats['swap_ins']} in ({stats['swap_in_bytes']} bytes, {gbps_in:.2f} GB/s), "
            f"prefetch hits {stats['prefetch_hits']}, misses {stats['prefetch_misses']} "
            f"({100 * hit_rate(stats):.1f}%), overcommits {stats['swap_overcommits']}")
