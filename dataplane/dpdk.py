"""The DPDK transport: the one module that touches the compiled shim (`_dpdk.lib`).

    t = DpdkTransport.connect(port=0)             # a local server over memif, default EAL
    with DpdkListener() as lst: t = lst.accept()  # the server side
    a, b = DpdkTransport.pair()                   # two ends in this process (ring pair)

One EAL per process, for its lifetime: the first transport (or `eal_init`) starts it,
with `eal_args.default_eal_args(role)` merged with the caller's arguments. The reliable
channel (sequence numbers, acks, retransmission, credits, keepalives) runs in C; Python
crosses into C once per message (and once more for large ones), with the GIL released.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import functools
import itertools
import logging
import os
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .._version import __version__
from ..errors import DpdkError, PeerGone, ProtocolError, TransportClosed, TransportTimeout, UnavailableError
from . import eal_args as _eal_args
from . import eal_files, memif_slots, wire
from .eal_args import default_eal_args  # noqa: F401  (part of this module's API)
from .transport import Listener, Message, PayloadSink, Transport, byte_view

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

log = logging.getLogger(__name__)

#: mbufs of a client's pool (one ~16.5 KiB mbuf each over memif): a connection needs a
#: window of frames each way plus the TX queue; the default (about 128 MiB of hugepages,
#: sized for a server's many connections) would let only a few clients fit in 2 GiB.
CLIENT_MBUFS = 2047
HEAD_CAP = 64 << 10  # first bytes of a message copied in the first call (prologue + small payloads)
_IOV_CACHED = 16
_PEER_GONE = {errno.EPIPE, errno.ECONNRESET, errno.EHOSTDOWN, errno.ENOLINK, errno.ETIMEDOUT,
              errno.EPROTO, errno.ENOTCONN}
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
        log.info("EAL started: %s", " ".join(full))
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


# -- the transport ----------------------------------------------------------------------
@dataclass(frozen=True)
class ChannelOptions:
    """Knobs of the reliable channel (both ends may differ; each keeps its own)."""

    window: int = 256              # frames in flight (x ~16 KiB over memif)
    chunk: int = 0                 # payload bytes per frame; 0: the port's largest
    peer_timeout: float = 8.0      # s of silence before the peer counts as gone
    stall_timeout: float = 30.0    # s without progress inside a send or a started message
    zero_copy_min: int = 256 << 10 # payloads this long go out as external buffers
    spin: float = 200e-6           # s of polling after traffic before napping
    busy_poll: bool = False        # never nap (benchmarks: burns a core per waiter)
    linger: float = 5.0            # s close() keeps retransmitting unacknowledged data

    def cdata(self, group: int = 0):
        o = ffi.new("struct shim_conn_opts *")
        o.window, o.chunk = self.window, self.chunk
        o.peer_timeout_ns = int(self.peer_timeout * 1e9)
        o.stall_ns = int(self.stall_timeout * 1e9)
        o.zero_copy_min = self.zero_copy_min
        o.spin_ns = int(self.spin * 1e9)
        o.busy_poll = int(self.busy_poll)
        o.group = group
        return o


@functools.lru_cache(maxsize=64)
def _lengths(n: int) -> struct.Struct:
    return struct.Struct(f"!{n}Q")


def _header(type_, flags, n_payloads, req_id, meta_len, payload_total, crc) -> wire.Header:
    """wire.Header(...) at half the cost: a frozen dataclass's __init__ goes through
    object.__setattr__ per field; setting __dict__ at once makes the same object."""
    h = _new(wire.Header)
    _set(h, "__dict__", {"type": type_, "flags": flags, "n_payloads": n_payloads, "req_id": req_id,
                         "meta_len": meta_len, "payload_total": payload_total, "crc": crc})
    return h


_new, _set = object.__new__, object.__setattr__
assert [f.name for f in dataclasses.fields(wire.Header)] == list(_header(*range(7)).__dict__)


class DpdkTransport(Transport):
    """A reliable, ordered message link to one peer over a DPDK port."""

    def __init__(self, conn, *, port: int, limits: wire.Limits = wire.DEFAULT_LIMITS,
                 options: ChannelOptions = ChannelOptions()):
        self._c = conn
        self._port = port
        self._limits = limits
        self._options = options
        self._closed = False
        self._send_lock = threading.Lock()
        self._head = ffi.new("char[]", HEAD_CAP)
        self._head_view = memoryview(ffi.buffer(self._head, HEAD_CAP))
        self._info = ffi.new("struct shim_msg_info *")
        self._iov = ffi.new("struct shim_iov[]", _IOV_CACHED)
        self._iov_items = [self._iov[i] for i in range(_IOV_CACHED)]  # views into the array
        self._max_meta, self._max_payloads = limits.max_meta, limits.max_payloads
        self._max_total = limits.max_payload_total
        self._wire = _wire_limits(limits)
        self._finalizer = weakref.finalize(self, lib.shim_conn_free, conn)
        info = ffi.new("struct shim_conn_info *")
        lib.shim_conn_info(conn, info)
        mac = ":".join(f"{b:02x}" for b in bytes(ffi.buffer(info.peer_mac, 6)))
        try:
            name = port_name(port)
        except DpdkError:  # the port went away meanwhile (removed vdev)
            name = f"port{port}"
        self.peer = f"dpdk:{name}:{mac}"
        self.chunk = info.chunk

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def connect(cls, port: int = 0, eal_args=None, timeout: float = 10.0, *,
                options: ChannelOptions = ChannelOptions(), **kwargs) -> "DpdkTransport":
        """Connect to the server on the L2 segment behind `port` (HELLO to broadcast).

        With default EAL arguments port 0 is a memif client of the local server.
        Raises PeerGone when no server answers within `timeout`, DpdkError for DPDK failures.
        """
        ensure_eal(eal_args, role="client")
        setup_port(port, n_mbufs=CLIENT_MBUFS)
        out = ffi.new("struct shim_conn **")
        rc = lib.shim_connect(port, options.cdata(), int(timeout * 1e9), out)
        if rc in (-errno.ETIMEDOUT, -errno.ENOLINK):
            what = "no link" if rc == -errno.ENOLINK else "no server answered"
            raise PeerGone(f"cannot connect over DPDK port {port} ({port_name(port)}): {what} "
                           f"within {timeout:g} s (is remote-accel-server --transport dpdk running?)")
        _check(rc, "connect", port)
        return cls(out[0], port=port, options=options, **kwargs)

    @classmethod
    def pair(cls, *, options: ChannelOptions = ChannelOptions(), timeout: float = 10.0,
             **kwargs) -> tuple["DpdkTransport", "DpdkTransport"]:
        """Two connected transports over a ring pair in this process (for tests)."""
        ensure_eal(None, role="local")
        a, b = ring_pair()
        with DpdkListener([b], options=options, **kwargs) as lst:
            client = cls.connect(a, timeout=timeout, options=options, **kwargs)
            server = lst.accept(timeout)
        client._pair = server._pair = _PairPorts((a, b))  # removed when both ends are closed
        return client, server

    # -- Transport --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with _close_lock:  # a failing recv thread and the owner may close at once
            if self._closed:
                return
            self._closed = True
        lib.shim_conn_close(self._c, int(self._options.linger * 1e9))
        pair = getattr(self, "_pair", None)
        if pair is not None:
            pair.end_closed()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"transport to {self.peer} is closed")

    def _fail(self, rc: int, op: str):
        """The exception for a failed channel call (the transport is closed for PeerGone)."""
        _drain_log()  # what DPDK said about it (memif disconnects, ...) goes to logging
        err = -rc
        if err == errno.ESHUTDOWN:
            return TransportClosed(f"transport to {self.peer} was closed")
        if op == "recv" and err == errno.ETIMEDOUT:
            return TransportTimeout(f"no message from {self.peer} within the timeout")
        if err in _PEER_GONE:
            reason = ffi.new("char[]", 200)
            lib.shim_conn_reason(self._c, reason, 200)
            text = ffi.string(reason).decode() or os.strerror(err)
            self.close()
            return PeerGone(f"{self.peer}: {text}")
        try:
            _check(rc, op, self._port)
        except DpdkError as exc:
            return exc

    def send(self, msg_type: int, meta: bytes = b"", payloads: Sequence = (), *, req_id: int = 0,
             flags: int = 0) -> None:
        # The prologue is built in C (same bytes as wire.encode_prologue; tests check).
        # This is the round trip's hot path: no helper calls where a comparison does.
        ptrs = [ffi.from_buffer(p) for p in payloads]
        n = len(ptrs)
        total = sum(map(len, ptrs))
        if len(meta) > self._max_meta or n > self._max_payloads or total > self._max_total:
            self._limits.check(len(meta), n, total)  # raises MessageTooLarge, with the why
        if not 0 <= req_id < 1 << 32:
            raise ValueError(f"req_id {req_id} does not fit in 32 bits")
        if type(meta) is not bytes:
            meta = bytes(meta)
        with self._send_lock:
            if self._closed:
                raise TransportClosed(f"transport to {self.peer} is closed")
            if n <= _IOV_CACHED:
                iov, items = self._iov, self._iov_items
            else:
                iov = ffi.new("struct shim_iov[]", n)
                items = [iov[i] for i in range(n)]
            for item, ptr in zip(items, ptrs):
                item.base = ptr
                item.len = len(ptr)
            rc = lib.shim_conn_send_msg(self._c, self._wire, msg_type, flags, req_id, meta, len(meta), iov, n)
        if rc < 0:
            raise self._fail(rc, "send")

    def _send_raw(self, pieces: list) -> None:
        """One message made of these bytes as they are (tests send malformed ones)."""
        iov = ffi.new("struct shim_iov[]", len(pieces))
        keep = []
        for i, piece in enumerate(pieces):
            ptr = ffi.from_buffer(piece)
            keep.append(ptr)
            iov[i].base = ptr
            iov[i].len = len(ptr)
        with self._send_lock:
            self._check_open()
            rc = lib.shim_conn_send(self._c, iov, len(pieces))
        if rc < 0:
            raise self._fail(rc, "send")

    def recv(self, timeout: Optional[float] = None, sink: Optional[PayloadSink] = None) -> Message:
        self._check_open()
        t = -1 if timeout is None else int(max(timeout, 0.0) * 1e9)
        info = self._info
        n = lib.shim_conn_recv_msg(self._c, self._wire, self._head, HEAD_CAP, t, info)
        if n < 0:
            raise self._fail(n, "recv")
        if info.status != 0:  # an error, or a prologue longer than the head: wire.py decides
            return self._recv_checked(n, info.msg_len, sink)
        head, k, plen = self._head_view, info.n_payloads, info.prologue_len
        lengths = list(_lengths(k).unpack_from(head, wire.HEADER_SIZE)) if k else []
        meta = bytes(head[plen - info.meta_len:plen])
        if sink is None and n == info.msg_len:  # all of it came with the head: copy it out
            buffers, pos = [], plen
            for m in lengths:
                buffers.append(np.frombuffer(head, np.uint8, m, pos).copy())
                pos += m
            return Message(info.type, meta, buffers, info.req_id, info.flags)
        header = _header(info.type, info.flags, k, info.req_id, info.meta_len, info.payload_total, info.crc)
        return self._recv_payloads(header, meta, lengths, plen, n, sink)

    def _recv_checked(self, n: int, total: int, sink) -> Message:
        head = self._head_view
        try:
            header = wire.decode_header(head[:n], self._limits)
            plen = wire.HEADER_SIZE + header.rest_len
            if total != plen + header.payload_total:
                raise ProtocolError(f"message of {total} bytes, its header says {plen + header.payload_total}")
            if plen <= n:
                rest = head[wire.HEADER_SIZE:plen]
            else:
                rest = bytearray(plen - wire.HEADER_SIZE)
                rest[: n - wire.HEADER_SIZE] = head[wire.HEADER_SIZE:n]
                self._recv_into([memoryview(rest)[n - wire.HEADER_SIZE:]])
            lengths, meta = wire.decode_rest(header, head[: wire.HEADER_SIZE], rest)
        except ProtocolError:
            lib.shim_conn_recv_discard(self._c)  # message-oriented: the link stays usable
            raise
        return self._recv_payloads(header, meta, lengths, plen, n, sink)

    def _recv_payloads(self, header, meta: bytes, lengths: list, plen: int, n: int, sink) -> Message:
        """Payloads into the sink's buffers: first what came with the head, then the rest."""
        head = self._head_view
        try:
            buffers = sink(header, meta, lengths) if sink else [np.empty(m, np.uint8) for m in lengths]
            views = [byte_view(b) for b in buffers]
            if [v.nbytes for v in views] != lengths:
                raise ValueError("payload sink returned buffers of the wrong sizes")
            if any(v.readonly for v in views):
                raise ValueError("payload sink returned read-only buffers")
        except Exception:  # the message is dropped whole: the link stays usable
            lib.shim_conn_recv_discard(self._c)
            raise
        pos, todo = plen, []
        for v in views:
            if pos < n:
                take = min(v.nbytes, n - pos)
                v[:take] = head[pos:pos + take]
                pos += take
                if take < v.nbytes:
                    todo.append(v[take:])
            elif v.nbytes:
                todo.append(v)
        if todo:
            self._recv_into(todo)
        return Message(header.type, meta, buffers, header.req_id, header.flags)

    def _recv_into(self, views: list) -> None:
        iov = ffi.new("struct shim_iov[]", len(views))
        keep = []
        for i, v in enumerate(views):
            ptr = ffi.from_buffer(v, require_writable=True)
            keep.append(ptr)
            iov[i].base = ptr
            iov[i].len = len(ptr)
        rc = lib.shim_conn_recv_into(self._c, iov, len(views))
        if rc < 0:
            raise self._fail(rc, "recv_into")

    def stats(self) -> dict:
        st = ffi.new("struct shim_conn_stats *")
        lib.shim_conn_stats(self._c, st)
        out = {f: getattr(st, f) for f, _ in ffi.typeof("struct shim_conn_stats").fields}
        try:
            out.update({f"port_{k}": v for k, v in port_stats(self._port).items()})
        except DpdkError:
            pass  # the port is gone (pair() removes its ring ports once both ends closed)
        return out


_close_lock = threading.Lock()


class _PairPorts:
    """The two ring ports of pair(): removed once, when the second end closes (the two
    ends may close at the same moment from two threads)."""

    def __init__(self, ports: tuple[int, int]):
        self.ports = ports
        self._open_ends = 2
        self._lock = threading.Lock()

    def end_closed(self) -> None:
        with self._lock:
            self._open_ends -= 1
            last = self._open_ends == 0
        if last:
            for p in self.ports:
                remove_vdev(p)


class DpdkListener(Listener):
    """Accepts clients on DPDK ports: by default every memif server interface of this
    process's EAL (one per client slot), after starting EAL with server defaults.

    max_clients: the server's limit; its default EAL arguments get
    memif_slots.slots_for(max_clients) memif interfaces (None: DEFAULT_SLOTS), published
    for local clients (memif_slots.py) while the listener is open."""

    def __init__(self, ports: Optional[Sequence[int]] = None, eal_args=None, *,
                 options: ChannelOptions = ChannelOptions(), max_clients: Optional[int] = None,
                 **transport_kwargs):
        slots = memif_slots.slots_for(max_clients) if max_clients else memif_slots.DEFAULT_SLOTS
        args = ensure_eal(eal_args, role="server", memif_slots=slots)
        vdevs = _eal_args.vdev_options(args)
        memif_servers = [p for p in range(port_count()) if vdevs.get(port_name(p), {}).get("role") == "server"]
        if ports is None:  # the memif server interfaces, else every port
            ports = memif_servers or list(range(port_count()))
        if not ports:
            raise dpdk_error(errno.ENODEV, f"no DPDK port to listen on (EAL args: {' '.join(args)})")
        self._group = next(_groups) % 16 or 1
        self._ports = list(ports)
        self._options = options
        self._kwargs = transport_kwargs
        self._closed = False
        for p in self._ports:
            setup_port(p)
            _check(lib.shim_listen(p, options.cdata(self._group)), "listen", p)
        self.address = "dpdk:" + ",".join(port_name(p) for p in self._ports)
        self._sockets = self._publish([p for p in self._ports if p in memif_servers], vdevs, slots)

    @staticmethod
    def _publish(ports: list, vdevs: dict, slots: int) -> list:
        """Tell local clients how many memif slots each socket has (memif_slots.py)."""
        per_socket: dict[str, int] = {}
        for p in ports:
            sock = vdevs[port_name(p)].get("socket")
            if sock:
                per_socket[sock] = per_socket.get(sock, 0) + 1
        for sock, n in per_socket.items():
            limited_by = "max_clients" if n < memif_slots.MAX_SLOTS and n <= slots else "ports"
            memif_slots.publish(sock, n, limited_by)
            _published.add(sock)
        return list(per_socket)

    def accept(self, timeout: Optional[float] = None) -> DpdkTransport:
        if self._closed:
            raise TransportClosed("listener is closed")
        out = ffi.new("struct shim_conn **")
        rc = lib.shim_accept(self._group, -1 if timeout is None else int(timeout * 1e9), out)
        if rc == -errno.ETIMEDOUT:
            raise TransportTimeout(f"no client within {timeout} s")
        if rc == -errno.ESHUTDOWN:
            raise TransportClosed("listener is closed")
        _check(rc, "accept")
        info = ffi.new("struct shim_conn_info *")
        lib.shim_conn_info(out[0], info)
        return DpdkTransport(out[0], port=info.port, options=self._options, **self._kwargs)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for sock in self._sockets:
                memif_slots.unpublish(sock)
                _published.discard(sock)
            for p in self._ports:
                lib.shim_unlisten(p)
            lib.shim_accept_cancel(self._group)
