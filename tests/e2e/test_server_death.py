"""A server killed mid-training becomes a RemoteAccelError within the timeout, no hang."""

import subprocess
import sys
import textwrap
import time

from remote_accel.server.testing import ServerProcess

CLIENT = textwrap.dedent("""
    import sys, time, torch, torch.nn as nn, remote_accel
    remote_accel.init(transport="tcp", server=sys.argv[1], token=sys.argv[2], timeout=3.0)
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
