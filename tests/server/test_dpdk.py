"""The same server over DPDK memif: a server serving TCP and DPDK at once, and DPDK
clients in processes of their own (one EAL per process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from remote_accel.server.testing import Client, ServerProcess

pytestmark = [pytest.mark.dpdk, pytest.mark.any_torch]

try:
    from remote_accel.dataplane import dpdk  # noqa: F401
except ImportError as exc:  # UnavailableError: no DPDK or the shim is not built
    pytest.skip(f"DPDK transport unavailable: {exc}", allow_module_level=True)

CLIENT_TIMEOUT_S = 180  # EAL start-up is a few seconds; a loaded 2-core machine is slow

PRELUDE = textwrap.dedent("""
    import sys, torch
    from remote_accel.dataplane.dpdk import DpdkTransport
    from remote_accel.server.testing import Client
    c = Client(DpdkTransport.connect(port=0, timeout=30), sys.argv[1])
    assert c.transport.peer.startswith("dpdk:"), c.transport.peer
""")


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--transport", "tcp,dpdk", "--heartbeat-timeout", "5",
                       start_timeout=CLIENT_TIMEOUT_S) as proc:
        assert any(a.startswith("dpdk:") for a in proc.addresses), proc.addresses
        yield proc
        assert proc.alive(), proc.log()
        assert "Traceback" not in proc.log(), proc.log()


def dpdk_client(server, body: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body), server.token],
                            env=dict(os.environ, **server.client_env()), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def finish(proc: subprocess.Popen) -> str:
    try:
        out, err = proc.communicate(timeout=CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, f"DPDK client failed ({proc.returncode}):\n{out}\n{err}"
    return out


def test_ops_views_errors_and_bulk_over_memif(server):
    out = finish(dpdk_client(server, """
        import torch.nn.functional as F
        from remote_accel.errors import RemoteOpError
        torch.manual_seed(0)
        a, b, w = torch.randn(8, 16), torch.randn(16, 4), torch.randn(3, 2, 3, 3)
        ra, rb = c.upload(a), c.upload(b)
        mm = c.empty((8, 4))
        c.run("aten::mm", ra, rb, outs=(mm,))
        torch.testing.assert_close(c.download(mm), a @ b)
        x = torch.randn(1, 2, 6, 6)
        y = c.empty((1, 3, 4, 4))
        c.run("aten::convolution_overrideable", c.upload(x), c.upload(w), None, [1, 1], [0, 0], [1, 1],
              False, [0, 0], 1, outs=(y,))
        torch.testing.assert_close(c.download(y), F.conv2d(x, w), rtol=1e-2, atol=1e-2)
        sm = c.empty((8, 16))
        c.run("aten::_softmax", ra, 1, False, outs=(sm,))
        torch.testing.assert_close(c.download(sm), torch.softmax(a, 1))
        c.run("aten::mul_.Scalar", ra.view((8,), (16,), 3), 0.0)   # a column, in place
        a[:, 3] = 0
        torch.testing.assert_close(c.download(ra), a)
        big = torch.randint(0, 256, (24 << 20,), dtype=torch.uint8)   # 24 MiB, many frames
        rbig = c.upload(big)
        assert torch.equal(c.download(rbig), big)
        c.run("aten::add.Tensor", ra, c.upload(torch.ones(3)), outs=(c.empty((8, 16)),))
        try:
            c.sync()
            raise SystemExit("no error reported")
        except RemoteOpError as exc:
            assert exc.kind == "op", exc
        assert c.ping(9) == 9
        print("ok", c.stats()["transport"])
    """))
    assert out.startswith("ok")


def test_tcp_and_dpdk_clients_at_once_are_isolated(server):
    proc = dpdk_client(server, """
        x = c.upload(torch.ones(4))
        c.alloc(64, sid=4242)
        c.sync()
        print(x.sid, flush=True)
        sys.stdin.readline()        # the TCP client works meanwhile
        assert torch.equal(c.download(x), torch.ones(4))
        print("ok")
    """, stdin=subprocess.PIPE)
    try:
        sid = int(proc.stdout.readline())
        with Client.tcp(*server.tcp, token=server.token) as tcp:
            y = tcp.upload(torch.full((4,), 2.0))
            assert y.sid == sid  # the same id, another session's storage
            tcp.run("aten::add_.Scalar", y, 1)
            assert torch.equal(tcp.download(y), torch.full((4,), 3.0))
            with pytest.raises(Exception, match="bad_handle"):
                tcp.read(4242, 64)
            assert tcp.stats()["server_sessions"] == 2
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert finish(proc).strip().endswith("ok")
    finally:
        proc.kill()


def test_killed_dpdk_client_memory_is_freed(server):
    proc = dpdk_client(server, """
        import time
        c.upload(torch.ones(1 << 20))
        c.sync()
        print(c.welcome.session, flush=True)
        time.sleep(600)
    """)
    try:
        session = int(proc.stdout.readline())
        with Client.tcp(*server.tcp, token=server.token) as observer:
            assert observer.stats()["server_memory_allocated"] >= 4 << 20
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            start = time.monotonic()
            deadline = start + 30
            while time.monotonic() < deadline:
                stats = observer.stats()
                if stats["server_memory_allocated"] == stats["memory_allocated"]:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"memory not freed:\n{server.log()}")
        assert f"client disconnected: session {session}," in server.log()
    finally:
        proc.kill()
        proc.communicate()


def test_wrong_token_over_dpdk(server):
    out = finish(subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            from remote_accel.dataplane.dpdk import DpdkTransport
            from remote_accel.errors import AuthError
            from remote_accel.server.testing import Client
            try:
                Client(DpdkTransport.connect(port=0, timeout=30), "wrong")
            except AuthError as exc:
                print("refused", exc)
        """)], env=dict(os.environ, **server.client_env()), text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE))
    assert out.startswith("refused") and "wrong token" in out
