"""The token never crosses a memif link: a session through a wiretap (memif_tap.py)
that records every frame, checked for any run of the token's bytes."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap

from remote_accel.server.testing import ServerProcess

# conftest.py marks these dpdk, and skips them only where DPDK is not installed at all
TIMEOUT_S = 180  # EAL start-up takes seconds; three DPDK processes share two cores
TAP = os.path.join(os.path.dirname(__file__), "memif_tap.py")

CLIENT = textwrap.dedent("""
    import sys, torch
    from remote_accel.dataplane.dpdk import DpdkTransport
    from remote_accel.dataplane.eal_args import memif_vdev
    from remote_accel.server.testing import Client
    sock, token = sys.argv[1:3]
    c = Client(DpdkTransport.connect(port=0, eal_args=[memif_vdev(0, "client", 0, sock)], timeout=60), token)
    x = torch.randn(1000)
    assert torch.equal(c.download(c.upload(x)), x)
    c.sync()
    c.goodbye()
    c.close()
    print("DONE")
""")


def test_the_token_never_crosses_memif(tmp_path):
    token = secrets.token_hex(32)
    pcap, tap_socket = tmp_path / "memif.pcap", str(tmp_path / "tap.sock")
    with ServerProcess("--transport", "dpdk", token=token, start_timeout=TIMEOUT_S) as server:
        server_socket = os.path.join(server.runtime_dir, "memif.sock")
        tap = subprocess.Popen([sys.executable, TAP, tap_socket, server_socket, str(pcap)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert tap.stdout.readline().strip() == "READY", tap.stderr.read()
            client = subprocess.run([sys.executable, "-c", CLIENT, tap_socket, token], capture_output=True,
                                    text=True, timeout=TIMEOUT_S, env=dict(os.environ, **server.client_env()))
            assert client.returncode == 0 and "DONE" in client.stdout, client.stderr
        finally:
            tap.send_signal(signal.SIGTERM)
            out, err = tap.communicate(timeout=TIMEOUT_S)
        assert tap.returncode == 0 and "WROTE" in out, err
        assert "wrong token" not in server.log()
    dump = subprocess.run([sys.executable, "-m", "remote_accel.tools.dump", str(pcap)], capture_output=True,
                          text=True, timeout=120)
    kinds = [line.split("]  ")[1].split()[0] for line in dump.stdout.splitlines()
             if "]  " in line and "]  frame " not in line]  # messages, not the link's own frames
    # the tap saw the whole session, handshake first
    assert kinds[:4] == ["HELLO", "CHALLENGE", "AUTH", "WELCOME"], dump.stdout
    assert "READ" in kinds and "DATA" in kinds, dump.stdout
    captured = pcap.read_bytes()
    raw = token.encode()
    assert not [raw[i:i + 8] for i in range(len(raw) - 7) if raw[i:i + 8] in captured]
