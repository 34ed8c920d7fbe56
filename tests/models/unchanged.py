"""Run one of this folder's user scripts (hf_unchanged.py, lightning_unchanged.py) the way
its users run it: `python script.py`, in a fresh interpreter that never imports
remote_accel, the server named by the environment alone (autoload)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

#: how far a run on remote_accel may be from the same run on cpu, for the frameworks' tests:
#: fp32 on the server's CPU runs the same kernels as here, only summation orders may differ
FP32 = dict(rtol=1e-5, atol=1e-6)
#: autocast on remote_accel casts as on CUDA (more ops in half precision than CPU's autocast)
HALF = dict(rtol=2e-3, atol=1e-3)


def clean_environment() -> dict:
    """This process's environment without any REMOTE_ACCEL_* variable: a machine that
    names no server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTE_ACCEL_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # tiny models built from configs, nothing from a hub
    return env


def run(script: str, server, timeout: float = 300) -> dict:
    """The JSON line `script` prints last, run against `server` (a ServerProcess) over TCP."""
    env = dict(clean_environment(), REMOTE_ACCEL_SERVER="%s:%d" % server.tcp, REMOTE_ACCEL_TOKEN=server.token,
               REMOTE_ACCEL_TRANSPORT="tcp", REMOTE_ACCEL_RUNTIME_DIR=server.runtime_dir)
    out = subprocess.run([sys.executable, os.path.join(HERE, script)], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
