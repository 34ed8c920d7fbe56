"""A client's session with one server: batching one-way requests, and the sync points.

Ops, allocations, frees and small uploads are one-way: they are queued and leave in
Batch messages, so the client never waits for them. Only sync points wait for a reply
(`sync`, `read`, `run_with_reply`, `stats`, `rng`): each one first flushes the queue,
and the server reports at that moment the first error of any earlier one-way request.

A sync waits as long as the work takes, as on CUDA. Liveness is separate from latency:
the server keeps sending heartbeats while it computes, so `timeout` is how long the
server may stay *silent*; a dead or frozen server makes that call, and every later one,
raise RemoteAccelError: no hang. Waits are sliced so that Ctrl-C (KeyboardInterrupt)
answers within a fraction of a second; the interrupted request's late reply is skipped
by its request id, and the session goes on.

Where things go: a new one-way request is a method that builds its message and calls
`_queue` (a request that may travel inside a Batch) or `_queue_message` (one that may
not); a new sync point is a method that calls `_call(request, ReplyType)`, whose
`_exchange` flushes the queue, sends the request and waits for its reply. The session's
helpers, one concept each: sender.py (TCP's sender thread and its outbox), heartbeat.py
(the PING of an idle session), timer_flush.py (a batch leaves soon after the last send),
session_recovery.py (rebuilding the session on a server that came back).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import socket
import threading
import time
from typing import Callable, Optional, Sequence

from ..errors import (DeadlineExceeded, ProtocolError, RemoteAccelError, TransportError, TransportTimeout,
                      WrongPeerError)
from .._version import WIRE_VERSION
from ..dataplane import handshake
from ..dataplane import messages as m
from ..dataplane.codec import encode
from ..dataplane.tcp import TcpTransport
from ..dataplane.transport import Message, Transport, default_sink
from ..dataplane.wire import MsgType
from . import interrupts, recovery
from .heartbeat import HEARTBEAT_S, Heartbeat  # noqa: F401  (HEARTBEAT_S: part of this module's names)
from .sender import Sender
from .session_recovery import SessionRecovery
from .timer_flush import FLUSH_AFTER_S, TimerFlush

log = logging.getLogger(__name__)

#: Queue limits: a batch leaves when it holds this many requests or payload bytes.
MAX_BATCH_ITEMS = 256
#: ...and the C++ queue's first batch after a sync point leaves at this many requests,
#: each full batch after it at twice as many (up to MAX_BATCH_ITEMS): the server starts
#: on a step's first ops at once instead of after 256 (csrc/op_queue_internal.h). 32
#: measured best of 8-256 for the tiny Transformer step over TCP and memif (8 and 16:
#: the server's per-batch cost shows; 64 and up: it waits longer for its first work).
FIRST_BATCH_ITEMS = 32
MAX_BATCH_PAYLOAD = 1 << 20
#: Uploads at least this large travel as their own WRITE message (no batching copy).
LARGE_WRITE = 256 << 10
#: A one-way message after a batch that carries at most this many payload bytes leaves
#: from the calling thread when the sender thread is idle (a send of this size takes less
#: than waking the sender)
SEND_HERE_BYTES = 64 << 10
#: A sync's wait is cut into slices this long, so that Ctrl-C is seen between them (a
#: DPDK receive waits in C, where Python's signal handlers cannot run).
WAIT_SLICE_S = 0.1
_SYNC_META = m.encode(m.Sync())


class Session(SessionRecovery):
    """One connection to one server (one remote_accel device index)."""

    def __init__(self, transport: Transport, *, token: str = "", timeout: float = 10.0, name: str = "",
                 reconnect: Optional[Callable[[], tuple]] = None, recovery_timeout: float = 60.0,
                 recovery_memory: Optional[int] = None, server_name: str = ""):
        """reconnect: makes a new transport to this session's server (the same address, or
        a pool member's replacement) as (transport, token, peer_address); with it, the
        session survives its server (recovery.py): it keeps a snapshot and a journal within
        `recovery_memory` bytes, and waits up to `recovery_timeout` s for a server to come back.
        server_name: "HOST:PORT" of the server meant, told to it in the handshake where the
        transport may reach another one (DPDK): that one refuses (ConfigError, kind
        "wrong_server")."""
        self.server_name = server_name
        self.transport = transport
        self._transport_send_many = transport.send_many
        self.timeout = timeout
        self._req_ids = itertools.count(1)
        self._lock = threading.RLock()  # sync calls and flushes; RLock: flush inside sync
        self._batch = bytearray()  # queued requests, encoded back to back
        self._batch_items = 0
        self._payloads: list = []
        self._payload_bytes = 0
        self._dead: Optional[RemoteAccelError] = None
        #: when this session last sent (time.monotonic()): the heartbeat and the timer flush wait from it
        self.last_send = time.monotonic()
        self._stop = threading.Event()
        self._abandoned: set[int] = set()  # ids of requests whose caller stopped waiting
        self._late_error: Optional[RemoteAccelError] = None  # reported to an abandoned sync
        # the server's ops_done of the last SyncOk while nothing was sent since: a sync
        # then has nothing to wait for and no error to hear about (None: ask the server)
        self._settled: Optional[int] = None
        self.counters = {"batches": 0, "ops": 0, "graphs": 0, "round_trips": 0, "bytes_up": 0, "bytes_down": 0,
                         "peer_copies": 0, "peer_bytes": 0, "collectives": 0}
        #: "host:port" other servers reach this one at (TCP or TLS), and its token: set by
        #: init() for direct server-to-server copies (None: copies to it go through this client)
        self.peer_address: Optional[str] = None
        #: a TLS server's CA (PEM text), which the source of a copy checks this server by
        self.peer_tls_ca: Optional[str] = None
        self.token = token
        #: the device's C++ queue (handles.NativeQueue): requests queued there, and the FREE
        #: of storages freed since, leave before anything queued here after them
        self.native_queue = None
        #: the timer flush's delay (FLUSH_AFTER_S); None stops it (tests that look at the queue)
        self.flush_after: Optional[float] = FLUSH_AFTER_S
        self._reconnect = reconnect
        self.recovery_timeout = recovery_timeout
        self._journal: Optional[recovery.Journal] = None
        if reconnect is not None:
            self._journal = recovery.Journal(recovery.default_memory() if recovery_memory is None else recovery_memory)
        self._deaths = 0  # recoveries since the last reply: the same work killing the server again
        self._snapshotting = False
        client = self._client = name or f"{socket.gethostname()} pid {os.getpid()}"
        try:
            reply = self._handshake(token, client)
        except BaseException:
            self._dead = RemoteAccelError("the handshake failed")
            self.transport.close()
            raise
        self.welcome: m.Welcome = reply
        self.device_type = reply.device.partition(":")[0]  # the server's torch device type
        self._device_properties: Optional[dict] = None
        # Over TCP, Batches leave from a sender thread (sender.py says why)
        self._sender: Optional[Sender] = None
        if isinstance(transport, TcpTransport):
            self._sender = Sender(functools.partial(self._send_many, drain=False), self._stop)
        self._heartbeat = Heartbeat(self, self._stop)
        self._flusher = TimerFlush(self, self._lock, self._stop)

    # -- one-way requests ------------------------------------------------------------------
    def alloc(self, sid: int, nbytes: int) -> None:
        self._queue(m.AllocStorage(sid, nbytes))

    def free(self, sids: Sequence[int]) -> None:
        if sids:
            self._queue(m.FreeStorage(tuple(sids)))

    def run(self, op: str, args: tuple, kwargs: dict, outs: tuple, stream=None, plan: Optional[int] = None) -> None:
        """Queue a RunOp; `plan` also keeps it on the server for RunPlanned (fallback's plans)."""
        self.counters["ops"] += 1
        msg = m.RunOp(op, args, kwargs, outs, False, stream, plan)
        self._queue(msg)
        if plan is not None and self._journal is not None:
            self._journal.define_plan(plan, m.encode(msg))

    def write(self, sid: int, offset: int, data, background: bool = False, source=None) -> None:
        """Upload `data` (any buffer) into storage `sid` at byte `offset`.

        Small uploads are copied into the batch (the caller may reuse its buffer at once);
        large ones are sent before this returns, without a copy; or, with `background`,
        by the sender thread after the batch queued before them (the buffer is kept alive
        until then, and must not change meanwhile: pinned non_blocking copies).
        `source`: the CPU tensor whose bytes `data` are, which recovery's journal may keep
        by reference instead of copying them (recovery.Borrowed).
        """
        view = memoryview(data).cast("B")
        self.counters["bytes_up"] += view.nbytes
        if source is not None and view.nbytes >= LARGE_WRITE and self._journal is not None:
            self._journal.lend(view, source)
        if view.nbytes >= LARGE_WRITE and background and self._sender is not None:
            self._post_after_batch((m.WriteStorage.TYPE, m.encode(m.WriteStorage(sid, offset, view.nbytes)), [view], 0))
            return
        if view.nbytes >= LARGE_WRITE:
            # the queued batch (its destination's allocation, as a fresh tensor's .to() has)
            # and the write leave together from this thread, in one transport call: posting
            # the batch to the sender thread and then waiting for it to be gone cost two
            # thread switches, 50-150 us of a 256 KiB upload's 190 on two cores
            with self._lock:
                self._collect()
                write = (m.WriteStorage.TYPE, m.encode(m.WriteStorage(sid, offset, view.nbytes)), [view], 0)
                self._send_many(self._batch_then(write))
        else:
            self._queue(m.WriteStorage(sid, offset, view.nbytes), bytes(view))

    def _queue(self, msg, payload: Optional[bytes] = None) -> None:
        self._queue_item(m.batch_item(msg), payload)

    def _queue_item(self, item, payload: Optional[bytes] = None) -> None:
        """Queue a batch item, a (type, fields) pair."""
        with self._lock:
            self._check_alive()
            self._take_native()
            self._batch += encode(item)
            self._batch_items += 1
            if self._batch_items == 1 and self.native_queue is not None:
                self.native_queue.wake()  # the timer flush sleeps until something is queued
            if payload is not None:
                self._payloads.append(payload)
                self._payload_bytes += len(payload)
            if self._batch_items >= MAX_BATCH_ITEMS or self._payload_bytes >= MAX_BATCH_PAYLOAD:
                self.flush()

    def _take_native(self) -> None:
        if self.native_queue is not None:
            requests, ops, encoded = self.native_queue.take()
            if requests:
                self._batch += encoded
                self._batch_items += requests
                self.counters["ops"] += ops

    def flush(self, here: bool = False) -> None:
        """Send every queued request now (without waiting for anything). here: from this
        thread, not the sender thread's, when nothing posted earlier is still on its way
        (the order stays: posting happens under self._lock, which this holds)."""
        with self._lock:
            self._collect()
            batch = self._take_batch()
            if batch is None:
                return
            if here:
                here = self._sender is None or self._sender.idle()
            if here or not self._post([batch]):
                self._send_many([batch], drain=not here)

    def _take_batch(self) -> Optional[tuple]:
        """The queued requests as one Batch message (type, meta, payloads, 0); None if none."""
        if not self._batch_items:
            return None
        meta = m.encoded_batch(self._batch_items, self._batch)
        payloads = self._payloads
        self._batch, self._batch_items, self._payloads, self._payload_bytes = bytearray(), 0, [], 0
        self.counters["batches"] += 1
        return (m.Batch.TYPE, meta, payloads, 0)

    def _batch_then(self, message: tuple) -> list:
        """The queued requests as a Batch (taken), then `message`: what leaves in one
        transport call when a message must follow everything queued before it."""
        batch = self._take_batch()
        return [batch, message] if batch is not None else [message]

    def _collect(self) -> None:
        """Move what the C++ queue holds (the freed ids included) into the batch."""
        if self._dead is None:
            self._take_native()

    # -- sync points ---------------------------------------------------------------------------
    def sync(self, timeout: Optional[float] = None) -> int:
        """Wait until the server ran everything sent so far; raise its first error.

        timeout: give up after this many seconds with DeadlineExceeded (the work goes on
        on the server and the session stays usable); None: wait as long as it takes.
        """
        with self._lock:
            self._collect()
            if (self._settled is not None and not self._batch_items and self._late_error is None
                    and not self._abandoned and self._dead is None):
                return self._settled  # as torch.cuda.synchronize() with an idle device: no wait
            ops_done = self._exchange(MsgType.SYNC, _SYNC_META, m.SyncOk, deadline=timeout).ops_done
            self._settled = ops_done
            return ops_done

    def read(self, sid: int, offset: int, nbytes: int, out=None):
        """Download bytes of a storage into `out` (a writable buffer) or a new buffer."""
        def sink(header, meta, lengths):
            # an error reply carries no payload: only a Data of the asked size lands in `out`
            return [out] if lengths == [nbytes] else default_sink(header, meta, lengths)


        reply = self._exchange(MsgType.READ, m.encode_read(sid, offset, nbytes), m.Data,
                               sink=None if out is None else sink)
        self.counters["bytes_down"] += nbytes
        return reply.payloads[0]

    def run_with_reply(self, op: str, args: tuple, kwargs: dict, out_sids: tuple, stream=None) -> tuple:
        """Run an op whose result shapes depend on data; returns the results' metadata."""
        self.counters["ops"] += 1
        return self._call(m.RunOp(op, args, kwargs, out_sids, True, stream), m.RunReply).results

    def stats(self) -> dict:
        return self._call(m.Stats(), m.StatsReply).values

    def local_stats(self) -> dict:
        """This session's counters (no round trip): `counters`, with the ops still in the C++
        queue counted, plus the transport's bytes and messages each way (headers and
        heartbeats included)."""
        with self._lock:
            if self._dead is None:
                self._take_native()  # they are issued: they leave with the next batch
            out = dict(self.counters)
        out.update(self._journal.stats() if self._journal is not None else recovery.NO_STATS)
        wire = self.transport.stats()
        for key, name in (("tx_bytes", "bytes_sent"), ("rx_bytes", "bytes_received"),
                          ("tx_messages", "messages_sent"), ("rx_messages", "messages_received")):
            out[name] = int(wire.get(key, 0))
        return out

    def profile(self, action: str) -> m.ProfileReply:
        """torch.profiler's window on the server ("start", "stop": profiling.py)."""
        return self._call(m.Profile(action), m.ProfileReply)

    def rng(self, action: str, generator, state: bytes = b"") -> bytes:
        return self._call(m.Rng(action, generator, state), m.RngReply).state

    def empty_cache(self) -> None:
        self._queue_message(m.EmptyCache())  # not allowed inside a Batch

    def record_event(self, event_id: int) -> None:
        """torch.Event.record(): a marker after the ops queued so far (server/events.py)."""
        self._queue_message(m.Event("record", event_id))

    def event(self, action: str, event_id: int, end: int = 0):
        """An event's query ("query" -> bool), wait ("synchronize") or time to `end` ("elapsed" -> ms)."""
        return self._call(m.Event(action, event_id, end), m.EventReply).value

    def device_properties(self) -> dict:
        """The server device's properties (server/device.py), asked once."""
        if self._device_properties is None:
            self._device_properties = dict(self.stats()["device_properties"])
        return self._device_properties

    def run_graph(self, msg: m.RunGraph) -> None:
        self.counters["graphs"] += 1
        if not msg.nodes:
            # A rerun by id is a few dozen bytes: it goes in the batch like an op, and the
            # batch leaves at once, so that the server runs the graph while this thread
            # goes on (the backward's Python, the next graph). Sent from this thread when
            # the sender thread is idle: a hand-over to it (a wake-up, GIL traffic) cost
            # more than the send on 2 shared cores.
            self._queue(msg)
            self.flush(here=True)
            return
        if self._journal is not None:
            self._journal.define_graph(msg.graph_id, m.encode(msg))
        self._queue_message(msg)

    def _post_after_batch(self, message: tuple) -> None:
        """The queued batch, then `message` (type, meta, payloads, req_id), in one transport
        call: from this thread when the sender thread is idle and the batch carries little
        (a hand-over wakes the sender, which then takes the GIL from this thread: 6% of a
        DataParallel step's client CPU went to those wake-ups, py-spy), else as one entry
        for the sender thread, so that this thread does not wait for a large batch to
        leave; sent here too when the sender has stopped."""
        with self._lock:
            self._check_alive()
            self._collect()
            small = self._payload_bytes <= SEND_HERE_BYTES
            messages = self._batch_then(message)
            if small and self._sender is not None:
                if self._sender.idle():
                    self._send_many(messages, drain=False)
                    return
            if not self._post(messages):
                self._send_many(messages)

    def peer_receive(self, ticket: bytes, sid: int, offset: int, nbytes: int, source: "Session") -> None:
        """Tell this server (the destination) that `source`'s server will write these bytes."""
        self._queue_message(m.PeerReceive(ticket, sid, offset, nbytes, source.peer_address))

    def peer_send(self, ticket: bytes, sid: int, offset: int, nbytes: int, dest: "Session") -> None:
        """Tell this server (the source) to send these bytes to `dest`'s server itself."""
        self.counters["peer_copies"] += 1
        self.counters["peer_bytes"] += nbytes
        expires = handshake.copy_expiry()
        key = handshake.copy_key(dest.token, ticket, nbytes, expires)  # dest's token stays here
        self._queue_message(m.PeerSend(ticket, sid, offset, nbytes, dest.peer_address, key, expires,
                                       dest.peer_tls_ca))

    def join_group(self, msg: m.CollJoin) -> None:
        """Make this session's server rank msg.rank of a process group (process_group.py).
        Recovery stops for good: the group's state lives on every rank's server."""
        if self._journal is not None:
            self._journal.joined_group()
        self._queue_message(msg)

    def collective(self, msg: m.Collective) -> None:
        """Queue a collective of a group this session joined: one-way, as an op."""
        self.counters["collectives"] += 1
        self._queue_message(msg)

    def _queue_message(self, msg) -> None:
        """`msg`, a one-way message that cannot go inside a Batch, after the queued batch.
        Where there is a sender thread both go through it as one entry (one wake-up of the
        sender, one transport call, one wake-up of the server) instead of this thread
        waiting for the batch to leave: about a millisecond a graph call on 2 shared cores
        (py-spy), and DataParallel's copies between servers queue two of these per tensor."""
        self._post_after_batch((msg.TYPE, m.encode(msg), [], 0))

    # -- plumbing ---------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._dead is None

    @property
    def recovers(self) -> bool:
        """Whether a lost server is waited for: recovery is on, and the session is neither
        dead nor closed."""
        return self._journal is not None and self._dead is None

    @property
    def queued(self) -> int:
        """Requests queued in this session's batch (not counting those in the C++ queue)."""
        return self._batch_items

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise RemoteAccelError(f"the remote_accel server at {self.transport.peer} is gone: {self._dead}")

    def _fail(self, exc: Exception) -> RemoteAccelError:
        if self._dead is None:
            self._dead = exc if isinstance(exc, RemoteAccelError) else RemoteAccelError(str(exc))
            self._stop.set()
            if self.native_queue is not None:
                self.native_queue.close()  # later ops come to Python, which raises
            self.transport.close()
        return RemoteAccelError(f"the remote_accel server at {self.transport.peer} is gone: {exc}")

    def _send(self, msg, payloads, req_id: int = 0) -> None:
        self._send_many([(msg.TYPE, m.encode(msg), payloads, req_id)])

    def _post(self, messages: list) -> bool:
        """Hand (type, meta, payloads, req_id) messages (a Batch, a graph call) to the sender
        thread, to leave in one transport call; False when there is no sender thread or it
        has stopped (the caller sends them)."""
        if self._sender is None:
            return False
        self._settled = None  # a sync must now ask the server
        return self._sender.post(messages)

    def _send_many(self, messages: list, drain: bool = True, defer: bool = True) -> None:
        """Send (type, meta, payloads, req_id) messages in order, in one transport call
        where the transport can. defer=False: the caller holds interrupts.deferred()."""
        if drain and self._sender is not None:
            self._sender.drain()  # in order: the batches posted before these messages first
        self._check_alive()
        self._settled = None
        try:
            if defer:
                with interrupts.deferred():  # half a message would put the stream out of step for good
                    self._transmit(messages)
            else:
                self._transmit(messages)
        except TransportError as exc:
            self._lost(exc, messages)
        self.last_send = time.monotonic()

    def _transmit(self, messages: list) -> None:
        if self._journal is not None:
            self._journal.record(messages)  # before they leave: a failed send is replayed too
        self._transport_send_many(messages)

    def _handshake(self, token: str, client: str) -> m.Welcome:
        """The challenge-response handshake. A peer that stays silent, closes, or answers
        with bytes that are no remote_accel message (an HTTP or SSH port) is not a
        remote_accel server; a refused token stays an AuthError."""
        try:
            return handshake.client_handshake(self.transport, token, client, self.timeout, server=self.server_name)
        except (TransportError, TransportTimeout, ProtocolError) as exc:
            raise WrongPeerError(f"{self.transport.peer} is not a remote_accel server (or not one speaking wire "
                                 f"version {WIRE_VERSION}): {exc}") from exc

    def _call(self, msg, reply_cls, sink=None, deadline: Optional[float] = None):
        return self._exchange(msg.TYPE, m.encode(msg), reply_cls, sink, deadline)

    def _exchange(self, msg_type: int, meta: bytes, reply_cls, sink=None, deadline: Optional[float] = None):
        """Flush, send the request (its encoded meta), wait for its reply (skipping
        heartbeats and late replies). The flush and the request leave in one transport
        call: over TCP or DPDK they wake the server once. This is every sync point's path:
        it makes as few Python calls as it can (issue #20)."""
        with self._lock:
            with interrupts.deferred() as sigint:
                req_id = next(self._req_ids) & 0xFFFFFFFF or next(self._req_ids)  # 0: unsolicited
                self._collect()
                request = (msg_type, meta, (), req_id)
                self._send_many(self._batch_then(request), defer=False)
                self.counters["round_trips"] += 1
                while True:
                    reply = self._wait(request, sink, deadline, sigint)
                    if reply.type == MsgType.DATA and reply_cls is m.Data and len(reply.payloads) == 1:
                        decoded = reply  # its meta only repeats the payload's length: nothing to decode
                        break
                    decoded = m.decode(reply.type, reply.meta)
                    if isinstance(decoded, m.ErrorReply) and decoded.kind == "device_lost":
                        # the server exits: nothing more can run there; a restarted one may
                        self._lost(handshake.remote_error(decoded), [request])
                        continue
                    break
            journal = self._journal
            if journal is not None:
                journal.record_answered(msg_type, meta)
                self._deaths = 0
            if isinstance(decoded, m.ErrorReply):
                raise handshake.remote_error(decoded)  # a late error, if any, waits for the next sync
            if decoded is not reply and not isinstance(decoded, reply_cls):
                raise self._fail(ProtocolError(f"expected {reply_cls.__name__}, got {type(decoded).__name__}"))
            if self._late_error is not None:
                late, self._late_error = self._late_error, None
                raise late
            if (journal is not None and not self._snapshotting and self.native_queue is not None
                    and journal.snapshot_due(time.monotonic(), self.native_queue.memory_allocated())):
                self._take_snapshot()
            return decoded

    def _wait(self, request: tuple, sink, deadline: Optional[float], sigint) -> "Message":
        """The reply to `request` (type, meta, payloads, req_id). Any message from the server
        (a heartbeat included) shows it is alive; `self.timeout` of silence means it is
        frozen: RemoteAccelError. A connection that breaks (the server died) recovers,
        and the request is sent again."""
        req_id = request[3]
        if sink is not None:
            user_sink = sink

            def sink(header, meta, lengths):  # a late reply's payloads must not land in `out`
                return user_sink(header, meta, lengths) if header.req_id == req_id else default_sink(header, meta, lengths)
        until = None if deadline is None else time.monotonic() + deadline
        heard = time.monotonic()
        while True:
            if sigint.is_set:
                self._abandoned.add(req_id)
                raise KeyboardInterrupt
            now = time.monotonic()
            silent = self.timeout - (now - heard)
            if silent <= 0:
                # Silence, with the connection open: a frozen server (or a link cut without a
                # reset). Reconnecting would reach the same frozen process: fail as without
                # recovery; a server that died closes the connection, and that recovers.
                raise self._fail(TransportTimeout(
                    f"no message for {self.timeout:g} s (a working server sends heartbeats): it died or froze"))
            wait = min(WAIT_SLICE_S, silent)
            if until is not None:
                if until <= now:
                    self._abandoned.add(req_id)
                    raise DeadlineExceeded(f"the server did not finish within {deadline:g} s; the work goes on "
                                           "there and the session stays usable")
                wait = min(wait, until - now)
            try:
                reply = self.transport.recv(timeout=wait, sink=sink)
            except TransportTimeout:
                continue
            except (TransportError, ProtocolError) as exc:
                self._lost(exc, [request])
                heard = time.monotonic()
                continue
            heard = time.monotonic()
            if reply.type == MsgType.PONG:
                continue
            if reply.req_id == req_id:
                return reply
            if reply.req_id in self._abandoned:
                self._abandoned.discard(reply.req_id)
                self._keep_late_error(reply)
                continue
            raise self._fail(ProtocolError(f"reply {reply.req_id} does not answer request {req_id}"))

    def _keep_late_error(self, reply) -> None:
        """An abandoned request's reply: its error (the first error of earlier one-way
        work, which the server reports once) is raised by the next sync instead."""
        try:
            decoded = m.decode(reply.type, reply.meta)
        except ProtocolError as exc:
            raise self._fail(exc) from exc
        if isinstance(decoded, m.ErrorReply):
            if decoded.kind == "device_lost":
                raise self._fail(handshake.remote_error(decoded))
            if self._late_error is None:
                self._late_error = handshake.remote_error(decoded)
        log.debug("skipped the late reply to request %d", reply.req_id)

    def close(self) -> None:
        self._stop.set()
        if self.native_queue is not None:
            self.native_queue.wake()  # the timer flush may sleep in C++
        self._journal = None  # a session that ends does not wait for its server to come back
        if self._dead is None:
            try:
                with self._lock:
                    self.flush()
                    self._send(m.Goodbye(), [])
            except RemoteAccelError:
                pass
        self._join_threads()
        if self.native_queue is not None:
            self.native_queue.close()
        self.transport.close()

    def _join_threads(self, timeout: float = 2.0) -> None:
        """Let the heartbeat, flush and send threads end before the transport they use
        closes (a DPDK connection's C memory goes with it). Each ends at once once
        _stop is set, unless it is in the middle of a send, which its transport bounds."""
        threads = [self._heartbeat.thread, self._flusher.thread]
        if self._sender is not None:
            self._sender.wake()
            threads.append(self._sender.thread)
        me = threading.current_thread()
        for thread in threads:
            if thread is not me:
                thread.join(timeout)
