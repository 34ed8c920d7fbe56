"""Swapping under a DPDK (memif) client: WRITE payloads land straight in storages that
may have been swapped out, READs come from storages swapped back in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from remote_accel.server.testing import ServerProcess

pytestmark = [pytest.mark.dpdk, pytest.mark.any_torch]

try:
    from remote_accel.dataplane import dpdk  # noqa: F401
except ImportError as exc:  # UnavailableError: no DPDK or the shim is not built
    pytest.skip(f"DPDK transport unavailable: {exc}", allow_module_level=True)

TIMEOUT_S = 180

CLIENT = textwrap.dedent("""
    import sys, torch
    from remote_accel.dataplane.dpdk import DpdkTransport
    from remote_accel.server.testing import Client
    c = Client(DpdkTransport.connect(port=0, timeout=30), sys.argv[1])
    assert c.transport.peer.startswith("dpdk:"), c.transport.peer
    data = [torch.full((3 << 18,), float(i)) for i in range(4)]  # 4 x 3 MiB on 8 MiB
    refs = [c.upload(t) for t in data]
    for ref, t in zip(refs, data):
        assert torch.equal(c.download(ref), t)
    stats = c.stats()
    assert stats["swap_outs"] >= 2 and stats["swap_ins"] >= 1, stats
    assert stats["swapped_out_bytes"] > 0, stats
    print("ok", stats["swap_outs"], stats["swap_ins"])
""")


def test_memif_client_on_a_swapping_server():
    with ServerProcess("--transport", "tcp,dpdk", "--device-memory", "8M", "--swap-space", "64M",
                       start_timeout=TIMEOUT_S) as server:
        proc = subprocess.run([sys.executable, "-c", CLIENT, server.token], capture_output=True, text=True,
                              env=dict(os.environ, **server.client_env()), timeout=TIMEOUT_S)
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{server.log()[-3000:]}"
        assert proc.stdout.startswith("ok")
        assert "Traceback" not in server.log()
