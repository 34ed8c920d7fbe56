"""A wiretap on a memif link: relays raw frames between a client's memif socket and a
server's, and writes every frame it relayed to a pcap file when it gets SIGTERM.

    python tests/dpdk/memif_tap.py CLIENT_SOCKET SERVER_SOCKET OUT.pcap

memif is shared memory, so no tcpdump sees it; this process sits where a switch (or a
snooper on a shared L2 fabric) would, and sees exactly the frames the two ends send.
It prints READY once the client may connect, and WROTE N at the end.
"""

from __future__ import annotations

import signal
import sys
import time

from remote_accel.dataplane import dpdk
from remote_accel.dataplane.eal_args import MEMIF_BSIZE, memif_vdev

IDLE_SLEEP_S = 0.0005  # two cores, three DPDK processes: never spin when idle


def main() -> int:
    client_socket, server_socket, out = sys.argv[1:4]
    dpdk.eal_init([memif_vdev(0, "server", 0, client_socket), memif_vdev(1, "client", 0, server_socket)],
                  role="local")
    for port in (0, 1):
        dpdk.setup_port(port, raw=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    frames = []
    print("READY", flush=True)
    while not stop:
        moved = 0
        for src, dst in ((0, 1), (1, 0)):
            for frame in dpdk.rx_raw(src, 32, MEMIF_BSIZE):
                dpdk.tx_raw(dst, frame)
                frames.append((time.time(), frame))
                moved += 1
        if not moved:
            time.sleep(IDLE_SLEEP_S)
    from scapy.layers.l2 import Ether
    from scapy.utils import wrpcap

    packets = []
    for when, frame in frames:
        packet = Ether(frame)
        packet.time = when
        packets.append(packet)
    wrpcap(out, packets)
    print(f"WROTE {len(packets)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
