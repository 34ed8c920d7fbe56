"""Documented DPDK settings that no other test sets end to end, each with a real server
and client processes over memif: REMOTE_ACCEL_MEMIF_BSIZE (the two ends use the smaller
buffer: one frame per buffer), REMOTE_ACCEL_DPDK_DOORBELL, and a server given its own EAL
options and `--port N` with clients given theirs by init(eal_args=...) and by
REMOTE_ACCEL_EAL_ARGS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from remote_accel.server.testing import ServerProcess

pytestmark = [pytest.mark.dpdk, pytest.mark.any_torch]

try:
    from remote_accel.dataplane.eal_args import memif_vdev
    from remote_accel.dataplane import dpdk  # noqa: F401
    NO_DPDK = None
except ImportError as exc:  # UnavailableError: DPDK or the shim is missing
    NO_DPDK = f"DPDK transport unavailable: {exc}"

TIMEOUT_S = 180  # EAL start-up takes seconds; a loaded 2-core machine is slow
MIB = 1 << 20

#: A client process: init() over DPDK (its EAL arguments as argv[3] says: "" for none),
#: 1 MiB up and back, then its transport's figures for that round trip as JSON.
CLIENT = textwrap.dedent("""
    import json, sys, torch, remote_accel
    from remote_accel.pytorch_ext import runtime
    token, timeout, eal = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    remote_accel.init(transport="dpdk", port=0, token=token, timeout=timeout, eal_args=[eal] if eal else None)
    t = runtime.sessions()[0].transport
    before = t.stats()
    x = torch.randn(1 << 18)
    assert torch.equal((x.to("remote_accel") * 2).cpu(), x * 2)
    after = t.stats()
    print(json.dumps({"peer": t.peer, "doorbell": after["doorbell"],
                      **{k: after[k] - before[k] for k in ("tx_frames", "rx_frames", "tx_retransmits")}}))
    remote_accel.shutdown()
""")


@pytest.fixture(autouse=True)
def _need_dpdk(require_in_ci):
    if NO_DPDK:
        require_in_ci(NO_DPDK)


def run_client(server, timeout: float = 30, eal: str = "", **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("REMOTE_ACCEL_MEMIF_BSIZE", "REMOTE_ACCEL_DPDK_DOORBELL", "REMOTE_ACCEL_EAL_ARGS")}
    full_env.update(server.client_env(), **env)
    return subprocess.run([sys.executable, "-c", CLIENT, server.token, str(timeout), eal], capture_output=True,
                          text=True, env=full_env, timeout=TIMEOUT_S)


def figures(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["peer"].startswith("dpdk:"), out
    return out


@pytest.fixture
def clean_env(monkeypatch):
    """Servers start without the outer environment's DPDK settings."""
    for name in ("REMOTE_ACCEL_MEMIF_BSIZE", "REMOTE_ACCEL_DPDK_DOORBELL", "REMOTE_ACCEL_EAL_ARGS"):
        monkeypatch.delenv(name, raising=False)


def test_memif_bsize_and_doorbell_of_the_client(clean_env):
    with ServerProcess("--transport", "tcp,dpdk", start_timeout=TIMEOUT_S) as server:
        default = figures(run_client(server))
        # 16384-byte buffers: 1 MiB each way in about 66 frames; and waits sleep on a doorbell
        assert default["tx_frames"] < 128 and default["rx_frames"] < 128, default
        assert default["doorbell"] == 1, default
        small = figures(run_client(server, REMOTE_ACCEL_MEMIF_BSIZE="4096", REMOTE_ACCEL_DPDK_DOORBELL="0"))
        # the client's 4096-byte buffers: at least 1 MiB / 4096 = 256 frames each way
        assert small["tx_frames"] >= 256 and small["rx_frames"] >= 256, small
        assert small["doorbell"] == 0, small
        assert "Traceback" not in server.log(), server.log()


def test_memif_bsize_and_doorbell_of_the_server(clean_env):
    env = {"REMOTE_ACCEL_MEMIF_BSIZE": "4096", "REMOTE_ACCEL_DPDK_DOORBELL": "0"}
    with ServerProcess("--transport", "tcp,dpdk", env=env, start_timeout=TIMEOUT_S) as server:
        out = figures(run_client(server))
        # the client has the default 16384, the server 4096: both ends use the smaller
        assert out["tx_frames"] >= 256 and out["rx_frames"] >= 256, out
        # the connection's doorbell figure is 1 only where both ends have one: the server has none
        assert out["doorbell"] == 0, out
        assert "Traceback" not in server.log(), server.log()


def test_server_eal_options_and_port_with_client_eal_args(clean_env, tmp_path):
    """Two memif server interfaces from the server's own EAL options, of which `--port 1`
    serves the second alone; clients name their end with init(eal_args=...) or
    REMOTE_ACCEL_EAL_ARGS."""
    served, unserved = str(tmp_path / "served.sock"), str(tmp_path / "unserved.sock")
    eal = (memif_vdev(0, "server", 0, unserved), memif_vdev(1, "server", 0, served))
    with ServerProcess("--transport", "tcp,dpdk", "--port", "1", eal=eal, start_timeout=TIMEOUT_S) as server:
        assert [a for a in server.addresses if a.startswith("dpdk:")] == ["dpdk:net_memif1"], server.addresses
        figures(run_client(server, eal=memif_vdev(0, "client", 0, served)))
        figures(run_client(server, REMOTE_ACCEL_EAL_ARGS=memif_vdev(0, "client", 0, served)))
        # port 0 exists in the server's EAL but is not served: no link
        refused = run_client(server, timeout=3, eal=memif_vdev(0, "client", 0, unserved))
        assert refused.returncode != 0 and "no link within 3 s" in refused.stderr, refused.stderr[-3000:]
        assert server.alive() and "Traceback" not in server.log(), server.log()
        assert server.log().count("client connected") == 2, server.log()
