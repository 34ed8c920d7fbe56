"""Documented client settings that no other test sets, each against a real server process:
init(tls_cert=, tls_key=) and REMOTE_ACCEL_TLS_CERT / REMOTE_ACCEL_TLS_KEY (mutual TLS),
torch.remote_accel.reset_peak_memory_stats (and reset_accumulated_memory_stats),
REMOTE_ACCEL_CLIENT_CACHE_MB (the host cache of large `.cpu()` results, read once per
process: each setting in a client process of its own), and a server started with
REMOTE_ACCEL_COMPILE_GRAPHS=0 (graphs replayed, never compiled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import remote_accel
from remote_accel.errors import ConfigError, RemoteAccelError
from remote_accel.pytorch_ext import runtime
from remote_accel.server.testing import make_ca, make_leaf, ServerProcess

pytestmark = pytest.mark.any_torch

MIB = 1 << 20


# -- mutual TLS ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "other")
    server = make_leaf(d, "server", "ca", "IP:127.0.0.1,DNS:localhost")
    client = make_leaf(d, "client", "ca", "DNS:client")
    stranger = make_leaf(d, "stranger", "other", "DNS:stranger")  # a client certificate of another CA
    return {"ca": str(d / "ca.crt"), "server": server, "client": client, "stranger": stranger}


@pytest.fixture(scope="module")
def mtls_server(pki):
    cert, key = pki["server"]
    with ServerProcess("--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pki["ca"]) as server:
        yield server
        assert server.alive(), server.log()
        assert "Traceback" not in server.log(), server.log()


@pytest.fixture
def tls_env(monkeypatch):
    """No REMOTE_ACCEL_TLS_* from the outside; a test sets what it means to."""
    for name in ("REMOTE_ACCEL_TLS_CA", "REMOTE_ACCEL_TLS_CERT", "REMOTE_ACCEL_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    remote_accel.shutdown()


def _address(server) -> str:
    return "%s:%d" % server.tcp


def _works_over_tls() -> None:
    assert runtime.session(0).transport.peer.startswith("tls:"), runtime.session(0).transport.peer
    x = torch.arange(6.0)
    assert torch.equal((x.to("remote_accel") * 2).cpu(), x * 2)


def test_init_presents_tls_cert_and_key_to_a_server_that_asks(mtls_server, pki, tls_env):
    cert, key = pki["client"]
    remote_accel.init(transport="tcp", server=_address(mtls_server), token=mtls_server.token, tls_ca=pki["ca"],
                      tls_cert=cert, tls_key=key)
    _works_over_tls()


def test_without_a_client_certificate_of_its_ca_the_server_refuses(mtls_server, pki, tls_env):
    with pytest.raises(RemoteAccelError, match="certificate"):
        remote_accel.init(transport="tcp", server=_address(mtls_server), token=mtls_server.token, tls_ca=pki["ca"],
                          timeout=30)
    cert, key = pki["stranger"]
    with pytest.raises(RemoteAccelError):
        remote_accel.init(transport="tcp", server=_address(mtls_server), token=mtls_server.token, tls_ca=pki["ca"],
                          tls_cert=cert, tls_key=key, timeout=30)
    assert mtls_server.alive()


def test_tls_cert_and_key_come_from_the_environment(mtls_server, pki, tls_env):
    cert, key = pki["client"]
    tls_env.setenv("REMOTE_ACCEL_TLS_CA", pki["ca"])
    tls_env.setenv("REMOTE_ACCEL_TLS_CERT", cert)
    tls_env.setenv("REMOTE_ACCEL_TLS_KEY", key)
    remote_accel.init(transport="tcp", server=_address(mtls_server), token=mtls_server.token)
    _works_over_tls()
    remote_accel.shutdown()
    # an argument wins over its variable: the stranger's pair in the environment is not used
    tls_env.setenv("REMOTE_ACCEL_TLS_CERT", pki["stranger"][0])
    tls_env.setenv("REMOTE_ACCEL_TLS_KEY", pki["stranger"][1])
    remote_accel.init(transport="tcp", server=_address(mtls_server), token=mtls_server.token, tls_cert=cert,
                      tls_key=key)
    _works_over_tls()
    remote_accel.shutdown()
    with pytest.raises(RemoteAccelError):  # and the stranger's pair alone is refused
        remote_accel.init(transport="tcp", server=_address(mtls_server), token=mtls_server.token, timeout=30)


def test_a_client_certificate_needs_the_ca_and_its_key(pki, tls_env):
    cert, key = pki["client"]
    with pytest.raises(ConfigError, match="tls_ca"):
        remote_accel.init(transport="tcp", server="127.0.0.1:1", token="t", tls_cert=cert, tls_key=key)
    tls_env.setenv("REMOTE_ACCEL_TLS_CERT", cert)  # the same through the environment
    with pytest.raises(ConfigError, match="REMOTE_ACCEL_TLS_CA"):
        remote_accel.init(transport="tcp", server="127.0.0.1:1", token="t")
    tls_env.delenv("REMOTE_ACCEL_TLS_CERT")
    with pytest.raises(ConfigError, match="needs its certificate"):
        remote_accel.init(transport="tcp", server="127.0.0.1:1", token="t", tls_ca=pki["ca"], tls_key=key)


# -- memory figures --------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_server():
    with ServerProcess() as server:
        yield server


@pytest.fixture
def remote(plain_server):
    remote_accel.init(transport="tcp", server=_address(plain_server), token=plain_server.token)
    yield plain_server
    remote_accel.shutdown()


def test_reset_peak_memory_stats(remote):
    ra = torch.remote_accel
    ra.reset_peak_memory_stats()
    base = ra.memory_allocated()
    assert ra.max_memory_allocated() == base
    x = torch.empty(MIB, device="remote_accel")  # 4 MiB
    del x
    assert ra.memory_allocated() == base
    assert ra.max_memory_allocated() >= base + 4 * MIB
    assert ra.memory_stats()["allocated_bytes.all.peak"] >= base + 4 * MIB
    ra.reset_peak_memory_stats()
    assert ra.max_memory_allocated() == base
    assert ra.memory_stats()["allocated_bytes.all.peak"] == base
    # the device given as torch.cuda's function takes it, and the peak becomes what is live
    kept = torch.empty(MIB // 4, device="remote_accel")  # 1 MiB
    y = torch.empty(2 * MIB, device="remote_accel")  # 8 MiB
    del y
    for device in ("remote_accel:0", 0, torch.device("remote_accel", 0), "remote_accel"):
        assert ra.max_memory_allocated() >= base + 9 * MIB
        ra.reset_peak_memory_stats(device)
        assert ra.max_memory_allocated() == base + MIB == ra.memory_allocated(), device
        y = torch.empty(2 * MIB, device="remote_accel")
        del y
    del kept
    torch.accelerator.reset_peak_memory_stats()  # torch's own entry point reaches the same counters
    assert ra.max_memory_allocated() == base


def test_reset_accumulated_memory_stats(remote):
    ra = torch.remote_accel
    x = torch.empty(MIB, device="remote_accel")
    del x
    stats = torch.accelerator.memory_stats()
    assert stats["allocated_bytes.all.allocated"] >= 4 * MIB and stats["allocated_bytes.all.freed"] >= 4 * MIB
    ra.reset_accumulated_memory_stats()
    stats = torch.accelerator.memory_stats()
    assert stats["allocated_bytes.all.allocated"] == 0 and stats["allocated_bytes.all.freed"] == 0, stats
    x = torch.empty(MIB, device="remote_accel")
    assert torch.accelerator.memory_stats()["allocated_bytes.all.allocated"] == 4 * MIB
    del x
    torch.accelerator.reset_accumulated_memory_stats()
    assert torch.accelerator.memory_stats()["allocated_bytes.all.allocated"] == 0


# -- REMOTE_ACCEL_CLIENT_CACHE_MB ------------------------------------------------------
HOST_CACHE_CLIENT = textwrap.dedent("""
    import json, torch, remote_accel
    remote_accel.init(transport="tcp")  # the server and token from the environment
    stats = torch.remote_accel.host_memory_stats
    out = {"start": stats()}
    small, big = torch.randn(1 << 20), torch.randn(4 << 20)  # 4 MiB, 16 MiB
    remote_small, remote_big = small.to("remote_accel"), big.to("remote_accel")
    got = remote_small.cpu()
    assert torch.equal(got, small)
    out["alive"] = stats()
    del got
    out["freed"] = stats()
    got = remote_big.cpu()
    assert torch.equal(got, big)
    del got
    out["big_freed"] = stats()
    remote_accel.shutdown()
    print(json.dumps(out))
""")


def _host_cache_run(server, cache_mb) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "REMOTE_ACCEL_CLIENT_CACHE_MB"}
    env.update(REMOTE_ACCEL_SERVER=_address(server), REMOTE_ACCEL_TOKEN=server.token)
    if cache_mb is not None:
        env["REMOTE_ACCEL_CLIENT_CACHE_MB"] = cache_mb
    proc = subprocess.run([sys.executable, "-c", HOST_CACHE_CLIENT], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_client_cache_mb_sets_the_host_cache_limit(plain_server):
    default = _host_cache_run(plain_server, None)
    assert default["start"]["limit_bytes"] == 1024 * MIB  # the README's default
    assert default["alive"]["live_bytes"] >= 4 * MIB and default["big_freed"]["cached_bytes"] >= 20 * MIB

    small = _host_cache_run(plain_server, "8")
    assert small["start"]["limit_bytes"] == 8 * MIB
    assert small["alive"]["live_bytes"] >= 4 * MIB  # a large result on a cached host block
    assert small["freed"]["cached_bytes"] >= 4 * MIB  # kept: it fits the 8 MiB
    # 16 MiB more would pass the limit: that block goes back to the system
    assert small["big_freed"]["released"] == small["freed"]["released"] + 1
    assert small["big_freed"]["cached_bytes"] == small["freed"]["cached_bytes"] <= 8 * MIB


def test_client_cache_mb_zero_turns_the_cache_off(plain_server):
    off = _host_cache_run(plain_server, "0")
    assert off["start"]["limit_bytes"] == 0
    for when in ("alive", "freed", "big_freed"):  # results are plain memory: no block taken, kept or mapped
        figures = off[when]
        assert figures["live_bytes"] == figures["cached_bytes"] == 0, off
        assert figures["hits"] == figures["misses"] == 0, off


# -- REMOTE_ACCEL_COMPILE_GRAPHS=0 (a server setting) ------------------------------------
def test_compile_graphs_zero_replays_every_graph():
    with ServerProcess(env={"REMOTE_ACCEL_COMPILE_GRAPHS": "0"}) as server:
        remote_accel.init(transport="tcp", server=_address(server), token=server.token)
        torch._dynamo.reset()
        try:
            def f(x, w):
                return torch.relu(x @ w).sin().sum(dim=0) + 1

            compiled = torch.compile(f, backend="remote_accel")
            x, w = torch.randn(8, 16), torch.randn(16, 4)
            xr, wr = x.to("remote_accel"), w.to("remote_accel")
            for _ in range(3):
                torch.testing.assert_close(compiled(xr, wr).cpu(), f(x, w))
            assert remote_accel.stats()["graphs"] >= 3  # the calls went to the server as graphs
            stats = remote_accel.server_stats()
            # ... where none was kept for compiling, let alone compiled
            assert stats["graphs_cached"] == 0 and stats["graph_compiles"] == 0, stats
            assert stats["graphs_compiled"] == 0 and stats["graph_runs_compiled"] == 0, stats
        finally:
            remote_accel.shutdown()
            torch._dynamo.reset()
        assert "Traceback" not in server.log(), server.log()
