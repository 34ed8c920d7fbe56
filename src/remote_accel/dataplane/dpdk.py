"""The DPDK transport: a reliable message link over the compiled shim (`_dpdk.lib`).

    t = DpdkTransport.connect(port=0)             # a local server over memif, default EAL
    with DpdkListener() as lst: t = lst.accept()  # the server side
    a, b = DpdkTransport.pair()                   # two ends in this process (ring pair)

One EAL per process, for its lifetime: the first transport (or `eal_init`) starts it,
with `eal_args.default_eal_args(role)` merged with the caller's arguments. The reliable
channel (sequence numbers, acks, retransmission, credits, keepalives) runs in C; Python
crosses into C once per message (and once more for large ones), with the GIL released.

The shim's EAL, ports, fault hooks and pinned memory live in dpdk_eal.py; their names
stay importable from here (tests and tools use them as `dpdk.set_fault`, ...). Which
ports a listener listens on, and the memif slots it publishes, are dpdk_listen.py's.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .. import config
from ..errors import DpdkError, PeerGone, PeerSilent, ProtocolError, TransportClosed, TransportTimeout
from . import wire
from .dpdk_eal import (  # noqa: F401  (public names re-exported: this module's API)
    INSTALL_HINT, _check, _drain_log, _lengths, _shim_version, _wire_limits,
    add_vdev, build_frame, crc32c, dpdk_error, eal_args, eal_init, ensure_eal, ffi, is_pinned, lib,
    pinned_buffer, pool_audit, port_count, port_driver, port_name, port_stats, remove_vdev,
    reset_port_stats, ring_pair, rx_raw, set_fault, setup_port, tx_raw, wire_check, wire_encode)
from .dpdk_listen import ListenPorts
from .eal_args import default_eal_args  # noqa: F401  (part of this module's API)
from .transport import DISCARD_CHUNK, Discard, Listener, Message, PayloadSink, Transport, byte_view

#: mbufs of a client's pool (one ~16.5 KiB mbuf each over memif): a connection needs a
#: window of frames each way plus the TX queue; the default (about 128 MiB of hugepages,
#: sized for a server's many connections) would let only a few clients fit in 2 GiB.
CLIENT_MBUFS = 2047
HEAD_CAP = 64 << 10  # first bytes of a message copied in the first call (prologue + small payloads)
_IOV_CACHED = 16
_PEER_GONE = {errno.EPIPE, errno.ECONNRESET, errno.EHOSTDOWN, errno.ENOLINK, errno.ETIMEDOUT,
              errno.EPROTO, errno.ENOTCONN}


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
    # memif/ring: a waiter sleeps until the peer's next frame instead of napping (the
    # shim's doorbell.c); REMOTE_ACCEL_DPDK_DOORBELL=0 turns it off (to compare, or where
    # /dev/shm is not shared between the two processes)
    doorbell: bool = dataclasses.field(default_factory=lambda: config.enabled("REMOTE_ACCEL_DPDK_DOORBELL"))
    linger: float = 5.0            # s close() keeps retransmitting unacknowledged data

    def cdata(self, group: int = 0):
        o = ffi.new("struct shim_conn_opts *")
        o.window, o.chunk = self.window, self.chunk
        o.peer_timeout_ns = int(self.peer_timeout * 1e9)
        o.stall_ns = int(self.stall_timeout * 1e9)
        o.zero_copy_min = self.zero_copy_min
        o.spin_ns = int(self.spin * 1e9)
        o.busy_poll = int(self.busy_poll)
        o.doorbell = int(self.doorbell)
        o.group = group
        return o


def _free_conn(conn, linger_ns: int, closing: threading.Lock) -> None:
    """A transport collected or alive at exit without close(): it closes as a socket would,
    still sending what the peer has not acknowledged for the linger (shim_conn_free
    alone closes with none, and a script's last messages were lost at exit). `closing`: a
    close() another thread is still in (at exit) ends before the connection is freed
    (ASan saw shim_conn_close read a connection this freed)."""
    with closing:
        lib.shim_conn_close(conn, linger_ns)
        lib.shim_conn_free(conn)


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
        self._skip_buffer = None  # made by the first Discard
        self._info = ffi.new("struct shim_msg_info *")
        self._iov = ffi.new("struct shim_iov[]", _IOV_CACHED)
        self._iov_items = [self._iov[i] for i in range(_IOV_CACHED)]  # views into the array
        self._max_meta, self._max_payloads = limits.max_meta, limits.max_payloads
        self._max_total = limits.max_payload_total
        self._wire = _wire_limits(limits)
        self._linger_ns = int(options.linger * 1e9)
        self._closing = threading.Lock()  # held through shim_conn_close: _free_conn waits for it
        self._finalizer = weakref.finalize(self, _free_conn, conn, self._linger_ns, self._closing)
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
        with self._closing:
            lib.shim_conn_close(self._c, self._linger_ns)
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
            # A send that found the peer gone (it closed, reset, or its port went away
            # after its last frames came): the messages it sent before are still in this
            # connection's receive ring, and recv reads them first (a server's busy beat
            # must not drop a client's last work and GOODBYE; see
            # TcpTransport._send_failed). A stalled send, or a failed recv, closes.
            if op != "send" or err == errno.ETIMEDOUT:
                self.close()
            else:
                self._peer_gone = True
            if err == errno.EHOSTDOWN:  # the channel's silence limit (peer_timeout), the link up
                return PeerSilent(f"{self.peer}: {text} (a frozen or hung peer, or a link cut without a reset)")
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

    def send_many(self, messages: Sequence, *, flags: int = 0) -> None:
        """Send (type, meta, payloads, req_id) messages in order, small ones in one burst:
        a sync point's flush and its request wake the peer once. Every message is checked
        before any is sent. Raises as send."""
        if len(messages) == 1:
            msg_type, meta, payloads, req_id = messages[0]
            return self.send(msg_type, meta, payloads, req_id=req_id, flags=flags)
        if len(messages) == 2 and not flags:  # a sync point's Batch and request: one C call
            (type1, meta1, payloads1, req1), (type2, meta2, payloads2, req2) = messages
            if (not payloads1 and not payloads2 and len(meta1) <= self._max_meta and len(meta2) <= self._max_meta
                    and 0 <= req1 < 1 << 32 and 0 <= req2 < 1 << 32):
                with self._send_lock:
                    self._check_open()
                    rc = lib.shim_conn_send_pair(self._c, self._wire, type1, req1, bytes(meta1), len(meta1),
                                                 type2, req2, bytes(meta2), len(meta2))
                if rc < 0:
                    raise self._fail(rc, "send")
                return
        for _, meta, payloads, req_id in messages:
            if payloads or len(meta) > self._max_meta:  # (most requests have no payloads)
                self._limits.check(len(meta), len(payloads), sum(byte_view(p).nbytes for p in payloads))
            if not 0 <= req_id < 1 << 32:
                raise ValueError(f"req_id {req_id} does not fit in 32 bits")
        self._check_open()
        lib.shim_conn_cork(self._c, 1)
        try:
            for msg_type, meta, payloads, req_id in messages:
                self.send(msg_type, meta, payloads, req_id=req_id, flags=flags)
        finally:
            lib.shim_conn_cork(self._c, 0)  # the burst leaves here

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
        n = lib.shim_conn_recv_msg(self._c, self._wire, self._head, HEAD_CAP, t, self._info)
        if n < 0:
            raise self._fail(n, "recv")
        return self.finish_recv(n, sink)

    def finish_recv(self, n: int, sink: Optional[PayloadSink] = None) -> Message:
        """The rest of recv() for a message whose first `n` bytes shim_conn_recv_msg put in
        this transport's head buffer: its own call above, or a server session's C++ loop
        (native_addresses) that left the message to Python."""
        info = self._info
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
        if not k and sink is not None:  # no payloads (most requests): the sink only looks at it
            try:
                if sink(header, meta, lengths):
                    raise ValueError("payload sink returned buffers of the wrong sizes")
            except Exception:
                lib.shim_conn_recv_discard(self._c)
                raise
            return Message(header.type, meta, [], header.req_id, header.flags)
        return self._recv_payloads(header, meta, lengths, plen, n, sink)

    def send_locked(self, send_fn) -> None:
        """Run `send_fn()`, a C call that sends one message on this connection and returns
        0 or a -errno (a server session's C++ loop), under the lock Python's sends hold:
        messages never interleave. Raises as send."""
        with self._send_lock:
            self._check_open()
            rc = send_fn()
        if rc < 0:
            raise self._fail(rc, "send")

    def recv_error(self, rc: int) -> Exception:
        """The exception recv() raises for the shim's return code `rc` (a -errno)."""
        return self._fail(rc, "recv")

    def native_link(self) -> Optional[tuple]:
        return ("dpdk", self.native_addresses())

    def native_addresses(self) -> tuple:
        """(conn, wire, head, head capacity, info, shim_conn_recv_msg, shim_conn_send_msg) as
        integers, for a server session's receive loop in C++ (server/csrc/fast_loop.h). It
        uses this transport's own head buffer, so finish_recv() can take over a message.
        Valid while this transport lives."""
        def address(cdata) -> int:
            return int(ffi.cast("uintptr_t", cdata))

        return (address(self._c), address(self._wire), address(self._head), HEAD_CAP, address(self._info),
                address(ffi.addressof(lib, "shim_conn_recv_msg")), address(ffi.addressof(lib, "shim_conn_send_msg")))

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
            views = [b if type(b) is Discard else byte_view(b) for b in buffers]
            if [v.nbytes for v in views] != lengths:
                raise ValueError("payload sink returned buffers of the wrong sizes")
            if any(type(v) is not Discard and v.readonly for v in views):
                raise ValueError("payload sink returned read-only buffers")
        except Exception:  # the message is dropped whole: the link stays usable
            lib.shim_conn_recv_discard(self._c)
            raise
        if any(type(v) is Discard for v in views):
            views = self._skip_views(views)
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

    def _skip_views(self, views: list) -> list:
        """A Discard's bytes as views that all land in one small buffer (the shim fills
        them one after another, so the same memory is simply written again)."""
        out = []
        for v in views:
            if type(v) is not Discard:
                out.append(v)
                continue
            if self._skip_buffer is None:
                self._skip_buffer = memoryview(np.empty(DISCARD_CHUNK, np.uint8)).cast("B")
            left = v.nbytes
            while left:
                n = min(left, DISCARD_CHUNK)
                out.append(self._skip_buffer[:n])
                left -= n
        return out

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
    process's EAL (one per client slot), after starting EAL with server defaults
    (dpdk_listen.py says which ports, and how local clients learn of their slots).

    max_clients: the server's limit, which sets how many memif interfaces its default EAL
    arguments get (memif_slots.slots_for)."""

    def __init__(self, ports: Optional[Sequence[int]] = None, eal_args=None, *,
                 options: ChannelOptions = ChannelOptions(), max_clients: Optional[int] = None,
                 **transport_kwargs):
        self._ports = ListenPorts(ports, eal_args, options.cdata, max_clients)
        self.address = self._ports.address
        self._options = options
        self._kwargs = transport_kwargs

    def accept(self, timeout: Optional[float] = None) -> DpdkTransport:
        conn, port = self._ports.accept(timeout)
        return DpdkTransport(conn, port=port, options=self._options, **self._kwargs)

    def close(self) -> None:
        self._ports.close()
