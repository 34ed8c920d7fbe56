"""Which DATA frames carry a CRC over their chunk.

Memory-to-memory ports (ring pairs, memif) cannot corrupt a frame: their chunks go
without one (the header keeps its CRC). A port that can corrupt (af_packet, a PCI NIC,
or a port whose fault stage corrupts frames, standing for such a medium) keeps the CRC
on every chunk, and there a corrupted frame is caught and sent again.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

from remote_accel.dataplane import dpdk
from remote_accel.dataplane.wire import MsgType

from dpdk_helpers import AF_PACKET_OPTS, VethPair, netns_available, start_echo, stop
from test_shim import _pipeline

SIZES = [1 << 20, 1, 70_000, 3 << 20, 513, 300_000]


def test_ring_ports_leave_the_chunk_crc_out(pair):
    a, b = pair
    _pipeline(a, b, SIZES)
    st = a.stats()
    assert st["tx_frames"] > 0 and st["tx_no_crc_frames"] == st["tx_frames"]
    assert b.stats()["port_rx_bad_crc"] == 0


def test_a_corrupting_port_keeps_the_crc_and_it_catches_every_corruption(pair):
    a, b = pair
    dpdk.set_fault(a._port, "tx", corrupt=0.05, seed=7)
    try:
        _pipeline(a, b, SIZES)  # bit-identical, in order, exactly once
        st = a.stats()
        assert st["tx_frames"] > 0 and st["tx_no_crc_frames"] == 0
        assert st["port_fault_corrupted"] > 0
        assert b.stats()["port_rx_bad_crc"] > 0 and st["tx_retransmits"] > 0
    finally:
        dpdk.set_fault(a._port, "tx")
    assert dpdk.pool_audit() == 0


def test_a_receiver_that_starts_corrupting_gets_covered_chunks(pair):
    """Faults switched on mid-connection on the receiving side only: the sender learns
    it from the receiver's frames and covers what it sends (retransmissions too)."""
    a, b = pair
    _pipeline(a, b, [1 << 20])
    uncovered = a.stats()["tx_no_crc_frames"]
    assert uncovered > 0
    dpdk.set_fault(b._port, "rx", corrupt=0.05, seed=9)
    try:
        _pipeline(a, b, SIZES)  # intact: uncovered frames were dropped, and sent again covered
        assert b.stats()["port_rx_bad_crc"] > 0 and b.stats()["port_fault_corrupted"] > 0
        # the frames in flight before the receiver's first answer went uncovered; none since
        uncovered = a.stats()["tx_no_crc_frames"]
        _pipeline(a, b, SIZES)
        assert a.stats()["tx_no_crc_frames"] == uncovered
    finally:
        dpdk.set_fault(b._port, "rx")
    assert dpdk.pool_audit() == 0


def test_af_packet_is_a_medium_that_corrupts(eal):
    """No chunk goes uncovered over af_packet (an echo over a veth pair, needs root)."""
    if not netns_available():
        pytest.skip("af_packet over veth needs root and network namespaces")
    veth = VethPair(f"rcrc{os.getpid() % 10000}")
    port = proc = None
    try:
        with tempfile.TemporaryDirectory() as runtime:
            proc = start_echo([f"--vdev=net_af_packet0,iface={veth.there},{AF_PACKET_OPTS}"], runtime,
                              netns=veth.netns)
            port = dpdk.add_vdev(f"net_af_packet_crc{os.getpid()}", f"iface={veth.here},{AF_PACKET_OPTS}")
            with dpdk.DpdkTransport.connect(port, timeout=30) as t:
                data = np.arange(200_000, dtype=np.uint8)
                t.send(MsgType.ECHO, b"x", [data])
                reply = t.recv(timeout=60)
                assert np.array_equal(np.frombuffer(reply.payloads[0], np.uint8), data)
                st = t.stats()
                assert st["tx_frames"] > 0 and st["tx_no_crc_frames"] == 0
    finally:
        if proc is not None:
            stop(proc)
        if port is not None:
            dpdk.remove_vdev(port)
        veth.close()
