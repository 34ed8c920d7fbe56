"""DPDK peers for the conformance suite: a ring pair in this process, memif between two
processes, and af_packet over a veth pair whose far end sits in a network namespace.

Our end lives in the pytest process (one EAL for the session; memif and af_packet
ports are hot-added per peer); the far end is `remote_accel.dataplane.echo`.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from typing import Callable

import sys

import pytest

# The Peer of the conftest that imports us (already loaded by pytest, under its package
# name): importing "conftest" again would load and run a second copy of it.
Peer = next(m.Peer for n, m in list(sys.modules.items())
            if n.endswith("conftest") and hasattr(m, "Peer") and hasattr(m, "PEER_FACTORIES"))

HERE = os.path.dirname(__file__)


def _dpdk():
    from remote_accel.errors import UnavailableError

    try:
        from remote_accel.dataplane import dpdk
    except UnavailableError as exc:  # a reason CI turns into a failure (tests/conftest.py MUST_RUN_IN_CI)
        pytest.skip(f"DPDK transport unavailable: {exc}")
    dpdk.ensure_eal(None, role="local")
    return dpdk


def _helpers():
    import sys

    sys.path.insert(0, os.path.join(HERE, "..", "dpdk"))
    import dpdk_helpers

    return dpdk_helpers


def _garbage_injector(dpdk, connect: Callable[[], object]):
    """Malformed messages over a second connection: the far end must drop that one
    (ProtocolError there) and keep serving the others."""

    def inject(data: bytes) -> None:
        from remote_accel.errors import PeerGone, TransportClosed, TransportTimeout

        raw = connect()
        raw._send_raw([data])
        try:
            raw.recv(timeout=10)
        except (PeerGone, TransportClosed):
            pass  # the far end closed it, as it should
        except TransportTimeout:
            raise AssertionError("the far end neither answered nor closed a malformed message")
        finally:
            raw.close()

    return inject


def _ring_peer() -> Peer:
    dpdk = _dpdk()
    from remote_accel.dataplane import echo

    pa, pb = dpdk.ring_pair()
    options = dpdk.ChannelOptions(peer_timeout=10.0)
    listener = dpdk.DpdkListener([pb], options=options)
    stop = threading.Event()
    thread = threading.Thread(target=echo.serve_forever, args=(listener, stop), daemon=True)
    thread.start()

    def connect():
        return dpdk.DpdkTransport.connect(pa, timeout=10, options=options)

    peer = Peer("dpdk-ring", connect(), inject_garbage=_garbage_injector(dpdk, connect), reconnect=connect)
    peer.cleanups += [stop.set, lambda: thread.join(5), listener.close,
                      lambda: dpdk.remove_vdev(pa), lambda: dpdk.remove_vdev(pb)]
    return peer


def _memif_peer() -> Peer:
    dpdk, h = _dpdk(), _helpers()
    runtime = tempfile.mkdtemp(prefix="ra-memif-")
    proc = h.start_echo([], runtime)
    try:
        port = h.memif_client_port(os.path.join(runtime, "memif.sock"))

        def connect():
            return dpdk.DpdkTransport.connect(port, timeout=20)

        peer = Peer("dpdk-memif", connect(), kill=lambda: proc.send_signal(signal.SIGKILL),
                    inject_garbage=_garbage_injector(dpdk, connect), reconnect=connect, dead_peer_timeout_s=2.0)
    except BaseException:
        h.stop(proc)
        raise
    peer.cleanups += [lambda: h.stop(proc), lambda: dpdk.remove_vdev(port),
                      lambda: shutil.rmtree(runtime, ignore_errors=True)]
    return peer


_veth = {}


def _af_packet_peer() -> Peer:
    dpdk, h = _dpdk(), _helpers()
    if not h.netns_available():
        pytest.skip("af_packet over veth needs root and network namespaces")
    if "pair" not in _veth:
        import atexit

        _veth["pair"] = h.VethPair(f"rac{os.getpid() % 10000}")
        atexit.register(_veth["pair"].close)  # after the session: no namespaces left behind
    veth = _veth["pair"]
    runtime = tempfile.mkdtemp(prefix="ra-afp-")
    proc = h.start_echo([f"--vdev=net_af_packet0,iface={veth.there},{h.AF_PACKET_OPTS}"], runtime,
                        netns=veth.netns)
    try:
        name = f"net_af_packet_t{os.getpid()}_{len(_veth)}"
        _veth[name] = True
        port = dpdk.add_vdev(name, f"iface={veth.here},{h.AF_PACKET_OPTS}")
        options = dpdk.ChannelOptions(peer_timeout=3.0)  # no link signal here: keepalives tell

        def connect():
            return dpdk.DpdkTransport.connect(port, timeout=20, options=options)

        peer = Peer("dpdk-af_packet", connect(), kill=lambda: proc.send_signal(signal.SIGKILL),
                    inject_garbage=_garbage_injector(dpdk, connect), reconnect=connect, dead_peer_timeout_s=3.0)
    except BaseException:
        h.stop(proc)
        raise
    peer.cleanups += [lambda: h.stop(proc), lambda: dpdk.remove_vdev(port),
                      lambda: shutil.rmtree(runtime, ignore_errors=True)]
    return peer


DPDK_PEER_FACTORIES = {"dpdk-ring": _ring_peer, "dpdk-memif": _memif_peer, "dpdk-af_packet": _af_packet_peer}
DPDK_PEER_MARKS = {
    "dpdk-ring": [pytest.mark.dpdk],
    "dpdk-memif": [pytest.mark.dpdk],
    "dpdk-af_packet": [pytest.mark.dpdk, pytest.mark.netns],
}
