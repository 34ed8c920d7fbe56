"""TLS for the TCP transport, with Python's `ssl`.

    server: TcpListener(host, port, tls=server_context(cert, key, client_ca=None))
    client: TcpTransport.connect(host, port, tls=client_context(ca))

A client given a CA accepts only a server whose certificate that CA signed for the
name it dialled (host name or IP address). With `client_ca` the server asks every
client for a certificate signed by that CA (mutual TLS).

Bulk data crosses with the copies TLS cannot avoid: the sender encrypts straight from
the caller's buffer (no gathering into one bytes object), the receiver decrypts
straight into the buffer the payload sink chose.

An SSL object must not be read and written by two threads at once, while a Transport
lets one thread receive as others send. So the socket is non-blocking, every OpenSSL
call runs under one short lock, and all waiting (select) happens outside it.

After the handshake the SSL object inside `ssl`'s socket is found (`_ssl_address`, checked):
reads then take as many records as are there in one call in C (`_tls_io.c`), records
travel many to a syscall each way (a write buffer flushed after each message, and
read-ahead: `openssl_calls.h`, ra_ssl_batch_records), and a server session hands the
object to its C++ receive loop (`native_link`, server/csrc/tls_link.h). Where it cannot
be found, Python's `ssl` does every read and write, a record a syscall.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import select
import socket
import ssl
import threading
import time
from collections import OrderedDict
from typing import Optional

from ..errors import AuthError, ConfigError, PeerGone, ProtocolError, RemoteAccelError, TransportTimeout
from . import messages as m
from . import wire
from .tcp import TcpListener, TcpTransport

try:
    from . import _tls_io
except ImportError:  # not built: Python's reads and writes, one record a call
    _tls_io = None

_WOULD_BLOCK = -2  # _tls_io.read_into: SSL_ERROR_WANT_READ (-3: WANT_WRITE)
#: Pieces of a message smaller than this are joined before encryption: one TLS record
#: (and one syscall) for a small message instead of one per piece.
_COALESCE = 64 << 10
#: What a plain-text client is told (in plain text) by a TLS server before it hangs up.
PLAINTEXT_REFUSED = ("this server takes TLS connections only: give the client the server's CA "
                     "(remote_accel.init(..., tls_ca=PATH) or REMOTE_ACCEL_TLS_CA=PATH)")


def server_context(cert: str, key: str, client_ca: Optional[str] = None) -> ssl.SSLContext:
    """A server's TLS settings; ConfigError naming the file when one cannot be used."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load(ctx.load_cert_chain, f"certificate {cert} with key {key}", cert, key)
    if client_ca:
        _load(ctx.load_verify_locations, f"client CA {client_ca}", client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(ca: Optional[str] = None, cert: Optional[str] = None, key: Optional[str] = None, *,
                   ca_text: Optional[str] = None) -> ssl.SSLContext:
    """A client's TLS settings: trust the CA of the PEM file `ca` (or the PEM text
    `ca_text`: a server copying to another, with the CA its client named) alone, check
    the server's name; present `cert` (and `key`) to a server that asks for one."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_text is not None:
        _load(lambda: ctx.load_verify_locations(cadata=ca_text), "CA (PEM text)")
    else:
        _load(ctx.load_verify_locations, f"CA {ca}", ca)
    if cert:
        _load(ctx.load_cert_chain, f"client certificate {cert}", cert, key)
    elif key:
        raise ConfigError("a TLS client key needs its certificate too")
    return ctx


class PeerContexts:
    """A server's TLS settings for its connections to other servers (direct copies,
    process groups), by the CA text a client named to check the other server; the most
    recent `kept` of them (a handful of CAs at most: one per client deployment)."""

    def __init__(self, identity: Optional[tuple[str, str]] = None, kept: int = 8):
        #: this server's (certificate, key) files, shown to another server that asks
        self.identity = identity
        self._kept = kept
        self._lock = threading.Lock()
        self._contexts: "OrderedDict[str, ssl.SSLContext]" = OrderedDict()

    def get(self, ca_text: str, purpose: str) -> ssl.SSLContext:
        """The settings for a connection checked by `ca_text`; ProtocolError naming
        `purpose` (the message that carried the CA) where the text is no certificate."""
        with self._lock:
            ctx = self._contexts.get(ca_text)
            if ctx is not None:
                self._contexts.move_to_end(ca_text)
                return ctx
        cert, key = self.identity or (None, None)  # checked when the server started
        try:
            ctx = client_context(cert=cert, key=key, ca_text=ca_text)
        except ConfigError as exc:
            raise ProtocolError(f"{purpose}: the CA is no PEM certificate ({exc})") from None
        with self._lock:
            self._contexts[ca_text] = ctx
            while len(self._contexts) > self._kept:
                self._contexts.popitem(last=False)
        return ctx


def _load(fn, what: str, *paths) -> None:
    try:
        fn(*paths)
    except FileNotFoundError as exc:
        raise ConfigError(f"TLS {what}: no such file {exc.filename or ''}".rstrip()) from None
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ConfigError(f"TLS {what} cannot be used: {getattr(exc, 'reason', None) or exc}") from None


class TlsTransport(TcpTransport):
    """A TcpTransport over TLS. Made from a connected plain socket; the TLS handshake runs
    at `connect` on a client, and in the first recv (within its timeout) on a server,
    so that an accept loop never waits for a slow or hostile peer."""

    def native_link(self) -> Optional[tuple]:
        """("tls", TcpTransport.native_socket()'s tuple + (the SSL object's address, OpenSSL's
        functions)) for a server session's C++ loop (server/csrc/tls_link.h), after the
        handshake; None where Python's `ssl` cannot hand its SSL object over (every message
        then goes through Python, as before)."""
        if self._ssl_address is None or self._closed:
            return None
        return ("tls", (*self.native_socket(), self._ssl_address, _openssl_functions()))

    def send_locked(self, send_fn) -> None:
        """TcpTransport.send_locked, and the C++ send runs under the lock of every call into
        the SSL object: the heartbeat's send never meets Python's read of the same object."""
        def locked():
            with self._io:
                return send_fn()
        super().send_locked(locked)

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, *, server_side: bool,
                 server_hostname: Optional[str] = None, **kwargs):
        super().__init__(sock, **kwargs)
        self.peer = self.peer.replace("tcp:", "tls:", 1)
        self._context = context
        self._server_side = server_side
        self._hostname = server_hostname
        self._io = threading.Lock()  # every call into the SSL object
        self._ready = False
        self._ssl_address: Optional[int] = None  # the SSL object's, after the handshake (_found_ssl_object)
        self._c_reads: Optional[tuple] = None  # _tls_io.read_into's (SSL*, SSL_read, SSL_get_error, ERR_clear_error)
        self._batching: Optional[tuple] = None  # _tls_io.flush's (SSL*, calls) once records are batched
        sock.setblocking(False)

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 10.0, *, tls: ssl.SSLContext,
                **kwargs) -> "TlsTransport":
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise PeerGone(f"cannot connect to tcp:{host}:{port}: {exc.strerror or exc}") from exc
        t = cls(sock, tls, server_side=False, server_hostname=host, **kwargs)
        try:
            t._handshake(time.monotonic() + timeout)
        except BaseException:
            t.close()
            raise
        return t

    # -- the TLS handshake -----------------------------------------------------------
    def _handshake(self, deadline: float) -> None:
        if self._ready:
            return
        with self._io:
            if self._ready:
                return
            try:
                if self._server_side:
                    self._refuse_plaintext(deadline)
                if not isinstance(self._sock, ssl.SSLSocket):
                    self._sock = self._context.wrap_socket(self._sock, server_side=self._server_side,
                                                           server_hostname=self._hostname,
                                                           do_handshake_on_connect=False)
                while True:
                    try:
                        self._sock.do_handshake()
                        break
                    except ssl.SSLWantReadError:
                        self._wait(True, False, deadline, "the TLS handshake")
                    except ssl.SSLWantWriteError:
                        self._wait(False, True, deadline, "the TLS handshake")
            except (socket.timeout, TimeoutError):
                raise self._failed(PeerGone(f"the TLS handshake with {self.peer} did not finish in time"
                                            f"{self._hint()}")) from None
            except ssl.SSLCertVerificationError as exc:
                if self._server_side:  # the client is gone, there is no one to raise AuthError to
                    raise self._failed(PeerGone(f"TLS: {self.peer} has no client certificate valid under "
                                                f"--tls-client-ca ({exc.verify_message})")) from None
                raise self._failed(AuthError(
                    f"TLS: {self.peer} has no certificate valid for {self._hostname!r} under the given CA "
                    f"({exc.verify_message})")) from None
            except ssl.SSLError as exc:
                raise self._failed(PeerGone(f"TLS handshake with {self.peer} failed: {exc.reason or exc}"
                                            f"{self._hint()}")) from None
            except RemoteAccelError:
                raise
            except OSError as exc:
                raise self._failed(PeerGone(f"{self.peer} closed the connection during the TLS handshake "
                                            f"({exc.strerror or exc}){self._hint()}")) from None
            self._ready = True
            self._found_ssl_object()

    def _found_ssl_object(self) -> None:
        """After the handshake: the SSL object's address, for reads in C and batched records
        (_tls_io.c) and a server's C++ loop; None where Python's `ssl` cannot hand it over
        (Python's reads and writes)."""
        sslobj = getattr(self._sock, "_sslobj", None)
        address = None if sslobj is None else _ssl_address(sslobj, self._sock.fileno())
        if address is None:
            return
        self._native_ssl = sslobj  # used through its address: never freed before this transport
        self._ssl_address = address
        if _tls_io is not None:
            read, _, get_error, _, clear_error, _, *batching = _openssl_functions()
            self._c_reads = (address, read, get_error, clear_error)
            calls = tuple(batching)
            if _tls_io.batch_records(address, calls):  # under self._io, as _handshake holds it
                self._batching = (address, calls)

    def _hint(self) -> str:
        if self._server_side:
            return " (a client without TLS, or one that does not trust our certificate)"
        return (" (a server without TLS, or one that wants a client certificate: "
                "REMOTE_ACCEL_TLS_CERT / REMOTE_ACCEL_TLS_KEY)")

    def _gone(self, text: str) -> PeerGone:
        # TLS 1.3 lets a client finish its handshake before the server has checked the
        # client's certificate: a refusal then shows up as a reset on the first exchange,
        # a send's or a receive's
        if not self._server_side and not self._counters["rx_messages"]:
            text += (" (if the server wants a client certificate, this is its refusal: give one with "
                     "tls_cert=/tls_key= or REMOTE_ACCEL_TLS_CERT/REMOTE_ACCEL_TLS_KEY)")
        return super()._gone(text)

    def _refuse_plaintext(self, deadline: float) -> None:
        """A plain-text client opens with our magic, not a TLS record: tell it, in its own
        language, what it must do, instead of leaving it to guess from a closed socket."""
        self._wait(True, False, deadline, "the TLS handshake")
        try:
            first = self._sock.recv(len(wire.MAGIC), socket.MSG_PEEK)
        except OSError:
            return  # the handshake below reports it
        if first != wire.MAGIC:
            return
        reply = m.ErrorReply("auth", PLAINTEXT_REFUSED, "")
        meta = m.encode(reply)
        try:
            self._sock.setblocking(True)
            self._sock.settimeout(1.0)
            self._sock.sendall(wire.encode_prologue(reply.TYPE, meta, []) + meta)
        except OSError:
            pass
        raise self._failed(ProtocolError(f"{self.peer} spoke plain text to a TLS listener (told to use TLS)"))

    def _failed(self, exc: Exception) -> Exception:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass
        return exc

    # -- TcpTransport's byte moving, non-blocking under the lock -----------------------------
    def _wait(self, read: bool, write: bool, deadline: Optional[float], what: str) -> None:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise socket.timeout(f"{what} took too long")
        try:
            r, w, _ = select.select([self._sock] if read else [], [self._sock] if write else [], [], left)
        except (OSError, ValueError):
            self._check_open()
            raise
        if not (r or w):
            raise socket.timeout(f"{what} took too long")

    def _sendall(self, pieces: list) -> None:
        self._handshake(time.monotonic() + self._stall)
        for piece in _coalesced(pieces):
            while piece.nbytes:
                with self._io:
                    try:
                        n = self._sock.send(piece)
                    except ssl.SSLWantWriteError:
                        n, read = 0, False
                    except ssl.SSLWantReadError:
                        n, read = 0, True
                if n:
                    piece = piece[n:]
                else:
                    self._wait(read, not read, time.monotonic() + self._stall, "a send")
        if self._batching is not None:
            self._flush()

    def _flush(self) -> None:
        """The write buffer's records out: the message just written ends there."""
        while True:
            with self._io:
                if self._closed:
                    raise OSError(errno.EBADF, "closed")
                sent = _tls_io.flush(*self._batching)
            if sent > 0:
                return
            if sent < 0:
                raise OSError(errno.EPIPE, "TLS write failed")
            self._wait(False, True, time.monotonic() + self._stall, "a send")

    def _wait_readable(self, timeout: Optional[float]) -> None:
        """Wait for the first bytes of a message: raw readability is not enough (a TLS
        record may hold no application data, e.g. a session ticket), so read them here,
        into the read-ahead buffer as TcpTransport does: one read takes a whole record (a
        small message, often the next ones too) instead of a header, then its rest."""
        if self._tail > self._head:
            return  # a message (or its start) was read ahead already
        deadline = None if timeout is None else time.monotonic() + timeout
        started = time.monotonic_ns()
        poll_until = self._poll_until(started, timeout) if self._ready else 0
        try:
            self._handshake(deadline if deadline is not None else time.monotonic() + self._stall_s())
            n = self._tls_read(memoryview(self._ahead), deadline, "a message", poll_until)
            self._head, self._tail = 0, n
            if n == 0:
                raise OSError(errno.ECONNRESET, "connection closed by peer")
        except RemoteAccelError:
            raise
        except (socket.timeout, TimeoutError):
            self._check_open()
            self._waited(started if poll_until else 0, polled=False)
            self._heard = False  # silent for a whole timeout: the next wait blocks at once
            raise TransportTimeout(f"no message from {self.peer} within {timeout} s") from None
        except OSError as exc:
            raise self._broken(f"receive from {self.peer} failed: {exc.strerror or exc}") from exc
        self._waited(started if poll_until else 0, polled=poll_until > 0 and time.monotonic_ns() <= poll_until)

    def _tls_read(self, view: memoryview, deadline: Optional[float], what: str, poll_until: int = 0) -> int:
        """Read what there is into `view` (0: the peer's end), waiting until `deadline` for
        something; until `poll_until` (monotonic ns) the wait polls (see
        TcpTransport._wait_readable)."""
        while True:
            with self._io:
                n = -1
                if self._c_reads is not None and not self._closed:  # many records a call, in C
                    n = _tls_io.read_into(*self._c_reads, view)
                    if n < -1:
                        n, read = None, n == _WOULD_BLOCK
                if n == -1:  # without it, or for the peer's end and errors: Python's own call
                    try:
                        n = self._sock.recv_into(view)
                    except ssl.SSLWantReadError:
                        n, read = None, True
                    except ssl.SSLWantWriteError:
                        n, read = None, False
            if self._closed:  # closed meanwhile: SSLSocket.shutdown drops the SSL object before the
                raise OSError(errno.EBADF, "closed")  # socket's, a read in between returns raw records
            if n is not None:
                return n
            if read and poll_until and time.monotonic_ns() < poll_until:  # closed: the next read says so
                if self._yield_core():  # outside the lock: a sender goes on meanwhile
                    continue
                poll_until = 0  # the yield lost the core: block from now on
            self._wait(read, not read, deadline, what)

    # TcpTransport._recv_exact's reads: the rest of a message, within the stall timeout
    def _read_some(self, buffer) -> int:
        return self._tls_read(memoryview(buffer), time.monotonic() + self._stall_s(), "a message")

    _read_direct = _read_some


#: OpenSSL's functions a server's C++ loop calls (server/csrc/tls_link.h, SslFunctions):
#: its own six, then those that batch records, in struct ra_ssl_batching's order
#: (dataplane/openssl_calls.h), which _tls_io.c takes too
_SSL_FUNCTIONS = ("SSL_read", "SSL_write", "SSL_get_error", "SSL_set_fd", "ERR_clear_error", "ERR_peek_error",
                  "BIO_f_buffer", "BIO_new", "BIO_free", "BIO_up_ref", "BIO_push", "BIO_ctrl", "BIO_int_ctrl",
                  "BIO_test_flags", "SSL_get_wbio", "SSL_set0_wbio", "SSL_set_read_ahead",
                  "SSL_set_default_read_buffer_len", "SSL_free_buffers")


@functools.lru_cache(maxsize=None)
def _openssl() -> Optional[ctypes.CDLL]:
    """The OpenSSL that Python's `_ssl` module uses, its functions looked up through that
    module (so the loop calls the library that made the SSL object); None where the module
    does not expose them (an OpenSSL linked in statically)."""
    try:
        import _ssl
        lib = ctypes.CDLL(_ssl.__file__)
        for name in _SSL_FUNCTIONS + ("SSL_get_fd",):
            getattr(lib, name)
    except (ImportError, OSError, AttributeError):
        return None
    lib.SSL_get_fd.argtypes, lib.SSL_get_fd.restype = [ctypes.c_void_p], ctypes.c_int
    return lib


@functools.lru_cache(maxsize=None)
def _openssl_functions() -> Optional[tuple]:
    lib = _openssl()
    return None if lib is None else tuple(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in _SSL_FUNCTIONS)


def _ssl_address(sslobj, fd: int) -> Optional[int]:
    """The SSL* inside a `_ssl._SSLSocket`, or None. CPython (3.8 to 3.13) lays the object
    out as its header, the socket's weak reference, the SSL*, then the context: the context
    pointer must be the object `sslobj.context` is, and the SSL's descriptor `fd`."""
    lib = _openssl()
    if lib is None:
        return None
    word = ctypes.sizeof(ctypes.c_void_p)
    fields = id(sslobj) + object.__basicsize__
    try:
        if ctypes.c_void_p.from_address(fields + 2 * word).value != id(sslobj.context):
            return None
    except AttributeError:
        return None
    address = ctypes.c_void_p.from_address(fields + word).value
    if not address or lib.SSL_get_fd(address) != fd:
        return None
    return address


def _coalesced(pieces: list) -> list:
    """Small neighbours joined (one copy of small bytes), large pieces as they are."""
    out, small = [], bytearray()
    for piece in pieces:
        if small and (piece.nbytes >= _COALESCE or len(small) + piece.nbytes > _COALESCE):
            out.append(memoryview(small))
            small = bytearray()
        if piece.nbytes >= _COALESCE:
            out.append(piece)
        else:
            small += piece
    if small:
        out.append(memoryview(small))
    return out


class TlsListener(TcpListener):
    """A TcpListener whose clients must speak TLS (the handshake runs in their session
    thread, at its first recv)."""

    tls = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, tls: ssl.SSLContext, **kwargs):
        super().__init__(host, port, **kwargs)
        self._tls = tls

    def _transport(self, sock: socket.socket) -> TlsTransport:
        return TlsTransport(sock, self._tls, server_side=True, **self._kwargs)
