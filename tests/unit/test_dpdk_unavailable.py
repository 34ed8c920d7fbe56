"""Without the compiled shim (a machine without DPDK), importing the DPDK transport is a
clear UnavailableError that says how to get it, and "auto" falls back to TCP."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import importlib.abc, sys
class NoShim(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "remote_accel.dataplane._dpdk":
            raise ImportError("no module named remote_accel.dataplane._dpdk (built without libdpdk)")
sys.meta_path.insert(0, NoShim())
from remote_accel.errors import UnavailableError
try:
    import remote_accel.dataplane.dpdk
except UnavailableError as exc:
    print("UNAVAILABLE", exc)
from remote_accel.dataplane import connect
print("REASON", connect._dpdk_unusable(None))
"""


def test_missing_shim_is_a_clear_unavailable_error():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "UNAVAILABLE" in out.stdout and "apt-get install dpdk dpdk-dev libdpdk-dev" in out.stdout
    assert "REASON" in out.stdout and "apt-get install" in out.stdout.split("REASON", 1)[1]
