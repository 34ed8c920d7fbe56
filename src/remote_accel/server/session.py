"""One client's session: the handshake, the message loop, the one-way work, error reporting.

A session runs in a thread of its own and handles its messages strictly in order, so
an op always sees the effect of every earlier request of the same client.

Errors come back in two ways. A message the server cannot read (undecodable meta,
wrong field types, an unknown or unexpected type, a Batch with forbidden items) is
answered at once with ErrorReply(kind="protocol"). A request that is well formed but
fails (an op raises, a bad handle, out of memory) is one-way for the client, so the
first such error is kept, with the server's traceback, and reported at the client's
next sync point: Sync, READ, or RunOp(reply=True). Later failures of ops that depended
on the missing results do not replace it.

While the session works on a request, its Heartbeat tells the client it is alive.
Where a message's payload lands is receiving.py's (a base of Session, run inside the
transport's recv); the requests it answers are replies.py's (another base).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import NamedTuple, Optional

import torch

from .. import config
from ..dataplane import codec
from ..dataplane import messages as m
from ..dataplane.transport import Message, Transport
from ..dataplane.wire import MsgType, type_name
from ..errors import ProtocolError, TransportError, TransportTimeout
from . import auth, collectives, failure, groups, native, peer, profiling, swap
from .counters import SessionCounters
from .events import SessionEvents
from .executor import Executor
from .heartbeat import Heartbeat
from .host import Host
from .placement import Desync, WriteTarget
from .receiving import MAX_ECHO_BYTES, FastRead, Receiving  # noqa: F401  (re-exported)
from .replies import SMALL_READ, Replies
from .rng import Generators
from .storage import StorageTable

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = auth.HANDSHAKE_TIMEOUT_S
_MAX_MESSAGE_TEXT = 64 << 10
_MAX_TRACE_TEXT = 256 << 10
_PONG_META = m.encode(m.Pong(0))


class NativeBatch(NamedTuple):
    """A Batch the C++ executor has checked whole and runs (Executor.native.scan)."""

    meta: bytes


#: what a source server's session (authenticated by one copy's key) may send
COPY_SESSION_TYPES = frozenset({MsgType.PEER_WRITE, MsgType.PING, MsgType.GOODBYE})


class Session(Receiving, Replies):
    def __init__(self, server: Host, transport: Transport, number: int):
        self.server = server
        self.transport = transport
        self.number = number
        self.device = server.device
        self.client = "?"
        self.admitted = False  # counted by the server (authenticated, under max_clients)
        # (ticket, nbytes, expires): a source server's session, authenticated by one copy's
        # key (server/peer.py), which may write that copy, then copies each proven by its
        # own key over copy_binding (the WELCOME proof of this connection), and nothing else
        self.copy_grant: Optional[tuple] = None
        self.copy_binding = b""
        # (group, source rank, rank here): a peer server's connection that delivers one
        # rank's process-group data (server/groups.py), and nothing else
        self.group_grant: Optional[tuple] = None
        self.members: dict = {}  # process groups this client's rank joined: group id -> groups.Member
        self.slot = -1  # the server's client number for metrics, recycled (set when admitted)
        self.counters = SessionCounters()
        self.table = StorageTable(self.device, server.session_limit, server.pool)
        self.executor: Optional[Executor] = None  # made in the session's own thread
        self.pending: Optional[m.ErrorReply] = None
        self.sink_messages = 0
        self.sink_bytes = 0
        self.busy_ns = 0  # time spent running one-way requests (ops), for benchmarks
        self._stream = None
        self._stash: Optional[tuple] = None  # (type, decoded message or exception, payload plan)
        self.heartbeat = Heartbeat(transport, f"session-{number}-heartbeat")
        self._fast: Optional["native.FastLoop"] = None  # the C++ receive loop (DPDK, TCP, TLS)
        self._tcp_link: Optional["native.TcpLink"] = None  # its link, on a TCP or TLS connection
        self._handlers = {
            MsgType.PING: self._on_ping, MsgType.GOODBYE: self._on_goodbye, MsgType.ALLOC: self._one_way,
            MsgType.FREE: self._one_way, MsgType.WRITE: self._one_way, MsgType.BATCH: self._one_way,
            MsgType.RUN_GRAPH: self._one_way, MsgType.RUN_PLANNED: self._one_way, MsgType.RUN: self._on_run,
            MsgType.READ: self._on_read,
            MsgType.SYNC: self._on_sync, MsgType.STATS: self._on_stats, MsgType.RNG: self._on_rng,
            MsgType.EMPTY_CACHE: self._on_empty_cache, MsgType.EVENT: self._on_event, MsgType.ECHO: self._on_echo, MsgType.SINK: self._on_sink,
            MsgType.PEER_RECEIVE: self._on_peer, MsgType.PEER_SEND: self._on_peer,
            MsgType.PEER_WRITE: self._on_peer_write, MsgType.STATE: self._on_state, MsgType.DEFINE: self._on_define,
            MsgType.PROFILE: self._on_profile, MsgType.COLL_JOIN: self._on_join,
            MsgType.COLLECTIVE: self._on_collective,
        }
        self.profiler: Optional[profiling.SessionProfiler] = None

    @property
    def ops_done(self) -> int:
        return self.executor.ops_done if self.executor else 0

    # -- life cycle ---------------------------------------------------------------------------
    def serve(self) -> None:
        """The session thread's body; returns when the client is gone. Never raises."""
        reason = "closed"
        try:
            if self._handshake():
                reason = self._loop()
        except TransportError as exc:  # the client left while the server answered it
            reason = "server shutting down" if self.server.stopping else f"connection lost ({exc})"
        except Exception:  # a server bug: end this session, keep serving the others
            log.exception("session %d failed", self.number)
            reason = "server error"
        finally:
            self._release(reason)

    def _handshake(self) -> bool:
        try:
            return auth.handshake(self)
        finally:
            self.server.handshake_over(self)

    def refuse_busy(self, why: str) -> None:
        """Shed this connection while it is in its handshake (from the accept thread): tell
        the client the server is busy, and close; the session thread then ends."""
        self._send_quietly(m.ErrorReply(failure.BUSY, f"the server is busy: {why}; try again later", ""))
        self.transport.close()

    def _loop(self) -> str:
        self._stream = self.device.new_stream()
        self.device.bind_thread(self._stream)
        torch.set_grad_enabled(False)  # thread-local: autograd is the client's business
        self.executor = Executor(self.device, self.table, Generators(self.device), self.server.graphs)
        self.events = SessionEvents(self.device)
        self.heartbeat.start()
        timeout = self.server.heartbeat_timeout
        if self.copy_grant is not None:  # a source's kept copy connection: sends no heartbeats
            timeout = min(timeout, peer.COPY_IDLE_S)
        # bound once: each message's path is a few microseconds of Python (issue #20)
        recv, sink, heartbeat, unpin = self.transport.recv, self._sink, self.heartbeat, self.table.native.unpin
        dispatch, exit_if_device_lost = self._dispatch, self.server.exit_if_device_lost
        fast = self._fast_loop()
        if fast is not None:
            recv = functools.partial(self._fast_recv, fast)
        while True:
            try:
                msg = recv(timeout=timeout, sink=sink)
                if msg is None:  # the C++ loop served what came
                    exit_if_device_lost()
                    continue
            except TransportTimeout:
                return f"no message for {timeout:.0f} s (heartbeat timeout)"
            except TransportError as exc:
                return "server shutting down" if self.server.stopping else f"connection lost ({exc})"
            except Desync as exc:
                self._send_quietly(m.ErrorReply(failure.PROTOCOL, str(exc), ""))
                return f"protocol error: {exc}"
            except ProtocolError as exc:
                # A byte stream cannot resynchronise (the transport closed itself); a
                # message-oriented transport can, and the session goes on.
                if self.transport.closed:
                    return f"protocol error: {exc}"
                self._send_quietly(m.ErrorReply(failure.PROTOCOL, str(exc), ""))
                continue
            heartbeat.busy = True
            try:
                going_on = dispatch(msg)
            finally:
                heartbeat.busy = False
                unpin(0)  # its storages may be swapped out again
            exit_if_device_lost()  # after the reply that says so has left
            if not going_on:
                return "goodbye"

    def _fast_loop(self) -> Optional["native.FastLoop"]:
        """The C++ receive loop (csrc/fast_loop.h) for a DPDK, TCP or TLS connection; None
        for a transport that cannot hand its connection over (native_link), or with
        REMOTE_ACCEL_SERVER_FAST_LOOP=0 (every message through Python)."""
        if (not config.enabled("REMOTE_ACCEL_SERVER_FAST_LOOP") or self.copy_grant is not None
                or self.group_grant is not None):
            return None  # a copy or group connection's messages go through Python's checks
        described = self.transport.native_link()
        if described is None:
            return None
        kind, what = described
        if kind == "dpdk":
            link = native.DpdkLink(what)
        elif kind == "tls":
            fd, buffer, capacity, poll_ns, stall_ns, wire_params, ssl, functions = what
            link = self._tcp_link = native.TlsLink(fd, buffer, capacity, wire_params, poll_ns, stall_ns, ssl,
                                                   functions)
        else:
            fd, buffer, capacity, poll_ns, stall_ns, wire_params = what
            link = self._tcp_link = native.TcpLink(fd, buffer, capacity, wire_params, poll_ns, stall_ns)
        types = (MsgType.BATCH, MsgType.READ, MsgType.SYNC, MsgType.DATA, MsgType.SYNC_OK, MsgType.PONG)
        loop = native.FastLoop(self.executor.native, link, tuple(map(int, types)), not self.device.accelerator,
                               SMALL_READ, _PONG_META)
        self.heartbeat.native_busy = loop.busy
        self.heartbeat.send_pong = functools.partial(self.transport.send_locked, loop.send_pong)
        self._fast = loop
        return loop

    def _fast_recv(self, fast, timeout: float, sink) -> Optional[Message]:
        """transport.recv through the C++ loop: the next message Python must dispatch, or
        None when the loop served all that came (or ran a Batch on until an item Python
        runs, which ran here). Raises as recv."""
        tcp = self._tcp_link
        if tcp is not None:  # the loop reads on where Python's recv stopped, and the reverse
            tcp.set_read_ahead(*self.transport.read_ahead())
        try:
            result = fast.run(int(timeout * 1e9), self.executor.python_ops, self.pending is not None)
        finally:
            if tcp is not None:
                self.transport.set_read_ahead(*tcp.read_ahead())
                self.transport.add_native_counts(*tcp.take_counts())
        for ns in fast.take_batch_ns():
            self.busy_ns += ns
            self.counters.batch(ns * 1e-9)
        code = result[0]
        if code == native.LOOP_MESSAGE:
            return self.transport.finish_recv(result[1], sink)
        if code == native.LOOP_FAILED:
            raise self.transport.recv_error(result[1])
        if code == native.LOOP_STOPPED:
            start = time.perf_counter_ns()
            self.heartbeat.busy = True
            try:
                self._run_native(NativeBatch(result[2]), stopped=result[1])
            finally:
                self.heartbeat.busy = False
                self.table.native.unpin(0)
                self.busy_ns += time.perf_counter_ns() - start
        return None

    def _release(self, reason: str) -> None:
        self.heartbeat.stop()
        if self.members:
            self.server.groups.leave(self, f"its client is gone ({reason})", failed=reason != "goodbye")
        if self.group_grant is not None:
            groups.link_ended(self, reason)
        if self.profiler is not None:
            self.profiler.close()
        self.server.exit_if_device_lost()  # freeing tensors of a lost device can abort the process
        try:
            if self.executor is not None:
                self.device.synchronize(self._stream)
        except Exception as exc:  # an earlier async device error; the memory goes anyway
            log.debug("session %d: sync at close failed: %s", self.number, exc)
        swapped = self.table.native.swap_stats()
        count, nbytes = self.table.clear()
        if self.executor is not None:
            self.executor.clear()
        self.transport.close()
        if self._tcp_link is not None:
            self._tcp_link.close()
        self.server.remove(self)
        if self.admitted:
            log.info("client disconnected: session %d, %s (%s): %s; freed %d storages, %d bytes, after %d ops",
                     self.number, self.transport.peer, self.client, reason, count, nbytes, self.ops_done)
            if swapped["swap_outs"] or swapped["swap_ins"]:
                log.info("session %d %s", self.number, swap.summary(swapped))

    # -- dispatch ----------------------------------------------------------------------------------
    def _dispatch(self, msg: Message) -> bool:
        stash, self._stash = self._stash, None
        if stash is None and msg.type == MsgType.BATCH and not msg.payloads and self._scan(msg.meta):
            stash = self._stash
            self._stash = None
        if stash is None:  # a transport that skips the sink for payload-free messages
            try:
                stash = (msg.type, m.decode(msg.type, msg.meta), None)
            except ProtocolError as exc:
                stash = (msg.type, exc, None)
        _, request, plan = stash
        if isinstance(request, Exception):  # what placing its payloads found (receiving.py)
            kind = request.kind if isinstance(request, failure.Failure) else failure.PROTOCOL
            self._send(m.ErrorReply(kind, failure.clip(str(request), _MAX_MESSAGE_TEXT), ""), msg.req_id)
            return True
        if self.group_grant is not None:
            return groups.on_link_message(self, msg.type, request, plan)
        handler = self._handlers.get(msg.type)
        if self.copy_grant is not None and msg.type not in COPY_SESSION_TYPES:
            handler = None  # a source server's session writes its copy, and nothing else
        if handler is None:
            text = f"{type_name(msg.type)} is not a request a client may send"
            self._send(m.ErrorReply(failure.PROTOCOL, text, ""), msg.req_id)
            return True
        return handler(request, msg, plan) is not False

    def _fail(self, exc: BaseException) -> None:
        """Keep the first error of one-way work for the next sync point."""
        self.counters.error(exc)
        if self.pending is None:
            self.pending = self._error_reply(exc)
            log.debug("session %d: deferred %s error: %s", self.number, self.pending.kind, exc)

    def _error_reply(self, exc: BaseException) -> m.ErrorReply:
        reply = failure.error_reply(exc, _MAX_MESSAGE_TEXT, _MAX_TRACE_TEXT)
        if self.device.lost(exc):
            reply = m.ErrorReply(failure.DEVICE_LOST, failure.clip(self.server.device_lost(exc), _MAX_MESSAGE_TEXT),
                                 reply.trace)
        return reply

    def _report_pending(self, req_id: int) -> bool:
        if self.pending is None:
            return False
        error, self.pending = self.pending, None
        self._send(error, req_id)
        return True

    # -- one-way requests ----------------------------------------------------------------------------
    def _scan(self, meta) -> bool:
        """Whether the C++ executor takes this Batch (no WRITE payloads to place, well
        formed); if so the stash says so. Anything else is decoded in Python, which says
        what is wrong with it."""
        if self.executor is None:
            return False
        meta = bytes(meta)
        if not self.executor.native.scan(meta):
            return False
        self._stash = (MsgType.BATCH, NativeBatch(meta), None)
        return True

    def _run_native(self, batch: NativeBatch, stopped: Optional[tuple] = None, writes=None) -> None:
        """Run a scanned Batch: C++ runs what it can with the GIL released and stops at
        each item Python must run (RunOp, plans without a template, graph reruns, WRITEs
        it has no payload for or cannot do) or that failed. stopped: where the C++ loop's
        run of it stopped (Executor.resume's answer); writes: the placed payloads of its
        WRITEs, in order (receiving.py), when Python received them."""
        writes = iter(()) if writes is None else writes
        first = 0
        while True:
            if stopped is None:
                index, stop, begin, _, error = self.executor.native.resume(first)
            else:
                (index, stop, begin, _, error), stopped = stopped, None
            if stop == native.END:
                return
            first = index + 1
            try:
                if stop == native.ERROR:
                    raise native.to_exception(*error)
                value, _ = codec.decode_at(batch.meta, begin)
                item = m.batch_items(m.Batch((value,)))[0]
                held = self.executor.native.held_payload(index) if type(item) is m.WriteStorage else None
                if held is not None:  # the C++ loop kept its payload and did not write it: Python says why
                    staging = torch.tensor(bytearray(held), dtype=torch.uint8)
                    self._write(item, WriteTarget(None, staging=staging))
                else:
                    self._execute(item, writes)
            except Exception as exc:
                self._fail(exc)

    def _one_way(self, request, msg: Message, plan) -> None:
        start = time.perf_counter_ns()
        try:
            self._run_one_way(request, msg, plan)
        finally:
            elapsed = time.perf_counter_ns() - start
            self.busy_ns += elapsed
            if msg.type == MsgType.BATCH:  # counted per batch, not per op: the hot path stays cheap
                self.counters.batch(elapsed * 1e-9)

    def _run_one_way(self, request, msg: Message, plan) -> None:
        if type(request) is NativeBatch:
            # with uploads (a training step's `x.to(device)` and the ops queued with it),
            # `plan` holds where their bytes were placed (receiving.py)
            self._run_native(request, writes=iter(plan) if plan else None)
            return
        try:
            if type(request) is m.Batch:  # the sink did not see it (no payloads)
                items = m.batch_items(request)
            else:
                items = request if type(request) is list else [request]
        except ProtocolError as exc:
            self._send(m.ErrorReply(failure.PROTOCOL, str(exc), ""), msg.req_id)
            return
        writes = iter(plan or ())
        for item in items:
            try:
                self._execute(item, writes)
            except Exception as exc:
                self._fail(exc)

    def _execute(self, item, writes) -> None:
        kind = type(item)
        if kind is m.RunOp:
            if item.reply:
                raise ProtocolError("RunOp with reply set cannot be batched")
            self.executor.run_op(item)
        elif kind is m.RunPlanned:
            self.executor.run_planned(item)
        elif kind is m.WriteStorage:
            self._write(item, next(writes, None))
        elif kind is m.AllocStorage:
            self.table.alloc(item.sid, item.nbytes)
            self.executor.forget(item.sid)
            self.executor.python_alloc_requests += 1
        elif kind is m.FreeStorage:
            for sid in item.sids:
                self.table.free(sid)
                self.executor.forget(sid)
        elif kind is m.RunGraph:
            self.executor.run_graph(item)

    def _write(self, w: m.WriteStorage, target: Optional["WriteTarget"]) -> None:
        if target is None:  # the transport skipped the sink: no payload came
            if w.nbytes:
                raise ProtocolError("WRITE without its payload")
            self.table.byte_range(w.sid, w.offset, 0)
            return
        if target.error is not None:
            raise target.error
        if target.staging is not None:
            view = target.view if target.view is not None else self.table.byte_range(w.sid, w.offset, w.nbytes)
            view.copy_(target.staging, non_blocking=True)

    # -- one-way messages that travel outside a Batch ----------------------------------------------
    def _on_define(self, request: m.Define, msg: Message, plan) -> None:
        """One-way: a recovering client's plan, graph or random streams; errors wait for the next sync."""
        try:
            self.executor.define(request.kind, request.meta)
        except Exception as exc:
            self._fail(exc)

    def _on_empty_cache(self, request, msg: Message, plan) -> None:
        self.device.empty_cache()

    def _on_sink(self, request, msg: Message, plan) -> None:
        self.sink_messages += 1
        self.sink_bytes += sum(p.nbytes for p in msg.payloads)  # each a transport.Discard

    def _on_peer(self, request, msg: Message, plan) -> None:
        """A half of a server-to-server copy (`peer`): one-way, its error kept for the next sync."""
        try:
            (peer.on_receive if type(request) is m.PeerReceive else peer.on_send)(self, request)
        except Exception as exc:
            self._fail(exc)

    def _on_join(self, request: m.CollJoin, msg: Message, plan) -> None:
        """This client's rank joins a process group: one-way, its error kept for the next sync."""
        try:
            self.members[request.group] = self.server.groups.join(self, request)
        except Exception as exc:
            self._fail(exc)

    def _on_collective(self, request: m.Collective, msg: Message, plan) -> None:
        """A collective, in order with the ops (server/collectives.py): one-way, its error
        kept for the next sync."""
        touched: list = []
        mark = self.table.native.pin_mark()  # its storages stay on the device while it runs
        try:
            member = self.members.get(request.group)
            if member is None:
                raise ProtocolError("a collective of a process group this session did not join")
            decode = self.executor.decode
            collectives.run(member, request, [decode(t, touched) for t in request.tensors],
                            [decode(t, touched) for t in request.outputs])
        except Exception as exc:
            self._fail(exc)
        finally:
            self.table.native.unpin(mark)
        self.table.resync(touched)

    def _on_goodbye(self, request, msg: Message, plan) -> bool:
        return False

    # -- sending -------------------------------------------------------------------------------------------
    def _send(self, reply, req_id: int = 0, payloads=()) -> None:
        self.transport.send(reply.TYPE, m.encode(reply), payloads, req_id=req_id)
        self.heartbeat.last_send = time.monotonic()

    def _send_quietly(self, reply) -> None:
        try:
            self._send(reply)
        except TransportError:
            pass
