"""One answer on every transport: a frozen server raises RemoteAccelError within about
`timeout`, with the settings users run (recovery on, init()'s defaults).

A frozen server (SIGSTOP, a hung host) keeps its connections open and answers nothing; a
reconnection would reach the same frozen process, so the session must not wait
`recovery_timeout` (60 s) for a replacement as it does for a server that died. Each
client is a process of its own (one EAL per process), each server a real process.

`timeout` stays at its default (10 s): a shorter one lets the session's own silence
limit end the wait before a transport's (DPDK's channel gives a silent peer up after
8 s), and that hid the transport whose answer differed (issue 54: 68.6 s over DPDK).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from remote_accel.server.testing import ServerProcess, local_server_certificate

pytestmark = pytest.mark.any_torch

#: init()'s defaults, which the client keeps
TIMEOUT_S = 10.0
RECOVERY_TIMEOUT_S = 60.0
WAIT_S = 300  # a loaded 2-core machine, EAL start-up: generous, it only bounds a hang

CLIENT = textwrap.dedent("""
    import sys, time, torch, remote_accel
    kind, server, token, ca = sys.argv[1:5]
    kwargs = {} if kind == "dpdk" else {"server": server}
    if kind == "tls":
        kwargs["tls_ca"] = ca
    remote_accel.init(transport="dpdk" if kind == "dpdk" else "tcp", token=token, **kwargs)
    x = torch.ones(64, 64, device="remote_accel")
    (x + 1).sum().item()
    print("ready", flush=True)
    sys.stdin.readline()  # the test froze the server meanwhile
    start = time.monotonic()
    try:
        (x @ x).sum().item()
        print("finished", flush=True)
    except remote_accel.RemoteAccelError as exc:
        print("error", time.monotonic() - start, str(exc).splitlines()[0], flush=True)
""")


@pytest.fixture(params=["tcp", "tls", pytest.param("dpdk", marks=pytest.mark.dpdk)])
def server(request, tmp_path):
    kind = request.param
    if kind == "dpdk":
        request.getfixturevalue("needs_dpdk")
    options, ca = (), ""
    if kind == "tls":
        options, ca = local_server_certificate(tmp_path)
    elif kind == "dpdk":
        options = ("--transport", "tcp,dpdk")
    with ServerProcess(*options, start_timeout=WAIT_S) as proc:
        proc.kind, proc.ca = kind, ca
        try:
            yield proc
        finally:
            proc.proc.send_signal(signal.SIGCONT)  # a stopped process does not act on SIGTERM


def test_a_frozen_server_raises_within_the_timeout_on_every_transport(server):
    host, port = server.tcp
    client = subprocess.Popen([sys.executable, "-c", CLIENT, server.kind, f"{host}:{port}", server.token, server.ca],
                              env=dict(os.environ, **server.client_env()), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = client.stdout.readline().split()
        if ready != ["ready"]:
            client.kill()
            pytest.fail(f"the client did not start: {client.stderr.read()}")
        server.proc.send_signal(signal.SIGSTOP)
        client.stdin.write("go\n")
        client.stdin.flush()
        words = client.stdout.readline().split()
        _, err = client.communicate(timeout=WAIT_S)
    finally:
        client.kill()
    assert words[:1] == ["error"], (words, err)
    waited, message = float(words[1]), " ".join(words[2:])
    # the server's silence, noticed by the session (`timeout`) or by the transport itself
    # (DPDK's channel, sooner): no recovery was tried, which would wait recovery_timeout
    assert "recovering this session" not in err, err
    assert "gone" in message, message
    assert waited < RECOVERY_TIMEOUT_S / 2, (waited, message)
    assert client.returncode == 0, err
