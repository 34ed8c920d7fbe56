"""A server that dies, killed or by its device's fault, becomes a RemoteAccelError, no hang."""

import subprocess
import sys
import textwrap
import time

import pytest
import torch

import remote_accel
from remote_accel.server.failure import EXIT_DEVICE_LOST
from remote_accel.server.testing import ServerProcess

CLIENT = textwrap.dedent("""
    import sys, time, torch, torch.nn as nn, remote_accel
    remote_accel.init(transport="tcp", server=sys.argv[1], token=sys.argv[2], timeout=3.0, recovery=False)
    model = nn.Linear(16, 4).to("remote_accel")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16).to("remote_accel")
    print("training", flush=True)
    started = None
    try:
        for step in range(100000):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            started = time.monotonic()
            loss.item()
            time.sleep(0.01)
    except remote_accel.RemoteAccelError as exc:
        print(f"ERROR after {time.monotonic() - started:.1f}s: {exc}", flush=True)
        try:
            (x + 1).cpu()
        except remote_accel.RemoteAccelError:
            print("later ops fail too", flush=True)
        sys.exit(0)
    sys.exit(1)
""")


def test_killed_server_turns_into_error():
    server = ServerProcess().start()
    host, port = server.tcp
    client = subprocess.Popen([sys.executable, "-c", CLIENT, f"{host}:{port}", server.token],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "training"
        time.sleep(1.0)
        server.kill()
        out, _ = client.communicate(timeout=60)
    finally:
        client.kill()
        server.kill()
    assert client.returncode == 0, out
    assert "ERROR after" in out and "later ops fail too" in out
    seconds = float(out.split("ERROR after ")[1].split("s:")[0])
    assert seconds < 3.0 + 5.0


INDEX_ERROR_CLIENT = textwrap.dedent("""
    import sys, torch, remote_accel
    remote_accel.init(transport="tcp", server=sys.argv[1], token=sys.argv[2], timeout=10.0, recovery=False)
    a = torch.ones(4, device="remote_accel")
    idx = torch.tensor([0, 10]).to("remote_accel")
    for name, step in (("index", lambda: a[idx].cpu()), ("after", lambda: (a + 1).cpu().tolist())):
        try:
            print(name, "ok", step(), flush=True)
        except remote_accel.RemoteAccelError as exc:
            print(name, "error", str(exc).splitlines()[0], flush=True)
""")


def test_out_of_range_index_fails_at_the_next_sync():
    """The index op is queued; its failure on the server surfaces at the sync. On CPU the
    session goes on. On CUDA it is a device-side assert, which poisons the process's CUDA
    context: the server tells the client so and exits with EXIT_DEVICE_LOST (a supervisor
    restarts it) instead of aborting in a destructor."""
    with ServerProcess() as server:
        host, port = server.tcp
        proc = subprocess.run([sys.executable, "-c", INDEX_ERROR_CLIENT, f"{host}:{port}", server.token],
                              capture_output=True, text=True, timeout=120)
        lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert lines["index"].startswith("error "), lines
        if server.device == "cpu":
            assert "out of" in lines["index"] and "bounds" in lines["index"], lines
            assert lines["after"] == "ok [2.0, 2.0, 2.0, 2.0]"
            assert server.alive()
        else:
            assert "unrecoverable error" in lines["index"], lines
            assert lines["after"].startswith("error the remote_accel server at"), lines
            assert "unrecoverable error" in lines["after"], lines
            assert server.proc.wait(timeout=30) == EXIT_DEVICE_LOST, server.log()
            assert "Traceback" not in server.log() and "terminate called" not in server.log(), server.log()


def test_ops_served_from_plans_after_the_server_is_gone_raise():
    with ServerProcess() as server:
        try:
            remote_accel.init(transport="tcp", server="%s:%d" % server.tcp, token=server.token, timeout=5, recovery=False)
            x = torch.ones(8, device="remote_accel")
            for _ in range(3):  # the later two are served from the plan in C++
                x.add_(1.0)
            assert x.cpu().tolist() == [4.0] * 8
            server.kill()
            with pytest.raises(remote_accel.RemoteAccelError):
                for _ in range(10_000):  # served from the plan until the queue fills and meets the dead link
                    x.add_(1.0)
                x.cpu()
            with pytest.raises(remote_accel.RemoteAccelError):
                x.add_(1.0)  # the queue is closed: Python raises the session's error
        finally:
            remote_accel.shutdown()
