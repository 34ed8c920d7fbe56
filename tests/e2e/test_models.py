"""Real models trained 20 steps against a server process, over TCP and over DPDK memif.

The client is a process of its own (train_models.py: one EAL per process); it trains each
model locally and on remote_accel, and the loss curves must agree. Locally means on the
server's kind of device (server.testing.reference_device): CPU in CI, the GPU in the GPU
check; so the remote run draws the same dropout masks as the local one.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from remote_accel.server.testing import ServerProcess, reference_device

SCRIPT = pathlib.Path(__file__).with_name("train_models.py")
CLIENT_TIMEOUT_S = 600


def _dpdk_available() -> bool:
    try:
        from remote_accel.dataplane import dpdk  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("transport", ["tcp", pytest.param("dpdk", marks=pytest.mark.dpdk)])
def test_cnn_and_transformer_train_like_cpu(transport, tmp_path):
    if transport == "dpdk" and not _dpdk_available():
        pytest.skip("the DPDK transport is not built here")
    with ServerProcess("--transport", "tcp,dpdk" if transport == "dpdk" else "tcp",
                       start_timeout=180) as server:
        args = [sys.executable, str(SCRIPT), "--transport", transport, "--token", server.token,
                "--workdir", str(tmp_path), "--reference", reference_device(server.device)]
        if transport == "tcp":
            args += ["--server", "%s:%d" % server.tcp]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S,
                              env=dict(os.environ, **server.client_env()))
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\nserver log:\n{server.log()}"
        assert "Traceback" not in server.log(), server.log()
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines[0]["peer"].startswith(transport), lines[0]
    runs = {line["model"]: line for line in lines[1:]}
    assert set(runs) == {"cnn", "transformer"}
    for name, run in runs.items():
        assert len(run["remote"]) == len(run["local"]) == 20
        assert run["remote"] == pytest.approx(run["local"], rel=1e-3, abs=1e-4), name
        first, last = sum(run["local"][:4]), sum(run["local"][-4:])  # one pass over the data each
        assert last < first, f"{name} did not learn: {run['local']}"
