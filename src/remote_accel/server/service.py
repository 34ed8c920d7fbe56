"""The server: listeners, one accept thread per listener, one thread per session.

Listeners are pluggable (`dataplane.transport.Listener`): TCP and DPDK clients are
served side by side by the same sessions. A session's thread owns everything of that
session; the server only counts sessions and sums their figures for STATS.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Optional

from ..dataplane.tcp import TcpListener
from ..dataplane.tls import PeerContexts
from ..dataplane.transport import Listener, Transport
from ..errors import TransportClosed, TransportTimeout
from .counters import Totals
from .device import ComputeDevice
from .failure import EXIT_DEVICE_LOST
from .graphs import GraphCompiler
from .groups import Groups
from .peer import PeerCopies
from .session import HELLO_TIMEOUT_S, Session
from .swap import make_pool, server_figures

log = logging.getLogger(__name__)

#: How often accept threads look at the stop flag.
ACCEPT_POLL_S = 0.2
#: Connections still in their handshake (not yet authenticated), from all sources and from
#: one source address. Past either, the oldest such connection (of that source) is shed to
#: make room: a client that connects goes through within its few milliseconds of handshake
#: however many idle or half-open connections others hold, and a shed one is told why
#: (an ErrorReply "busy", never a silent close). They count apart from max_clients: they
#: never starve authenticated clients. auth.HANDSHAKE_TIMEOUT_S bounds each in time.
MAX_HANDSHAKING = 256
MAX_HANDSHAKING_PER_SOURCE = 128
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
DEFAULT_MAX_CLIENTS = 64


class Server:
    def __init__(self, device: ComputeDevice, token: str, *, memory_limit: int = 0,
                 max_clients: int = DEFAULT_MAX_CLIENTS, heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
                 device_memory: int = 0, swap_space: int = 0, tls_identity: Optional[tuple[str, str]] = None):
        """tls_identity: the server's (certificate, key) files, which it shows when it
        copies to another server that asks TLS clients for a certificate."""
        self.device = device
        # what every session's storages may take of the device, and the host memory that
        # takes what does not fit (swap.py); 0: all the device has, no swapping
        self.pool = make_pool(device, device_memory, swap_space)
        self.token = token
        self.memory_limit = memory_limit  # as configured; 0: none but the device's
        self.session_limit = memory_limit or device.total_memory()
        self.max_clients = max_clients
        self.heartbeat_timeout = heartbeat_timeout
        self.graphs = GraphCompiler(device)  # compiled RunGraph graphs, shared by every session
        peer_tls = PeerContexts(tls_identity)  # this server's TLS settings toward other servers
        self.peer_copies = PeerCopies(peer_tls)  # copies to and from other servers (server-to-server)
        self.groups = Groups(peer_tls)  # process groups' members and their connections
        self.stopping = False
        # The error that made the device unusable; kept so that the tensors its frames
        # hold are never freed (freeing on a lost CUDA context aborts the process).
        self.device_error: BaseException | None = None
        self._lock = threading.Lock()
        self._live: set[Session] = set()  # every connection, handshaking or admitted
        self._admitted: set[Session] = set()
        self._handshaking: "OrderedDict[Session, str]" = OrderedDict()  # oldest first -> its source
        self._threads: set[threading.Thread] = set()
        self._listeners: list[Listener] = []
        self._next_number = 1
        self._ended_ops = 0
        self._ended_sessions = 0
        self._ended = Totals()  # the metrics' figures of sessions that ended

    # -- listeners ----------------------------------------------------------------------------
    def serve(self, *listeners: Listener) -> None:
        """Start accepting clients from each listener in a thread of its own. All are
        known before any accepts: a client's HELLO over one may name another (handshake.answers_to)."""
        # What is loaded by now (torch's modules and op tables) lives as long as the
        # server: out of the collector's sight, a collection that the op path's Python
        # allocations trigger costs microseconds instead of milliseconds.
        gc.freeze()
        with self._lock:
            self._listeners.extend(listeners)
        for listener in listeners:
            self._start(self._accept_loop, f"accept {listener.address}", listener)

    def tcp_addresses(self) -> tuple[str, ...]:
        """Where this server listens for TCP clients, as "tcp:HOST:PORT" or "tls:HOST:PORT"
        (a WELCOME tells them to a client that came over DPDK: server-to-server copies)."""
        with self._lock:
            return tuple(f"{'tls' if getattr(lst, 'tls', False) else 'tcp'}:{lst.host}:{lst.port}"
                         for lst in self._listeners if isinstance(lst, TcpListener))

    def _accept_loop(self, listener: Listener) -> None:
        while not self.stopping:
            try:
                transport = listener.accept(timeout=ACCEPT_POLL_S)
            except TransportTimeout:
                continue
            except TransportClosed:
                break
            except Exception:  # one bad connection attempt must not stop the listener
                log.exception("accept on %s failed", listener.address)
                time.sleep(ACCEPT_POLL_S)
                continue
            self._open(transport)

    def _open(self, transport: Transport) -> None:
        source = _source(transport.peer)
        with self._lock:
            if self.stopping:
                transport.close()
                return
            shed, why = self._make_room(source)
            session = Session(self, transport, self._next_number)
            self._next_number += 1
            self._live.add(session)
            self._handshaking[session] = source
        if shed is not None:
            log.warning("shedding %s, the oldest connection still in its handshake (%s), for %s",
                        shed.transport.peer, why, transport.peer)
            shed.refuse_busy("too many connections to this server are in their handshake")
        self._start(session.serve, f"session {session.number}")

    def _make_room(self, source: str) -> tuple:
        """(the oldest handshaking connection to shed for a new one from `source`, which
        bound it is shed for), or (None, None) while there is room; the one shed is taken
        out of the handshaking ones. The caller holds the lock."""
        same = [s for s, src in self._handshaking.items() if src == source]
        if len(same) >= MAX_HANDSHAKING_PER_SOURCE:
            victim, why = same[0], f"{MAX_HANDSHAKING_PER_SOURCE} from its source"
        elif len(self._handshaking) >= MAX_HANDSHAKING:
            victim, why = next(iter(self._handshaking)), f"{MAX_HANDSHAKING} in all"
        else:
            return None, None
        del self._handshaking[victim]
        return victim, why

    def handshake_over(self, session: Session) -> None:
        """The session authenticated, or was refused: it no longer counts as handshaking."""
        with self._lock:
            self._handshaking.pop(session, None)

    def _start(self, target, name: str, *args) -> None:
        thread = threading.Thread(target=self._run_thread, args=(target, args), name=name, daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def _run_thread(self, target, args) -> None:
        try:
            target(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    # -- sessions -------------------------------------------------------------------------------
    def admit(self, session: Session) -> bool:
        """Count an authenticated session; False when max_clients are already served.
        A source server's copy connection (session.copy_grant) is no client: it takes no
        slot, is not counted, and shows in no client's metrics (server/peer.py)."""
        with self._lock:
            if self.stopping:
                return False
            if session.copy_grant is not None or session.group_grant is not None:
                return True
            if len(self._admitted) >= self.max_clients:
                return False
            # the lowest free client slot: a metrics label that stays below max_clients
            used = {s.slot for s in self._admitted}
            session.slot = next(i for i in range(len(used) + 1) if i not in used)
            self._admitted.add(session)
            return True

    def remove(self, session: Session) -> None:
        with self._lock:
            self._live.discard(session)
            self._handshaking.pop(session, None)
            if session in self._admitted:
                self._admitted.discard(session)
                self._ended_sessions += 1
                self._ended_ops += session.ops_done
                self._ended.add(session)

    def stats(self) -> dict:
        """Server-wide figures (every session), added to each session's STATS reply."""
        with self._lock:
            sessions = list(self._admitted)
            ended_sessions, ended_ops = self._ended_sessions, self._ended_ops
        return {
            "server_sessions": len(sessions),
            "server_sessions_ended": ended_sessions,
            "server_storages": sum(len(s.table) for s in sessions),
            "server_memory_allocated": sum(s.table.used for s in sessions),
            "server_ops_done": ended_ops + sum(s.ops_done for s in sessions),
            "max_clients": self.max_clients,
            **server_figures(self.pool),
            **self.graphs.stats(),
            **self.peer_copies.stats(),
            **self.groups.stats(),
        }

    def snapshot(self) -> tuple[list, Totals, list]:
        """For the metrics: the admitted sessions, the totals of those that ended, the listeners."""
        with self._lock:
            return list(self._admitted), self._ended.copy(), list(self._listeners)

    # -- a lost device ----------------------------------------------------------------------
    def device_lost(self, exc: BaseException) -> str:
        """Record that the device can no longer be used; returns what clients are told."""
        with self._lock:
            first = self.device_error is None
            if first:
                self.device_error = exc
                self.stopping = True
        text = (f"{self.device.name} hit an unrecoverable error: {type(exc).__name__}: {str(exc).strip()}. "
                f"Every client's tensors on it are lost; the server exits (status {EXIT_DEVICE_LOST}) "
                "so that it can be restarted")
        if first:
            log.critical("%s", text)
        return text

    def exit_if_device_lost(self) -> None:
        """End the process at once once the device is lost: no tensor may be freed, no
        thread joined (a CUDA context with a sticky error aborts in destructors). Clients
        see the connection close; the one whose request hit the error was told why."""
        if self.device_error is None:
            return
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_DEVICE_LOST)

    # -- shutdown --------------------------------------------------------------------------------
    def shutdown(self, timeout: float = HELLO_TIMEOUT_S) -> None:
        """Stop accepting, close every client's transport, and wait for the threads."""
        self.stopping = True
        for listener in self._listeners:
            listener.close()
        with self._lock:
            live = list(self._live)
        for session in live:
            session.transport.close()  # wakes the session thread out of recv
        self.peer_copies.close_links()
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t in threads if t.is_alive()]
        if left:
            log.warning("still busy at shutdown: %s", ", ".join(left))


def _source(peer: str) -> str:
    """The address a connection comes from, without its port ("tcp:10.0.0.5:40000" ->
    "tcp:10.0.0.5"); a link without ports (memif) is a source of its own."""
    kind, _, rest = peer.partition(":")
    if kind in ("tcp", "tls") and rest.rpartition(":")[0]:
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer
