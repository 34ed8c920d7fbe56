"""txonly, rxonly and io: frames through the DPDK shim's raw burst API.

The ports are set up raw (the reliable channel leaves them alone). Frames are ours
(Ethernet/IPv4/UDP/frame header, built by the shim), each carrying a chunk of
`txpkts - FRAME_OVERHEAD` bytes. Python crosses into C once per burst: tx_raw sends
`burst` copies of a frame, rx_raw returns what one rx_burst (and the shim's fault
stage) gave. The loop polls without pause: this is a benchmark, it burns a core.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Optional

from ..errors import DpdkError
from .pmd_stats import Counters, PortInfo
from .wire_layers import FRAME_DATA, FRAME_OVERHEAD

log = logging.getLogger(__name__)

#: rx_raw receives one burst, up to 2 x 32 + 8 frames, and drops what does not fit
RX_SLOTS = 80
MIN_RX_STRIDE = 2048
DRAIN_IDLE_S = 0.1  # at the end, a port whose queue moved not at all for this long is done
DRAIN_MAX_S = 2.0


class RawRunner:
    unit = "frames"

    def __init__(self, mode: str, ports: list, txpkts: int, burst: int, tx_first: bool = False):
        from ..dataplane import dpdk

        self.dpdk = dpdk
        self.mode = mode
        self.ports = ports
        self.burst = burst
        self.tx_first = tx_first
        self.txpkts = txpkts
        self.stride = -(-max(txpkts, MIN_RX_STRIDE) // 64) * 64
        self.info = [PortInfo(p, dpdk.port_name(p), dpdk.port_driver(p)) for p in ports]
        # testpmd's pairing: 0<->1, 2<->3, ...; an odd last port forwards to itself
        self.peer = {}
        for i in range(0, len(ports), 2):
            a, b = ports[i], ports[min(i + 1, len(ports) - 1)]
            self.peer[a], self.peer[b] = b, a
        self.frames = {}
        for p in ports:
            dpdk.setup_port(p, raw=True)
            chunk = bytes((i * 7 + p) & 0xFF for i in range(txpkts - FRAME_OVERHEAD))
            self.frames[p] = dpdk.build_frame(FRAME_DATA, 0x7E570000 + p, 0, chunk)
        self.offered = {p: 0 for p in ports}
        self.rx = {p: [0, 0, 0] for p in ports}  # frames, bytes, payload bytes
        self.base = {p: dpdk.port_stats(p) for p in ports}

    def latency(self, since: int = 0) -> Optional[dict]:
        return None  # raw frames are not answered: no round trips

    def latency_count(self) -> int:
        return 0

    def start(self) -> None:
        if self.mode == "io" and self.tx_first:
            for p in self.ports:
                self._send(p, self.frames[p], self.burst)

    def poll(self, until: float) -> None:
        now = time.monotonic
        mode = self.mode
        while now() < until:
            for p in self.ports:
                if mode == "txonly":
                    self._send(p, self.frames[p], self.burst)
                else:
                    got = self.dpdk.rx_raw(p, RX_SLOTS, self.stride)
                    if not got:
                        continue
                    self._count_rx(p, got)
                    if mode == "io":
                        self._forward(self.peer[p], got)

    def stop(self) -> None:
        # The shim queues what the PMD refused (up to 512 frames a port): flush until the
        # PMD takes no more, so that the report counts them as sent, not dropped.
        for p in self.ports:
            sent, idle_until = -1, time.monotonic() + DRAIN_IDLE_S
            deadline = time.monotonic() + DRAIN_MAX_S
            while time.monotonic() < min(idle_until, deadline):
                try:
                    self.dpdk.tx_raw(p, self.frames[p], 0)
                except DpdkError:
                    break
                now_sent = self.dpdk.port_stats(p)["tx_frames"]
                if now_sent != sent:
                    sent, idle_until = now_sent, time.monotonic() + DRAIN_IDLE_S
                time.sleep(0.001)

    def snapshot(self) -> list:
        out = []
        for p in self.ports:
            st, base = self.dpdk.port_stats(p), self.base[p]

            def d(key: str) -> int:
                return st[key] - base[key]

            sent = d("tx_frames")
            frames, nbytes, payload = self.rx[p]
            out.append(Counters(
                rx_packets=frames,
                rx_dropped=d("eth_imissed") + d("eth_rx_nombuf") + d("eth_ierrors"),
                rx_bytes=nbytes, rx_payload=payload,
                tx_packets=sent, tx_dropped=max(0, self.offered[p] - sent),
                tx_bytes=d("tx_bytes"), tx_payload=d("tx_bytes") - FRAME_OVERHEAD * sent,
            ))
        return out

    def extra(self) -> dict:
        return {"txpkts": self.txpkts, "burst": self.burst,
                "port_stats": {str(p): self.dpdk.port_stats(p) for p in self.ports}}

    # -- helpers ----------------------------------------------------------------------------
    def _send(self, port: int, frame: bytes, count: int) -> None:
        self.offered[port] += count
        try:
            self.dpdk.tx_raw(port, frame, count)
        except DpdkError as exc:
            # no mbuf left: the frames not queued count as dropped (offered, never sent)
            if exc.errno != errno.ENOBUFS:
                raise

    def _count_rx(self, port: int, frames: list) -> None:
        c = self.rx[port]
        c[0] += len(frames)
        for f in frames:
            n = len(f)
            c[1] += n
            c[2] += max(0, n - FRAME_OVERHEAD)

    def _forward(self, port: int, frames: list) -> None:
        # tx_raw sends copies of one frame: runs of identical frames (a txonly stream)
        # go in one call, others one call each
        run_start = 0
        for i in range(1, len(frames) + 1):
            if i == len(frames) or frames[i] != frames[run_start]:
                self._send(port, frames[run_start], i - run_start)
                run_start = i
