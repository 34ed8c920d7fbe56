"""`torch.remote_accel`: the device module, mirroring `torch.cuda` where it makes sense.

Before `remote_accel.init()`, `is_available()` is False and `device_count()` 0.
`memory_allocated()` counts, as on CUDA, every live storage of the session from the
moment it is allocated (no round trip); `memory_stats()` adds the server's own figures.
"""

from __future__ import annotations

import contextlib

import torch

from .. import config
from . import runtime
from ._native import load

_C = load()


def is_available() -> bool:
    """True once init() connected, or when the environment names a server that the first
    use of the device will connect to (autoload)."""
    return runtime.is_initialized() or runtime.connects_on_first_use()


def is_initialized() -> bool:
    return runtime.is_initialized()


def device_count() -> int:
    """The servers connected, or those the environment names before the first use connects."""
    return len(runtime.sessions()) or (len(config.servers()) if runtime.connects_on_first_use() else 0)


def _lazy_init() -> None:
    """torch calls this before the first tensor is made on or moved to the device (as
    torch.cuda._lazy_init): connect now if the environment names a server."""
    if runtime.connects_on_first_use():
        runtime.session(0)


def current_device() -> int:
    return _C.current_device()


def set_device(device) -> None:
    index = _index(device)
    if index >= 0:
        _C.set_device(index)


def _index(device) -> int:
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if device is None:
        return -1
    if device.type != "remote_accel":
        raise ValueError(f"expected a remote_accel device, got {device}")
    return device.index if device.index is not None else current_device()


class device(contextlib.ContextDecorator):
    """Context manager that changes the current remote_accel device."""

    def __init__(self, device):
        self.index = _index(device)
        self.previous = -1

    def __enter__(self):
        self.previous = current_device()
        if self.index >= 0:
            _C.set_device(self.index)
        return self

    def __exit__(self, *exc):
        if self.index >= 0:
            _C.set_device(self.previous)
        return False


def synchronize(device=None, timeout=None) -> None:
    """Wait until the server finished every op sent so far; raise the first error.

    It waits as long as the work takes (a dead or frozen server is detected by missing
    heartbeats). timeout: seconds after which to give up with DeadlineExceeded; the work
    goes on on the server and the session stays usable.
    """
    index = _index(device)
    runtime.session(current_device() if index < 0 else index).sync(timeout=timeout)


# -- random numbers ------------------------------------------------------------------------------
def _generator(index: int) -> torch.Generator:
    return _C.default_generator(current_device() if index < 0 else index)


def manual_seed(seed: int) -> None:
    if is_available():
        _generator(-1).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        _C.default_generator(i).manual_seed(int(seed))


def seed() -> None:
    if is_available():
        _generator(-1).seed()


def seed_all() -> None:
    for i in range(device_count()):
        _C.default_generator(i).seed()


def initial_seed() -> int:
    return _generator(-1).initial_seed()


def get_rng_state(device="remote_accel") -> torch.Tensor:
    """The server generator's state (as on CUDA, a uint8 CPU tensor): the default
    generator's get_state(), which asks the server (handles.install_generator_state_hooks)."""
    return _generator(_index(device)).get_state()


def set_rng_state(new_state: torch.Tensor, device="remote_accel") -> None:
    # any dtype is taken as its raw bytes, as before the generator carried the state itself
    _generator(_index(device)).set_state(new_state.contiguous().reshape(-1).view(torch.uint8))


def get_rng_state_all() -> list:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(states) -> None:
    for i, state in enumerate(states):
        set_rng_state(state, i)


# -- memory ------------------------------------------------------------------------------------------
def _stats(device) -> dict:
    index = _index(device)
    return runtime.session(current_device() if index < 0 else index).stats()


def _counted(device) -> tuple[int, int]:
    index = _index(device)
    index = current_device() if index < 0 else index
    runtime.session(index)  # raises when not initialised
    return _C.memory_allocated(index)


def memory_allocated(device=None) -> int:
    return _counted(device)[0]


def max_memory_allocated(device=None) -> int:
    return _counted(device)[1]


def reset_peak_memory_stats(device=None) -> None:
    index = _index(device)
    _C.reset_peak_memory(current_device() if index < 0 else index)


#: memory_stats(): torch.cuda's key for each of the server's figures, then the server's own keys.
_MEMORY_KEYS = {
    "allocated_bytes.all.current": "memory_allocated",
    "allocated_bytes.all.peak": "max_memory_allocated",
    "allocation.all.current": "storages",
    "limit_bytes": "memory_limit",
}
_SERVER_MEMORY_KEYS = ("memory_allocated", "max_memory_allocated", "memory_limit", "storages",
                       "device_memory_allocated", "server_session_memory_allocated",
                       "server_session_max_memory_allocated", "server_memory_allocated", "server_storages",
                       # swapping to host memory (server --swap-space): this client's storages
                       "swapped_out_bytes", "swap_ins", "swap_outs", "prefetch_hits", "prefetch_misses",
                       "swap_in_bytes", "swap_out_bytes", "swap_in_ns", "swap_out_ns", "swap_overcommits",
                       # and the server's, every client's
                       "server_device_memory", "server_swap_space", "server_resident_bytes",
                       "server_swapped_bytes", "server_peak_resident_bytes")


def memory_stats(device=None) -> dict:
    """This client's memory under torch.cuda.memory_stats()' keys for what has a CUDA
    counterpart (so tools that log those work), then memory_allocated and
    max_memory_allocated as counted at allocation (as torch.cuda counts them), and the
    server's figures (one round trip): memory_limit, storages, device_memory_allocated
    (the device allocator's, None on a CPU server), server_session_memory_allocated and
    server_session_max_memory_allocated (what the server holds for this session), and
    server_memory_allocated and server_storages (every client's). With a server that
    swaps to host memory (--swap-space): swapped_out_bytes (this client's bytes now in
    host memory), swap_ins, swap_outs, prefetch_hits and prefetch_misses (uses of a
    once swapped-out storage that a look-ahead had, or had not, brought back in time),
    swap_in_bytes/swap_out_bytes and swap_in_ns/swap_out_ns (copies, for GB/s),
    swap_overcommits, and the server's server_device_memory, server_swap_space,
    server_resident_bytes, server_swapped_bytes, server_peak_resident_bytes."""
    values = dict(_stats(device))
    values["server_session_memory_allocated"] = values.pop("memory_allocated", 0)
    values["server_session_max_memory_allocated"] = values.pop("max_memory_allocated", 0)
    values["memory_allocated"], values["max_memory_allocated"] = _counted(device)
    out = {key: values[name] for key, name in _MEMORY_KEYS.items() if name in values}
    out.update((name, values[name]) for name in _SERVER_MEMORY_KEYS if name in values)
    return out


def stats(device=None) -> dict:
    """The session's counters for `device` (default: the current one), without a round
    trip: ops, batches, graphs, round_trips, bytes_up and bytes_down (tensor bytes
    uploaded and read back), peer_copies and peer_bytes (copies this client asked this
    server to send straight to another server, and their bytes), bytes_sent,
    bytes_received, messages_sent and messages_received (everything on the wire). Also `remote_accel.stats()`."""
    index = _index(device)
    return runtime.session(current_device() if index < 0 else index).local_stats()


def server_stats(device=None) -> dict:
    """The server's figures for `device` (default: the current one), one round trip:
    this session's (ops_done, memory_allocated, ...) and the whole server's (server_*),
    among them peer_bytes_sent, peer_bytes_received, peer_copies_sent and
    peer_copies_received: what went to or came from other servers directly (server-to-
    server copies), never through a client. Also `remote_accel.server_stats()`."""
    return dict(_stats(device))


def empty_cache() -> None:
    """Release cached memory: each server's, and this process's cache of host memory for
    `.cpu()` results (host_memory_stats())."""
    for s in runtime.sessions():
        s.empty_cache()
    _C.host_cache_empty()


def host_memory_stats() -> dict:
    """The host memory that `.cpu()` results of 1 MiB and more come from (as
    torch.cuda.host_memory_stats() describes CUDA's pinned host cache), no round trip:
    pre-faulted blocks on 2 MiB pages that a freed result hands back for the next one, so
    that a large download does not wait for the kernel to zero fresh memory.
    cached_bytes (free blocks kept), live_bytes (blocks held by tensors), limit_bytes
    (most bytes of free blocks kept: REMOTE_ACCEL_CLIENT_CACHE_MB, default 1024 MiB;
    0 turns the cache off), hits (results that reused a block), misses (blocks mapped),
    released (blocks given back to the system). empty_cache() releases the free blocks."""
    return dict(_C.host_cache_stats())


def memory_reserved(device=None) -> int:
    """As memory_allocated(): the client holds no cache of device memory of its own."""
    return memory_allocated(device)


def max_memory_reserved(device=None) -> int:
    return max_memory_allocated(device)


def reset_max_memory_allocated(device=None) -> None:
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device=None) -> None:
    index = _index(device)
    _C.reset_accumulated(current_device() if index < 0 else index)


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the server's device, one round trip; within this session's
    memory limit where the server sets one (--memory-limit), since that is what this
    client can allocate."""
    values = _stats(device)
    free, total = values["device_memory_info"]
    limit = values.get("memory_limit") or 0
    if limit:
        total = min(total, limit)
        free = max(0, min(free, limit - values.get("memory_allocated", 0)))
    return int(free), int(total)


class _DeviceProperties:
    """torch.cuda.get_device_properties()' answer for the server's device: name,
    total_memory, major, minor, multi_processor_count (None where the device has none,
    as a CPU server), type (the server's torch device type)."""

    def __init__(self, values: dict):
        self.name = values.get("name")
        self.type = values.get("type")
        self.total_memory = values.get("total_memory")
        self.major = values.get("major")
        self.minor = values.get("minor")
        self.multi_processor_count = values.get("multi_processor_count")

    def __repr__(self) -> str:
        return (f"_RemoteAccelDeviceProperties(name='{self.name}', type='{self.type}', major={self.major}, "
                f"minor={self.minor}, total_memory={(self.total_memory or 0) >> 20}MB, "
                f"multi_processor_count={self.multi_processor_count})")


def get_device_properties(device=None) -> _DeviceProperties:
    index = _index(device)
    return _DeviceProperties(runtime.session(current_device() if index < 0 else index).device_properties())


def get_device_name(device=None) -> str:
    """The server device's name: the GPU's model (an H100 says so), or the CPU's."""
    return get_device_properties(device).name


def get_device_capability(device=None) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA server's GPU; (0, 0) for a device that
    has none (a CPU server)."""
    props = get_device_properties(device)
    return (props.major or 0, props.minor or 0)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """bfloat16 kernels exist on CPU servers and on GPUs from compute capability 8.0."""
    props = get_device_properties()
    return props.type != "cuda" or (props.major or 0) >= 8 or including_emulation


def get_amp_supported_dtype() -> list:
    return [torch.float16, torch.bfloat16]


# -- streams and events ------------------------------------------------------------------------
# One stream per device, in issue order on the server (device.cpp); torch.Event and
# torch.Stream work on remote_accel as on CUDA (events on the server device's timeline).
def current_stream(device=None) -> torch.Stream:
    index = _index(device)
    return torch.Stream(device=torch.device("remote_accel", current_device() if index < 0 else index))


def default_stream(device=None) -> torch.Stream:
    return current_stream(device)


@contextlib.contextmanager
def stream(stream):
    """torch.cuda.stream()'s shape: every stream is the device's one stream, so this
    only makes its device current."""
    if stream is None:
        yield
        return
    with device(stream.device):
        yield


def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> torch.Event:
    return torch.Event(device=torch.device("remote_accel", current_device()), enable_timing=enable_timing,
                       blocking=blocking, interprocess=interprocess)


def Stream(device=None, priority: int = 0) -> torch.Stream:
    index = _index(device)
    return torch.Stream(device=torch.device("remote_accel", current_device() if index < 0 else index),
                        priority=priority)


def _is_in_bad_fork() -> bool:
    return False
