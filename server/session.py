"""One client's session: the handshake, the message loop, payload placement, error reporting.

A session runs in a thread of its own and handles its messages strictly in order, so
an op always sees the effect of every earlier request of the same client.

Errors come back in two ways. A message the server cannot read (undecodable meta,
wrong field types, an unknown or unexpected type, a Batch with forbidden items) is
answered at once with ErrorReply(kind="protocol"). A request that is well formed but
fails (an op raises, a bad handle, out of memory) is one-way for the client, so the
first such error is kept, with the server's traceback, and reported at the client's
next sync point: Sync, READ, or RunOp(reply=True). Later failures of ops that depended
on the missing results do not replace it.
"""

from __future__ import annotations

import hmac
import logging
import traceback
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import numpy as np
import torch

from .._version import WIRE_VERSION
from .._version import __version__ as SERVER_VERSION
from ..dataplane import messages as m
from ..dataplane import torch_values
from ..dataplane.codec import Ext
from ..dataplane.transport import Message, Transport, default_sink
from ..dataplane.wire import MsgType, type_name
from ..errors import ProtocolError, TransportError, TransportTimeout
from . import failure
from .executor import Executor
from .failure import Failure
from .rng import Generators
from .storage import StorageTable, host_bytes

if TYPE_CHECKING:
    from .service import Server

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
#: Payloads the server only throws away (SINK, a WRITE to a bad handle) land in one
#: reused scratch buffer; one larger than this cannot be taken, and the session ends.
MAX_DISCARD_BYTES = 2 << 30
MAX_ECHO_BYTES = 2 << 30
_MAX_MESSAGE_TEXT = 64 << 10
_MAX_TRACE_TEXT = 256 << 10


class WriteTarget(NamedTuple):
    """Where one WRITE payload is received: `buffer`. With `staging` set, the bytes are
    copied into `view` (or, when None, the range the WRITE names once it runs) later;
    with `error` set, they are thrown away and the error reported."""

    buffer: Any
    view: Optional[torch.Tensor] = None
    staging: Optional[torch.Tensor] = None
    error: Optional[BaseException] = None


class Desync(Exception):
    """Raised from the payload sink when a message's payloads cannot be received: the
    byte stream would be out of step afterwards, so the session must end."""


class Session:
    def __init__(self, server: "Server", transport: Transport, number: int):
        self.server = server
        self.transport = transport
        self.number = number
        self.device = server.device
        self.client = "?"
        self.admitted = False  # counted by the server (authenticated, under max_clients)
        self.table = StorageTable(self.device, server.session_limit)
        self.executor: Optional[Executor] = None  # made in the session's own thread
        self.pending: Optional[m.ErrorReply] = None
        self.sink_messages = 0
        self.sink_bytes = 0
        self._stream = None
        self._stash: Optional[tuple] = None  # (type, decoded message or exception, payload plan)
        self._scratch = np.empty(0, dtype=np.uint8)
        self._handlers = {
            MsgType.PING: self._on_ping, MsgType.GOODBYE: self._on_goodbye, MsgType.ALLOC: self._one_way,
            MsgType.FREE: self._one_way, MsgType.WRITE: self._one_way, MsgType.BATCH: self._one_way,
            MsgType.RUN_GRAPH: self._one_way, MsgType.RUN_PLANNED: self._one_way, MsgType.RUN: self._on_run,
            MsgType.READ: self._on_read,
            MsgType.SYNC: self._on_sync, MsgType.STATS: self._on_stats, MsgType.RNG: self._on_rng,
            MsgType.EMPTY_CACHE: self._on_empty_cache, MsgType.ECHO: self._on_echo, MsgType.SINK: self._on_sink,
        }

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
            msg = self.transport.recv(timeout=HELLO_TIMEOUT_S, sink=_refuse_payloads)
        except TransportTimeout:
            log.info("%s sent no HELLO within %.0f s; closing", self.transport.peer, HELLO_TIMEOUT_S)
            return False
        except (TransportError, ProtocolError, Desync) as exc:
            log.info("%s dropped before HELLO: %s", self.transport.peer, exc)
            return False
        try:
            hello = m.decode(msg.type, msg.meta)
            if type(hello) is not m.Hello:
                raise ProtocolError(f"the first message must be HELLO, not {type_name(msg.type)}")
        except ProtocolError as exc:
            return self._refuse(msg, failure.AUTH, str(exc))
        self.client = hello.client[:200]
        if hello.wire_version != WIRE_VERSION:
            return self._refuse(msg, failure.PROTOCOL, f"client speaks wire version {hello.wire_version}, "
                                                       f"this server {WIRE_VERSION}")
        if not hmac.compare_digest(hello.token.encode(), self.server.token.encode()):
            log.warning("refused %s (%s): wrong token", self.transport.peer, self.client)
            return self._refuse(msg, failure.AUTH, "wrong token")
        self.admitted = self.server.admit(self)
        if not self.admitted:
            log.warning("refused %s (%s): %d clients already", self.transport.peer, self.client,
                        self.server.max_clients)
            return self._refuse(msg, failure.BUSY, f"the server serves at most {self.server.max_clients} clients")
        self._send(m.Welcome(self.number, self.device.name, self.server.memory_limit, SERVER_VERSION), msg.req_id)
        log.info("client connected: session %d, %s (%s)", self.number, self.transport.peer, self.client)
        return True

    def _refuse(self, msg: Message, kind: str, text: str) -> bool:
        try:
            self._send(m.ErrorReply(kind, text, ""), msg.req_id)
        except TransportError:
            pass
        return False

    def _loop(self) -> str:
        self._stream = self.device.new_stream()
        self.device.bind_thread(self._stream)
        torch.set_grad_enabled(False)  # thread-local: autograd is the client's business
        self.executor = Executor(self.device, self.table, Generators(self.device), self.server.graphs)
        timeout = self.server.heartbeat_timeout
        while True:
            try:
                msg = self.transport.recv(timeout=timeout, sink=self._sink)
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
            going_on = self._dispatch(msg)
            self.server.exit_if_device_lost()  # after the reply that says so has left
            if not going_on:
                return "goodbye"

    def _release(self, reason: str) -> None:
        self.server.exit_if_device_lost()  # freeing tensors of a lost device can abort the process
        try:
            if self.executor is not None:
                self.device.synchronize(self._stream)
        except Exception as exc:  # an earlier async device error; the memory goes anyway
            log.debug("session %d: sync at close failed: %s", self.number, exc)
        count, nbytes = self.table.clear()
        if self.executor is not None:
            self.executor.clear()
        self.transport.close()
        self.server.remove(self)
        if self.admitted:
            log.info("client disconnected: session %d, %s (%s): %s; freed %d storages, %d bytes, after %d ops",
                     self.number, self.transport.peer, self.client, reason, count, nbytes, self.ops_done)

    # -- receiving --------------------------------------------------------------------------------
    def _sink(self, header, meta: bytes, lengths: list) -> list:
        """Decode the message as soon as its prologue is in, and choose where its payloads
        land: straight into the destination storage where that is safe, else staging.
        Raises only Desync: anything else would leave the payload bytes unread."""
        try:
            return self._place(header, meta, lengths)
        except Desync:
            raise
        except Exception as exc:  # a server bug: report it, keep the stream in step
            log.exception("session %d: placing the payloads of a %s failed", self.number, type_name(header.type))
            self._stash = (header.type, ProtocolError(f"the server could not place this message's payloads: {exc}"),
                           None)
            return self._discard(lengths)

    def _place(self, header, meta: bytes, lengths: list) -> list:
        try:
            msg = m.decode(header.type, meta)
        except ProtocolError as exc:
            self._stash = (header.type, exc, None)
            return self._discard(lengths)
        self._stash = (header.type, msg, None)
        if header.type == MsgType.ECHO:
            if header.payload_total > MAX_ECHO_BYTES:
                raise Desync(f"ECHO of {header.payload_total} bytes exceeds {MAX_ECHO_BYTES}")
            return default_sink(header, meta, lengths)
        if header.type == MsgType.SINK:
            return self._discard(lengths)
        try:
            if header.type == MsgType.WRITE:
                request, writes, direct = msg, [msg], [True]
            elif header.type == MsgType.BATCH:
                request = m.batch_items(msg)
                writes, direct = _batch_writes(request)
            elif lengths:
                raise ProtocolError(f"{type_name(header.type)} carries no payloads")
            else:
                return []
            if len(writes) != len(lengths) or any(w.nbytes != n for w, n in zip(writes, lengths)):
                raise ProtocolError("payload lengths do not match the WRITE sizes")
        except ProtocolError as exc:
            self._stash = (header.type, exc, None)
            return self._discard(lengths)
        staged = sum(n for n, d in zip(lengths, direct) if not d or self.device.accelerator)
        if staged > self.table.limit:
            raise Desync(f"{staged} bytes of WRITE payload exceed this session's memory limit")
        plan = [self._write_target(w, ok) for w, ok in zip(writes, direct)]
        self._stash = (header.type, request, plan)
        return [t.buffer for t in plan]

    def _write_target(self, w: m.WriteStorage, direct: bool) -> "WriteTarget":
        view = None
        if direct:
            try:
                view = self.table.byte_range(w.sid, w.offset, w.nbytes)
            except (Failure, ProtocolError) as exc:
                return WriteTarget(self._discard([w.nbytes])[0], error=exc)
            if not self.device.accelerator:
                # CPU: the storage's own memory; earlier ops of this client have all run.
                return WriteTarget(host_bytes(view))
        staging = self.device.staging(w.nbytes)
        return WriteTarget(host_bytes(staging), view, staging)

    def _discard(self, lengths: list) -> list:
        need = max(lengths, default=0)
        if need > MAX_DISCARD_BYTES:
            raise Desync(f"a payload of {need} bytes cannot be received here")
        if need > self._scratch.nbytes:
            self._scratch = np.empty(need, dtype=np.uint8)
        return [self._scratch[:n] for n in lengths]

    # -- dispatch ----------------------------------------------------------------------------------
    def _dispatch(self, msg: Message) -> bool:
        stash, self._stash = self._stash, None
        if stash is None:  # a transport that skips the sink for payload-free messages
            try:
                stash = (msg.type, m.decode(msg.type, msg.meta), None)
            except ProtocolError as exc:
                stash = (msg.type, exc, None)
        _, request, plan = stash
        if isinstance(request, Exception):
            self._send(m.ErrorReply(failure.PROTOCOL, _clip(str(request), _MAX_MESSAGE_TEXT), ""), msg.req_id)
            return True
        handler = self._handlers.get(msg.type)
        if handler is None:
            text = f"{type_name(msg.type)} is not a request a client may send"
            self._send(m.ErrorReply(failure.PROTOCOL, text, ""), msg.req_id)
            return True
        return handler(request, msg, plan) is not False

    def _fail(self, exc: BaseException) -> None:
        """Keep the first error of one-way work for the next sync point."""
        if self.pending is None:
            self.pending = self._error_reply(exc)
            log.debug("session %d: deferred %s error: %s", self.number, self.pending.kind, exc)

    def _error_reply(self, exc: BaseException) -> m.ErrorReply:
        reply = _error_reply(exc)
        if self.device.lost(exc):
            reply = m.ErrorReply(failure.DEVICE_LOST, _clip(self.server.device_lost(exc), _MAX_MESSAGE_TEXT),
                                 reply.trace)
        return reply

    def _report_pending(self, req_id: int) -> bool:
        if self.pending is None:
            return False
        error, self.pending = self.pending, None
        self._send(error, req_id)
        return True

    # -- one-way requests ----------------------------------------------------------------------------
    def _one_way(self, request, msg: Message, plan) -> None:
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

    # -- requests with a reply -----------------------------------------------------------------------
    def _on_run(self, request: m.RunOp, msg: Message, plan) -> None:
        if not request.reply:
            return self._one_way(request, msg, plan)
        if self._report_pending(msg.req_id):
            self.executor.mark_failed(request.outs)
            return
        try:
            results = self.executor.run_op(request)
            self._send(m.RunReply(tuple(results)), msg.req_id)
        except TransportError:
            raise
        except Exception as exc:
            self._send(self._error_reply(exc), msg.req_id)

    def _on_read(self, request: m.ReadStorage, msg: Message, plan) -> None:
        if self._report_pending(msg.req_id):
            return
        try:
            view = self.table.byte_range(request.sid, request.offset, request.nbytes)
            if self.device.accelerator:
                staging = self.device.staging(request.nbytes)
                staging.copy_(view, non_blocking=True)
                self.device.synchronize(self._stream)
                view = staging
            payload = host_bytes(view)
        except Exception as exc:
            self._send(self._error_reply(exc), msg.req_id)
            return
        self._send(m.Data(request.nbytes), msg.req_id, (payload,))

    def _on_sync(self, request, msg: Message, plan) -> None:
        try:
            self.device.synchronize(self._stream)
        except Exception as exc:  # an asynchronous kernel failure surfaces here
            self._fail(exc)
        if not self._report_pending(msg.req_id):
            self._send(m.SyncOk(self.ops_done), msg.req_id)

    def _on_stats(self, request, msg: Message, plan) -> None:
        values = {
            "session": self.number,
            "device": self.device.name,
            "memory_allocated": self.table.used,
            "max_memory_allocated": self.table.peak,
            "memory_limit": self.table.limit,
            "storages": len(self.table),
            "ops_done": self.ops_done,
            "pending_error": self.pending is not None,
            "sink_messages": self.sink_messages,
            "sink_bytes": self.sink_bytes,
            "device_memory_allocated": self.device.memory_allocated(),
            "transport": {k: v for k, v in self.transport.stats().items() if type(v) in (int, float, str)},
        }
        values.update(self.server.stats())
        self._send(m.StatsReply(values), msg.req_id)

    def _on_rng(self, request: m.Rng, msg: Message, plan) -> None:
        try:
            if request.generator is None:
                gen = self.executor.generators.default
            else:
                gen = self.executor.decode(request.generator, [])
                if not isinstance(gen, torch.Generator):
                    raise ProtocolError("Rng.generator is not a generator reference")
            if request.action == "get":
                state = self.executor.generators.get_state(gen)
            elif request.action == "set" and type(request.state) is bytes:
                self.executor.generators.set_state(gen, request.state)
                state = b""
            else:
                raise ProtocolError(f"unknown Rng action {request.action!r}")
        except Exception as exc:
            self._send(self._error_reply(exc), msg.req_id)
            return
        self._send(m.RngReply(state), msg.req_id)

    def _on_empty_cache(self, request, msg: Message, plan) -> None:
        self.device.empty_cache()

    def _on_echo(self, request: m.Echo, msg: Message, plan) -> None:
        self._send(m.EchoReply(request.seq), msg.req_id, msg.payloads)

    def _on_sink(self, request, msg: Message, plan) -> None:
        self.sink_messages += 1
        self.sink_bytes += sum(len(p) for p in msg.payloads)

    def _on_ping(self, request: m.Ping, msg: Message, plan) -> None:
        self._send(m.Pong(request.nonce), msg.req_id)

    def _on_goodbye(self, request, msg: Message, plan) -> bool:
        return False

    # -- sending -------------------------------------------------------------------------------------------
    def _send(self, reply, req_id: int = 0, payloads=()) -> None:
        self.transport.send(reply.TYPE, m.encode(reply), payloads, req_id=req_id)

    def _send_quietly(self, reply) -> None:
        try:
            self._send(reply)
        except TransportError:
            pass


def _refuse_payloads(header, meta, lengths) -> list:
    if lengths:
        raise Desync("payloads before HELLO")
    return []


def _batch_writes(items: list) -> tuple[list, list]:
    """The batch's WRITE items, and for each whether it may land in its storage at once:
    only when no earlier item of the batch names that storage (an op reading the old
    bytes, or an ALLOC/FREE changing what the id means)."""
    writes, direct, named = [], [], set()
    for item in items:
        if type(item) is m.WriteStorage:
            writes.append(item)
            direct.append(item.sid not in named)
            named.add(item.sid)
        elif type(item) is m.RunOp:
            _collect_sids((item.args, item.kwargs, item.outs), named)
        elif type(item) is m.RunPlanned:  # its ints are storage ids, its bytes CPU scalars
            named.update(v for v in item.values if type(v) is int)
        elif type(item) is m.AllocStorage:
            named.add(item.sid)
        elif type(item) is m.FreeStorage:
            named.update(sid for sid in item.sids if type(sid) is int)
    return writes, direct


def _collect_sids(value: Any, into: set) -> None:
    if type(value) is Ext:
        if value.code == torch_values.TENSOR and type(value.value) is tuple and value.value:
            if type(value.value[0]) is int:
                into.add(value.value[0])
        else:
            _collect_sids(value.value, into)
    elif type(value) in (tuple, list):
        for v in value:
            _collect_sids(v, into)
    elif type(value) is dict:
        for v in value.values():
            _collect_sids(v, into)


def _error_reply(exc: BaseException) -> m.ErrorReply:
    kind = failure.classify(exc)
    text = f"{type(exc).__name__}: {exc}" if kind == failure.OP else str(exc)
    notes = getattr(exc, "__notes__", None)
    if notes:
        text += " (" + "; ".join(notes) + ")"
    trace = "" if isinstance(exc, (Failure, ProtocolError)) else "".join(traceback.format_exception(exc))
    return m.ErrorReply(kind, _clip(text, _MAX_MESSAGE_TEXT), _clip(trace, _MAX_TRACE_TEXT))


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 20] + " ...[truncated]"
