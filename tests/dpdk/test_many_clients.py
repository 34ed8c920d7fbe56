"""One server port, many clients: remote clients (a NIC, af_packet) all reach the server
through its one port, so the port must hold as many connections as --max-clients
allows (4096), not the memif slots of local clients. Here: a ring pair standing in for
that link, more connections than the old per-port limit of 64, all served at once."""

from __future__ import annotations

from remote_accel.dataplane import dpdk
from remote_accel.dataplane.wire import MsgType

CLIENTS = 80


def test_one_port_serves_more_clients_than_memif_slots(eal):
    a, b = dpdk.ring_pair()
    opts = dpdk.ChannelOptions(window=64)  # 80 x 64 frames in flight stay within the pool
    clients, servers = [], []
    try:
        with dpdk.DpdkListener([b], options=opts) as lst:
            for _ in range(CLIENTS):
                clients.append(dpdk.DpdkTransport.connect(a, timeout=10, options=opts))
                servers.append(lst.accept(10))
            for i, c in enumerate(clients):
                c.send(MsgType.PING, f"hello {i}".encode(), req_id=i)
            for i, s in enumerate(servers):  # each server end hears its own client only
                msg = s.recv(timeout=10)
                assert (msg.req_id, msg.meta) == (i, f"hello {i}".encode())
                s.send(MsgType.PING, msg.meta, req_id=i)
            for i, c in enumerate(clients):
                assert c.recv(timeout=10).meta == f"hello {i}".encode()
    finally:
        for t in clients + servers:
            t.close()
        for p in (a, b):
            dpdk.remove_vdev(p)
