"""ra-demo (tools/demo.py), as a user runs it, with small settings: it starts its own
server, trains the small CNN on remote_accel and then on the local CPU, and exits 0 only
when the remote run learned. Over DPDK memif (its default) and over TCP (--listen)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(sys.executable).parent / "ra-demo"
#: the fewest steps and smallest batch after which the seeded run has clearly learned
#: (loss 2.37 -> 0.34); 3 steps of 8 samples do not, and the demo then exits 1
SMALL = ("--steps", "8", "--batch", "32")
NUMBER = r"\d+(?:\.\d+)?(?:e[-+]\d+)?"


def run_demo(tmp_path, *args: str) -> subprocess.CompletedProcess:
    # a runtime folder of its own: the demo's memif server is private to this test
    env = dict(os.environ, REMOTE_ACCEL_RUNTIME_DIR=str(tmp_path))
    for name in ("REMOTE_ACCEL_SERVER", "REMOTE_ACCEL_TRANSPORT", "REMOTE_ACCEL_TOKEN", "REMOTE_ACCEL_EAL_ARGS"):
        env.pop(name, None)
    return subprocess.run([str(DEMO), *SMALL, *args], capture_output=True, text=True, env=env, timeout=600)


def check_report(proc: subprocess.CompletedProcess, transport: str) -> None:
    assert proc.returncode == 0, f"ra-demo exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert f"training on remote_accel over {transport}" in proc.stderr, proc.stderr
    assert "step 8/8" in proc.stderr and "the same run on the local CPU" in proc.stderr, proc.stderr
    final, times = proc.stdout.strip().splitlines()[-2:]
    assert re.fullmatch(rf"final loss: remote {NUMBER}, local {NUMBER} \(largest difference over 8 steps: "
                        rf"{NUMBER}\)", final), final
    assert re.fullmatch(rf"step time: remote {NUMBER} ms, local {NUMBER} ms \(remote/local {NUMBER}x\)",
                        times), times


@pytest.mark.dpdk
def test_demo_over_memif(tmp_path, require_in_ci):
    try:
        from remote_accel.dataplane import dpdk  # noqa: F401
    except ImportError as exc:
        require_in_ci(f"DPDK transport unavailable: {exc}")
    proc = run_demo(tmp_path)  # --transport dpdk is the default
    check_report(proc, "dpdk")
    assert "server: listening on dpdk:net_memif0" in proc.stderr, proc.stderr


def test_demo_over_tcp(tmp_path):
    with socket.socket() as s:  # a free port for the demo's server (--listen)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_demo(tmp_path, "--transport", "tcp", "--listen", f"127.0.0.1:{port}")
    check_report(proc, "tcp")
    assert f"server: listening on tcp:127.0.0.1:{port}" in proc.stderr, proc.stderr
