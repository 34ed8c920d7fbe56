"""Recovery over DPDK (memif): the server killed with SIGKILL between two steps, and again
while the client waits in a sync, each time started again on the same memif socket; the
client, in its own process (one EAL per process), ends with the results of an
uninterrupted run, and each kill cost one recovery where it landed."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from remote_accel.server.testing import ServerProcess, wait_for

pytestmark = [pytest.mark.dpdk, pytest.mark.any_torch]

try:
    from remote_accel.dataplane import dpdk  # noqa: F401
except ImportError as exc:  # UnavailableError: no DPDK or the shim is not built
    pytest.skip(f"DPDK transport unavailable: {exc}", allow_module_level=True)

WAIT_S = 300
LIBS = str(pathlib.Path(__file__).parents[1] / "libs")  # ra_test_ops: ra_test::pause, on both sides
LIB_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [LIBS, os.environ.get("PYTHONPATH")]))}

CLIENT = textwrap.dedent("""
    import json, sys, torch, torch.nn as nn, remote_accel
    import ra_test_ops
    armed = sys.argv[1]  # while this file exists, the server's next ra_test::pause waits in it
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
    step_recoveries = remote_accel.stats()["recoveries"]
    def slow():
        g = torch.Generator().manual_seed(3)
        a = torch.randn(1024, 1024, generator=g).to("remote_accel")
        w = a
        for _ in range(24):
            w = torch.tanh(w @ a / 32)
        return w.sum()
    reference = slow().item()
    waited = slow()
    torch.ops.ra_test.pause(waited, armed, 120.0)  # with the work: the server waits there, and says so
    print("waiting", flush=True)  # the test kills the server while this sync waits
    during = waited.item()
    print(json.dumps({"same": got == expected, "sync": during == reference, "between_steps": step_recoveries,
                      "in_the_sync": remote_accel.stats()["recoveries"] - step_recoveries}), flush=True)
    remote_accel.shutdown()
""")


def test_memif_session_recovers_after_kills_between_steps_and_during_a_sync(tmp_path):
    armed = tmp_path / "armed"
    armed.touch()
    with ServerProcess("--transport", "tcp,dpdk", "--threads", "1", "--op-namespaces", "ra_test=ra_test_ops",
                       start_timeout=WAIT_S, env=LIB_ENV) as server:
        client = subprocess.Popen([sys.executable, "-c", CLIENT, str(armed)],
                                  env=dict(os.environ, **server.client_env(), **LIB_ENV),
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
            # the scenario: the server is inside the work the client's sync waits for
            wait_for(lambda: not armed.exists(), "the server to reach the pause in the client's work", WAIT_S)
            server.kill()
            server.restart()
            out, err = client.communicate(timeout=WAIT_S)
        finally:
            client.kill()
        assert client.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        # one recovery where each kill landed; the results of an uninterrupted run
        assert result == {"same": True, "sync": True, "between_steps": 1, "in_the_sync": 1}, err
        assert "recovered the session" in err
