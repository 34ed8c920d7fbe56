"""A script that ends without remote_accel.shutdown(), as most scripts do: it exits
cleanly (status 0, nothing on stderr), no session thread is left running while the
interpreter tears down (over DPDK, under a connection whose C memory is freed at exit),
and the server frees the session at once (the session says goodbye after its queued
work). One client process per case (one EAL per process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from remote_accel.server.testing import ServerProcess

# work left queued at the end (never synced), and a heartbeat's worth of idle time before
# it, so that every session thread has run
SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time, torch, remote_accel

    @atexit.register  # registered first, so it runs after remote_accel's own exit hook
    def threads_left():
        print("left", sorted(t.name for t in threading.enumerate() if t.name.startswith("remote_accel")))

    token, transport, address = sys.argv[1:4]
    if transport == "dpdk":
        remote_accel.init(transport="dpdk", port=0, token=token)
    else:
        remote_accel.init(transport="tcp", server=address, token=token)
    x = torch.randn(256, 256, device="remote_accel")
    print((x @ x).sum().item() != 0.0)
    time.sleep(1.5)
    for _ in range(50):
        x = torch.tanh(x @ x)
    print("end", flush=True)
""")


FORKED_CHILD = textwrap.dedent("""
    import os, sys, torch, remote_accel
    token, address = sys.argv[1:3]
    remote_accel.init(transport="tcp", server=address, token=token)
    x = torch.ones(8, device="remote_accel")
    pid = os.fork()
    if pid == 0:  # a child that ends normally runs the atexit hooks it inherited
        sys.exit(0)
    os.waitpid(pid, 0)
    print((x * 3).sum().item())  # the parent's session is still its own
""")


def test_a_forked_child_that_exits_leaves_the_parent_s_session_alone():
    with ServerProcess() as server:
        host, port = server.tcp
        proc = subprocess.run([sys.executable, "-c", FORKED_CHILD, server.token, f"{host}:{port}"],
                              env=dict(os.environ, **server.client_env()), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0 and proc.stdout.split() == ["24.0"], \
            f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}\n{server.log()[-3000:]}"
        # one session from start to end: not ended by the child, then recovered on a new one
        assert server.log().count("client connected") == 1 and "recover" not in proc.stderr, \
            f"{proc.stderr}\n{server.log()[-3000:]}"


def test_a_script_that_never_calls_shutdown_exits_cleanly_and_says_goodbye(transport):
    with ServerProcess("--transport", "tcp,dpdk" if transport == "dpdk" else "tcp", start_timeout=240) as server:
        host, port = server.tcp
        proc = subprocess.run([sys.executable, "-c", SCRIPT, server.token, transport, f"{host}:{port}"],
                              env=dict(os.environ, **server.client_env()), capture_output=True, text=True,
                              timeout=240)
        assert proc.returncode == 0 and proc.stdout.splitlines() == ["True", "end", "left []"], \
            f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        assert "Traceback" not in proc.stderr and "Fatal" not in proc.stderr, proc.stderr
        deadline = time.monotonic() + 10  # far below the heartbeat timeout (30 s)
        while "client disconnected" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        ended = [line for line in server.log().splitlines() if "client disconnected" in line]
        assert ended, server.log()[-3000:]
        # in order on the connection: the queued work, then the goodbye (read even when a
        # busy beat of the server met the closed client first: tests/server/test_sessions.py)
        assert ended[0].split(": ")[-1].startswith("goodbye; freed"), ended
        assert int(ended[0].rsplit("after ", 1)[1].split()[0]) > 100, ended  # the 100 queued ops ran
        assert server.alive(), server.log()[-3000:]
