"""Metrics of a server serving TCP and DPDK (memif) at once: a DPDK client's bytes land
under transport="dpdk", read from its DPDK channel while the session runs and kept after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from remote_accel.server.testing import ServerProcess, scrape

pytestmark = [pytest.mark.dpdk, pytest.mark.any_torch]

try:
    from remote_accel.dataplane import dpdk  # noqa: F401
except ImportError as exc:  # UnavailableError: no DPDK or the shim is not built
    pytest.skip(f"DPDK transport unavailable: {exc}", allow_module_level=True)

CLIENT_TIMEOUT_S = 180  # EAL start-up is a few seconds; a loaded 2-core machine is slow

CLIENT = textwrap.dedent("""
    import json, sys, torch
    from remote_accel.dataplane.dpdk import DpdkTransport
    from remote_accel.server.testing import Client
    c = Client(DpdkTransport.connect(port=0, timeout=30), sys.argv[1])
    c.upload(torch.ones(1 << 18))          # 1 MiB up
    c.sync()
    st = c.transport.stats()
    print(json.dumps({"tx": st["tx_bytes"], "rx": st["rx_bytes"]}), flush=True)
    sys.stdin.readline()                   # the test scrapes meanwhile
    c.goodbye()
    c.close()
""")


def wait_for(server, predicate, what: str):
    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    while True:
        s = scrape(server.metrics_url)
        if predicate(s):
            return s
        assert time.monotonic() < deadline, f"never saw {what}: {dict(s)}"
        time.sleep(0.1)


def test_dpdk_client_bytes_by_transport():
    with ServerProcess("--transport", "tcp,dpdk", "--metrics", "127.0.0.1:0",
                       start_timeout=CLIENT_TIMEOUT_S) as server:
        s = scrape(server.metrics_url)
        assert s.labels("remote_accel_bytes_received_total", "transport") == {"dpdk": 0, "tcp": 0}
        proc = subprocess.Popen([sys.executable, "-c", CLIENT, server.token], env=dict(os.environ,
                                **server.client_env()), text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        try:
            wire = json.loads(proc.stdout.readline() or "null") or pytest.fail(proc.stderr.read())
            during = wait_for(server, lambda s: s.value("remote_accel_client_bytes_sent_total") == wire["rx"],
                              "the reply's bytes counted")
            [(slot, transport)] = [(labels["client"], labels["transport"])
                                   for labels, _ in during["remote_accel_client_info"]]
            assert transport == "dpdk"
            assert during.value("remote_accel_client_bytes_received_total", client=slot) == wire["tx"]
            assert during.value("remote_accel_bytes_received_total", transport="dpdk") == wire["tx"] >= 1 << 20
            assert during.value("remote_accel_bytes_received_total", transport="tcp") == 0
            assert during.value("remote_accel_memory_bytes", client=slot) == 1 << 20
            proc.stdin.write("bye\n")
            proc.stdin.flush()
            assert proc.wait(CLIENT_TIMEOUT_S) == 0, proc.stderr.read()
        finally:
            proc.kill()
        after = wait_for(server, lambda s: s.value("remote_accel_clients") == 0, "the client gone")
        assert after.value("remote_accel_bytes_received_total", transport="dpdk") >= wire["tx"]
        assert after.value("remote_accel_memory_bytes") == 0
        assert server.alive() and "Traceback" not in server.log(), server.log()
