"""The DPDK shim's EAL, ports, fault hooks and pinned memory: the one module that loads
the compiled shim (`_dpdk.lib`); dpdk.py builds the transport and listener on it.

One EAL per process, for its lifetime: the first transport (or `eal_init`) starts it,
with `eal_args.default_eal_args(role)` merged with the caller's arguments. The rest
are thin, checked calls into the shim: port setup and stats, ring pairs, virtual
devices added after start, fault injection, raw frames and the C wire helpers that
tests hold equal to wire.py.
"""

from __future__ import annotations

import atexit
import errno
import functools
import itertools
import logging
import os
import struct
import threading
from typing import Optional, Sequence

from .._version import __version__
from ..errors import DpdkError, UnavailableError
from . import eal_args as _eal_args
from . import eal_files, memif_slots, wire


INSTALL_HINT = ("install DPDK (apt-get install dpdk dpdk-dev libdpdk-dev) and rebuild "
                "remote_accel (pip install --no-build-isolation -e . , or scripts/dev-build.sh)")
try:
    from ._dpdk import ffi, lib
except ImportError as exc:  # built without libdpdk, or DPDK's libraries went away
    raise UnavailableError(f"the DPDK transport is not available ({exc}): {INSTALL_HINT}") from exc

_shim_version = ffi.string(lib.shim_version()).decode()
if _shim_version != __version__:
    raise UnavailableError(f"the compiled DPDK shim is version {_shim_version} but remote_accel is "
                           f"{__version__}: rebuild it (scripts/dev-build.sh)")

# The logger of the DPDK transport as a whole (dpdk.py), where DPDK's chatter always went.
log = logging.getLogger(__package__ + ".dpdk")

_eal_lock = threading.Lock()
_groups = itertools.count(1)  # listen group 0 is for listeners made without one
_added_vdevs: dict[str, str] = {}  # vdevs created after EAL start: name -> args
_published: set[str] = set()  # memif sockets whose slots file this process wrote


def dpdk_error(err: int, text: str) -> DpdkError:
    """DpdkError with .errno set (its RuntimeError base would leave OSError's fields empty)."""
    exc = DpdkError(text)
    exc.errno, exc.strerror = err, text  # str(exc): "[Errno N] text"
    return exc


def _check(rc: int, op: str, port: Optional[int] = None) -> int:
    """A shim return code, or DpdkError naming the operation and the port."""
    if rc >= 0:
        return rc
    err = -rc
    where = f" on port {port}" if port is not None else ""
    _drain_log()
    raise dpdk_error(err, f"{op}{where} failed: {os.strerror(err)} (errno {err})")


def _drain_log() -> None:
    buf = ffi.new("char[]", 65536)
    n = lib.shim_log_read(buf, 65536)
    for line in ffi.buffer(buf, n)[:].decode(errors="replace").splitlines():
        if line.strip():  # DPDK's own chatter: details for debugging, not for users
            log.debug("dpdk: %s", line.strip())


# -- EAL -----------------------------------------------------------------------------
def eal_args() -> Optional[list[str]]:
    """The arguments EAL was started with in this process, or None."""
    n = lib.shim_eal_args(ffi.NULL, 0)
    if n < 0:
        return None
    buf = ffi.new("char[]", n)
    lib.shim_eal_args(buf, n)
    return [a.decode() for a in ffi.buffer(buf, n)[:].split(b"\0")[:-1]]


def eal_init(args=None, *, role: str = "client", memif_slots: int = memif_slots.DEFAULT_SLOTS) -> list[str]:
    """Start EAL with default_eal_args(role) merged with `args` (list or string);
    `memif_slots`: memif interfaces of a server's default arguments.

    Raises DpdkError(EALREADY) if EAL already runs in this process: DPDK allows one
    EAL per process, for its lifetime, whatever the arguments.
    """
    with _eal_lock:
        current = eal_args()
        if current is not None:
            raise dpdk_error(errno.EALREADY, "EAL is already initialised in this process (with "
                            f"{' '.join(current)}); DPDK allows one EAL per process")
        user = _eal_args.split_args(args)
        defaults = _eal_args.default_eal_args(role, memif=not _has_device(user), slots=memif_slots)
        full = _eal_args.merge_eal_args(defaults, user)
        eal_files.sweep_dead()
        argv = [ffi.new("char[]", a.encode()) for a in full]
        rc = lib.shim_eal_init(len(argv), ffi.new("char *[]", argv))
        _drain_log()
        if rc < 0:
            raise dpdk_error(-rc, f"EAL init failed ({os.strerror(-rc)}) with arguments: {' '.join(full)}")
        atexit.register(_at_exit, _runtime_dir())
        log.debug("EAL started: %s", " ".join(full))
        return full


def _runtime_dir() -> str:
    buf = ffi.new("char[]", 4096)
    return ffi.string(buf).decode() if lib.shim_eal_runtime_dir(buf, 4096) >= 0 else ""


def _at_exit(runtime_dir: str) -> None:
    """Say goodbye on every connection, close the ports (a memif server's socket goes
    with them), then remove what EAL made on disk: nothing of this process stays."""
    lib.shim_shutdown()
    for sock in list(_published):
        memif_slots.unpublish(sock)
    eal_files.remove_own(runtime_dir)


def ensure_eal(args=None, *, role: str = "client", memif_slots: int = memif_slots.DEFAULT_SLOTS) -> list[str]:
    """EAL's arguments, starting it first if needed. Explicit `args` that EAL did not
    start with are an error (one EAL per process)."""
    with _eal_lock:
        current = eal_args()
    if current is None:
        try:
            return eal_init(args, role=role, memif_slots=memif_slots)
        except DpdkError as exc:
            if exc.errno != errno.EALREADY:  # another thread won the race
                raise
            return eal_args() or []
    user = _eal_args.split_args(args)
    if user and not all(u in current for u in user if u.startswith("-")):
        raise dpdk_error(errno.EALREADY, f"EAL already runs with {' '.join(current)}; cannot apply "
                        f"{' '.join(user)} (one EAL per process)")
    return current


def _has_device(user: Sequence[str]) -> bool:
    return any(u.split("=")[0] in ("--vdev", "-a", "--allow") for u in user)


# -- ports ---------------------------------------------------------------------------
def port_count() -> int:
    return _check(lib.shim_port_count(), "port_count")


def port_name(port: int) -> str:
    buf = ffi.new("char[]", 128)
    _check(lib.shim_port_name(port, buf, 128), "port_name", port)
    return ffi.string(buf).decode()


def port_driver(port: int) -> str:
    buf = ffi.new("char[]", 64)
    _check(lib.shim_port_driver(port, buf, 64), "port_driver", port)
    return ffi.string(buf).decode()


def setup_port(port: int, *, max_frame: Optional[int] = None, raw: bool = False,
               zero_copy: Optional[bool] = None, n_mbufs: int = 0) -> None:
    """Configure and start a port (again: nothing). max_frame None: from its vdev args."""
    if not 0 <= port < 1024 or lib.shim_port_link(port) == -errno.ENODEV:
        raise dpdk_error(errno.ENODEV, f"no DPDK port {port} (EAL arguments: {' '.join(eal_args() or [])})")
    conf = ffi.new("struct shim_port_conf *")
    args = (eal_args() or []) + [f"--vdev={n},{a}" for n, a in _added_vdevs.items()]
    frame, conf.min_room = _eal_args.port_frame_sizes(port_name(port), port_driver(port), args)
    conf.max_frame = frame if max_frame is None else max_frame
    conf.n_mbufs = n_mbufs
    conf.raw = int(raw)
    conf.zero_copy = -1 if zero_copy is None else int(zero_copy)
    _check(lib.shim_port_setup(port, conf), "port_setup", port)


def ring_pair(name: Optional[str] = None, *, raw: bool = False,
              zero_copy: Optional[bool] = None) -> tuple[int, int]:
    """Two set-up ports joined by crossed rings: what one sends the other receives."""
    name = name or f"rp{os.getpid()}_{next(_groups)}"
    a, b = ffi.new("uint16_t *"), ffi.new("uint16_t *")
    _check(lib.shim_ring_pair(name.encode(), a, b), "ring_pair")
    for p in (a[0], b[0]):
        setup_port(p, max_frame=_eal_args.RING_PAIR_MAX_FRAME, raw=raw, zero_copy=zero_copy)
    return a[0], b[0]


def port_stats(port: int) -> dict:
    st = ffi.new("struct shim_port_stats *")
    _check(lib.shim_port_stats(port, st), "port_stats", port)
    return {f: getattr(st, f) for f, _ in ffi.typeof("struct shim_port_stats").fields}


def reset_port_stats(port: int) -> None:
    _check(lib.shim_port_stats_reset(port), "port_stats_reset", port)


def set_fault(port: int, direction: str = "rx", *, drop: float = 0.0, corrupt: float = 0.0,
              duplicate: float = 0.0, reorder: float = 0.0, seed: int = 0) -> None:
    """Inject faults on frames of `port` going "rx" or "tx" (rates are probabilities)."""
    f = ffi.new("struct shim_fault *", {"drop": drop, "corrupt": corrupt, "duplicate": duplicate,
                                         "reorder": reorder, "seed": seed})
    dir_ = {"rx": lib.SHIM_RX, "tx": lib.SHIM_TX}[direction]
    _check(lib.shim_port_fault(port, dir_, f), "port_fault", port)


def tx_raw(port: int, frame: bytes, count: int = 1) -> None:
    _check(lib.shim_port_tx_raw(port, frame, len(frame), count), "tx_raw", port)


def rx_raw(port: int, max_frames: int = 32, stride: int = 2048) -> list[bytes]:
    buf = ffi.new("char[]", max_frames * stride)
    lens = ffi.new("uint32_t[]", max_frames)
    n = _check(lib.shim_port_rx_raw(port, buf, stride, lens, max_frames), "rx_raw", port)
    return [ffi.buffer(buf + i * stride, lens[i])[:] for i in range(n)]


def wire_encode(msg_type: int, meta: bytes, payloads: Sequence, *, req_id: int = 0, flags: int = 0,
                limits: wire.Limits = wire.DEFAULT_LIMITS) -> bytes:
    """The prologue the C fast path sends (tests hold it equal to wire.encode_prologue)."""
    w = _wire_limits(limits)
    ptrs = [ffi.from_buffer(p) for p in payloads]
    iov = ffi.new("struct shim_iov[]", max(len(ptrs), 1))
    for i, ptr in enumerate(ptrs):
        iov[i].base, iov[i].len = ptr, len(ptr)
    cap = wire.HEADER_SIZE + 8 * len(ptrs) + len(meta)
    buf = ffi.new("char[]", cap)
    n = _check(lib.shim_wire_encode(w, buf, cap, msg_type, flags, req_id, bytes(meta), len(meta), iov, len(ptrs)),
               "wire_encode")
    return ffi.buffer(buf, n)[:]


def wire_check(data: bytes, msg_len: int, limits: wire.Limits = wire.DEFAULT_LIMITS) -> Optional[tuple]:
    """(type, flags, req_id, meta, lengths) if the C fast path accepts this head, else None."""
    info = ffi.new("struct shim_msg_info *")
    lib.shim_wire_check(_wire_limits(limits), data, len(data), msg_len, info)
    if info.status != 0:
        return None
    k, plen = info.n_payloads, info.prologue_len
    lengths = list(_lengths(k).unpack_from(data, wire.HEADER_SIZE)) if k else []
    return info.type, info.flags, info.req_id, bytes(data[plen - info.meta_len:plen]), lengths


def _wire_limits(limits: wire.Limits):
    return ffi.new("struct shim_wire *", {
        "magic0": wire.MAGIC[0], "magic1": wire.MAGIC[1], "version": wire.WIRE_VERSION,
        "max_meta": min(limits.max_meta, 0xFFFFFFFF), "max_payloads": min(limits.max_payloads, 0xFFFFFFFF),
        "max_payload_total": limits.max_payload_total})


def pool_audit() -> int:
    """mbufs that sit twice in the free pools (each one a double free); 0 when sound."""
    return _check(lib.shim_pool_audit(), "pool_audit")


def build_frame(frame_type: int, conn: int, seq: int, chunk: bytes = b"") -> bytes:
    """One frame of our protocol, checksummed, to broadcast (tests feed it to a port)."""
    buf = ffi.new("char[]", len(chunk) + 256)
    n = _check(lib.shim_frame_build(buf, len(chunk) + 256, frame_type, conn, seq, chunk, len(chunk)),
               "frame_build")
    return ffi.buffer(buf, n)[:]


def crc32c(data, value: int = 0) -> int:
    return lib.shim_crc32c(value, ffi.from_buffer(data), len(memoryview(data).cast("B")))


# -- pinned memory -----------------------------------------------------------------------
def pinned_buffer(nbytes: int, align: int = 4096) -> memoryview:
    """`nbytes` of DPDK heap memory (hugepages where EAL has them) as a writable
    memoryview, without copying; freed when the last view of it goes. EAL must run
    (a transport or listener started it, or eal_init): which role it takes is not
    for a buffer to decide."""
    if eal_args() is None:
        raise dpdk_error(errno.ENODEV, "pinned buffers live in DPDK memory: open a DPDK transport "
                         "or listener (or call dpdk.eal_init) first")
    ptr = lib.shim_mem_alloc(max(nbytes, 1), align)
    if ptr == ffi.NULL:
        raise dpdk_error(errno.ENOMEM, f"cannot allocate {nbytes} bytes of DPDK memory "
                        "(more hugepages, or -m with --no-huge)")
    ptr = ffi.gc(ptr, lib.shim_mem_free, size=nbytes)
    return memoryview(ffi.buffer(ptr, nbytes))


def is_pinned(buf) -> bool:
    """True if `buf` starts in DPDK memory (hugepages where EAL has them)."""
    return bool(lib.shim_mem_is_dpdk(ffi.from_buffer(buf)))


def add_vdev(name: str, args: str = "") -> int:
    """Create a virtual device after EAL start ("net_memif5", "role=client,socket=/x");
    returns its port id. One process can so reach several memif or af_packet peers."""
    port = _check(lib.shim_vdev_add(name.encode(), args.encode()), f"vdev_add {name}")
    _added_vdevs[name] = args
    return port


def remove_vdev(port: int) -> None:
    name = port_name(port)
    _check(lib.shim_vdev_remove(port), "vdev_remove", port)
    _added_vdevs.pop(name, None)



@functools.lru_cache(maxsize=64)
def _lengths(n: int) -> struct.Struct:
    return struct.Struct(f"!{n}Q")
