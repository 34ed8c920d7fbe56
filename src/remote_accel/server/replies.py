"""The requests a server session answers: the sync points (Sync, READ, RunOp with reply),
the queries (Stats, Rng, State, Profile, Event), Echo, PeerWrite and Ping.

`Replies` is a base of Session (session.py), kept apart from the message loop and the
one-way work: a sync point is where the first error of earlier one-way work is reported
(`_report_pending`) instead of its own answer; a query that fails is answered with its
error at once. Each handler takes (request, msg, plan) as the loop's dispatch gives them
and uses the session's executor, table, device, stream and `_send`.
"""

from __future__ import annotations

import time

import torch

from ..dataplane import messages as m
from ..dataplane.transport import Message
from ..dataplane.wire import MsgType
from ..errors import ProtocolError, TransportError
from . import native, peer, profiling
from .receiving import FastRead
from .storage import host_bytes

#: READs up to this size on a CPU server are copied out (StorageTable.host_copy)
SMALL_READ = 4096
#: Data reply metas of small READs, encoded once per size (a CPU server's `.item()`)
_DATA_META: dict = {}


class Replies:
    """The answering handlers of a Session."""

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
            self.counters.error(exc)
            self._send(self._error_reply(exc), msg.req_id)

    def _on_read(self, request: m.ReadStorage, msg: Message, plan) -> None:
        if self._report_pending(msg.req_id):
            return
        if type(request) is FastRead and request.nbytes <= SMALL_READ and self._read_small(request, msg.req_id):
            return
        try:
            if not self.device.accelerator and type(request.nbytes) is int and request.nbytes <= SMALL_READ:
                payload = self.table.host_copy(request.sid, request.offset, request.nbytes)
            else:
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

    def _read_small(self, request: FastRead, req_id: int) -> bool:
        """A small READ of a CPU server answered from C++'s copy with a Data meta encoded
        once; False where the general path must answer (and say what is wrong)."""
        try:
            payload = native.read_small(self.table.native, request.sid, request.offset, request.nbytes)
        except Exception:  # e.g. a swap-in that failed: the general path raises it again
            return False
        if payload is None:
            return False
        meta = _DATA_META.get(request.nbytes)
        if meta is None:
            meta = _DATA_META[request.nbytes] = m.encode(m.Data(request.nbytes))
        self.transport.send(MsgType.DATA, meta, (payload,), req_id=req_id)
        self.heartbeat.last_send = time.monotonic()
        return True

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
            "native_ops_done": self.executor.native.ops_done() if self.executor else 0,
            "alloc_requests": self.executor.alloc_requests if self.executor else 0,
            "storages_made": self.executor.storages_made if self.executor else 0,
            "busy_ns": self.busy_ns,
            "cpu_threads": torch.get_num_threads(),  # this thread's, which its kernels use (cpu_threads.py)
            # whose kernel draws bernoulli_(p) (dropout's masks) on CPU tensors (csrc/cpu_bernoulli.cpp)
            "cpu_bernoulli": "server" if native.cpu_bernoulli_installed() else "torch",
            # messages the C++ receive loop served (DPDK, TCP): (batches, reads, syncs)
            "fast_loop_served": list(self._fast.served()) if self._fast is not None else [0, 0, 0],
            "pending_error": self.pending is not None,
            "sink_messages": self.sink_messages,
            "sink_bytes": self.sink_bytes,
            "device_memory_allocated": self.device.memory_allocated(),
            "device_properties": self.device.properties(),
            "device_memory_info": list(self.device.memory_info()),
            **self.table.native.swap_stats(),
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

    def _on_state(self, request, msg: Message, plan) -> None:
        """What a client's recovery snapshot keeps (pytorch_ext/recovery.py): the storages
        (it reads each one) and every random stream's state."""
        if self._report_pending(msg.req_id):
            return
        storages = tuple(tuple(entry) for entry in self.table.native.entries())
        self._send(m.StateReply(storages, self.executor.generators.states()), msg.req_id)

    def _on_profile(self, request: m.Profile, msg: Message, plan) -> None:
        """torch.profiler's window (profiling.py): answered after the work before it ran."""
        received = time.time_ns()
        try:
            self.device.synchronize(self._stream)
            if self.profiler is None:
                self.profiler = profiling.SessionProfiler(self.number, self.device.device.type)
            if request.action == "start":
                self.profiler.start()
                events = ()
            elif request.action == "stop":
                events = self.profiler.stop()
            else:
                raise ProtocolError(f"unknown Profile action {str(request.action)[:40]!r}")
        except Exception as exc:
            self._send(self._error_reply(exc), msg.req_id)
            return
        self._send(m.ProfileReply(received, time.time_ns(), events), msg.req_id)

    def _on_event(self, request: m.Event, msg: Message, plan) -> None:
        """torch.Event (events.py): record one-way, its error kept for the next sync; the
        rest answered, after any error of the ops before them."""
        if request.action == "record":
            try:
                self.events.record(request.event_id)
            except Exception as exc:
                self._fail(exc)
            return
        try:
            if request.action == "query":
                value = self.events.query(request.event_id)
            elif request.action == "synchronize":
                value = self.events.synchronize(request.event_id)
            elif request.action == "elapsed":
                value = self.events.elapsed_ms(request.event_id, request.end)
            else:
                raise ProtocolError(f"unknown Event action {request.action[:40]!r}")
        except Exception as exc:
            self._send(self._error_reply(exc), msg.req_id)
            return
        if not self._report_pending(msg.req_id):
            self._send(m.EventReply(value), msg.req_id)

    def _on_echo(self, request: m.Echo, msg: Message, plan) -> None:
        try:
            self._send(m.EchoReply(request.seq), msg.req_id, msg.payloads)
        finally:  # what receiving.py charged for the payload while it was held
            self.table.release(sum(len(p) for p in msg.payloads))

    def _on_peer_write(self, request: m.PeerWrite, msg: Message, plan) -> None:
        try:
            reply = peer.on_write(self, request, plan)
        except Exception as exc:
            self._send(self._error_reply(exc), msg.req_id)
            return
        self._send(reply, msg.req_id)

    def _on_ping(self, request: m.Ping, msg: Message, plan) -> None:
        self._send(m.Pong(request.nonce), msg.req_id)
