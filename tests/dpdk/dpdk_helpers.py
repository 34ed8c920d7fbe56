"""Shared by the DPDK tests and the conformance peers: peers in other processes."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

import numpy as np

READY_TIMEOUT_S = 90
_names = itertools.count()


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Cheap, position- and seed-dependent bytes (misplaced chunks are caught)."""
    words = (np.arange((nbytes + 7) // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(seed)
    return words.view(np.uint8)[:nbytes]


def start_echo(eal_args: list[str], runtime_dir: str, netns: Optional[str] = None,
               app_args: tuple = ()) -> subprocess.Popen:
    """An echo peer on DPDK in another process; returns once it prints READY."""
    env = dict(os.environ, REMOTE_ACCEL_RUNTIME_DIR=runtime_dir)
    cmd = [sys.executable, "-m", "remote_accel.dataplane.echo", *eal_args, "--", "--transport", "dpdk", *app_args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(READY_TIMEOUT_S)
    if not line or not line[0].startswith("READY "):
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"DPDK echo peer did not start ({line[:1]}); command: {' '.join(cmd)}")
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def memif_client_port(socket_path: str, bsize: int = 16384) -> int:
    """A memif client vdev in this process, on a server's socket; returns its port."""
    from remote_accel.dataplane import dpdk

    name = f"net_memif_t{os.getpid()}_{next(_names)}"
    return dpdk.add_vdev(name, f"role=client,id=0,socket={socket_path},bsize={bsize},rsize=10")


# -- af_packet over a veth pair, one end in a network namespace ------------------------
def netns_available() -> bool:
    if os.geteuid() != 0:
        return False
    probe = f"ra_probe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=False).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return ok


class VethPair:
    """veth pair `<name>0` (here) <-> `<name>1` (in netns `<name>ns`), MTU 9000."""

    def __init__(self, name: str):
        self.here, self.there, self.netns = f"{name}0", f"{name}1", f"{name}ns"
        self.close()
        for cmd in (["ip", "netns", "add", self.netns],
                    ["ip", "link", "add", self.here, "type", "veth", "peer", "name", self.there],
                    ["ip", "link", "set", self.there, "netns", self.netns],
                    ["ip", "link", "set", self.here, "mtu", "9000", "up"],
                    ["ip", "netns", "exec", self.netns, "ip", "link", "set", self.there, "mtu", "9000", "up"]):
            subprocess.run(cmd, check=True, capture_output=True)
        time.sleep(0.2)

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.here], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)


AF_PACKET_OPTS = "framesz=16384,blocksz=16384,framecnt=512"
