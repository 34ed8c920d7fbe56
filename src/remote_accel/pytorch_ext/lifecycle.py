"""`init()` and `shutdown()`: connect to the server(s), make the device usable, forget them.

Settings come from the explicit arguments, then the environment (REMOTE_ACCEL_SERVER,
REMOTE_ACCEL_TRANSPORT, REMOTE_ACCEL_TOKEN, REMOTE_ACCEL_EAL_ARGS), then defaults:
transport "auto" (DPDK when it can reach a local server, else TCP, saying why in the log).

The top of the client: it imports the device modules, which find their sessions in
`runtime` below them. Those imports wait for init(): importing remote_accel.pytorch_ext
must not load torch's C++ extension (a build without it still imports, and init() says
how to rebuild).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Optional, Sequence

from .. import config, frameworks
from ..dataplane import handshake as hs
from ..dataplane.tcp import TcpTransport
from ..dataplane.tls import TlsTransport, client_context
from ..errors import AuthError, ConfigError, RemoteAccelError
from . import runtime
from .session import Session

log = logging.getLogger("remote_accel")

#: The sessions were made by the first use of the device, from the environment (autoload),
#: not by an explicit init(): an explicit init() replaces them.
_implicit = False
_first_use = threading.local()  # .connecting: this thread is in connect_from_environment


def init(
    transport: Optional[str] = None,
    port: int = 0,
    server: Optional[str] = None,
    eal_args: Optional[Sequence[str] | str] = None,
    token: Optional[str | Sequence[str]] = None,
    timeout: float = config.DEFAULT_TIMEOUT_S,
    *,
    servers=None,
    tokens: Optional[Sequence[str]] = None,
    direct_copies: bool = True,
    tls_ca: Optional[str] = None,
    tls_cert: Optional[str] = None,
    tls_key: Optional[str] = None,
    recovery: bool = True,
    recovery_timeout: float = 60.0,
) -> None:
    """Connect to the remote_accel server(s); afterwards device="remote_accel" works.

    transport: "dpdk", "tcp" or "auto" (default: $REMOTE_ACCEL_TRANSPORT, else "auto").
    port: the DPDK port id (0: the default memif port to a server on this host).
    server: "host:port" of a TCP server (default: $REMOTE_ACCEL_SERVER, else 127.0.0.1:18515);
      several, comma-separated, are the same as `servers` (and $REMOTE_ACCEL_TOKEN may
      then list one token per server, comma-separated).
    servers: several "host:port" servers, which become remote_accel:0, remote_accel:1, ...;
      or a server pool (`remote_accel.ray.ServerPool`, anything with addresses() and
      tokens()), whose servers are then reached over TCP with their own tokens.
    eal_args: DPDK EAL arguments (list or one string; default: $REMOTE_ACCEL_EAL_ARGS, else
      a memif client of the local server's default socket).
    token: the server's shared secret (default: $REMOTE_ACCEL_TOKEN, else the token file a
      local server wrote); or one token per server of `servers`.
    tokens: one token per server of `servers` (the same as a list for `token`).
    direct_copies: a tensor moved between two servers (`t.to("remote_accel:1")`) goes from
      one server straight to the other (the source connects to the destination's TCP
      listener, under the destination's token; over TLS checking its certificate with
      tls_ca's CA, which this client hands it; a server reached over DPDK takes part
      where it also listens on TCP); False: through this client.
    With `servers` and a DPDK port, only the server named is used over DPDK: a port
    leads to whichever server is behind it, the handshake names the one meant, and
    "auto" reaches any other over TCP ("dpdk" raises ConfigError, kind "wrong_server").
    timeout: seconds of silence (no reply, no heartbeat) after which the server counts as
      dead or frozen and RemoteAccelError is raised. A sync waits as long as the work
      takes: a working server keeps sending heartbeats (see synchronize(timeout=...) for
      a deadline). Also the limit for connecting and for the handshake.
    tls_ca: PEM file of the CA that signed the server's certificate (default:
      $REMOTE_ACCEL_TLS_CA): TCP then speaks TLS, and a server without a certificate valid
      for its address under that CA is refused. DPDK links stay plain text.
    tls_cert, tls_key: this client's certificate and key, for a server that asks for one
      (--tls-client-ca; default: $REMOTE_ACCEL_TLS_CERT, $REMOTE_ACCEL_TLS_KEY).
    recovery: when a server goes away (killed, crashed, restarted), reconnect to it (or
      to a pool member's replacement), rebuild every tensor from a snapshot and a journal
      of the work since, and go on with no exception (see recovery.py; host memory for
      it: $REMOTE_ACCEL_RECOVERY_MEMORY). False: a dead server's tensors are lost, and
      the next call raises RemoteAccelError at once.
    recovery_timeout: seconds to wait for a server to answer again before giving up
      with RemoteAccelError.
    """
    from . import _register

    global _implicit
    _register.register_device()
    frameworks.install()  # transformers, accelerate, Lightning: on the device, imported before or after
    if _implicit and runtime.sessions():
        # explicit settings win over the environment's, which connected on first use
        log.info("remote_accel: init() replaces the session(s) made from the environment")
        shutdown()
    _implicit = False
    transport = config.transport(transport)
    if transport not in ("auto", "tcp", "dpdk"):
        raise ConfigError(f"transport must be 'dpdk', 'tcp' or 'auto', not {transport!r}")
    eal_args = config.eal_args(eal_args)
    if servers is not None and callable(getattr(servers, "addresses", None)) and callable(
            getattr(servers, "tokens", None)):
        # a pool: its addresses and tokens (the tokens came through the pool, never a file)
        pool = servers
        servers, tokens = list(pool.addresses()), list(pool.tokens())
        if transport == "auto":
            transport = "tcp"
    else:
        pool = None
    if servers is None:
        # "host:port" or several, comma-separated: remote_accel:0, remote_accel:1, ... (every
        # rank of a torchrun job sees them all, as every CUDA process sees every GPU)
        servers = config.servers(server)
        if tokens is None and token is None and len(servers) > 1 and "," in config.setting(config.ENV_TOKEN):
            tokens = [t.strip() for t in config.setting(config.ENV_TOKEN).split(",")]
    elif isinstance(servers, str):
        servers = [s.strip() for s in servers.split(",")]
    if timeout <= 0:
        raise ConfigError("timeout must be positive")
    if recovery_timeout <= 0:
        raise ConfigError("recovery_timeout must be positive")
    if tokens is None and token is not None and not isinstance(token, str):
        tokens = token
    if tokens is not None:
        tokens = list(tokens)
        if len(tokens) != len(servers) or not all(isinstance(t, str) for t in tokens):
            raise ConfigError(f"tokens: expected one token (a str) per server, {len(servers)} in all; "
                              f"got {len(tokens)}")
        token_sources = [(t, f"the tokens argument (server {i})") for i, t in enumerate(tokens)]
    else:
        token_sources = [(token, "the token argument") if token is not None else _default_token()] * len(servers)
    tls = _tls_context(tls_ca, tls_cert, tls_key)
    peer_tls_ca = _ca_text(tls_ca) if tls is not None and direct_copies else None

    with runtime.lock:
        if runtime.sessions() and not any(s.alive for s in runtime.sessions()):
            _forget_dead()  # the server died: a new init() needs no shutdown() first
        if runtime.sessions():
            raise RemoteAccelError("remote_accel is already initialised; call remote_accel.shutdown() first")
        made: list[Session] = []
        try:
            for index, (address, (token, token_source)) in enumerate(zip(servers, token_sources)):
                route = [transport]  # "tcp" once a DPDK port led to another server (_open): reconnects follow
                reconnect = None
                if recovery:
                    reconnect = _reconnector(pool, index, route, address, port, eal_args, timeout, tls, token,
                                             token_source, direct_copies)
                try:
                    made.append(_open(route, address, port, eal_args, timeout, tls, token=token, reconnect=reconnect,
                                      recovery_timeout=recovery_timeout))
                except AuthError as exc:
                    exc.add_note(f"the token came from {token_source}")
                    raise
                link = made[-1].transport
                if direct_copies:
                    made[-1].peer_address = _peer_address(link, address, made[-1].welcome, tls)
                    made[-1].peer_tls_ca = peer_tls_ca
                log.info("remote_accel:%d -> %s (server device %s)", len(made) - 1, link.peer, made[-1].welcome.device)
        except BaseException:
            for s in made:
                s.close()
            raise
        from . import fallback, handles

        fallback.forget_plans()  # plans are made for a server's device type
        for index, s in enumerate(made):
            s.native_queue = handles.NativeQueue(index)
            handles.set_memory_limit(index, s.welcome.memory_limit)
        runtime.add(made)
        _register.set_device_count(len(made))
        _close_at_exit()
    try:
        _register.check_autograd_queues(len(made))
    except RemoteAccelError:
        shutdown()
        raise


def connect_on_first_use() -> None:
    """Torch autoloaded remote_accel in a process whose environment names a server
    (remote_accel_autoload): make the device known now, and connect at its first use."""
    from . import _register

    _register.register_device()
    runtime.connect_on_first_use(connect_from_environment)
    # as CUDA counts its devices before it initialises: a torchrun rank takes
    # remote_accel:LOCAL_RANK (torch.accelerator.device_count() tells it how many there are)
    _register.set_device_count(len(config.servers()))
    frameworks.install()


def connect_from_environment() -> None:
    """init() from the environment alone, once, at the first use of the device (torch's
    lazy device initialisation calls torch.remote_accel._lazy_init, and any op of a
    session-less device comes here through runtime.session)."""
    global _implicit
    if getattr(_first_use, "connecting", False):
        return  # init() itself touched the device: runtime.session says it is not ready
    _first_use.connecting = True
    try:
        with _first_use_lock:
            if runtime.is_initialized():
                return
            log.info("remote_accel: connecting on first use, as the environment says (%s)",
                     ", ".join(f"{k}={config.setting(k)}" for k in (config.ENV_SERVER, config.ENV_TRANSPORT)))
            init()
            _implicit = True
    finally:
        _first_use.connecting = False


_first_use_lock = threading.Lock()


def _connect(transport: str, address: Optional[str], port: int, eal_args, timeout: float, tls):
    try:
        from ..dataplane import connect as dataplane_connect
    except ImportError:  # built without the DPDK data plane
        dataplane_connect = None
    if dataplane_connect is not None:
        return dataplane_connect.connect(transport, server=address, port=port, eal_args=eal_args, timeout=timeout,
                                         tls=tls)
    host, tcp_port = config.parse_host_port(address or config.DEFAULT_TCP_SERVER)
    if tls is not None:
        return TlsTransport.connect(host, tcp_port, timeout=timeout, tls=tls)
    return TcpTransport.connect(host, tcp_port, timeout=timeout)


def _open(route: list, address: Optional[str], port: int, eal_args, timeout: float, tls, **session_args) -> Session:
    """A session with the server at `address` (None: the default one) over route[0].

    A DPDK port reaches whichever server is behind it (the local memif server), which
    may not be the one named: the handshake names it (HELLO.server), and a server that
    listens elsewhere refuses. "auto" then reaches the named server over TCP (and says
    so in route[0], for reconnecting); "dpdk" raises, saying why."""
    link = _connect(route[0], address, port, eal_args, timeout, tls)
    name = address if address and not isinstance(link, TcpTransport) else ""
    try:
        return Session(link, timeout=timeout, server_name=name, **session_args)
    except ConfigError as exc:
        if getattr(exc, "kind", None) != "wrong_server":
            raise
        if route[0] != "auto":
            exc.add_note(f"transport='{route[0]}' reaches the server behind DPDK port {port}; transport='tcp' or "
                         f"'auto' reaches {address} over TCP")
            raise
        log.info("remote_accel: the server behind DPDK port %d is not %s (%s); reaching %s over TCP", port, address,
                 exc, address)
    route[0] = "tcp"
    return Session(_connect("tcp", address, port, eal_args, timeout, tls), timeout=timeout, **session_args)


def _reconnector(pool, index: int, route: list, address: Optional[str], port: int, eal_args, timeout: float, tls,
                 token: str, token_source: str, direct_copies: bool):
    """How a recovering session reaches its server again: (transport, token, peer address).

    A pool's member may have been replaced (a new address and token: asked anew); a token
    read from the local server's token file is read again (a restarted server may have
    written a new one). route[0]: the transport _open settled on."""
    def reconnect():
        where, secret = address, token
        if pool is not None:
            where, secret = list(pool.addresses())[index], list(pool.tokens())[index]
        elif token_source.startswith("the token file"):
            secret = _default_token()[0]
        link = _connect(route[0], where, port, eal_args, timeout, tls)
        return link, secret, _peer_address(link, where, None, tls) if direct_copies else None

    return reconnect


def _peer_address(link, address: Optional[str], welcome, tls) -> Optional[str]:
    """The address other servers reach this server at, for direct copies.

    Over TCP and TLS the one this client reached it at (a TLS server is checked by the
    source server with this client's CA, _ca_text). Over DPDK the server's own TCP
    listener that answers to the address named (the handshake checked it): plain TCP,
    or TLS where this client has a CA to hand the source; None where no address was
    named or the server listens on none (copies to it then go through this client).
    welcome None: a reconnect of a session that had one (the handshake checks the name)."""
    if isinstance(link, TcpTransport):
        address = address or config.DEFAULT_TCP_SERVER
    elif not address:
        return None
    elif welcome is not None:
        kinds = {listen.partition(":")[0] for listen in welcome.listens if hs.answers_to((listen,), address)}
        if "tcp" not in kinds and not (tls is not None and "tls" in kinds):
            return None
    host, port = config.parse_host_port(address)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _tls_context(ca: Optional[str], cert: Optional[str], key: Optional[str]):
    """The TLS settings of init()'s arguments or the environment; None: plain TCP."""
    ca = ca or config.setting(config.ENV_TLS_CA)
    cert = cert or config.setting(config.ENV_TLS_CERT)
    key = key or config.setting(config.ENV_TLS_KEY)
    if not ca:
        if cert or key:
            raise ConfigError("a TLS client certificate needs tls_ca (or REMOTE_ACCEL_TLS_CA) too: "
                              "the server must be checked as well")
        return None
    return client_context(ca, cert, key)


def _ca_text(ca: Optional[str]) -> str:
    """The PEM text of the CA file _tls_context loaded (read once more: an SSLContext
    does not give its certificates back as PEM)."""
    path = ca or config.setting(config.ENV_TLS_CA)
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read the TLS CA {path}: {exc.strerror or exc}") from None


def _default_token() -> tuple[str, str]:
    """(token, where it came from, for error messages)."""
    token = config.setting(config.ENV_TOKEN)
    if token:
        return token, f"${config.ENV_TOKEN}"
    path = config.default_token_file()
    try:
        with open(path) as f:
            return f.read().strip(), f"the token file {path}"
    except OSError as exc:
        # Not an error yet: a server may run without a token. If it wants one, the
        # refusal says where we looked.
        return "", (f"nowhere: no token argument, ${config.ENV_TOKEN} unset, and the token file {path} "
                    f"unreadable ({exc.strerror or exc}); pass token=... or set ${config.ENV_TOKEN}")


def _forget_dead() -> None:
    """Drop sessions whose server is gone (their tensors are already stale)."""
    from . import _register

    dead = runtime.take_all()
    for s in dead:
        s.close()
    _register.set_device_count(0)


_exit_hook_pid = 0  # the process that registered the hook (a forked child inherits it)


def _close_at_exit() -> None:
    """Once per process: shut the sessions down when the interpreter exits, before it
    tears down what their threads use. Without it, a script that never calls shutdown()
    ends with its heartbeat, flush and send threads still running while Python finalises
    (and, over DPDK, the connection's C memory is freed by its weakref.finalize at exit
    under a thread that may be sending on it). The server is told goodbye after the work
    still queued, as shutdown() does. atexit runs hooks last registered first: this one
    runs before the transports' own finalizers."""
    global _exit_hook_pid
    if _exit_hook_pid != os.getpid():
        _exit_hook_pid = os.getpid()
        atexit.register(_shutdown_at_exit)


def _shutdown_at_exit() -> None:
    """In the exiting thread itself, bounded by the transports' own send timeouts (a hung
    server's full socket: TCP's stall timeout). Not in a helper thread with a shorter
    bound: Python 3.12+ starts no thread once finalisation began, and a helper's OS thread
    may still be ending when the process does (LeakSanitizer's stop-the-world at exit
    crashed on it in every DPDK client of the fast-loop tests, docs/sanitizers.md)."""
    # A child forked after init() inherits the hook and the sessions; they are its
    # parent's: a goodbye over the shared socket would end the parent's session.
    if os.getpid() != _exit_hook_pid or not runtime.sessions():
        return
    _shutdown_quietly()


def _shutdown_quietly() -> None:
    try:
        shutdown()
    except Exception as exc:  # the process is ending: say it, do not change its exit status
        log.warning("remote_accel: closing the sessions at exit failed: %s", exc)


def shutdown() -> None:
    """Flush, say goodbye to every server and forget them. Remote tensors become invalid."""
    from . import _register

    with runtime.lock:
        sessions = runtime.take_all()
    for s in sessions:
        try:
            s.close()
        except RemoteAccelError as exc:
            log.warning("shutdown: %s", exc)
    if sessions:
        _register.set_device_count(0)
