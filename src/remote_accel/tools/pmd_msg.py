"""echo and tensor: whole messages through a Transport (DPDK or TCP), round trips timed.

echo    ECHO with one payload of --size bytes, answered by ECHO_REPLY with the same bytes
        (the echo peer, or a remote-accel-server after HELLO).
tensor  a remote-accel-server's storage protocol: WRITE of a --size byte tensor into a
        storage, then READ of it back (DATA); against the echo peer, ECHO of the tensor.

Up to --burst requests are in flight: a sender thread keeps the window full, a receiver
thread times each reply against its request (by req_id).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Optional

import numpy as np

from ..dataplane import handshake
from ..dataplane import messages as m
from ..dataplane import wire
from ..errors import RemoteAccelError, TransportError, TransportTimeout
from .pmd_stats import Counters, Latency, PortInfo

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 5.0  # replies still in flight when the time is up


class PeerError(RemoteAccelError):
    """The peer answered with an error or something unexpected."""


def _buffer(nbytes: int, tensor: bool) -> np.ndarray:
    """Random bytes to send: a CPU tensor's memory in tensor mode (seen through numpy,
    without a copy), a numpy array otherwise."""
    if tensor:
        import torch

        gen = torch.Generator().manual_seed(1)
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).numpy()
    return np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)


class MessageRunner:
    unit = "msgs"

    def __init__(self, mode: str, transport, peer: str, size: int, burst: int, verify: bool,
                 token: str = "", port_info: Optional[PortInfo] = None, on_stop=None):
        self.mode, self.t, self.peer_kind = mode, transport, peer
        self.on_stop = on_stop  # ends an in-process peer
        self.size, self.burst, self.verify = size, burst, verify
        self.info = [port_info or PortInfo(0, transport.peer, type(transport).__name__)]
        self.lat = Latency()
        self.c = Counters()
        self.errors: list[str] = []
        self.payload = _buffer(size, tensor=mode == "tensor")
        self.rx_buf = np.empty(size, dtype=np.uint8)
        self.window = threading.Semaphore(burst)
        self.sent_at: dict[int, int] = {}
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.next_req = 1
        self.mismatches = 0
        if peer == "server":
            self._hello(token)
        if mode == "tensor" and peer == "server":
            # one storage per request in flight, as a client's tensors would be
            for sid in range(1, burst + 1):
                self._send(m.AllocStorage(sid, size), 0)

    # -- setup ---------------------------------------------------------------------------
    def _hello(self, token: str) -> None:
        client = f"{socket.gethostname()} {os.getpid()} ra-testpmd"
        try:
            reply = handshake.client_handshake(self.t, token, client, timeout=30)
        except RemoteAccelError as exc:
            raise PeerError(str(exc)) from exc
        self.info[0].driver += f" -> {reply.device}"

    def _send(self, msg, req_id: int, payloads=()) -> None:
        meta = m.encode(msg)
        self.t.send(msg.TYPE, meta, payloads, req_id=req_id)
        nbytes = sum(memoryview(p).nbytes for p in payloads)
        self.c.tx_packets += 1
        self.c.tx_bytes += wire.HEADER_SIZE + 8 * len(payloads) + len(meta) + nbytes
        self.c.tx_payload += nbytes

    # -- running -------------------------------------------------------------------------
    def latency(self, since: int = 0) -> Optional[dict]:
        return self.lat.summary(since)

    def latency_count(self) -> int:
        return len(self.lat)

    def start(self) -> None:
        for target in (self._sender, self._receiver):
            th = threading.Thread(target=self._guard(target), name=f"testpmd-{target.__name__}", daemon=True)
            th.start()
            self.threads.append(th)

    def poll(self, until: float) -> None:
        while not self.stopping.is_set():
            left = until - time.monotonic()
            if left <= 0:
                break
            self.stopping.wait(min(left, 0.05))
        if self.errors:
            raise PeerError(self.errors[0])

    def stop(self) -> None:
        self.stopping.set()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        for th in self.threads:
            th.join(max(0.0, deadline - time.monotonic()))
        try:
            self.t.send(m.Goodbye.TYPE, m.encode(m.Goodbye()))
        except TransportError:
            pass
        self.t.close()
        if self.on_stop is not None:
            self.on_stop()
        if self.sent_at:
            log.warning("%d requests got no reply within %.0f s of the end", len(self.sent_at), DRAIN_TIMEOUT_S)

    def snapshot(self) -> list:
        return [Counters(**vars(self.c))]

    def extra(self) -> dict:
        out = {"size": self.size, "burst": self.burst, "peer": self.peer_kind, "unanswered": len(self.sent_at),
               "verify_mismatches": self.mismatches if self.verify else None}
        try:
            out["transport_stats"] = {k: v for k, v in self.t.stats().items() if type(v) in (int, float)}
        except RemoteAccelError:
            pass
        return out

    def _guard(self, fn):
        def run():
            try:
                fn()
            except TransportError as exc:
                if not self.stopping.is_set():
                    self.errors.append(f"transport failed: {exc}")
            except Exception as exc:  # reported by poll() on the main thread
                self.errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                if self.errors:
                    self.stopping.set()

        return run

    def _sender(self) -> None:
        while not self.stopping.is_set():
            if not self.window.acquire(timeout=0.05):
                continue
            if self.stopping.is_set():
                return
            req = self.next_req
            self.next_req += 1
            self.sent_at[req] = time.perf_counter_ns()
            if self.mode == "tensor" and self.peer_kind == "server":
                sid = req % self.burst + 1  # replies come in order: this slot's last READ is done
                self._send(m.WriteStorage(sid, 0, self.size), 0, (self.payload,))
                self._send(m.ReadStorage(sid, 0, self.size), req)
            else:
                self._send(m.Echo(req), req, (self.payload,))

    def _sink(self, header, meta, lengths) -> list:
        if len(lengths) == 1 and lengths[0] == self.size:
            return [self.rx_buf]
        return [np.empty(n, dtype=np.uint8) for n in lengths]

    def _receiver(self) -> None:
        expect = m.Data if self.mode == "tensor" and self.peer_kind == "server" else m.EchoReply
        drain_end = None
        while True:
            if self.stopping.is_set():  # the time is up: collect the replies still due
                drain_end = drain_end or time.monotonic() + DRAIN_TIMEOUT_S
                if not self.sent_at or time.monotonic() > drain_end:
                    return
            try:
                msg = self.t.recv(timeout=0.1, sink=self._sink)
            except TransportTimeout:
                continue
            now = time.perf_counter_ns()
            reply = m.decode(msg.type, msg.meta)
            if isinstance(reply, m.ErrorReply):
                raise PeerError(f"the peer answered an error: {reply.message} ({reply.kind})")
            if not isinstance(reply, expect):
                raise PeerError(f"expected {expect.__name__}, got {wire.type_name(msg.type)}")
            sent = self.sent_at.pop(msg.req_id, None)
            if sent is None:
                raise PeerError(f"reply to unknown request {msg.req_id}")
            self.lat.add(now - sent)
            nbytes = sum(memoryview(p).nbytes for p in msg.payloads)
            self.c.rx_packets += 1
            self.c.rx_bytes += wire.HEADER_SIZE + 8 * len(msg.payloads) + len(msg.meta) + nbytes
            self.c.rx_payload += nbytes
            if self.verify and (nbytes != self.size or not np.array_equal(msg.payloads[0], self.payload)):
                self.mismatches += 1
                raise PeerError(f"reply {msg.req_id} does not hold the bytes sent")
            self.window.release()
