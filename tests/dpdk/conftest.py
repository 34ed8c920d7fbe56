"""DPDK tests: a real EAL on virtual PMDs (ring pairs, memif, af_packet), no mocks.

The pytest process starts one EAL (role "local": no vdev; ports are made at run time
with ring pairs and hot-added vdevs). Scenarios that need a fresh EAL, or a peer in
another process, run `python -m remote_accel.dataplane.echo`.
Skipped only where DPDK is not installed at all; if libdpdk is there, a missing
transport is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # dpdk_helpers, for tests here and conformance

from remote_accel.errors import UnavailableError


def _dpdk_installed() -> bool:
    return shutil.which("pkg-config") is not None and subprocess.run(
        ["pkg-config", "--exists", "libdpdk"], check=False).returncode == 0


try:
    from remote_accel.dataplane import dpdk
except UnavailableError as exc:
    if _dpdk_installed():
        raise  # DPDK is on this machine: the transport must have been built
    dpdk = None
    _why = f"DPDK transport unavailable: {exc}"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.dpdk)
            if dpdk is None:
                item.add_marker(pytest.mark.skip(reason=_why))


@pytest.fixture(scope="session")
def eal():
    """This process's EAL (started once, for the whole session)."""
    return dpdk.ensure_eal(None, role="local")


@pytest.fixture
def ring_ports(eal):
    """Two raw ports joined by crossed rings (the protocol leaves them alone)."""
    ports = dpdk.ring_pair(raw=True)
    yield ports
    for p in ports:
        dpdk.remove_vdev(p)


@pytest.fixture
def pair(eal):
    """Two connected DpdkTransports over a fresh ring pair in this process."""
    a, b = dpdk.DpdkTransport.pair(options=dpdk.ChannelOptions(peer_timeout=20.0))
    yield a, b
    a.close()
    b.close()
