"""ra-testpmd on real DPDK ports: net_null, net_ring, a ring pair, memif to an echo peer.

Each run is a process of its own (one EAL per process), bounded by --duration.
conftest.py marks these dpdk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from remote_accel.tools.wire_layers import FRAME_OVERHEAD

PROG = [sys.executable, "-m", "remote_accel.tools.testpmd"]


def report(*args, env=None) -> dict:
    out = subprocess.run([*PROG, *map(str, args), "--json"], capture_output=True, text=True, timeout=180,
                         env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_txonly_on_net_null():
    doc = report("--vdev=net_null0", "--", "--forward-mode", "txonly", "--duration", "1", "--txpkts", "256",
                 "--stats-period", "0.5")
    (port,) = doc["ports"]
    assert doc["unit"] == "frames" and port["driver"] == "net_null" and port["name"] == "net_null0"
    assert port["tx_packets"] > 10_000 and port["rx_packets"] == 0
    assert port["tx_bytes"] == 256 * port["tx_packets"]
    assert port["tx_payload"] == (256 - FRAME_OVERHEAD) * port["tx_packets"]
    assert port["tx_dropped"] == 0  # net_null takes everything
    assert port["tx_pps"] > 0 and port["tx_gbit_s"] > 0
    assert doc["latency_us"] is None and len(doc["samples"]) >= 1


def test_rxonly_on_net_null():
    doc = report("--vdev=net_null0,size=128", "--", "--forward-mode", "rxonly", "--duration", "1", "--stats-period", "0")
    (port,) = doc["ports"]
    assert port["rx_packets"] > 10_000 and port["tx_packets"] == 0
    assert port["rx_bytes"] == 128 * port["rx_packets"]  # net_null hands out frames of size=


def test_io_on_a_net_ring_loopback_with_tx_first():
    doc = report("--vdev=net_ring0", "--", "--forward-mode", "io", "--tx-first", "--burst", "16",
                 "--txpkts", "1000", "--duration", "1", "--stats-period", "0")
    (port,) = doc["ports"]
    assert port["driver"] == "net_ring"
    # the first burst goes round and round: everything received is sent again
    assert port["rx_packets"] > 1000
    assert port["tx_packets"] - port["rx_packets"] in range(0, 17)
    assert port["rx_bytes"] == 1000 * port["rx_packets"] and port["rx_dropped"] == 0


def test_io_without_ports_uses_a_ring_pair():
    out = subprocess.run([*PROG, "--", "--forward-mode", "io", "--duration", "1", "--json"], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "ring pair" in out.stderr
    doc = json.loads(out.stdout)
    assert len(doc["ports"]) == 2 and all(p["rx_packets"] > 0 for p in doc["ports"])
    a, b = doc["ports"]
    assert a["rx_packets"] <= b["tx_packets"] and b["rx_packets"] <= a["tx_packets"]


def test_echo_over_a_ring_pair_with_a_local_peer():
    doc = report("--", "--forward-mode", "echo", "--peer", "local", "--size", "20000", "--burst", "4",
                 "--duration", "1", "--stats-period", "0", "--verify")
    (port,) = doc["ports"]
    assert doc["transport"] == "dpdk" and doc["unit"] == "msgs"
    assert port["rx_packets"] == port["tx_packets"] > 10
    assert doc["latency_us"]["samples"] == port["rx_packets"] and doc["verify_mismatches"] == 0
    assert doc["transport_stats"]["tx_frames"] > port["tx_packets"]  # 20000 bytes take several frames


@pytest.fixture
def memif_echo_peer():
    """The echo peer as a memif server in another process, with a private runtime dir."""
    with tempfile.TemporaryDirectory(prefix="ra-testpmd-") as runtime:
        env = dict(os.environ, REMOTE_ACCEL_RUNTIME_DIR=runtime)
        proc = subprocess.Popen([sys.executable, "-m", "remote_accel.dataplane.echo", "--", "--transport", "dpdk"],
                                stdout=subprocess.PIPE, text=True, env=env)
        line: list = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(90)
        try:
            assert line and line[0].startswith("READY dpdk:"), line
            yield env
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_echo_and_tensor_over_memif_to_the_echo_peer(memif_echo_peer):
    doc = report("--", "--forward-mode", "echo", "--duration", "1.5", "--stats-period", "0.5", "--verify",
                 env=memif_echo_peer)
    (port,) = doc["ports"]
    assert port["name"].startswith("dpdk:net_memif0:") and port["driver"] == "dpdk"
    assert port["rx_packets"] == port["tx_packets"] > 10
    assert doc["latency_us"]["p99.9"] >= doc["latency_us"]["p50"] > 0
    # tensor mode against the echo peer: ECHO of the tensor's bytes
    doc = report("--", "--forward-mode", "tensor", "--peer", "echo", "--size", "1M", "--duration", "1.5",
                 "--stats-period", "0", "--verify", env=memif_echo_peer)
    (port,) = doc["ports"]
    assert port["rx_payload"] == port["tx_payload"] == (1 << 20) * port["rx_packets"] > 0
    assert doc["verify_mismatches"] == 0


def test_txonly_to_rxonly_across_processes_over_memif(tmp_path):
    sock = tmp_path / "memif.sock"
    rx = subprocess.Popen([*PROG, f"--vdev=net_memif0,role=server,socket={sock},socket-abstract=no,bsize=2048", "--",
                           "--forward-mode", "rxonly", "--duration", "8", "--stats-period", "0", "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():  # a memif client started before its server never connects
            assert time.monotonic() < deadline and rx.poll() is None, rx.communicate()[1]
            time.sleep(0.05)
        tx = report(f"--vdev=net_memif0,role=client,socket={sock},socket-abstract=no,bsize=2048", "--", "--forward-mode", "txonly",
                    "--txpkts", "1500", "--duration", "2", "--stats-period", "0")
        out, err = rx.communicate(timeout=60)
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait(10)
    assert rx.returncode == 0, err
    (sent,), (got,) = tx["ports"], json.loads(out)["ports"]
    assert sent["driver"] == got["driver"] == "net_memif"
    assert sent["tx_packets"] > 1000
    # what memif took arrived, whole; what its ring refused is counted as dropped by the sender
    assert got["rx_packets"] == sent["tx_packets"] and got["rx_bytes"] == 1500 * got["rx_packets"]
    assert sent["tx_total"] == sent["tx_packets"] + sent["tx_dropped"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and ip for a veth pair")
def test_txonly_to_rxonly_over_af_packet_on_a_veth_pair():
    veth = f"rtp{os.getpid() % 100000}"
    a, b = veth + "a", veth + "b"
    subprocess.run(["ip", "link", "add", a, "type", "veth", "peer", "name", b], check=True, timeout=30)
    rx = None
    try:
        for dev in (a, b):
            # no IPv6 neighbour discovery: the kernel's own frames would be counted too
            subprocess.run(["sysctl", "-qw", f"net.ipv6.conf.{dev}.disable_ipv6=1"], timeout=30)
            subprocess.run(["ip", "link", "set", dev, "up"], check=True, timeout=30)
        rx = subprocess.Popen([*PROG, f"--vdev=net_af_packet0,iface={a}", "--", "--forward-mode", "rxonly",
                               "--duration", "6", "--stats-period", "0", "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(2.0)  # the receiver's socket must be bound before frames arrive
        tx = report(f"--vdev=net_af_packet0,iface={b}", "--", "--forward-mode", "txonly", "--txpkts", "1000",
                    "--duration", "1", "--stats-period", "0")
        out, err = rx.communicate(timeout=60)
    finally:
        if rx is not None and rx.poll() is None:
            rx.kill()
            rx.wait(10)
        subprocess.run(["ip", "link", "del", a], timeout=30)
    assert rx.returncode == 0, err
    (sent,), (got,) = tx["ports"], json.loads(out)["ports"]
    assert sent["driver"] == got["driver"] == "net_af_packet"
    # the kernel may drop frames between the two sockets (no PMD counter sees those)
    assert 0 < got["rx_packets"] <= sent["tx_packets"]
    assert got["rx_bytes"] >= 1000 * (got["rx_packets"] - 10)  # ours, but for a stray kernel frame


def test_tensor_mode_against_a_real_server_over_memif():
    from remote_accel.server.testing import ServerProcess

    with ServerProcess("--transport", "tcp,dpdk") as server:
        doc = report("--", "--forward-mode", "tensor", "--size", "2M", "--token-file", server.token_file,
                     "--duration", "1.5", "--stats-period", "0", "--verify", env=dict(os.environ, **server.client_env()))
    (port,) = doc["ports"]
    assert port["name"].startswith("dpdk:net_memif0:") and "-> cpu" in port["driver"]
    assert port["rx_packets"] > 0 and port["tx_packets"] == 2 * port["rx_packets"] + 1  # WRITE+READ each, one ALLOC
    assert port["rx_payload"] == port["tx_payload"] == (2 << 20) * port["rx_packets"]
    assert doc["verify_mismatches"] == 0 and doc["latency_us"]["samples"] == port["rx_packets"]


def test_a_vdev_that_makes_no_port_is_a_clear_error():
    """A --vdev whose driver creates no port (here af_packet on an interface that does
    not exist) stops with one line saying so, not a traceback from an empty report."""
    out = subprocess.run([*PROG, "--vdev=net_af_packet0,iface=ra-nonexistent0", "--", "--forward-mode", "txonly",
                          "--duration", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, out.stdout
    assert "no DPDK port: the EAL options made none" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
