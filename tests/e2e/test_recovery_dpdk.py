"""Recovery over DPDK (memif): the server killed with SIGKILL between two steps, and again
while the client waits in a sync, each time started again on the same memif socket; the
client, in its own process (one EAL per process), ends with the results of an
uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from remote_accel.server.testing import ServerProcess

pytestmark = [pytest.mark.dpdk, pytest.mark.any_torch]

try:
    from remote_accel.dataplane import dpdk  # noqa: F401
except ImportError as exc:  # UnavailableError: no DPDK or the shim is not built
    pytest.skip(f"DPDK transport unavailable: {exc}", allow_module_level=True)

WAIT_S = 300

CLIENT = textwrap.dedent("""
    import json, sys, torch, torch.nn as nn, remote_accel
    remote_accel.init(transport="dpdk", timeout=30)
    def train(pause):
        torch.remote_accel.manual_seed(7)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.25), nn.Linear(64, 1)).to("remote_accel")
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(128, 16, generator=g).to("remote_accel"), torch.randn(128, 1, generator=g).to("remote_accel")
        losses = []
        for step in range(8):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            if pause and step == 3:
                print("paused", flush=True)
                sys.stdin.readline()  # the test kills the server and starts it again
            losses.append(loss.item())
        return losses, [p.detach().cpu().flatten().tolist() for p in model.parameters()]
    expected = train(False)
    got = train(True)
    def slow():  # a few seconds of server work: the client waits in the sync meanwhile
        g = torch.Generator().manual_seed(3)
        a = torch.randn(1024, 1024, generator=g).to("remote_accel")
        w = a
        for _ in range(24):
            w = torch.tanh(w @ a / 32)
        return w.sum()
    reference = slow().item()
    waited = slow()
    print("waiting", flush=True)  # the test kills the server while this sync waits
    during = waited.item()
    print(json.dumps({"same": got == expected, "sync": during == reference,
                      "recoveries": remote_accel.stats()["recoveries"]}), flush=True)
    remote_accel.shutdown()
""")


def test_memif_session_recovers_after_kills_between_steps_and_during_a_sync():
    with ServerProcess("--transport", "tcp,dpdk", "--threads", "1", start_timeout=WAIT_S) as server:
        client = subprocess.Popen([sys.executable, "-c", CLIENT], env=dict(os.environ, **server.client_env()),
                                  text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            line = client.stdout.readline()
            assert line.strip() == "paused", client.stderr.read() if not line else line
            server.kill()
            server.restart()
            client.stdin.write("go\n")
            client.stdin.flush()
            line = client.stdout.readline()
            assert line.strip() == "waiting", client.stderr.read() if not line else line
            time.sleep(0.2)
            server.kill()
            server.restart()
            out, err = client.communicate(timeout=WAIT_S)
        finally:
            client.kill()
        assert client.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result == {"same": True, "sync": True, "recoveries": 2}, err
        assert "recovered the session" in err
