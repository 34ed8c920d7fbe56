"""One model over the DPDK data plane (memif): GPT-2 and nms, in a client process of its own."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from remote_accel.server.testing import ServerProcess

CLIENT = pathlib.Path(__file__).with_name("over_dpdk.py")


@pytest.mark.dpdk
def test_gpt2_and_nms_over_memif():
    from remote_accel.dataplane import dpdk  # noqa: F401  (CI builds it: an ImportError fails here)

    with ServerProcess("--transport", "tcp,dpdk") as server:
        proc = subprocess.run([sys.executable, str(CLIENT), server.token], capture_output=True, text=True,
                              timeout=600, env=dict(os.environ, **server.client_env()))
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\nserver log:\n{server.log()}"
        assert "Traceback" not in server.log(), server.log()
    assert "peer dpdk" in proc.stdout and "agreed" in proc.stdout, proc.stdout
