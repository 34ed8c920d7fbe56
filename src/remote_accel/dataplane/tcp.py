"""TCP fallback transport (also any connected stream socket, e.g. a socketpair).

Large payloads move without extra copies: `sendmsg` gathers the prologue and the
payload buffers in one call, and `recv_into` writes straight into the buffers the
caller's sink chose. A receiver polls briefly before it blocks, after traffic (see
`tcp_poll`): a reply that comes within the window costs no kernel wake-up.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
import time
from typing import Optional, Sequence

import numpy as np

from .._version import WIRE_VERSION
from ..errors import PeerGone, ProtocolError, TransportClosed, TransportTimeout
from . import wire
from .tcp_poll import PollWindow, poll_us_from_env
from .transport import DISCARD_CHUNK, Discard, Listener, Message, PayloadSink, Transport, byte_view, default_sink

log = logging.getLogger(__name__)

#: A message that stops making progress for this long means the peer is gone.
DEFAULT_STALL_TIMEOUT_S = 30.0
_SOCKET_BUFFER = 4 << 20
_IOV_MAX = 512
_RECV_CHUNK = 16 << 20
#: Bytes read ahead per receive call: one call takes a small message's header, prologue
#: and payload (and a sync point's Batch with the request behind it) at once. Needs of
#: half this or more go straight into the caller's buffer, as before.
_READ_AHEAD = 64 << 10


class TcpTransport(Transport):
    def __init__(self, sock: socket.socket, *, peer: str | None = None, limits: wire.Limits = wire.DEFAULT_LIMITS,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT_S, poll_us: Optional[int] = None):
        """`poll_us`: the longest a receiver polls before it blocks (None: from
        REMOTE_ACCEL_TCP_POLL_US; 0: block at once). Raises ValueError for a bad value."""
        # a blocking descriptor (no stall timeout) cannot be polled without blocking
        self._window = PollWindow(0 if stall_timeout is None else poll_us_from_env() if poll_us is None else poll_us)
        self._heard = False  # traffic since the last wait that timed out: polling may pay
        self._sock = sock
        self._limits = limits
        self._stall = stall_timeout
        self._send_lock = threading.Lock()
        self._fd_lock = threading.Lock()  # a poller's read against close: the number is not reused under it
        self._closed = False
        self._ahead = bytearray(_READ_AHEAD)  # received, not yet taken: _ahead[_head:_tail]
        self._head = self._tail = 0
        self._skip_buffer: Optional[memoryview] = None  # made by the first Discard
        self._counters = {"tx_messages": 0, "tx_bytes": 0, "rx_messages": 0, "rx_bytes": 0,
                          "rx_polled": 0, "rx_slept": 0, "rx_yield_lost": 0}
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)
            except OSError:
                pass
        sock.settimeout(stall_timeout)
        if peer is None:
            try:
                host, port = sock.getpeername()[:2]
                peer = f"tcp:{host}:{port}"
            except (OSError, ValueError, TypeError):
                peer = "stream"
        self.peer = peer

    # -- construction -----------------------------------------------------------------
    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 10.0, **kwargs) -> "TcpTransport":
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise PeerGone(f"cannot connect to tcp:{host}:{port}: {exc.strerror or exc}") from exc
        return cls(sock, **kwargs)

    @classmethod
    def pair(cls, **kwargs) -> tuple["TcpTransport", "TcpTransport"]:
        """Two connected transports over a socketpair (the in-memory transport for tests)."""
        a, b = socket.socketpair()
        return cls(a, peer="pair:b", **kwargs), cls(b, peer="pair:a", **kwargs)

    # -- Transport ---------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self._fd_lock:
            self._sock.close()

    def stats(self) -> dict:
        return dict(self._counters)

    def fileno(self) -> int:
        """The socket's descriptor, for select() (a caller that waits for bytes unread)."""
        return self._sock.fileno()

    def send(self, msg_type: int, meta: bytes = b"", payloads: Sequence = (), *, req_id: int = 0, flags: int = 0) -> None:
        self.send_many(((msg_type, meta, payloads, req_id),), flags=flags)

    def send_many(self, messages: Sequence, *, flags: int = 0) -> None:
        """Send (type, meta, payloads, req_id) messages back to back in one system call:
        a sync point's flush and its request wake the peer once. Raises as send."""
        pieces, total = [], 0
        for msg_type, meta, payloads, req_id in messages:
            views = [byte_view(p) for p in payloads]
            prologue = wire.encode_prologue(msg_type, meta, [v.nbytes for v in views], req_id=req_id,
                                            flags=flags, limits=self._limits)
            pieces.append(memoryview(prologue))
            pieces += [v for v in views if v.nbytes]
            total += len(prologue) + sum(v.nbytes for v in views)
        with self._send_lock:
            self._check_open()
            try:
                self._sendall(pieces)
            except (socket.timeout, TimeoutError):
                raise self._send_stalled() from None
            except OSError as exc:
                raise self._send_failed(f"send to {self.peer} failed: {exc.strerror or exc}") from exc
        self._heard = True
        self._counters["tx_messages"] += len(messages)
        self._counters["tx_bytes"] += total

    def _sendall(self, pieces: list) -> None:
        while pieces:
            sent = self._sock.sendmsg(pieces[:_IOV_MAX])
            while sent:
                if sent >= pieces[0].nbytes:
                    sent -= pieces[0].nbytes
                    pieces.pop(0)
                else:
                    pieces[0] = pieces[0][sent:]
                    sent = 0

    def recv(self, timeout: Optional[float] = None, sink: Optional[PayloadSink] = None) -> Message:
        self._check_open()
        self._wait_readable(timeout)
        try:
            try:
                header, lengths, meta = self._prologue()
            except ProtocolError:
                log.warning("closing %s: malformed message", self.peer)
                self.close()
                raise
            buffers = (sink or default_sink)(header, meta, lengths)
            views = [b if type(b) is Discard else byte_view(b) for b in buffers]
            if [v.nbytes for v in views] != lengths:
                raise ValueError("payload sink returned buffers of the wrong sizes")
            for v in views:
                if type(v) is Discard:
                    self._skip(v.nbytes)
                else:
                    self._recv_exact(v)
        except (socket.timeout, TimeoutError):
            raise self._broken(f"{self.peer} stalled mid-message for {self._stall:.0f} s") from None
        except OSError as exc:
            raise self._broken(f"receive from {self.peer} failed: {exc.strerror or exc}") from exc
        self._heard = True
        self._counters["rx_messages"] += 1
        self._counters["rx_bytes"] += wire.HEADER_SIZE + header.rest_len + header.payload_total
        return Message(header.type, meta, buffers, header.req_id, header.flags)

    # -- a server session's receive loop in C++ (server/csrc/tcp_link.h) -----------------
    def native_link(self) -> Optional[tuple]:
        return ("tcp", self.native_socket())

    def native_socket(self) -> tuple:
        """(fd, read-ahead buffer address, its capacity, poll window ns, stall timeout ns,
        (magic0, magic1, version, max_meta, max_payloads, max_payload_total)) for a server
        session's C++ loop. It reads through this transport's own read-ahead buffer (which
        never moves: this view pins it), so recv() takes over any message it leaves; the
        session hands the buffer's state over with read_ahead() and set_read_ahead()."""
        self._ahead_pin = memoryview(self._ahead)
        address = np.frombuffer(self._ahead_pin, np.uint8).ctypes.data
        limits = self._limits
        stall_ns = int(self._stall_s() * 1e9)
        return (self._sock.fileno(), address, len(self._ahead), self._window.max_ns, stall_ns,
                (wire.MAGIC[0], wire.MAGIC[1], WIRE_VERSION, limits.max_meta, limits.max_payloads,
                 limits.max_payload_total))

    def read_ahead(self) -> tuple[int, int]:
        """The read-ahead buffer's unread bytes: [head, tail)."""
        return self._head, self._tail

    def set_read_ahead(self, head: int, tail: int) -> None:
        """What the C++ loop left unread in the read-ahead buffer."""
        self._head, self._tail = head, tail

    def add_native_counts(self, rx_messages: int, rx_bytes: int, tx_messages: int, tx_bytes: int) -> None:
        """Count the messages the C++ loop received and sent on this socket."""
        c = self._counters
        c["rx_messages"] += rx_messages
        c["rx_bytes"] += rx_bytes
        c["tx_messages"] += tx_messages
        c["tx_bytes"] += tx_bytes

    def finish_recv(self, n: int, sink: Optional[PayloadSink] = None) -> Message:
        """recv() of a message the C++ loop left in the read-ahead buffer (its first `n`
        bytes, at least, are there)."""
        self._heard = True
        return self.recv(sink=sink)

    def send_locked(self, send_fn) -> None:
        """Run `send_fn()`, a C call that sends one message on this socket and returns 0
        or a -errno (the C++ loop's heartbeat), under the lock Python's sends hold: messages
        never interleave. Raises as send."""
        with self._send_lock:
            self._check_open()
            rc = send_fn()
        if rc == -errno.ETIMEDOUT:  # the C++ send's own stall timeout (native_socket)
            raise self._send_stalled()
        if rc < 0:
            raise self._send_failed(f"send to {self.peer} failed: {os.strerror(-rc)}")

    def recv_error(self, rc: int) -> Exception:
        """The exception recv() raises for the C++ loop's -errno `rc`."""
        if rc == -errno.ETIMEDOUT:
            self._check_open()
            self._heard = False
            return TransportTimeout(f"no message from {self.peer} in time")
        if rc == -errno.ECONNRESET:
            return self._broken(f"receive from {self.peer} failed: connection closed by peer")
        return self._broken(f"receive from {self.peer} failed: {os.strerror(-rc)}")

    # -- helpers -----------------------------------------------------------------------
    def _prologue(self) -> tuple:
        """The next message's header, payload lengths and meta; decoded where they lie
        when the read-ahead buffer holds the whole prologue (a small message's usually
        does), else read into buffers of their own. Raises ProtocolError, OSError."""
        size = wire.HEADER_SIZE
        if self._tail - self._head >= size:
            at, view = self._head, memoryview(self._ahead)
            header = wire.decode_header(view[at : at + size], self._limits)
            end = at + size + header.rest_len
            if end <= self._tail:
                lengths, meta = wire.decode_rest(header, view[at : at + size], view[at + size : end])
                self._head = end
                return header, lengths, meta
        head = bytearray(size)
        self._recv_exact(memoryview(head), first=True)
        header = wire.decode_header(head, self._limits)
        rest = bytearray(header.rest_len)
        self._recv_exact(memoryview(rest))
        lengths, meta = wire.decode_rest(header, head, rest)
        return header, lengths, meta

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"transport to {self.peer} is closed")

    def _broken(self, text: str) -> Exception:
        if self._closed:
            return TransportClosed(f"transport to {self.peer} was closed")
        self.close()
        return self._gone(text)

    def _gone(self, text: str) -> PeerGone:
        """The error of a peer that went away, closed here or not (_broken, _send_failed)."""
        return PeerGone(text)

    def _stall_s(self) -> float:
        """The send stall timeout in force: this transport's, else the C++ send's default
        (Python's sends then block without one, and never stall out)."""
        return self._stall if self._stall is not None else DEFAULT_STALL_TIMEOUT_S

    def _send_stalled(self) -> Exception:
        """A send the peer stopped taking for the stall timeout: the transport closes."""
        return self._broken(f"send to {self.peer} stalled for {self._stall_s():.0f} s")

    def _send_failed(self, text: str) -> Exception:
        """A send that failed other than by stalling: the peer's end refused it (EPIPE,
        ECONNRESET: it closed or went away). The transport stays open for recv: what the
        peer sent before it left (a client's last requests, its GOODBYE) is still in the
        socket, and recv reads it, then finds the end of the stream. The sender is often
        another thread than the receiver (a server's busy beat): closing here dropped
        those bytes. Its owner closes it (a session that ends, a recovery)."""
        if self._closed:
            return TransportClosed(f"transport to {self.peer} was closed")
        self._peer_gone = True
        return self._gone(text)

    def _wait_readable(self, timeout: Optional[float]) -> None:
        if self._tail > self._head:
            return  # a message (or its start) was read ahead already
        asked, started = timeout, time.monotonic_ns()
        poll_until = self._poll_until(started, timeout)
        if poll_until:
            try:
                if self._poll(poll_until):
                    self._waited(started, polled=True)
                    return
            except OSError as exc:  # as the read that select would have led to
                raise self._broken(f"receive from {self.peer} failed: {exc.strerror or exc}") from exc
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic_ns() - started) / 1e9)
        try:
            ready, _, _ = select.select([self._sock], [], [], timeout)
        except (OSError, ValueError):
            self._check_open()
            raise
        self._waited(started if poll_until else 0, polled=False)
        if not ready:
            self._check_open()
            self._heard = False  # silent for a whole timeout: the next wait blocks at once
            raise TransportTimeout(f"no message from {self.peer} within {asked} s")

    def _poll_until(self, now_ns: int, timeout: Optional[float]) -> int:
        """When a wait that starts now stops polling and blocks (0: it blocks at once):
        after traffic, for the adapted window, never past the caller's timeout."""
        window = self._window.window_at(now_ns) if self._heard else 0
        if window and timeout is not None:
            window = min(window, int(timeout * 1e9))
        return now_ns + window if window > 0 else 0  # a negative timeout fails in select, as before

    def _waited(self, started_ns: int, polled: bool) -> None:
        """Count a wait (polled: its message came while polling) and adapt the window to
        it (started_ns 0: the wait did not poll, it tells nothing about the window)."""
        if polled:
            self._counters["rx_polled"] += 1
            self._window.caught()
            return
        self._counters["rx_slept"] += 1
        if started_ns:
            self._window.waited(time.monotonic_ns() - started_ns)

    def _poll(self, deadline_ns: int) -> bool:
        """Read what comes before `deadline_ns` into the read-ahead buffer, without
        blocking; True when the socket had something (bytes, or the peer's end). Each turn
        is two system calls that release the GIL (the read, a yield), so the peer, when
        it shares this core, and this process's other threads run in between."""
        while True:
            with self._fd_lock:
                if self._closed:
                    return True  # closed here meanwhile: the read reports it, as after a wake-up
                try:
                    n = os.readv(self._sock.fileno(), (self._ahead,))
                except BlockingIOError:
                    n = -1
            if n >= 0:
                self._head, self._tail = 0, n  # n == 0 (the peer closed): the read reports it
                return True
            if time.monotonic_ns() >= deadline_ns or not self._yield_core():
                return False

    def _yield_core(self) -> bool:
        """Yield the core between two polls. False when the yield lost it (others' work
        ran for longer than the whole window): the wait must block now, to be woken when
        its message lands, and polling pauses (PollWindow.yielded)."""
        before = time.monotonic_ns()
        os.sched_yield()
        after = time.monotonic_ns()
        if self._window.yielded(after - before, after):
            self._counters["rx_yield_lost"] += 1
            return False
        return True

    def _skip(self, nbytes: int) -> None:
        """Read `nbytes` of the stream and throw them away, through one small buffer."""
        scratch = self._skip_buffer
        if scratch is None:
            scratch = self._skip_buffer = memoryview(bytearray(DISCARD_CHUNK))
        while nbytes:
            n = min(nbytes, DISCARD_CHUNK)
            self._recv_exact(scratch[:n])
            nbytes -= n

    def _recv_exact(self, view: memoryview, first: bool = False) -> None:
        """Fill `view`: first from the bytes read ahead, then small needs through the
        read-ahead buffer (one system call may bring the next messages too), large ones
        straight into `view`."""
        got, total = 0, view.nbytes
        while got < total:
            if self._tail > self._head:
                n = min(total - got, self._tail - self._head)
                view[got : got + n] = self._ahead[self._head : self._head + n]
                self._head += n
                got += n
                continue
            need = total - got
            if need >= _READ_AHEAD // 2:
                n = self._read_direct(view[got : got + _RECV_CHUNK])
                got += n
            else:
                self._head = 0
                n = self._tail = self._read_some(self._ahead)
            if n == 0:
                where = "" if first and got == 0 else " mid-message"
                raise OSError(errno.ECONNRESET, f"connection closed by peer{where}")

    def _read_direct(self, view: memoryview) -> int:
        """Read a large need straight into `view` (the socket's timeout bounds the wait)."""
        return self._sock.recv_into(view)

    def _read_some(self, buffer) -> int:
        """What the socket holds, up to len(buffer); waits only if it holds nothing.
        The socket has a timeout, so its recv_into polls before every read; a plain read
        of the non-blocking descriptor is one system call where data is there (it
        usually is: select said so, or the rest of a message is on its way)."""
        try:
            return os.readv(self._sock.fileno(), (buffer,))
        except BlockingIOError:
            return self._sock.recv_into(buffer)  # waits up to the stall timeout


class TcpListener(Listener):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, backlog: int = 64, **transport_kwargs):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(backlog)
        self._kwargs = transport_kwargs
        self._closed = False
        self.host, self.port = self._sock.getsockname()[:2]
        self.address = f"tcp:{self.host}:{self.port}"

    def accept(self, timeout: Optional[float] = None) -> TcpTransport:
        if self._closed:
            raise TransportClosed("listener is closed")
        try:
            ready, _, _ = select.select([self._sock], [], [], timeout)
        except (OSError, ValueError):
            raise TransportClosed("listener is closed") from None
        if not ready:
            raise TransportTimeout(f"no client within {timeout} s")
        try:
            sock, _ = self._sock.accept()
        except OSError as exc:
            raise TransportClosed(f"listener closed: {exc}") from exc
        return self._transport(sock)

    def _transport(self, sock: socket.socket) -> TcpTransport:
        return TcpTransport(sock, **self._kwargs)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()
