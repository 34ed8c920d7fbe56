"""Large `.cpu()` results over memif land in cached host blocks (#13): 64 MiB round
trips of changing content stay byte-exact while blocks are reused, and results kept
alive keep their own bytes. The client is a process of its own (one EAL per process)."""

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

CLIENT = textwrap.dedent("""
    import sys, torch, remote_accel
    remote_accel.init(transport="dpdk", server=sys.argv[1], token=sys.argv[2])
    n = 16 << 20  # 64 MiB of int32
    def data(seed):
        return torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))
    kept = []
    for seed in range(4):
        x = data(seed)
        got = x.to("remote_accel").cpu()
        assert torch.equal(got, x), seed
        if seed % 2 == 0:
            kept.append(got)  # stays alive while later results reuse freed blocks
        del got
    assert len({t.data_ptr() for t in kept}) == len(kept)
    for seed, t in zip((0, 2), kept):
        assert torch.equal(t, data(seed)), seed
    stats = torch.remote_accel.host_memory_stats()
    assert stats["hits"] >= 1 and stats["live_bytes"] == 2 * (64 << 20), stats
    del kept, t  # t: the loop above still names the last one
    assert torch.remote_accel.host_memory_stats()["live_bytes"] == 0
    remote_accel.shutdown()
    print("ok", stats["hits"], stats["misses"])
""")


def test_memif_downloads_into_reused_blocks_are_exact():
    with ServerProcess("--transport", "tcp,dpdk") as server:
        env = dict(os.environ, **server.client_env())
        out = subprocess.run([sys.executable, "-c", CLIENT, "%s:%d" % server.tcp, server.token], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]
